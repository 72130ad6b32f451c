"""Training: the typed config (`config`), the SBD objective (`objective`), the compiled step (`step`),
the trainer that runs, logs and checkpoints it (`trainer`, `log`, `checkpoints`, `stop_request`).
Imports `sbd_jax.decoding` and below."""

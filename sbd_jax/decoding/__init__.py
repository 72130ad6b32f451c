"""Decoding: the shared decoder base and NTP (`base`), SBD's entropy-bounded block decoder (`sbd`), the
verified decoder and its draft sources (`verified`, `lookup`), how tokens are drawn (`token_choice`),
the user's settings (`settings`), choosing a block size (`block_choice`), the host-side batch loop
(`generate`) and forward timing (`timing`). Imports `sbd_jax.data` and below."""

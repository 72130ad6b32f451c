"""Training data: its config (`config`), documents read, tokenized and packed into rows (`packing`),
the corpus read in chunks (`chunks`), the streamed, sharded, resumable batches the trainer reads
(`streaming`) and JSONL reading (`jsonl`).
Imports nothing of the package but `sbd_jax.errors` (tokenizers are passed in)."""

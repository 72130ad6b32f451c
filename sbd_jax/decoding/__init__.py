"""Decoding: the shared decoder base and NTP (`base`), SBD's entropy-bounded block decoder (`sbd`), the
chain-verified decoder (`verified`, drafts from SBD's block and `lookup`), tree verification (`tree`: the tree,
its attention, the walk; `tree_verified`: the decoder; `drafts`: the draft sources and their names;
`tree_width`: the cost curve its width is chosen from), how tokens are drawn (`token_choice`),
the user's settings (`settings`), choosing a block size (`block_choice`), the host-side batch loop
(`generate`) and forward timing (`timing`). Imports `sbd_jax.data` and below."""

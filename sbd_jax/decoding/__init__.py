"""Decoding: the shared decoder base and NTP (`base`), SBD's entropy-bounded block decoder (`sbd`), the
verified decoder (`verified`: one loop that checks a chain or a tree of candidates a pass), the candidates' tree
(`tree`: its attention, the walk), the draft sources (`drafts`: their names and protocol; `chain_drafts`: SBD's
block, lookup and hybrid; `context_drafts`: tries of context matches and the model's own successors; `lookup`:
the match rule), `tree_width`: the cost curve the width is chosen from, how tokens are drawn (`token_choice`),
the user's settings (`settings`), choosing a block size (`block_choice`), the host-side batch loop
(`generate`) and forward timing (`timing`). Imports `sbd_jax.data` and below."""

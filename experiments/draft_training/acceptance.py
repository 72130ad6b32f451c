"""Per-position draft acceptance, teacher-forced: how often verified decoding would keep draft j.

Verified decoding drafts block position j (1..k-1) from a fully masked block that sees the exact prefix
before the block, and keeps it iff it equals NTP's greedy token there; on a greedy NTP output that token is
the output's own. So one forward over `[prompt + output | fully masked copy]` in the training layout gives
every block's drafts at once: position j of block b is right iff its argmax (the mask token excluded)
equals the output token. Blocks are cut at every offset of the answer, so each answer position is scored
at every block position. Returns, per j, the chance draft j is right given drafts 1..j-1 were.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.model.masks import SBDTrainingMask
from sbd_jax.model.transformer import Transformer


def conditional_acceptance(config: Any, params: Any, prompts: Sequence[Sequence[int]],
                           outputs: Sequence[Sequence[int]], block_size: int) -> list[float]:
    """`[P(draft j right | 1..j-1 right) for j in 1..k-1]` over every block inside the answers."""
    k = block_size
    rows = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    length = max(map(len, rows)) + k
    length += -length % k
    scored = []
    forward = jax.jit(lambda params, tokens, seg, pos: _block_predictions(config, params, tokens, seg, pos, k, length))
    for offset in range(k):  # blocks start at offset, offset + k, ...: every answer position at every j
        tokens = np.zeros((len(rows), length), np.int32)
        seg = np.zeros_like(tokens)
        for i, r in enumerate(rows):
            body = r[:length - offset]
            tokens[i, offset:offset + len(body)] = body
            seg[i, offset:offset + len(body)] = 1
        pos = np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32)
        guesses = np.asarray(forward(params, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)))
        for i, (p, o) in enumerate(zip(prompts, outputs)):
            start_answer, end = offset + len(p), offset + len(p) + len(o)
            for start in range(0, end - k + 1, k):  # blocks of the layout: multiples of k
                if start >= start_answer:  # its first token (exact in decoding) and its drafts in the answer
                    scored.append(guesses[i, start + 1:start + k] == tokens[i, start + 1:start + k])
    right = np.asarray(scored).reshape(-1, k - 1)
    out = []
    chain = np.ones(len(right), bool)
    for j in range(k - 1):
        reached = chain.sum()
        out.append(float((chain & right[:, j]).sum() / reached) if reached else float("nan"))
        chain &= right[:, j]
    return out


def _block_predictions(config: Any, params: Any, tokens: jax.Array, seg: jax.Array, pos: jax.Array, k: int,
                       length: int) -> jax.Array:
    """`[B, L]` argmax at each noisy position of the fully masked copy (the mask token excluded)."""
    noisy = jnp.where(seg > 0, config.mask_token_id, tokens)
    inputs = jnp.concatenate([tokens, noisy], axis=1)
    mask = SBDTrainingMask(jnp.concatenate([seg, seg], axis=1), seq_len=length, block_size=k)
    logits, _ = Transformer(config, gate_from=length).apply(
        {"params": params}, inputs, jnp.concatenate([pos, pos], axis=1), mask=mask.dense())
    return jnp.argmax(logits[:, length:].at[..., config.mask_token_id].set(-jnp.inf), axis=-1)

"""The one place that computes attention.

Today: the plain XLA dot-product reference. Faster kernels (blockwise, splash, GPU) plug in here,
behind the same signature, and must agree with it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

KeyPart = tuple[jax.Array, jax.Array, jax.Array]  # k [B,S,K,H], v [B,S,K,H], mask [B|1, T, S]


def attention(q_BTNH: jax.Array, parts: Sequence[KeyPart]) -> jax.Array:
    """Softmax attention of queries over the concatenation of several key/value parts.

    A part is `(k_BSKH, v_BSKH, mask)` with a boolean mask broadcastable to `[B, T, S]`
    (True = may attend). Decoding passes the cache and the new tokens as two parts, so the cache is
    read in place, never copied or concatenated. Grouped-query attention: query head n uses kv head
    n // (N // K). Scores and softmax in float32; every query must see at least one key.
    """
    batch, num_q, num_heads, head_dim = q_BTNH.shape
    num_kv = parts[0][0].shape[2]
    groups = num_heads // num_kv
    q = q_BTNH.reshape(batch, num_q, num_kv, groups, head_dim)
    neg = jnp.finfo(jnp.float32).min
    scores = []
    for k, _, mask in parts:
        s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5
        mask_B11TS = jnp.broadcast_to(mask, (batch,) + mask.shape[-2:])[:, None, None]
        scores.append(jnp.where(mask_B11TS, s, neg))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.zeros((batch, num_kv, groups, num_q, head_dim), jnp.float32)
    start = 0
    for k, v, _ in parts:
        p = probs[..., start:start + k.shape[1]].astype(v.dtype)
        out = out + jnp.einsum("bkgts,bskh->bkgth", p, v, preferred_element_type=jnp.float32)
        start += k.shape[1]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim).astype(q_BTNH.dtype)

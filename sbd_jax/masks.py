"""Attention masks as boolean arrays, True = the query may attend to the key.

The model takes the mask *among the tokens of one forward*; keys held in a KV cache are always
visible up to each row's cache length (the cache holds only the causal past).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal(num_tokens: int) -> jax.Array:
    """`[T, T]`: token i sees tokens 0..i."""
    idx = jnp.arange(num_tokens)
    return idx[None, :] <= idx[:, None]


def bidirectional(num_tokens: int) -> jax.Array:
    """`[T, T]`: every token sees every token (an SBD block being decoded)."""
    return jnp.ones((num_tokens, num_tokens), dtype=bool)


def from_block_ids(block_ids_BT: jax.Array) -> jax.Array:
    """`[B, T, T]`: token i sees token j iff block_ids[j] <= block_ids[i] (ids non-decreasing).

    `arange(T)` gives a causal mask, all zeros an all-to-all block, and `[0, 1, .., k-1, k, .., k]`
    the SBD pass that commits a finished block causally while a new block attends to it and to itself.
    """
    return block_ids_BT[:, None, :] <= block_ids_BT[:, :, None]


def same_segment(segment_ids_BT: jax.Array) -> jax.Array:
    """`[B, T, T]`: tokens of different packed documents never see each other."""
    return segment_ids_BT[:, None, :] == segment_ids_BT[:, :, None]

"""Attention masks as boolean arrays, True = the query may attend to the key.

The model takes the mask *among the tokens of one forward*; keys held in a KV cache are always
visible up to each row's cache length (the cache holds only the causal past).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def causal(num_tokens: int) -> jax.Array:
    """`[T, T]`: token i sees tokens 0..i."""
    idx = jnp.arange(num_tokens)
    return idx[None, :] <= idx[:, None]


def bidirectional(num_tokens: int) -> jax.Array:
    """`[T, T]`: every token sees every token (an SBD block being decoded)."""
    return jnp.ones((num_tokens, num_tokens), dtype=bool)


def same_segment(segment_ids_BT: jax.Array) -> jax.Array:
    """`[B, T, T]`: tokens of different packed documents never see each other."""
    return segment_ids_BT[:, None, :] == segment_ids_BT[:, :, None]


# --------------------------------------------------------------------------- SBD training layout
def sbd_allowed(q_idx: Any, kv_idx: Any, seq_len: int, block_size: int) -> Any:
    """The SBD training mask on the `[clean x_1..x_L | noisy x̂_1..x̂_L]` layout, for (broadcastable) index arrays.

    clean->clean causal; noisy->noisy within the same block; noisy->clean only for clean tokens of
    earlier blocks; clean->noisy never. Works on numpy and jax arrays alike.
    """
    q_noisy, kv_noisy = q_idx >= seq_len, kv_idx >= seq_len
    q_block = _block_of(q_idx - seq_len * q_noisy, block_size)
    kv_block = _block_of(kv_idx - seq_len * kv_noisy, block_size)
    clean_clean = ~q_noisy & ~kv_noisy & (kv_idx <= q_idx)
    noisy_noisy = q_noisy & kv_noisy & (q_block == kv_block)
    noisy_clean = q_noisy & ~kv_noisy & (q_block > kv_block)
    return clean_clean | noisy_noisy | noisy_clean


def _block_of(position: Any, block_size: Any) -> Any:
    """`position // block_size` for positions >= 0, where truncating division equals floor division.
    On jax arrays it is truncating: floor division adds a sign fix-up whose Mosaic lowering (splash's
    in-kernel mask) asks the host for its TPU generation, so lowering for TPU elsewhere would fail."""
    if isinstance(position, np.ndarray):
        return position // block_size
    position = jnp.asarray(position)
    return jax.lax.div(position, jnp.broadcast_to(jnp.asarray(block_size, position.dtype), position.shape))


class SBDTrainingMask(struct.PyTreeNode):
    """The SBD training mask, kept symbolic so attention kernels can skip tiles it rules out.

    `segment_ids` `[B, 2L]` (the clean half's ids repeated for the noisy half) additionally keep packed
    documents apart; 0 marks padding. `block_size` is a Python int or a traced int32 scalar (one
    compiled train step for every block size); a traced one needs `block_sizes`, the (min, max) range
    it takes, from which tile schedules are chosen to serve every block size in it.
    """

    segment_ids: jax.Array
    block_size: Any
    seq_len: int = struct.field(pytree_node=False)
    block_sizes: tuple[int, int] | None = struct.field(pytree_node=False, default=None)

    def block_range(self) -> tuple[int, int]:
        """(min, max) block size this mask may take: static, for tile schedules and kernel variants."""
        if self.block_sizes is not None:
            return self.block_sizes
        if isinstance(self.block_size, (int, np.integer)):
            return int(self.block_size), int(self.block_size)
        raise ValueError("a traced block_size needs block_sizes=(min, max)")

    def allowed(self, q_idx: jax.Array, kv_idx: jax.Array) -> jax.Array:
        """`[B, len(q_idx), len(kv_idx)]` for index vectors."""
        structure = sbd_allowed(q_idx[:, None], kv_idx[None, :], self.seq_len, self.block_size)
        q_seg = jnp.take(self.segment_ids, q_idx, axis=1)
        kv_seg = jnp.take(self.segment_ids, kv_idx, axis=1)
        return structure[None] & (q_seg[:, :, None] == kv_seg[:, None, :])

    def dense(self) -> jax.Array:
        idx = jnp.arange(2 * self.seq_len)
        return self.allowed(idx, idx)


def tile_visits(seq_len: int, tile: int, block_sizes: tuple[int, int]) -> np.ndarray:
    """bool `[tiles, tiles]` over the `[2L, 2L]` layout (tile divides L): may any (query, key) pair of
    the tile pair attend, for any block size in `block_sizes` (min, max)? Computed from tile bounds,
    never from a dense mask; the union over block sizes is what a step with a traced size must visit."""
    if seq_len % tile:
        raise ValueError(f"tile {tile} does not divide seq_len {seq_len}")
    lo = np.arange(2 * seq_len // tile) * tile
    q_lo, q_hi, kv_lo, kv_hi = lo[:, None], lo[:, None] + tile - 1, lo[None, :], lo[None, :] + tile - 1
    q_noisy, kv_noisy = q_lo >= seq_len, kv_lo >= seq_len
    visit = ~q_noisy & ~kv_noisy & (kv_lo <= q_hi)  # clean -> clean, causal
    for k in range(block_sizes[0], block_sizes[1] + 1):
        q_first, q_last = (q_lo - seq_len) // k, (q_hi - seq_len) // k  # noisy query blocks
        kv_first, kv_last = (kv_lo - seq_len * kv_noisy) // k, (kv_hi - seq_len * kv_noisy) // k
        visit |= q_noisy & kv_noisy & (q_first <= kv_last) & (kv_first <= q_last)  # a shared block
        visit |= q_noisy & ~kv_noisy & (q_last > kv_first)  # a clean key of an earlier block
    return visit

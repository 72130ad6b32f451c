"""Static-shape KV cache with a per-row length (no left padding, no batch-wide index)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.model.config import ModelConfig


class KVCache(struct.PyTreeNode):
    """Keys/values of all layers, `[layers, B, S, kv_heads, head_dim]`; row b holds `lengths[b]` valid slots.

    Slot s of row b holds the token at position s of that row's sequence. Slots at or beyond
    `lengths[b]` may hold stale values: attention never reads them, and the next append overwrites them.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype: jnp.dtype | None = None) -> KVCache:
    """An empty cache for `batch` rows of up to `capacity` tokens each."""
    shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
    dtype = dtype or config.compute_dtype
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def append(cache: KVCache, k_new: jax.Array, v_new: jax.Array, counts: jax.Array | int) -> KVCache:
    """Writes new keys/values `[layers, B, T, ...]` at slots `lengths[b] ..` and advances each row by `counts[b]`.

    All T tokens are written (static shape); only the first `counts[b]` become valid. Writes past the
    capacity are dropped, never clamped onto valid slots; callers check capacity before decoding.
    """
    num_new = k_new.shape[2]
    slots = cache.lengths[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
    rows = jnp.arange(slots.shape[0])[:, None]
    k = cache.k.at[:, rows, slots].set(k_new.astype(cache.k.dtype), mode="drop")
    v = cache.v.at[:, rows, slots].set(v_new.astype(cache.v.dtype), mode="drop")
    return KVCache(k=k, v=v, lengths=cache.lengths + jnp.asarray(counts, jnp.int32))


def valid_slots(cache: KVCache) -> jax.Array:
    """`[B, 1, S]` mask of the cache slots every query of a row may read."""
    return (jnp.arange(cache.capacity)[None, :] < cache.lengths[:, None])[:, None, :]

"""The one place that computes attention and picks how.

Implementations:
- `reference`: plain XLA dot-product attention with a dense boolean mask. Decoding always uses it:
  the cache and the new tokens are two key parts, so the cache is read in place, once per pass.
- `blockwise`: for the SBD training layout, a memory-efficient online-softmax loop over query and key
  tiles that never materialises a `[2L, 2L]` score matrix and skips, at trace time, every key tile the
  mask rules out entirely (about 3/4 of them on this layout). Pure XLA: CPU, GPU (the GPU path) and TPU.
- `splash`: TPU's Pallas splash-attention kernel with the SBD mask (block-sparse, fused backward);
  off TPU it runs in Pallas interpret mode (for tests). It needs head_dim % 128 == 0. It is a
  per-device kernel: under a multi-device mesh it would need a shard_map wrapper, not written yet.
`auto` takes `splash` on a single TPU device when head_dim allows, else `blockwise` for SBD training
sequences of 2L >= 1024 whose length a tile divides, else `reference`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.masks import SBDTrainingMask, sbd_training_mask, tile_visits

IMPLEMENTATIONS = ("auto", "reference", "blockwise", "splash")
_TILES = (512, 256, 128)
_NEG = -1e30  # finite: a fully masked tile row must not turn into NaN

KeyPart = tuple[jax.Array, jax.Array, Any]  # k [B,S,K,H], v [B,S,K,H], mask: bool [B|1,T,S] or SBDTrainingMask


def attention(q_BTNH: jax.Array, parts: Sequence[KeyPart], impl: str = "auto") -> jax.Array:
    """Softmax attention of queries over the concatenation of several key/value parts.

    A part is `(k_BSKH, v_BSKH, mask)`; the mask is boolean broadcastable to `[B, T, S]` (True = may
    attend) or, for a single part, an `SBDTrainingMask`. Grouped-query attention: query head n uses
    kv head n // (N // K). Scores and softmax in float32; every query must see at least one key.
    """
    if len(parts) == 1 and isinstance(parts[0][2], SBDTrainingMask):
        k, v, mask = parts[0]
        tile = _tile_for(mask.seq_len)
        on_one_tpu = jax.devices()[0].platform == "tpu" and jax.device_count() == 1
        if impl == "splash" or (impl == "auto" and on_one_tpu and tile and q_BTNH.shape[-1] % 128 == 0):
            return splash_sbd_attention(q_BTNH, k, v, mask, tile or _TILES[-1])
        if impl == "blockwise" or (impl == "auto" and tile is not None and 2 * mask.seq_len >= 1024):
            return blockwise_sbd_attention(q_BTNH, k, v, mask, tile or _TILES[-1])
        parts = [(k, v, mask.dense())]
    return reference_attention(q_BTNH, parts)


def _tile_for(seq_len: int) -> int | None:
    return next((t for t in _TILES if seq_len % t == 0), None)


def _grouped(q_BTNH: jax.Array, num_kv: int) -> jax.Array:
    b, t, n, h = q_BTNH.shape
    return q_BTNH.reshape(b, t, num_kv, n // num_kv, h)


def reference_attention(q_BTNH: jax.Array, parts: Sequence[KeyPart]) -> jax.Array:
    """Dense attention; decoding passes the cache and the new tokens as two parts."""
    batch, num_q, num_heads, head_dim = q_BTNH.shape
    q = _grouped(q_BTNH, parts[0][0].shape[2])
    neg = jnp.finfo(jnp.float32).min
    scores = []
    for k, _, mask in parts:
        s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5
        mask_B11TS = jnp.broadcast_to(mask, (batch,) + mask.shape[-2:])[:, None, None]
        scores.append(jnp.where(mask_B11TS, s, neg))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = jnp.zeros(q.shape[:1] + q.shape[2:4] + (num_q, head_dim), jnp.float32)
    start = 0
    for k, v, _ in parts:
        p = probs[..., start:start + k.shape[1]].astype(v.dtype)
        out = out + jnp.einsum("bkgts,bskh->bkgth", p, v, preferred_element_type=jnp.float32)
        start += k.shape[1]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim).astype(q_BTNH.dtype)


def blockwise_sbd_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: SBDTrainingMask,
                            tile: int) -> jax.Array:
    """Flash-style attention over the SBD training layout, visiting only key tiles the mask allows.

    The tile schedule is computed in numpy from L and the mask's block-size range, so it is static and
    serves every block size in that range (a traced block size compiles once); the exact mask, with
    the block size and segment ids (packing), is applied inside each visited tile. The per-tile step is rematerialised, so the backward pass
    keeps only the running (output, max, sum) per visited tile, never a score matrix.
    """
    batch, total, num_heads, head_dim = q_BTNH.shape
    if total % tile:
        raise ValueError(f"sequence length {total} is not a multiple of the tile {tile}")
    num_kv = k_BSKH.shape[2]
    q = _grouped(q_BTNH, num_kv)
    groups = q.shape[3]
    tiles = total // tile
    visit = tile_visits(mask.seq_len, tile, mask.block_range())  # [q tile, kv tile]
    outputs = []
    for qi in range(tiles):
        q_tile = q[:, qi * tile:(qi + 1) * tile]
        q_idx = qi * tile + jnp.arange(tile)

        @jax.checkpoint
        def step(carry, kj, q_tile=q_tile, q_idx=q_idx):
            out, running_max, running_sum = carry
            k_tile = jax.lax.dynamic_slice_in_dim(k_BSKH, kj * tile, tile, axis=1)
            v_tile = jax.lax.dynamic_slice_in_dim(v_BSKH, kj * tile, tile, axis=1)
            s = jnp.einsum("btkgh,bskh->bkgts", q_tile, k_tile, preferred_element_type=jnp.float32)
            ok = mask.allowed(q_idx, kj * tile + jnp.arange(tile))[:, None, None]  # [B,1,1,tq,tk]
            s = jnp.where(ok, s * head_dim**-0.5, _NEG)
            new_max = jnp.maximum(running_max, s.max(axis=-1))
            p = jnp.where(ok, jnp.exp(s - new_max[..., None]), 0.0)
            rescale = jnp.exp(running_max - new_max)
            out = out * rescale[..., None] + jnp.einsum("bkgts,bskh->bkgth", p.astype(v_tile.dtype), v_tile,
                                                        preferred_element_type=jnp.float32)
            return (out, new_max, running_sum * rescale + p.sum(axis=-1)), None

        init = (jnp.zeros((batch, num_kv, groups, tile, head_dim), jnp.float32),
                jnp.full((batch, num_kv, groups, tile), _NEG, jnp.float32),
                jnp.zeros((batch, num_kv, groups, tile), jnp.float32))
        (out, _, total_p), _ = jax.lax.scan(step, init, jnp.asarray(np.flatnonzero(visit[qi]), jnp.int32))
        outputs.append(out / jnp.maximum(total_p, 1e-30)[..., None])
    out = jnp.concatenate(outputs, axis=3)  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, total, num_heads, head_dim).astype(q_BTNH.dtype)


@functools.lru_cache(maxsize=32)
def _splash_kernel(seq_len: int, block_size: int, groups: int, tile: int, interpret: bool) -> Any:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    head_mask = splash_mask.NumpyMask(sbd_training_mask(seq_len, block_size))
    sizes = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
                              block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
    return splash.make_splash_mqa(splash_mask.MultiHeadMask([head_mask] * groups), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_sbd_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: SBDTrainingMask,
                         tile: int) -> jax.Array:
    """The SBD training mask through TPU splash attention: one MQA kernel per kv head (GQA groups).

    Splash's mask is static, so a traced block size selects among one kernel per size of the mask's
    range (`lax.switch`; 15 for sizes 2..16), all inside the one compiled step."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    batch, total, num_heads, head_dim = q_BTNH.shape
    if head_dim % 128:
        raise ValueError(f"splash attention needs head_dim % 128 == 0, got {head_dim}")
    num_kv = k_BSKH.shape[2]
    q = (_grouped(q_BTNH, num_kv) * head_dim**-0.5).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    k, v = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)  # [B, K, T, H]

    def with_block_size(block_size: int) -> Any:
        kernel = _splash_kernel(mask.seq_len, block_size, num_heads // num_kv, min(tile, total),
                                jax.devices()[0].platform != "tpu")

        def one_row(q_row, k_row, v_row, seg_row):
            per_kv_head = jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=SegmentIds(seg_row, seg_row)))
            return per_kv_head(q_row, k_row, v_row)

        return lambda q, k, v, seg: jax.vmap(one_row)(q, k, v, seg)  # [B, K, G, T, H]

    low, high = mask.block_range()
    if low == high:
        out = with_block_size(low)(q, k, v, mask.segment_ids)
    else:
        out = jax.lax.switch(mask.block_size - low, [with_block_size(b) for b in range(low, high + 1)],
                             q, k, v, mask.segment_ids)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, total, num_heads, head_dim).astype(q_BTNH.dtype)

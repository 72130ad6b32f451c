"""The SBD training mask through TPU's Pallas splash-attention kernel, on one device or under a mesh.

Splash is block-sparse: it skips the key tiles a mask rules out and fuses the backward pass. Its mask
here is computed, never stored: the kernel's tile plan is derived block by block from the mask function
(no dense `[2L, 2L]` array on the host), and partly masked tiles evaluate the function in the kernel.
Off TPU the kernel runs in Pallas interpret mode, which is for tests only.

Under a `(data, fsdp, tensor)` mesh the kernel runs inside `shard_map`: batch over the rules table's
batch axes, heads over its head axis (kv heads decide, so every query head keeps its kv head on the
same device), the sequence whole on each device — the per-device kernel sees only local shapes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import Mesh, PartitionSpec

from sbd_jax.model import sharding
from sbd_jax.model.masks import SBDTrainingMask, sbd_allowed


class SBDSplashMask(splash_mask._ComputableMask):
    """The `[2L, 2L]` SBD training mask for one block size, as a function of (query, key) indices."""

    def __init__(self, seq_len: int, block_size: int):
        self.seq_len, self.block_size = seq_len, block_size
        super().__init__((2 * seq_len, 2 * seq_len),
                         functools.partial(sbd_allowed, seq_len=seq_len, block_size=block_size))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SBDSplashMask) and (self.seq_len, self.block_size) == (other.seq_len, other.block_size)

    def __hash__(self) -> int:
        return hash((SBDSplashMask, self.seq_len, self.block_size))


@functools.lru_cache(maxsize=64)
def _kernel(seq_len: int, block_size: int, groups: int, tile: int, interpret: bool) -> Any:
    sizes = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
                              block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
    mask = splash_mask.MultiHeadMask([SBDSplashMask(seq_len, block_size)] * groups)
    # The kernel keeps its tile plan as arrays: made concrete here, so the cached kernel can serve later
    # traces (it is first built inside one: a scanned, rematerialised layer under shard_map).
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_sbd_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: SBDTrainingMask,
                         tile: int, interpret: bool) -> jax.Array:
    """One device: one MQA kernel per kv head (its GQA group of query heads), vmapped over the batch.

    Splash's mask is static, so a traced block size selects among one kernel per size of the mask's
    range (`lax.switch`; 15 for sizes 2..16), all inside the one compiled step. `interpret`: Pallas's
    interpreter (any platform; for tests)."""
    batch, total, num_heads, head_dim = q_BTNH.shape
    num_kv = k_BSKH.shape[2]
    q = (q_BTNH.reshape(batch, total, num_kv, num_heads // num_kv, head_dim) * head_dim**-0.5
         ).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    k, v = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)  # [B, K, T, H]

    def with_block_size(block_size: int) -> Any:
        kernel = _kernel(mask.seq_len, block_size, num_heads // num_kv, min(tile, total), interpret)

        def one_row(q_row, k_row, v_row, seg_row):
            ids = splash.SegmentIds(seg_row, seg_row)
            return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=ids))(q_row, k_row, v_row)

        return lambda q, k, v, seg: jax.vmap(one_row)(q, k, v, seg)  # [B, K, G, T, H]

    low, high = mask.block_range()
    if low == high:
        out = with_block_size(low)(q, k, v, mask.segment_ids)
    else:
        out = jax.lax.switch(mask.block_size - low, [with_block_size(b) for b in range(low, high + 1)],
                             q, k, v, mask.segment_ids)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, total, num_heads, head_dim).astype(q_BTNH.dtype)


def sharded_splash_sbd_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: SBDTrainingMask,
                                 tile: int, mesh: Mesh, interpret: bool) -> jax.Array:
    """`splash_sbd_attention` on every device of `mesh` (shard_map), each on its share of batch and heads.

    A dimension the mesh axes do not divide stays whole on every device (as `sharding.py` does for
    parameters), so any batch and head count runs on any mesh."""
    batch_spec = sharding.logical_spec((q_BTNH.shape[0],), ("batch",), mesh)[0]
    # kv heads decide: query head n uses kv head n // G, so both split at kv-head boundaries or neither.
    head_spec = sharding.logical_spec((k_BSKH.shape[2],), ("heads",), mesh)[0]
    qkv = PartitionSpec(batch_spec, None, head_spec, None)
    segments = PartitionSpec(batch_spec, None)
    block_range = mask.block_range()

    def local(q, k, v, segment_ids, block_size):
        local_mask = SBDTrainingMask(segment_ids, block_size if block_range[0] != block_range[1] else block_range[0],
                                     mask.seq_len, block_range)
        return splash_sbd_attention(q, k, v, local_mask, tile, interpret)

    block_size = np.int32(mask.block_size) if isinstance(mask.block_size, (int, np.integer)) else mask.block_size
    run = jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, segments, PartitionSpec()), out_specs=qkv,
                        check_vma=False)
    return run(q_BTNH, k_BSKH, v_BSKH, mask.segment_ids, block_size)

"""The one place that computes attention and picks how.

Implementations:
- `reference`: plain XLA dot-product attention with a dense boolean mask. Decoding always uses it:
  the cache and the new tokens are two key parts, so the cache is read in place, once per pass.
- `blockwise`: for the SBD training layout, a memory-efficient online-softmax loop over query and key
  tiles that never materialises a `[2L, 2L]` score matrix and skips, at trace time, every key tile the
  mask rules out entirely (about 3/4 of them on this layout). Pure XLA: CPU, GPU (the GPU path) and TPU.
- `splash`: TPU's Pallas splash-attention kernel with the SBD mask (`splash.py`: block-sparse, fused
  backward, run under `shard_map` when the model is given its mesh). It needs head_dim % 128 == 0 and
  L a multiple of 128; off TPU it runs in Pallas interpret mode (CPU, for tests); GPU refuses it.
The platform is the one being compiled for: the host's backend, or the target of `compiling_for`
(lowering for TPU or CUDA on a CPU host, `sbd_jax/lower.py`).
`auto` takes `splash` on TPU (one device or any mesh) when head_dim and L allow, else `blockwise` when
a tile of 128, 256 or 512 cuts each half into at least two tiles (L >= 256, a multiple of 128; the
largest such tile), else `reference` (at the SmolLM2 shape on a CPU blockwise makes the whole SBD train
step faster than the dense reference: `benchmarks/results/train_step_cpu.json`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sbd_jax.choice import Choice
from sbd_jax.errors import UserError
from sbd_jax.model.masks import SBDTrainingMask, tile_visits


class AttentionImpl(Choice):
    """How training's attention is computed (the module docstring says what each does and where it runs)."""

    AUTO = "auto"
    REFERENCE = "reference"
    BLOCKWISE = "blockwise"
    SPLASH = "splash"


_TILES = (512, 256, 128)
_NEG = -1e30  # finite: a fully masked tile row must not turn into NaN

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("sbd_jax_target_platform", default=None)

KeyPart = tuple[jax.Array, jax.Array, Any]  # k [B,S,K,H], v [B,S,K,H], mask: bool [B|1,T,S] or SBDTrainingMask


def attention(q_BTNH: jax.Array, parts: Sequence[KeyPart], impl: str = AttentionImpl.AUTO,
              mesh: Mesh | None = None) -> jax.Array:
    """Softmax attention of queries over the concatenation of several key/value parts.

    A part is `(k_BSKH, v_BSKH, mask)`; the mask is boolean broadcastable to `[B, T, S]` (True = may
    attend) or, for a single part, an `SBDTrainingMask`. Grouped-query attention: query head n uses
    kv head n // (N // K). Scores and softmax in float32; every query must see at least one key.
    `mesh`: the device mesh the caller's arrays are sharded over, for kernels that run per device.
    """
    if len(parts) == 1 and isinstance(parts[0][2], SBDTrainingMask):
        k, v, mask = parts[0]
        auto = impl == AttentionImpl.AUTO
        if impl == AttentionImpl.SPLASH or (auto and _splash_fits(q_BTNH.shape[-1], mask.seq_len)):
            return _splash(q_BTNH, k, v, mask, mesh)
        if impl == AttentionImpl.BLOCKWISE or (auto and uses_blockwise(mask.seq_len)):
            tile = blockwise_tile(mask.seq_len) or _tile_for(mask.seq_len)
            if tile is None:
                raise UserError(f"attention='blockwise' needs data.seq_len a multiple of 128 (got {mask.seq_len}); "
                                "use attention='auto'")
            return blockwise_sbd_attention(q_BTNH, k, v, mask, tile)
        parts = [(k, v, mask.dense())]
    return reference_attention(q_BTNH, parts)


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Traces inside choose kernels for `platform` ("tpu", "cuda", "rocm" or "cpu"), not for the host.

    Tracing does not know what it will be lowered for, and the kernel choice is made at trace time."""
    token = _TARGET.set("gpu" if platform in ("cuda", "rocm") else platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> str:
    """"tpu", "gpu" or "cpu": what the traced computation will run on."""
    return _TARGET.get() or jax.default_backend()


def _tile_for(seq_len: int) -> int | None:
    return next((t for t in _TILES if seq_len % t == 0), None)


def blockwise_tile(seq_len: int) -> int | None:
    """The largest tile that cuts each half of the 2L layout into at least two tiles (else no tile is
    ever skipped), None if there is none."""
    return next((t for t in _TILES if seq_len % t == 0 and seq_len >= 2 * t), None)


def uses_blockwise(seq_len: int) -> bool:
    """Whether `auto` runs the blockwise kernel for SBD training rows of L = seq_len (when splash does not)."""
    return blockwise_tile(seq_len) is not None


def _splash_fits(head_dim: int, seq_len: int) -> bool:
    return target_platform() == "tpu" and head_dim % 128 == 0 and _tile_for(seq_len) is not None


def _splash(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: SBDTrainingMask,
            mesh: Mesh | None) -> jax.Array:
    """Splash on this device or every device of `mesh`; a shape or platform it cannot serve is refused."""
    from sbd_jax.model import splash  # imports Pallas TPU ops: only when splash runs

    head_dim, platform = q_BTNH.shape[-1], target_platform()
    if platform == "gpu":
        raise UserError("attention='splash' is a TPU kernel (on GPU it would run in Pallas's slow interpreter); "
                        "use attention='blockwise' or 'auto'")
    tile = _tile_for(mask.seq_len)
    if head_dim % 128 or tile is None:
        raise UserError(f"attention='splash' needs head_dim % 128 == 0 and data.seq_len a multiple of 128 "
                        f"(got head_dim={head_dim}, seq_len={mask.seq_len}); use attention='auto'")
    if mesh is None or mesh.size == 1:
        return splash.splash_sbd_attention(q_BTNH, k_BSKH, v_BSKH, mask, tile, interpret=platform != "tpu")
    return splash.sharded_splash_sbd_attention(q_BTNH, k_BSKH, v_BSKH, mask, tile, mesh, interpret=platform != "tpu")


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

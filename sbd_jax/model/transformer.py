"""Pure-functional Llama / Qwen2 / Qwen3 decoder in Flax linen.

One forward serves every mode: a whole sequence (training, prefill) or new tokens against a KV
cache (decoding), with the attention among the forward's own tokens given as an explicit mask
(causal, an all-to-all SBD block, or anything `masks.py` builds). The forward never writes the
cache: it returns the new tokens' K/V and the caller decides what to commit (`kv_cache.append`).

With a gated adapter (`config.adapter`, `sbd_jax.model.adapter`) the forward's tokens from index `gate_from`
on (the block: SBD's masked positions) add the adapter's low-rank term to the targeted projections and
read the adapter's own mask-token embedding; the tokens before it are computed exactly as without it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from sbd_jax.choice import Choice
from sbd_jax.model import masks
from sbd_jax.model.adapter import with_low_rank, with_mask_embedding
from sbd_jax.model.attention import AttentionImpl, attention
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.kv_cache import KVCache, valid_slots
from sbd_jax.model.rope import apply_rope, inverse_frequencies

_init = nn.initializers.normal(stddev=0.02)


class NewKV(NamedTuple):
    """Post-RoPE keys/values of a forward's tokens, `[layers, B, T, kv_heads, head_dim]`."""

    k: jax.Array
    v: jax.Array


class RMSNorm(nn.Module):
    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        # transformers casts back to the input dtype before scaling; the same order keeps bf16 close.
        return (weight.astype(self.dtype) * normed.astype(self.dtype)).astype(self.dtype)


def _dense(features: int, bias: bool, name: str, cfg: ModelConfig) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=cfg.compute_dtype, param_dtype=cfg.weights_dtype,
                    kernel_init=_init, name=name)


def _project(x: jax.Array, features: int, bias: bool, name: str, cfg: ModelConfig, gate_from: int | None) -> jax.Array:
    """`W x` (+ bias), with the adapter's term on the tokens from `gate_from` on where it targets `name`."""
    return with_low_rank(_dense(features, bias, name, cfg)(x), x, name, cfg, gate_from)


class Attention(nn.Module):
    config: ModelConfig
    mesh: Any = None  # the device mesh, for attention kernels that run per device (attention.py)
    attention: str = AttentionImpl.AUTO  # the implementation (attention.py)
    gate_from: int | None = None  # the adapter's first token (None: off)

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask, cache_kv):
        cfg, gate = self.config, self.gate_from
        batch, num_tokens, _ = x_BTD.shape
        q = _project(x_BTD, cfg.num_heads * cfg.head_dim, cfg.qkv_bias, "q_proj", cfg, gate)
        k = _project(x_BTD, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, "k_proj", cfg, gate)
        v = _project(x_BTD, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, "v_proj", cfg, gate)
        q_BTNH = q.reshape(batch, num_tokens, cfg.num_heads, cfg.head_dim)
        k_BTKH = k.reshape(batch, num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v_BTKH = v.reshape(batch, num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            norm = dict(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weights_dtype)
            q_BTNH = RMSNorm(**norm, name="q_norm")(q_BTNH)
            k_BTKH = RMSNorm(**norm, name="k_norm")(k_BTKH)
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
        k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)
        parts = [(k_BTKH, v_BTKH, mask)]
        if cache_kv is not None:
            cache_k, cache_v, cache_mask = cache_kv
            parts.insert(0, (cache_k.astype(k_BTKH.dtype), cache_v.astype(v_BTKH.dtype), cache_mask))
        out = attention(q_BTNH, parts, self.attention, self.mesh).reshape(batch, num_tokens, cfg.num_heads * cfg.head_dim)
        return _project(out, cfg.hidden_size, cfg.o_bias, "o_proj", cfg, gate), (k_BTKH, v_BTKH)


class MLP(nn.Module):
    config: ModelConfig
    gate_from: int | None = None

    @nn.compact
    def __call__(self, x):
        cfg, g = self.config, self.gate_from
        gate = _project(x, cfg.intermediate_size, False, "gate_proj", cfg, g)
        up = _project(x, cfg.intermediate_size, False, "up_proj", cfg, g)
        return _project(nn.silu(gate) * up, cfg.hidden_size, False, "down_proj", cfg, g)


class DecoderLayer(nn.Module):
    """Pre-norm block; `(carry, per-layer input) -> (carry, per-layer output)` so it can be scanned."""

    config: ModelConfig
    mesh: Any = None
    attention: str = AttentionImpl.AUTO
    gate_from: int | None = None

    @nn.compact
    def __call__(self, x, positions, mask, cache_mask, cache_kv):
        cfg = self.config
        norm = dict(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weights_dtype)
        layer_cache = None if cache_kv is None else (cache_kv[0], cache_kv[1], cache_mask)
        h, new_kv = Attention(cfg, self.mesh, self.attention, self.gate_from, name="self_attn")(
            RMSNorm(**norm, name="input_layernorm")(x), positions, mask, layer_cache)
        x = x + h
        x = x + MLP(cfg, self.gate_from, name="mlp")(RMSNorm(**norm, name="post_attention_layernorm")(x))
        return x, new_kv


class Remat(Choice):
    """What a training step's backward pass recomputes of each layer instead of keeping it."""

    NONE = "none"  # nothing: every activation is kept
    FULL = "full"  # everything
    DOTS = "dots"  # all but the outputs of matmuls without batch dimensions (the projections)


def _layer_class(remat: str, scan_layers: bool):
    if remat == Remat.NONE:
        return DecoderLayer
    policy = {Remat.FULL: None, Remat.DOTS: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims}[Remat(remat)]
    return nn.remat(DecoderLayer, policy=policy, prevent_cse=not scan_layers)


class Transformer(nn.Module):
    """Token ids + explicit positions (+ optional cache) -> logits and the new tokens' K/V.

    `mesh`: the `(data, fsdp, tensor)` mesh the inputs are sharded over (training); attention kernels
    that run per device (splash) then run on each device's share under `shard_map`. `attention` (the
    implementation, attention.py) and `remat` (`Remat`: what the backward pass recomputes)
    change how training runs, not what it computes; decoding keeps the defaults. `gate_from`: the
    forward's first token that the adapter applies to (its block), None for none; no effect without
    `config.adapter`."""

    config: ModelConfig
    mesh: Any = None
    attention: str = AttentionImpl.AUTO
    remat: str = Remat.NONE
    gate_from: int | None = None

    @nn.compact
    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array,
        mask: jax.Array | masks.SBDTrainingMask | None = None,
        cache: KVCache | None = None,
        compute_logits: bool = True,
        cache_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, NewKV]:
        """Runs the model on `tokens_BT` at `positions_BT`.

        mask: boolean `[T, T]` or `[B, T, T]` among these tokens (default causal), or an
            `SBDTrainingMask` for the clean|noisy training layout.
        cache: if given, the tokens also see each row's first `cache.lengths[b]` cached slots (or, with
            `cache_mask` `[B, T, S]`, the slots it allows each token: training's noisy half over the clean one).
        Returns logits `[B, T, vocab]` in float32 (or the final hidden states when
        `compute_logits=False`) and the tokens' K/V for `kv_cache.append`.
        """
        cfg = self.config
        if mask is None:
            mask = masks.causal(tokens_BT.shape[1])
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype,
                         param_dtype=cfg.weights_dtype, embedding_init=_init, name="embed_tokens")
        gate = self.gate_from if cfg.adapter is not None else None
        x = with_mask_embedding(self, embed(tokens_BT), tokens_BT, cfg, gate)
        if cache is not None and cache_mask is None:
            cache_mask = valid_slots(cache)
        cache_kv = None if cache is None else (cache.k, cache.v)
        layer_cls = _layer_class(self.remat, cfg.scan_layers)
        if cfg.scan_layers:
            stack = nn.scan(
                layer_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=cfg.num_layers,
            )
            x, (k_new, v_new) = stack(cfg, self.mesh, self.attention, gate, name="layers")(
                x, positions_BT, mask, cache_mask, cache_kv)
        else:
            ks, vs = [], []
            for i in range(cfg.num_layers):
                layer_kv = None if cache_kv is None else (cache_kv[0][i], cache_kv[1][i])
                x, (k, v) = layer_cls(cfg, self.mesh, self.attention, gate, name=f"layers_{i}")(
                    x, positions_BT, mask, cache_mask, layer_kv)
                ks.append(k)
                vs.append(v)
            k_new, v_new = jnp.stack(ks), jnp.stack(vs)
        if cache is not None:
            k_new, v_new = _after_cache_reads(x, k_new, v_new)
        x = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weights_dtype, name="norm")(x)
        if not compute_logits:
            return x, NewKV(k_new, v_new)
        if cfg.tie_word_embeddings:
            return vocab_logits(x, embed.embedding.T), NewKV(k_new, v_new)
        return LMHead(cfg, name="lm_head")(x), NewKV(k_new, v_new)


def forward(model: Transformer, params: Any, *args: Any, **kwargs: Any) -> tuple[jax.Array, NewKV]:
    """`model.apply` on `params`: (logits, or hidden states with `compute_logits=False`; the new tokens' KV).
    The one place that names what flax's `apply` types only as a union."""
    return cast(tuple[jax.Array, NewKV], model.apply({"params": params}, *args, **kwargs))


def _after_cache_reads(x_BTD: jax.Array, k_new: jax.Array, v_new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The new K/V `[layers, B, T, ...]`, made to depend on each row's last hidden state (plus zero).

    The caller writes them into the cache in place (`kv_cache.append`). A layer's K/V are ready before
    the later layers read their cache slices, so without this dependency XLA cannot order the write after
    those reads and copies the whole cache on every decoding step, a step that then grows with the cache
    (`benchmarks/long_context.py`; its results: `benchmarks/results/long_context_cpu.json`). XLA keeps
    `x * 0` (it is NaN for x = inf), and a row whose hidden state is not finite has non-finite logits already.
    """
    zero = (x_BTD.sum(axis=(1, 2)) * 0).astype(k_new.dtype)[None, :, None, None, None]
    return k_new + zero, v_new + zero


class LMHead(nn.Module):
    """The untied output matrix `[hidden, vocab]` (HF's lm_head)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        return vocab_logits(x, self.param("kernel", _init, (cfg.hidden_size, cfg.vocab_size), cfg.weights_dtype))


def vocab_logits(hidden: jax.Array, kernel_DV: jax.Array) -> jax.Array:
    """float32 logits: hidden states times the output matrix in the compute dtype, accumulated in float32.

    The one projection of both the training loss (objective.token_cross_entropy) and decoding. Never
    rounded to bf16: bf16 logits tie exactly at a few percent of positions, and a tie broken differently
    by two passes of other shapes (NTP's one token, verification's block) changes a greedy output."""
    return jnp.einsum("...d,dv->...v", hidden, kernel_DV.astype(hidden.dtype), preferred_element_type=jnp.float32)


def output_kernel(params: dict, config: ModelConfig) -> jax.Array:
    """The `[hidden, vocab]` matrix that turns final hidden states into logits (tied or not)."""
    if config.tie_word_embeddings:
        return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Random parameters (normal(0.02) weights, unit norms), shaped as the checkpoints load them."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.jit(Transformer(config).init)(jax.random.key(seed), tokens, tokens)["params"]

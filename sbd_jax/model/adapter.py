"""The gated adapter: a small set of weights that teaches a frozen model to fill SBD's blocks while every
other position stays the base model's bit for bit.

The adapter (after "Your LLM Knows the Future", arXiv 2507.11851, gated LoRA; its sizes: `config.AdapterConfig`)
adds `(alpha / rank) B A x` to the targeted projections only at a forward's block (masked) positions, from the
`Transformer`'s `gate_from` on, and gives the mask token its own embedding there. Committed tokens never attend to
a block, so prefill, the KV cache, NTP decoding and the verifying logits are exactly the base model's, and verified
decoding reproduces the base model, not a fine-tuned copy of it. Training updates only the adapter.

Here: the layer, where the model applies it, its parameters' names (each targeted projection's `<name>_lora`
with `a` and `b`, and `adapter_mask_embedding`), splitting a parameter tree into base and adapter and merging
them back, and a new adapter's weights. Its files: `sbd_jax.checkpoints.adapter`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig

MASK_EMBEDDING = "adapter_mask_embedding"
_LORA = "_lora"  # the suffix of a targeted projection's adapter


class LowRank(nn.Module):
    """The adapter's `(alpha / rank) B A x` of one projection; `B` starts at zero (the base model)."""

    features: int
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, adapter = self.config, self.config.adapter
        assert adapter is not None, "LowRank is built only where the config has an adapter"
        a = self.param("a", nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"), (x.shape[-1], adapter.rank),
                       cfg.weights_dtype)
        b = self.param("b", nn.initializers.zeros, (adapter.rank, self.features), cfg.weights_dtype)
        low = jnp.einsum("...d,dr->...r", x, a.astype(x.dtype))
        return jnp.einsum("...r,rf->...f", low, b.astype(x.dtype)) * jnp.asarray(adapter.scale, x.dtype)


def with_low_rank(y: jax.Array, x: jax.Array, name: str, cfg: ModelConfig, gate_from: int | None) -> jax.Array:
    """The output `y` of projection `name` of `x`, plus the adapter's term on the tokens from `gate_from` on where
    the adapter targets `name` (the tokens before are left exactly as they are: nothing is added to them, not even
    a zero). Called inside the module that owns the projection, so the layer is its `<name>_lora`."""
    if gate_from is None or cfg.adapter is None or name not in cfg.adapter.targets:
        return y
    return y.at[:, gate_from:].add(LowRank(y.shape[-1], cfg, name=name + _LORA)(x[:, gate_from:]))


def with_mask_embedding(module: nn.Module, x_BTD: jax.Array, tokens_BT: jax.Array, cfg: ModelConfig,
                        gate_from: int | None) -> jax.Array:
    """The embedded tokens `x_BTD` with the mask tokens from `gate_from` on reading the adapter's own embedding of
    the mask token (a parameter of `module`, the model); unchanged without an adapter or a gate."""
    if gate_from is None or cfg.adapter is None:
        return x_BTD
    assert cfg.mask_token_id is not None, "an adapter acts on blocks of mask tokens: the config names one"
    # Its initial value is never used: init_adapter copies the base's row for the mask token into it.
    own = module.param(MASK_EMBEDDING, nn.initializers.normal(stddev=0.02), (cfg.hidden_size,), cfg.weights_dtype)
    is_mask = jnp.equal(tokens_BT[:, gate_from:], cfg.mask_token_id)[..., None]
    return x_BTD.at[:, gate_from:].set(jnp.where(is_mask, own.astype(x_BTD.dtype), x_BTD[:, gate_from:]))


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapter) parameter trees of a merged tree."""
    base, adapter = {}, {}
    for key, value in params.items():
        if key == MASK_EMBEDDING or key.endswith(_LORA):
            adapter[key] = value
        elif isinstance(value, dict):
            base[key], inner = split(value)
            if inner:
                adapter[key] = inner
        else:
            base[key] = value
    return base, adapter


def merge(base: dict, adapter: dict) -> dict:
    """The base tree with the adapter's subtrees added (neither is changed)."""
    out = dict(base)
    for key, value in adapter.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def adapter_tree(model: nn.Module, key: jax.Array) -> dict:
    """A freshly initialised adapter for `model` (a `Transformer` whose config has the adapter; jit this, or
    `jax.eval_shape` it for the shapes: the base's weights, initialised alongside, are dropped before anything is
    computed)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return split(model.clone(gate_from=0).init(key, tokens, tokens)["params"])[1]


def init_adapter(model: nn.Module, base_params: dict, seed: int = 0) -> dict:
    """A new adapter for `model` (a `Transformer` whose config has the adapter and a mask token): random `A`, zero
    `B` (so the model starts as the base), and the mask token's embedding copied from the base's row for it. The
    base's own weights are never made anew (only the adapter's subtree leaves the compiled init)."""
    config = model.config
    if config.adapter is None or config.mask_token_id is None:
        raise UserError("an adapter needs config.adapter and a mask token")
    fresh = jax.device_get(jax.jit(lambda key: adapter_tree(model, key))(jax.random.key(seed)))
    row = np.asarray(base_params["embed_tokens"]["embedding"][config.mask_token_id])
    fresh[MASK_EMBEDDING] = row.astype(np.asarray(fresh[MASK_EMBEDDING]).dtype)
    return fresh

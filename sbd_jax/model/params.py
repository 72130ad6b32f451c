"""The model's weight matrices in one table: each one's logical axes and its shape for a config.

Sharding reads the axes (`sharding.logical_axes`), checkpoint readers the shapes (a file whose tensors do
not match the config is refused before XLA sees it). Names are the flax modules' and HF's own
(`q_proj`, ...); a kernel is stored `[in, out]` (HF stores its transpose).
"""

from __future__ import annotations

from typing import NamedTuple

from sbd_jax.model.config import ModelConfig


class Weight(NamedTuple):
    """A weight matrix's logical axes, `[in, out]` (`embed_tokens`: `[vocab, embed]`)."""

    inputs: str
    outputs: str


WEIGHTS = {
    "embed_tokens": Weight("vocab", "embed"),
    "q_proj": Weight("embed", "heads"), "k_proj": Weight("embed", "heads"), "v_proj": Weight("embed", "heads"),
    "o_proj": Weight("heads", "embed"),
    "gate_proj": Weight("embed", "mlp"), "up_proj": Weight("embed", "mlp"), "down_proj": Weight("mlp", "embed"),
    "lm_head": Weight("embed", "vocab"),
}


def weight_shape(module: str, cfg: ModelConfig) -> tuple[int, int]:
    """`[in, out]` of `module`'s matrix (a key of WEIGHTS) under `cfg`."""
    d, heads, kv_heads = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"embed_tokens": (cfg.vocab_size, d), "q_proj": (d, heads), "k_proj": (d, kv_heads),
            "v_proj": (d, kv_heads), "o_proj": (heads, d), "gate_proj": (d, cfg.intermediate_size),
            "up_proj": (d, cfg.intermediate_size), "down_proj": (cfg.intermediate_size, d),
            "lm_head": (d, cfg.vocab_size)}[module]

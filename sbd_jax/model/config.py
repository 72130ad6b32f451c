"""Model architecture: one frozen dataclass for Llama, Qwen2 and Qwen3, read from / written to HF configs."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax.numpy as jnp

from sbd_jax.choice import Choice
from sbd_jax.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class DType(Choice):
    """A floating-point type by name: what a model computes in (`dtype`) and keeps its weights in (`param_dtype`)."""

    FLOAT64 = "float64"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def jnp(self) -> Any:
        """The JAX scalar type of this name."""
        return getattr(jnp, self.value)


RUN_DTYPES = (DType.FLOAT32, DType.BFLOAT16)  # what the CLIs offer: float32 (exact) and bfloat16 (GPU / TPU)


def backend_dtype(backend: str) -> DType:
    """The compute dtype recipes and benchmarks run in by default on `backend` (`jax.default_backend()`): float32
    on a CPU, bfloat16 on a GPU or TPU."""
    return DType.FLOAT32 if backend == "cpu" else DType.BFLOAT16


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """A gated low-rank adapter (`sbd_jax.model.adapter`): `W x + g (alpha / rank) B A x` on the `targets`
    projections, `g` = 1 only on the block (noisy) positions of a forward, so every other position is the
    base model's exactly; plus its own embedding of the mask token, used at those positions."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ADAPTER_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise UserError(f"adapter rank={self.rank!r} must be a whole number >= 1")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0 or self.alpha == float("inf"):
            raise UserError(f"adapter alpha={self.alpha!r} must be a finite number > 0")
        unknown = [t for t in self.targets if t not in ADAPTER_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise UserError(f"adapter targets {self.targets!r}: name each of {', '.join(ADAPTER_TARGETS)} at most once "
                            "(at least one)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer architecture plus the dtypes and layer layout (scanned or not) it runs in.

    Hashable, so it can be a static argument of jitted functions.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mask_token_id: int | None = None  # SBD's mask token; set by fine-tuning (config.json "sbd_mask_token_id")
    # How to run, not what the weights are:
    dtype: DType = DType.FLOAT32  # activations / matmul inputs
    param_dtype: DType = DType.FLOAT32
    scan_layers: bool = False  # one stacked parameter tree (compiles once for all layers)
    adapter: AdapterConfig | None = None  # a gated adapter on top of these weights (sbd_jax.model.adapter)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {self.model_type!r}: supported are "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise UserError(f"config {name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs whole groups"
            )
        if self.head_dim % 2:
            raise UserError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, DType.parse(getattr(self, name), f"config {name}"))
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.mask_token_id is not None and self.mask_token_id in self.eos_token_ids:
            # every decoder is kept from emitting the mask token, so it could then never stop
            raise UserError(f"mask_token_id={self.mask_token_id} is an end-of-sequence id of this model (eos ids "
                            f"{list(self.eos_token_ids)}): decoding would never stop; choose another (unused) token")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return self.dtype.jnp

    @property
    def weights_dtype(self) -> jnp.dtype:
        return self.param_dtype.jnp

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


class WithWeights(Protocol):
    """What decoding and measuring read from a model holder (`sbd_jax.load`'s SBDModel, `load_model`'s
    LoadedModel, the evaluation's EvaluatedModel): a config and its parameters."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def params(self) -> Any: ...

"""Model architecture: one frozen dataclass for Llama, Qwen2 and Qwen3, read from / written to HF configs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from sbd_jax.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTYPES = {"float64": jnp.float64, "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    dtype: str = "float32"  # activations / matmul inputs
    param_dtype: str = "float32"
    scan_layers: bool = False  # one stacked parameter tree (compiles once for all layers)

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
            if getattr(self, name) not in DTYPES:
                raise UserError(f"config {name}={getattr(self, name)!r}: use one of {', '.join(DTYPES)}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]

    @property
    def weights_dtype(self) -> jnp.dtype:
        return DTYPES[self.param_dtype]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, hf: dict[str, Any], **run_options: Any) -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dict (transformers 4.x or 5.x style)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r} in config.json: supported are "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("mlp_bias"):
            raise UserError("config.json has mlp_bias=true, which sbd_jax does not support; no Llama/Qwen release uses it")
        if hf.get("use_sliding_window"):
            raise UserError("config.json has use_sliding_window=true; sbd_jax supports full attention only")
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
        # transformers 5 keeps theta and scaling in rope_parameters; 4.x in rope_theta / rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise UserError(f"config.json rope_type={rope_type!r}: supported are 'default' and 'llama3'")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mask_token_id=hf.get("sbd_mask_token_id"),
            **run_options,
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict that transformers loads back into the same architecture."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta,
                    **dataclasses.asdict(self.rope_scaling)}
        architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        hf: dict[str, Any] = {
            "architectures": [architectures[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,  # transformers 5
            "rope_scaling": rope if self.rope_scaling is not None else None,  # transformers 4
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.param_dtype,
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        if self.mask_token_id is not None:
            hf["sbd_mask_token_id"] = self.mask_token_id
        return hf

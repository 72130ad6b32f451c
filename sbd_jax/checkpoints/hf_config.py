"""A Hugging Face `config.json` dict <-> ModelConfig (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sbd_jax.errors import UserError
from sbd_jax.model.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling

# Keys a config.json must have (the rest have defaults); one missing is named instead of a KeyError.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _require(found: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [key for key in keys if key not in found]
    if missing:
        raise UserError(f"{where} has no {missing[0]!r} (needed: {', '.join(keys)}); re-download or re-export "
                        "the model")


def config_from_hf(hf: dict[str, Any], source: str = "config.json", **run_options: Any) -> ModelConfig:
    """The architecture a Hugging Face `config.json` dict (read from `source`, named in errors) describes;
    `run_options`: dtypes, scan_layers."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"unsupported model_type {model_type!r} in config.json: supported are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _require(hf, _REQUIRED, source)
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
        _require(rope, _LLAMA3_ROPE, f"{source}'s llama3 rope scaling")
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
    return ModelConfig(
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

def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The `config.json` dict that transformers loads back into the same architecture."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta,
                **dataclasses.asdict(config.rope_scaling)}
    architectures = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    hf: dict[str, Any] = {
        "architectures": [architectures[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,  # transformers 5
        "rope_scaling": rope if config.rope_scaling is not None else None,  # transformers 4
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        "torch_dtype": config.param_dtype,
    }
    if config.model_type != "qwen2":
        hf["attention_bias"] = config.qkv_bias
    if config.mask_token_id is not None:
        hf["sbd_mask_token_id"] = config.mask_token_id
    return hf

"""GGUF (llama.cpp) files -> config + params + tokenizer, for the llama architecture."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from sbd_jax.checkpoints.hf import params_from_tensors
from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _open(path: str):
    import gguf  # imported lazily: only GGUF users pay for it

    if not os.path.isfile(path):
        raise UserError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on a truncated or foreign file
        raise UserError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's rotate_half halves)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(path: str, **run_options: Any) -> ModelConfig:
    """The ModelConfig of a llama-architecture GGUF, from its metadata alone (no tensor is read)."""
    return _config(_open(path), path, run_options)


def _config(reader: Any, path: str, run_options: dict) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)} (for Qwen, convert from the HF checkpoint)")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise UserError(f"{path}: GGUF with rope_freqs (Llama-3.1 rope scaling) is not supported; "
                        "load the Hugging Face checkpoint instead")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type="llama",
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        **run_options,
    )


def load_gguf(path: str, **run_options: Any) -> tuple[ModelConfig, dict]:
    """Reads a llama-architecture GGUF: architecture from its metadata, weights dequantized to float."""
    import gguf

    reader = _open(path)
    config = _config(reader, path, run_options)
    tensors = {t.name: t for t in reader.tensors}
    heads, kv_heads = config.num_heads, config.num_kv_heads
    by_hf_name = {}
    for name in tensors:
        hf_name = _hf_name(name)
        if hf_name is None:
            raise UserError(f"{path}: unexpected tensor {name!r} for a llama GGUF")
        by_hf_name[hf_name] = name

    def get(hf_name: str) -> np.ndarray:
        tensor = tensors[by_hf_name[hf_name]]
        try:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise UserError(f"{path}: tensor {tensor.name} has GGUF type {tensor.tensor_type.name}, which the "
                            "gguf package cannot dequantize; use a file with another type "
                            "(e.g. F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K)") from None
        w = np.asarray(w, dtype=np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        return w

    return config, params_from_tensors(by_hf_name.keys(), get, config, path)

"""Writes small llama GGUF files the way llama.cpp's converter does (Q/K rows permuted)."""

from __future__ import annotations

import gguf
import numpy as np

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_NAMES[module]}.{kind}"


def write_llama_gguf(path, torch_model, matrix_type=gguf.GGMLQuantizationType.F32, arch="llama",
                     overrides: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Saves a transformers Llama as GGUF; returns the (de)quantized weights a correct loader must see.

    `overrides` replaces (or adds) tensors by GGUF name, to write deliberately broken files.
    """
    overrides = dict(overrides or {})
    cfg = torch_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(cfg.eos_token_id)
    expected = {}
    for name, tensor in torch_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        gguf_w = w
        if "q_proj" in name:
            gguf_w = _permute(w, cfg.num_attention_heads)
        elif "k_proj" in name:
            gguf_w = _permute(w, cfg.num_key_value_heads)
        if _gguf_name(name) in overrides:
            writer.add_tensor(_gguf_name(name), overrides.pop(_gguf_name(name)))
        elif w.ndim == 2 and matrix_type != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(gguf_w, matrix_type)
            writer.add_tensor(_gguf_name(name), data, raw_dtype=matrix_type)
            # Quantization blocks run along rows, so permuting rows commutes with (de)quantizing.
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w, matrix_type), matrix_type)
        else:
            writer.add_tensor(_gguf_name(name), gguf_w)
            expected[name] = w
    for name, data in overrides.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected

"""Tiny random transformers models, saved as HF directories, for parity tests."""

from __future__ import annotations

import torch
import transformers

ARCHS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def tiny_hf_config(model_type: str, num_kv_heads: int = 2, tied: bool = False, llama3_rope: bool = False):
    kwargs = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=tied, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2,
    )
    if llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0}
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:  # transformers 4: theta apart, scaling only when there is some (tests/test_dependency_floor.py)
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = rope if llama3_rope else None
    return ARCHS[model_type](**kwargs)


def tiny_hf_model(model_type: str, seed: int = 0, **config_kwargs) -> transformers.PreTrainedModel:
    """A randomly initialised float32 model; biases and norms randomised too so they are tested."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(model_type, **config_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval().float()


def torch_logits(model, tokens) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()

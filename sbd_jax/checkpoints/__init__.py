"""Weights and tokenizers in and out: HF safetensors directories (`hf`, `hf_config`), GGUF files
(`gguf`), named embedded models (`load`), tokenizers (`tokenizer`) and gated-adapter files (`adapter`).
Imports `sbd_jax.model` and below."""

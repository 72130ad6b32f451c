"""Loading and saving weights: HF safetensors directories, GGUF files, named embedded models."""

"""Llama-3.1-8B with the paper's SBD recipe (AdamW, lr 3e-4, warmup 200, cosine, ~2M tokens/batch).

For 8 GPUs: fsdp over all devices. On a TPU slice, set --config.mesh='(1,-1,1)' (fsdp) or add tensor.
    python train.py --config configs/llama3_8b.py --workdir runs/llama3 --config.model.name=/path/to/Llama-3.1-8B
"""

from configs.base import paper_recipe_8b
from sbd_jax.training.config import default_config_dict

ARCHITECTURE = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))


def get_config():
    c = paper_recipe_8b(default_config_dict())
    c.model.name = ""  # an HF directory of Llama-3.1-8B(-Instruct)
    return c

"""Qwen3-8B with the paper's SBD recipe (AdamW, lr 3e-4, warmup 200, cosine, ~2M tokens/batch).

    python train.py --config configs/qwen3_8b.py --workdir runs/qwen3 --config.model.name=/path/to/Qwen3-8B
"""

from configs.base import paper_recipe_8b
from sbd_jax.training.config import default_config_dict

ARCHITECTURE = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                    num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                    qk_norm=True)


def get_config():
    c = paper_recipe_8b(default_config_dict())
    c.model.name = ""  # an HF directory of Qwen3-8B
    return c

"""A few-million-parameter Llama trained from scratch on CPU, on Python standard-library source.

    python train.py --config configs/tiny.py --workdir /tmp/tiny
"""

import glob
import os

from sbd_jax.training.config import default_config_dict

STDLIB = os.path.dirname(os.__file__)


def get_config():
    c = default_config_dict()
    c.model.architecture = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_layers=4,
                                num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024,
                                tie_word_embeddings=True, rope_theta=10000.0)
    c.model.tokenizer = "smollm2-135m"
    c.data.files = tuple(sorted(glob.glob(os.path.join(STDLIB, "json", "*.py")) +
                                glob.glob(os.path.join(STDLIB, "email", "*.py"))))
    c.data.seq_len = 128
    c.train.steps = 200
    c.train.batch_size = 8
    c.optimizer.lr = 2e-3
    c.optimizer.warmup_steps = 20
    c.checkpoint.every = 50
    return c

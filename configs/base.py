"""The paper's 8B recipe, shared by the 8B configs. Every field's default is written once, in the typed config
(`sbd_jax/training/config.py`); a config file starts from its `default_config_dict()` and sets what it changes."""

import ml_collections

from sbd_jax.model.config import DType
from sbd_jax.model.transformer import Remat


def paper_recipe_8b(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The paper's 8B SFT recipe: AdamW lr 3e-4, warmup 200, cosine, 34k steps, ~2M tokens a batch
    (512 x 4096), bf16 compute, full remat, scanned layers, fsdp over all devices."""
    c.model.dtype = DType.BFLOAT16
    c.model.scan_layers = True
    c.model.remat = Remat.FULL
    c.mesh = (1, -1, 1)
    c.data.seq_len = 4096
    c.train.steps = 34000
    c.train.batch_size = 512
    c.train.grad_accum = 64
    c.optimizer.lr = 3e-4
    c.optimizer.warmup_steps = 200
    c.checkpoint.every = 500
    return c

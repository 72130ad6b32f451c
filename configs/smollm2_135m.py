"""SBD fine-tuning of the embedded default model, SmolLM2-135M-Instruct.

The training stage of recipes/smollm2_sbd (which builds the data and evaluates):
    python -m recipes.smollm2_sbd.run --workdir runs/smollm2_sbd
or on your own chat JSONL:
    python train.py --config configs/smollm2_135m.py --workdir runs/smol --config.data.files='("sft.jsonl",)'

Sized for one GPU (bf16 compute, fp32 master weights and AdamW state; 400 steps of 32 x 512 tokens,
about 6.5M tokens). On a CPU use the recipe's --cpu sizes (batch 2 x 128).
"""

from sbd_jax.model.config import DType
from sbd_jax.training.config import default_config_dict


def get_config():
    c = default_config_dict()
    c.model.name = "smollm2-135m"
    c.model.dtype = DType.BFLOAT16
    c.model.scan_layers = True
    c.data.seq_len = 512
    c.train.steps = 400
    c.train.batch_size = 32
    c.optimizer.lr = 1e-4
    c.optimizer.warmup_steps = 40
    c.checkpoint.every = 100
    return c

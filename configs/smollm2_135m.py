"""SBD fine-tuning of the embedded default model, SmolLM2-135M-Instruct.

    python train.py --config configs/smollm2_135m.py --workdir runs/smollm2 --config.data.files='("sft.jsonl",)'

Sized for one GPU (bf16 compute, fp32 master weights); runs on CPU too, slowly (~11 s a step).
"""

from configs.base import get_base


def get_config():
    c = get_base()
    c.model.name = "smollm2-135m"
    c.model.dtype = "bfloat16"
    c.model.scan_layers = True
    c.data.seq_len = 512
    c.train.steps = 1000
    c.train.batch_size = 32
    c.optimizer.lr = 1e-4
    c.optimizer.warmup_steps = 50
    c.checkpoint.every = 200
    return c

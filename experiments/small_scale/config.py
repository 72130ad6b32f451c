"""Training configs of the three models: same architecture, data, steps and seed; only the objective differs."""

from __future__ import annotations

import ml_collections

from configs.base import get_base

# The three models, trained from scratch alike, then the paper's own setting: SBD fine-tuning
# of the trained NTP model (for half as many steps), which needs the NTP model first.
VARIANTS = ("ntp", "sbd", "sbd_no_ntp", "sbd_from_ntp")

# About 0.8M parameters (13k of them the character embedding): ~0.5 s an SBD step on 2 CPU cores.
ARCHITECTURE = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                    rope_theta=10000.0)
SMOKE_ARCHITECTURE = dict(ARCHITECTURE, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=16)


def get_config(variant: str, *, files: tuple[str, ...], tokenizer: str, steps: int, batch_size: int,
               seq_len: int, smoke: bool = False, ntp_model: str = "") -> ml_collections.ConfigDict:
    """`variant`: 'ntp' (next-token loss only), 'sbd' (NTP + MATP), 'sbd_no_ntp' (MATP only), or
    'sbd_from_ntp' (NTP + MATP starting from `ntp_model`, the NTP run's exported HF directory)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: use one of {VARIANTS}")
    c = get_base()
    if variant == "sbd_from_ntp":
        c.model.name = ntp_model
        steps = max(steps // 2, 1)
    else:
        c.model.architecture = SMOKE_ARCHITECTURE if smoke else ARCHITECTURE
    c.model.tokenizer = tokenizer
    c.data.files = files
    c.data.seq_len = seq_len
    c.objective.kind = "ntp" if variant == "ntp" else "sbd"
    c.objective.w_ntp = 0.0 if variant == "sbd_no_ntp" else 1.0
    c.objective.block_size_min, c.objective.block_size_max = 2, 16
    c.train.steps = steps
    c.train.batch_size = batch_size
    c.optimizer.lr = 2e-3
    c.optimizer.warmup_steps = max(steps // 20, 1)
    c.checkpoint.every = max(steps // 4, 1)
    c.checkpoint.keep = 1
    c.export_hf = variant == "ntp"  # the starting point of sbd_from_ntp
    return c

"""Training configs of the study's models: same architecture, data and seed; objective and budget differ."""

from __future__ import annotations

import ml_collections

from experiments.small_scale.task import STUDY
from sbd_jax.training.config import ObjectiveKind, Schedule, default_config_dict

# About 0.8M parameters (13k of them the character embedding): ~0.5 s an SBD step on 2 CPU cores.
ARCHITECTURE = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                    rope_theta=10000.0)
SMOKE_ARCHITECTURE = dict(ARCHITECTURE, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=16)
# The fine-tunes (the paper's setting) use warmup-stable-decay: the model of budget B is the long
# "trunk" run's state at 0.9 B followed by 0.1 B steps of linear decay, so every budget costs one
# long run plus its decay, and a later, longer budget only extends the trunk.
# The study's sizes: the full run, and a smoke run that checks every stage in minutes.
FULL = dict(STUDY, ntp_steps=1200, scratch_steps=2400, budgets=(600, 1200, 2400, 6000, 12000), batch_size=16, seq_len=128,
            code_chars=500_000, heldout_code_chars=100_000, block_sizes=(4, 8, 16),
            gammas=(0.0, 0.1, 0.35, 0.6, 1.0), speed_problems=64, speed_repeats=3)
SMOKE = dict(ntp_steps=6, scratch_steps=4, budgets=(10, 20), batch_size=4, seq_len=64, train_problems=300,
             valid_problems=8, test_problems=12, max_digits=3, code_chars=6000, heldout_code_chars=3000,
             max_new_tokens=40, block_sizes=(2, 4), gammas=(0.0, 1.0), speed_problems=4, speed_repeats=1)
DECAY_FRACTION = 0.1
LR = 2e-3


def stable_steps(budget: int) -> int:
    return round(budget * (1 - DECAY_FRACTION))


def get_config(variant: str, *, files: tuple[str, ...], tokenizer: str, steps: int, batch_size: int,
               seq_len: int, smoke: bool = False, ntp_model: str = "", trunk: str = "",
               checkpoint_every: int = 0) -> ml_collections.ConfigDict:
    """`variant`: 'ntp' (next-token loss only), 'sbd' (NTP + MATP) and 'sbd_no_ntp' (MATP only) from
    scratch for `steps`; 'trunk' (NTP + MATP from `ntp_model`, constant learning rate after warmup, for
    `steps`, a checkpoint every `checkpoint_every`); 'ft' (the trunk's checkpoint at 0.9 `steps`, then
    0.1 `steps` of decay: the fine-tune of budget `steps`)."""
    c = default_config_dict()
    if variant in ("trunk", "ft"):
        c.model.name = ntp_model
        c.optimizer.schedule = Schedule.WSD
        c.optimizer.warmup_steps = 30 if not smoke else 1
        c.checkpoint.every = checkpoint_every or steps
        c.checkpoint.keep = 1000  # the trunk keeps every branch point
        if variant == "ft":
            c.optimizer.decay_steps = steps - stable_steps(steps)
            c.init_from, c.init_step = trunk, stable_steps(steps)
    elif variant in ("ntp", "sbd", "sbd_no_ntp"):
        c.model.architecture = SMOKE_ARCHITECTURE if smoke else ARCHITECTURE
        c.model.tokenizer = tokenizer
        c.optimizer.warmup_steps = max(steps // 20, 1)
        c.checkpoint.every = max(steps // 4, 1)
        c.checkpoint.keep = 1
    else:
        raise ValueError(f"variant {variant!r}: use ntp, sbd, sbd_no_ntp, trunk or ft")
    c.data.files = files
    c.data.seq_len = seq_len
    c.objective.kind = ObjectiveKind.NTP if variant == "ntp" else ObjectiveKind.SBD
    c.objective.w_ntp = 0.0 if variant == "sbd_no_ntp" else 1.0
    c.objective.block_size_min, c.objective.block_size_max = 2, 16
    c.train.steps = steps
    c.train.batch_size = batch_size
    c.optimizer.lr = LR
    c.export_hf = variant in ("ntp", "ft")  # the fine-tunes' starting point, and the shipped models
    return c

"""The typed training config: every config file converts, and bad keys, types and values are refused by name."""

import dataclasses
import glob
import os

import pytest

from configs import tiny
from sbd_jax.config_files import load_config_file
from sbd_jax.errors import UserError
from sbd_jax.training.config import DataConfig, LoopConfig, ModelToTrain, TrainConfig, default_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_defaults_and_every_config_file_convert():
    """The config dict every file starts from converts back to the dataclass defaults, and every configs/*.py
    converts (the 8B configs name their model at run time: their ARCHITECTURE stands in)."""
    base = default_config_dict()
    base.model.name = "smollm2-135m"
    converted = TrainConfig.from_config_dict(base)
    assert converted == TrainConfig(model=ModelToTrain(name="smollm2-135m"))
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        if os.path.basename(path) in ("__init__.py", "base.py"):
            continue
        cfg, architecture = load_config_file(path)
        if architecture:
            cfg.model.architecture = architecture
        converted = TrainConfig.from_config_dict(cfg)
        assert converted.train.steps == cfg.train.steps and converted.data.files == tuple(cfg.data.files), path


def test_the_config_is_frozen():
    cfg = TrainConfig.from_config_dict(tiny.get_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3


@pytest.mark.parametrize("section, key, value, message", [
    ("train", "stepz", 5, r"config has no key train.stepz; the train level has batch_size, grad_accum, log_every, steps"),
    ("train", "steps", "100", r"config train.steps='100': expected int"),
    ("train", "steps", 1.5, r"config train.steps=1.5: expected int"),
    ("checkpoint", "async_save", 1, r"config checkpoint.async_save=1: expected bool"),
    ("model", "remat", "sometimes", r"config model.remat='sometimes': use one of none, full, dots$"),
    ("model", "attention", "flash", r"config model.attention='flash': use one of auto, reference, blockwise, splash$"),
    ("model", "dtype", "int8", r"config model.dtype='int8'"),
    ("optimizer", "schedule", "linear", r"config optimizer.schedule='linear': use one of cosine, wsd$"),
    ("objective", "kind", "mlm", r"config objective.kind='mlm': use one of sbd, ntp$"),
    ("optimizer", "decay_steps", 500, r"optimizer.decay_steps=500 must be in \[0, train.steps\]"),
    ("checkpoint", "keep_period", -1, r"checkpoint.keep_period=-1 must be >= 0"),
    ("checkpoint", "every", 0, r"checkpoint.every=0 must be >= 1"),
    ("data", "workers", -1, r"data.workers=-1 must be >= 0"),
    ("optimizer", "lr", -1.0, r"optimizer.lr=-1.0 must be in \(0.0, inf\)"),
    ("optimizer", "lr", float("nan"), r"optimizer.lr=nan must be in"),
    ("optimizer", "b1", 1.0, r"optimizer.b1=1.0 must be in \[0.0, 1.0\)"),
    ("optimizer", "b2", 1.5, r"optimizer.b2=1.5 must be in \[0.0, 1.0\)"),
    ("optimizer", "clip_norm", -1.0, r"optimizer.clip_norm=-1.0 must be > 0 \(or 0: no clipping\)"),
    ("optimizer", "eps", 0.0, r"optimizer.eps=0.0 must be in \(0.0, inf\)"),
    ("optimizer", "weight_decay", -0.1, r"optimizer.weight_decay=-0.1 must be in \[0.0, inf\)"),
    ("optimizer", "final_lr_ratio", 2.0, r"optimizer.final_lr_ratio=2.0 must be in"),
    ("objective", "full_mask_share", 1.5, r"objective.full_mask_share=1.5 must be in \[0, 1\]"),
    ("objective", "soft_target", float("nan"), r"objective.soft_target=nan must be in \[0, 1\]"),
    ("objective", "position_decay", -1.0, r"objective.position_decay=-1.0 must be a finite number >= 0"),
    ("adapter", "rank", -2, r"adapter.rank=-2 must be >= 0 \(0 = no adapter"),
    ("adapter", "alpha", 0.0, r"adapter alpha=0.0 must be a finite number > 0"),
    ("adapter", "targets", ("q_proj", "lm_head"), r"adapter targets \('q_proj', 'lm_head'\): name each of"),
])
def test_a_bad_key_type_or_value_is_named(section, key, value, message):
    cfg = tiny.get_config().to_dict()
    cfg[section][key] = value
    with pytest.raises(UserError, match=message):
        TrainConfig.from_config_dict(cfg)


def test_a_model_must_be_named_or_described():
    with pytest.raises(UserError, match="set config.model.name .* or config.model.architecture"):
        TrainConfig.from_config_dict(default_config_dict())


def test_ints_pass_as_floats_and_lists_as_tuples():
    cfg = tiny.get_config().to_dict()
    cfg["optimizer"]["lr"], cfg["data"]["files"], cfg["mesh"] = 1, ["a.jsonl"], [1, -1, 1]
    converted = TrainConfig.from_config_dict(cfg)
    assert converted.optimizer.lr == 1.0 and isinstance(converted.optimizer.lr, float)
    assert converted.data.files == ("a.jsonl",) and converted.mesh == (1, -1, 1)


def test_sections_check_themselves_when_built_directly():
    with pytest.raises(UserError, match="train.batch_size=6 is not divisible by train.grad_accum=4"):
        LoopConfig(batch_size=6, grad_accum=4)
    with pytest.raises(UserError, match="data.seq_len=1 must be >= 2"):
        DataConfig(seq_len=1)


def test_an_adapter_needs_the_sbd_objective():
    cfg = tiny.get_config().to_dict()
    cfg["adapter"]["rank"], cfg["objective"]["kind"] = 4, "ntp"
    with pytest.raises(UserError, match="adapter.rank > 0 trains SBD's blocks: it needs objective.kind=sbd"):
        TrainConfig.from_config_dict(cfg)

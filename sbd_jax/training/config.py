"""The training config, typed: frozen dataclasses per section that check their own values, and the one place
every default is written.

Config files stay `ml_collections` (`configs/*.py`, `--config.train.steps=50` at the command line): each starts
from `default_config_dict()` (these dataclasses' defaults) and sets only what it changes. The trainer converts
one once, with `TrainConfig.from_config_dict`, so a misspelt key, a value of the wrong type or an impossible
combination is a one-line error before any model is loaded or compiled.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from sbd_jax.choice import Choice
from sbd_jax.data.config import DataConfig
from sbd_jax.errors import UserError, check_at_least, check_in_range
from sbd_jax.model.attention import AttentionImpl
from sbd_jax.model.config import ADAPTER_TARGETS, AdapterConfig, DType
from sbd_jax.model.transformer import Remat


class ObjectiveKind(Choice):
    """What a run trains."""

    SBD = "sbd"  # the joint NTP + MATP loss (SBD's blocks)
    NTP = "ntp"  # next-token loss only (the baseline)


class Schedule(Choice):
    """The learning rate's shape after warmup."""

    COSINE = "cosine"  # cosine decay to final_lr_ratio at train.steps
    WSD = "wsd"  # warmup-stable-decay: constant, then linear decay over the last decay_steps


def _parse_choices(section: Any, prefix: str) -> None:
    """Each field of `section` whose default is a `Choice` made its member (a name is taken; UserError naming the
    field otherwise)."""
    for field in dataclasses.fields(section):
        if isinstance(field.default, Choice):
            value = type(field.default).parse(getattr(section, field.name), f"config {prefix}.{field.name}")
            object.__setattr__(section, field.name, value)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the processes of a multi-host run meet; empty / 0 / -1: detected from the cluster."""

    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0  # processes in the run (0: detected)
    process_id: int = -1  # this process's index (-1: detected)


@dataclasses.dataclass(frozen=True)
class ModelToTrain:
    """The model to train and how to run it. `remat` and `attention` shape only the training step, so
    they live here, not in the `ModelConfig` that keys every decoding compile."""

    name: str = ""  # a model to fine-tune: known name, HF directory or .gguf file
    architecture: dict | None = None  # or random init of these ModelConfig fields
    tokenizer: str = ""  # with `architecture`: where the tokenizer comes from (name / dir / gguf)
    dtype: DType = DType.FLOAT32  # compute dtype; master weights and optimizer state stay float32
    scan_layers: bool = False  # one stacked parameter tree, scanned: compiles once for all layers
    remat: Remat = Remat.NONE  # what the backward pass recomputes of each layer
    attention: AttentionImpl = AttentionImpl.AUTO  # splash: TPU only

    def __post_init__(self) -> None:
        _parse_choices(self, "model")
        if not self.name and not self.architecture:
            raise UserError("set config.model.name (a model to fine-tune) or config.model.architecture")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The loss: SBD's joint NTP + MATP (block size k ~ U{min..max} per step, masking rate ~ U[eta])
    or the NTP baseline."""

    kind: ObjectiveKind = ObjectiveKind.SBD  # what the run trains
    block_size_min: int = 2  # each step's block size k is drawn uniformly from [block_size_min, block_size_max]
    block_size_max: int = 16  # the largest k drawn (decoding with larger blocks drafts positions never trained)
    w_ntp: float = 1.0  # weight of the next-token loss on the clean half
    w_matp: float = 1.0  # weight of the masked-token loss on the noisy half's blocks
    eta_min: float = 0.0  # each block's masking rate is drawn uniformly from [eta_min, eta_max]
    eta_max: float = 1.0  # the largest masking rate drawn (1: the whole block masked)
    # What the drafts train on (objective.DraftTraining; 0 = the paper's objective):
    full_mask_share: float = 0.0  # the share of rows whose noisy half is masked entirely, as verified decoding drafts
    position_decay: float = 0.0  # > 0: block position j (from 0) weighs exp(-j / position_decay) in the MATP loss
    soft_target: float = 0.0  # the MATP target's weight on the clean half's own next-token distribution (rest: the data token)

    def __post_init__(self) -> None:
        _parse_choices(self, "objective")
        for name in ("full_mask_share", "soft_target"):
            if not 0.0 <= getattr(self, name) <= 1.0:  # NaN too
                raise UserError(f"config objective.{name}={getattr(self, name)} must be in [0, 1]")
        if not 0.0 <= self.position_decay < float("inf"):
            raise UserError(f"config objective.position_decay={self.position_decay} must be a finite number >= 0 "
                            "(0 = equal weights)")
        if self.block_size_min > self.block_size_max:
            raise UserError(f"config objective.block_size_min={self.block_size_min} > "
                            f"block_size_max={self.block_size_max}")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The `train` section: how long, how big a batch, how often the host looks at metrics."""

    steps: int = 100  # optimizer steps of the whole run (a resumed run stops here too)
    batch_size: int = 8  # sequences a step, over all devices
    grad_accum: int = 1  # micro-batches a step (batch_size must divide by it): less memory, same update
    log_every: int = 10  # steps between metric fetches (the only host sync; checkpoints fetch too)

    def __post_init__(self) -> None:
        check_at_least("train.steps", self.steps, 1)
        check_at_least("train.batch_size", self.batch_size, 1)
        check_at_least("train.grad_accum", self.grad_accum, 1)
        check_at_least("train.log_every", self.log_every, 1, "steps between metric fetches")
        if self.batch_size % self.grad_accum:
            raise UserError(f"config train.batch_size={self.batch_size} is not divisible by "
                            f"train.grad_accum={self.grad_accum}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (see train_step.make_optimizer)."""

    lr: float = 3e-4  # the peak learning rate (a gated adapter wants about 10x a full fine-tune's: docs/training.md)
    warmup_steps: int = 10  # linear warm-up from 0
    schedule: Schedule = Schedule.COSINE  # the learning rate's shape after warmup
    decay_steps: int = 0  # wsd: linear decay to final_lr_ratio over the last decay_steps steps
    final_lr_ratio: float = 0.1  # the learning rate at the end of the decay, as a share of the peak
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    clip_norm: float = 1.0  # 0: no clipping

    def __post_init__(self) -> None:
        _parse_choices(self, "optimizer")
        check_in_range("optimizer.lr", self.lr, 0.0, float("inf"), low_open=True, why="the peak learning rate")
        check_at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        check_at_least("optimizer.decay_steps", self.decay_steps, 0)
        check_in_range("optimizer.final_lr_ratio", self.final_lr_ratio, 0.0, 1.0 + 1e-12, why="of the peak lr")
        check_in_range("optimizer.b1", self.b1, 0.0, 1.0)
        check_in_range("optimizer.b2", self.b2, 0.0, 1.0)
        check_in_range("optimizer.eps", self.eps, 0.0, float("inf"), low_open=True)
        check_in_range("optimizer.weight_decay", self.weight_decay, 0.0, float("inf"))
        if not (self.clip_norm > 0 or self.clip_norm == 0):
            raise UserError(f"config optimizer.clip_norm={self.clip_norm} must be > 0 (or 0: no clipping)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # steps between checkpoints (a kill loses at most these; SIGTERM and Ctrl-C lose none)
    keep: int = 3  # the last checkpoints kept
    keep_period: int = 0  # > 0: also keep every checkpoint whose step is a multiple of it (milestones)
    async_save: bool = True  # write checkpoints in the background while training goes on

    def __post_init__(self) -> None:
        check_at_least("checkpoint.every", self.every, 1)
        check_at_least("checkpoint.keep", self.keep, 1)
        check_at_least("checkpoint.keep_period", self.keep_period, 0, "0: keep only the last checkpoint.keep")


@dataclasses.dataclass(frozen=True)
class AdapterSection:
    """The gated adapter (`sbd_jax.model.adapter`): rank 0 (the default) fine-tunes every weight as the paper
    does; rank > 0 freezes the base and trains only a low-rank adapter that acts on block positions."""

    rank: int = 0  # the adapter's rank (0: no adapter, every weight trains)
    alpha: float = 32.0  # the adapter's scale: it adds (alpha / rank) B A x
    targets: tuple[str, ...] = ADAPTER_TARGETS  # the projections the adapter acts on
    # Start the adapter from a trained one instead of a new one: an adapter directory or a shipped adapter's
    # name (e.g. smollm2-135m-sbd). Its rank, alpha, targets, base and mask token must be this run's; its
    # weights (mask embedding included) are used only when the workdir has no checkpoint of its own, and
    # the optimizer starts fresh.
    init_from: str = ""

    def __post_init__(self) -> None:
        check_at_least("adapter.rank", self.rank, 0, "0 = no adapter: full fine-tuning")
        AdapterConfig(rank=max(self.rank, 1), alpha=self.alpha, targets=self.targets)  # its checks, even when off
        if self.init_from:
            from sbd_jax.checkpoints.adapter import check_continues, read_adapter_config
            from sbd_jax.checkpoints.load import resolve_adapter

            if not self.rank:
                raise UserError(f"config adapter.init_from={self.init_from!r} continues an adapter: set adapter.rank "
                                "(and alpha, targets) to its own")
            meta = read_adapter_config(resolve_adapter(self.init_from))
            check_continues(self.init_from, meta, self.rank, self.alpha, self.targets)

    def model_config(self) -> AdapterConfig | None:
        """The adapter of the model this run trains (`ModelConfig.adapter`), None for none: the one place a run is
        told to be an adapter run."""
        return AdapterConfig(rank=self.rank, alpha=self.alpha, targets=self.targets) if self.rank else None


SECTIONS = dict(distributed=DistributedConfig, model=ModelToTrain, data=DataConfig, objective=ObjectiveConfig,
                train=LoopConfig, optimizer=OptimizerConfig, checkpoint=CheckpointConfig, adapter=AdapterSection)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole training run's config; checks what spans sections (the others check themselves)."""

    model: ModelToTrain
    data: DataConfig = DataConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    train: LoopConfig = LoopConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    adapter: AdapterSection = AdapterSection()
    seed: int = 0  # model init, masking draws and data order
    multihost: bool = False  # True: jax.distributed.initialize() (one process per host)
    mesh: tuple[int, ...] = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices
    export_hf: bool = True  # write workdir/hf (an HF directory with the mask token) at the end
    # Start from another run's checkpoint (state and data position) when this workdir has none: its
    # workdir, and the step (0 = its latest). E.g. branch a decay phase off a long WSD run.
    init_from: str = ""
    init_step: int = 0  # with init_from: the step of its checkpoint to start from (0: its latest)

    def __post_init__(self) -> None:
        from sbd_jax.training.objective import check_objective

        for k in (self.objective.block_size_min, self.objective.block_size_max):
            check_objective(k, (self.objective.eta_min, self.objective.eta_max), self.data.seq_len)
        if self.optimizer.decay_steps > self.train.steps:
            raise UserError(f"config optimizer.decay_steps={self.optimizer.decay_steps} must be in [0, train.steps]")

        if self.adapter.model_config() and self.objective.kind != ObjectiveKind.SBD:
            raise UserError("config adapter.rank > 0 trains SBD's blocks: it needs objective.kind=sbd (an NTP "
                            "adapter would leave the base model's outputs as they are)")
        check_in_range("seed", self.seed, 0, 2**32, why="a 32-bit random seed")
        if len(self.mesh) != 3:
            raise UserError(f"config mesh={self.mesh}: give (data, fsdp, tensor), -1 for the remaining devices")
        if self.init_from and self.adapter.init_from:
            raise UserError(f"config init_from={self.init_from!r} (another run's checkpoint: state and data position) "
                            f"and adapter.init_from={self.adapter.init_from!r} (an adapter's weights): set one of them")
        if self.init_from and not os.path.isdir(os.path.join(self.init_from, "checkpoints")):
            raise UserError(f"config init_from={self.init_from!r} holds no checkpoints/ directory: give another "
                            "run's workdir")

    @classmethod
    def from_config_dict(cls, config: Any) -> "TrainConfig":
        """Converts an `ml_collections.ConfigDict` (or a nested dict) of a config file; unknown keys and
        values of the wrong type are refused by name."""
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        sections = {}
        for name, section in SECTIONS.items():
            values = raw.pop(name, {}) or {}
            sections[name] = section(**_typed(section, values, name + "."))
        return cls(**sections, **_typed(cls, raw, "", skip=SECTIONS))


def default_config_dict() -> ml_collections.ConfigDict:
    """Every field of `TrainConfig` at its dataclass default, as the `ConfigDict` a config file starts from and
    `--config.SECTION.FIELD=VALUE` overrides (a `Choice` as its name; `model.architecture`, None, a dict
    placeholder)."""
    config = _defaults(TrainConfig, skip=SECTIONS)
    for name, section in SECTIONS.items():
        config[name] = _defaults(section)
    return config


def _defaults(cls: type, skip: dict | None = None) -> ml_collections.ConfigDict:
    values = ml_collections.ConfigDict()
    for field in dataclasses.fields(cls):
        if not skip or field.name not in skip:
            default = field.default
            values[field.name] = (ml_collections.config_dict.placeholder(dict) if default is None else
                                  str(default) if isinstance(default, Choice) else default)
    return values


def _typed(cls: type, values: dict, prefix: str, skip: dict | None = None) -> dict:
    """`values` checked against `cls`'s fields (types taken from their defaults): an int where a float
    is expected is accepted, a list where a tuple is; anything else names the key and what it wants."""
    fields = {f.name: f for f in dataclasses.fields(cls) if not skip or f.name not in skip}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(f"config has no key {prefix}{unknown[0]}; the {prefix.rstrip('.') or 'top'} level has "
                        f"{', '.join(sorted(fields))}")
    out = {}
    for key, value in values.items():
        default = fields[key].default
        name = prefix + key
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok, value = isinstance(value, (int, float)) and not isinstance(value, bool), value
            value = float(value) if ok else value
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        elif isinstance(default, tuple):
            ok = isinstance(value, (tuple, list))
            value = tuple(value) if ok else value
        else:  # model.architecture: a dict or nothing
            ok = value is None or isinstance(value, dict)
        if not ok:
            raise UserError(f"config {name}={value!r}: expected {type(default).__name__ if default is not None else 'a dict'}")
        out[key] = value
    return out

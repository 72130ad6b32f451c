"""SBD fine-tuning: the run (model, data, sharded state), its loop, Orbax checkpoints (state + data
iterator). The step itself is in `train_step.py`, the logs in `train_log.py`.

The same code runs on one CPU, one GPU or a `(data, fsdp, tensor)` mesh of many devices and hosts.
A run is a pure function of (config, step): the noise key is `fold_in(seed, step)`, the block size
is drawn from `(seed, step)`, and the Grain iterator is checkpointed with the state, so a resumed run
sees the same batches and computes the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Iterator

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from sbd_jax import sharding, streaming
from sbd_jax.data import Packed
from sbd_jax.checkpoints.load import load_model, resolve
from sbd_jax.config import ModelConfig, RopeScaling
from sbd_jax.errors import UserError
from sbd_jax.mask_token import setup_mask_token
from sbd_jax.model import Transformer, init_params
from sbd_jax.objective import Batch, check_objective
from sbd_jax.roofline import device_peak_flops, shape_of, training_flops_per_token
from sbd_jax.stop_request import StopRequest
from sbd_jax.tokenizer import load_tokenizer
from sbd_jax.train_log import Progress, Window, tensorboard, truncate_log
from sbd_jax.train_step import TrainState, block_size_for_step, jitted_train_step, make_optimizer


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Every config error we can see before loading a model or compiling anything."""
    if cfg.objective.kind not in ("sbd", "ntp"):
        raise UserError(f"objective.kind={cfg.objective.kind!r}: use 'sbd' or 'ntp'")
    if cfg.data.seq_len < 2:
        raise UserError(f"data.seq_len={cfg.data.seq_len} must be >= 2")
    if cfg.objective.block_size_min > cfg.objective.block_size_max:
        raise UserError(f"objective.block_size_min={cfg.objective.block_size_min} > block_size_max="
                        f"{cfg.objective.block_size_max}")
    for k in (cfg.objective.block_size_min, cfg.objective.block_size_max):
        check_objective(k, (cfg.objective.eta_min, cfg.objective.eta_max), cfg.data.seq_len)
    if cfg.train.steps < 1 or cfg.train.batch_size < 1 or cfg.train.grad_accum < 1:
        raise UserError("train.steps, train.batch_size and train.grad_accum must be >= 1")
    if cfg.optimizer.schedule not in ("cosine", "wsd"):
        raise UserError(f"optimizer.schedule={cfg.optimizer.schedule!r}: use 'cosine' or 'wsd'")
    if not 0 <= cfg.optimizer.decay_steps <= cfg.train.steps:
        raise UserError(f"optimizer.decay_steps={cfg.optimizer.decay_steps} must be in [0, train.steps]")
    if cfg.init_from and not os.path.isdir(os.path.join(cfg.init_from, "checkpoints")):
        raise UserError(f"init_from={cfg.init_from!r} holds no checkpoints/ directory: give another run's workdir")
    if cfg.data.shards < 0 or cfg.data.workers < 0:
        raise UserError(f"data.shards={cfg.data.shards} and data.workers={cfg.data.workers} must be >= 0")
    if cfg.checkpoint.get("keep_period", 0) < 0:
        raise UserError(f"checkpoint.keep_period={cfg.checkpoint.keep_period} must be >= 0 (0: keep only the last "
                        "checkpoint.keep)")
    if cfg.train.log_every < 1:
        raise UserError(f"train.log_every={cfg.train.log_every} must be >= 1 (steps between metric fetches)")
    if cfg.train.batch_size % cfg.train.grad_accum:
        raise UserError(f"train.batch_size={cfg.train.batch_size} is not divisible by train.grad_accum="
                        f"{cfg.train.grad_accum}")


def run_options(m: ml_collections.ConfigDict) -> dict[str, Any]:
    """The ModelConfig fields a training config's `model` section sets (master weights stay float32)."""
    return dict(dtype=m.dtype, param_dtype="float32", scan_layers=m.scan_layers, remat=m.remat, attention=m.attention)


def architecture_config(m: ml_collections.ConfigDict, architecture: dict | None,
                        tokenizer: Any = None) -> ModelConfig:
    """The ModelConfig of a model trained from scratch: `architecture` (ModelConfig fields; rope_scaling
    as a dict), its vocabulary size and EOS ids taken from the tokenizer where it leaves them out (the
    tokenizer `m.tokenizer` names is read only when the vocabulary size is missing and none is given)."""
    if not architecture:
        raise UserError("set config.model.name (a model to fine-tune) or config.model.architecture")
    arch = dict(architecture)
    if arch.get("rope_scaling"):
        arch["rope_scaling"] = RopeScaling(**arch["rope_scaling"])
    if tokenizer is None and "vocab_size" not in arch:
        tokenizer = load_tokenizer(resolve(m.tokenizer))
    if tokenizer is not None:
        arch.setdefault("vocab_size", len(tokenizer))
        arch.setdefault("eos_token_ids", (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    return ModelConfig(**arch, **run_options(m))


class Trainer:
    """Builds everything from a config, restores the latest checkpoint in `workdir`, and trains."""

    def __init__(self, cfg: ml_collections.ConfigDict, workdir: str):
        validate(cfg)
        if cfg.multihost:
            _initialize_distributed(cfg.distributed)
        self.cfg, self.workdir = cfg, workdir
        self.mesh = sharding.make_mesh(tuple(cfg.mesh))
        batch_ways = math.prod(self.mesh.shape[a] for a in sharding.LOGICAL_RULES["batch"])
        micro = cfg.train.batch_size // cfg.train.grad_accum
        if micro % batch_ways:
            raise UserError(f"micro-batch {micro} (batch_size / grad_accum) is not divisible by the "
                            f"{batch_ways} data x fsdp devices of mesh {tuple(self.mesh.shape.values())}")
        self.config, params, self.tokenizer = self._model()
        if cfg.objective.kind == "sbd":
            self.config, params, self.tokenizer = setup_mask_token(self.config, params, self.tokenizer,
                                                                   cfg.data.mask_token)
        self.iterator = streaming.host_batches(
            cfg.data.files, self.tokenizer, seq_len=cfg.data.seq_len, global_batch=cfg.train.batch_size,
            seed=cfg.seed, num_steps=cfg.train.steps, shards=cfg.data.shards, workers=cfg.data.workers,
            host=jax.process_index(), hosts=jax.process_count())
        self.model = Transformer(self.config, mesh=self.mesh)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.state = self._sharded_state(params)
        self._step: Any = None

    # ------------------------------------------------------------------ setup
    def _model(self) -> tuple[ModelConfig, dict, Any]:
        m = self.cfg.model
        if m.name:
            loaded = load_model(m.name, **run_options(m))
            return loaded.config, loaded.params, loaded.tokenizer
        tokenizer = load_tokenizer(resolve(m.tokenizer))
        config = architecture_config(m, m.architecture, tokenizer)
        return config, jax.device_get(init_params(config, self.cfg.seed)), tokenizer

    def _sharded_state(self, params: dict) -> TrainState:
        param_sh = sharding.param_shardings(params, self.mesh)
        params = jax.device_put(params, param_sh)
        opt_shapes = jax.eval_shape(self.tx.init, params)
        opt_sh = sharding.param_shardings(opt_shapes, self.mesh)
        opt_state = jax.jit(self.tx.init, out_shardings=opt_sh)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(self.mesh))
        return TrainState(step, params, opt_state)

    def state_shardings(self) -> TrainState:
        return jax.tree.map(lambda x: x.sharding, self.state)

    def compiled_step(self, example: tuple) -> tuple[Any, float]:
        """The compiled step (one for every block size), and its compile seconds (0 once compiled)."""
        if self._step is not None:
            return self._step, 0.0
        began = time.perf_counter()
        step = jitted_train_step(self.cfg, self.model, self.tx, self.schedule, self.mesh, self.state_shardings())
        self._step = step.lower(*example).compile()
        return self._step, time.perf_counter() - began

    def _checked(self, host_batch: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
        """Refuses a batch whose tokens include the mask token (the model could not tell them apart) or
        that carries no loss at all (chat data without assistant turns)."""
        mask_id, real = self.config.mask_token_id, host_batch["segment_ids"] > 0
        used = 0 if mask_id is None else int((host_batch["tokens"][real] == mask_id).sum())
        if used:
            raise UserError(f"mask token id {mask_id} occurs {used} times in the training data (step {step}'s "
                            "batch); choose a token the data never uses (or data.mask_token='new' for a new "
                            "embedding row)")
        if not host_batch["loss_mask"].any():
            raise UserError(f"step {step}'s batch has no token that carries loss (chat data without assistant turns?)")
        return host_batch

    def global_batch(self, host_batch: dict[str, np.ndarray]) -> Batch:
        batch_sh = sharding.batch_sharding(self.mesh)
        return Batch(*[jax.make_array_from_process_local_data(batch_sh, host_batch[name])
                       for name in Packed._fields])

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_manager(self, workdir: str | None = None):
        """Orbax manager of `workdir/checkpoints` (this run's by default)."""
        import orbax.checkpoint as ocp

        ck = self.cfg.checkpoint
        options = ocp.CheckpointManagerOptions(save_interval_steps=ck.every, max_to_keep=ck.keep,
                                               keep_period=ck.get("keep_period") or None,
                                               enable_async_checkpointing=ck.async_save)
        path = os.path.abspath(os.path.join(workdir or self.workdir, "checkpoints"))
        return ocp.CheckpointManager(path, options=options)

    def restore(self, manager) -> int:
        """Restores the latest checkpoint, if any, else `init_from`'s; returns the number of completed steps."""
        latest = manager.latest_step()
        if latest is not None:
            return self._restore_from(manager, latest, self.workdir)
        if not self.cfg.init_from:
            return 0
        source = self.checkpoint_manager(self.cfg.init_from)
        step = self.cfg.init_step or source.latest_step()
        if step not in source.all_steps():
            raise UserError(f"init_from={self.cfg.init_from!r} has no checkpoint of step {step} "
                            f"(it has {sorted(source.all_steps())})")
        return self._restore_from(source, step, self.cfg.init_from)

    def _restore_from(self, manager, step: int, where: str) -> int:
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(self.iterator)))
        except Exception as e:  # orbax raises many types for a foreign or damaged checkpoint
            raise UserError(f"cannot restore the checkpoint of step {step} in {where} "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it does not match this "
                            "config or is damaged: use another --workdir or delete it") from None
        self.state = restored["state"]
        return step

    # ------------------------------------------------------------------ loop
    def run(self) -> list[dict[str, float]]:
        """Trains to `train.steps`, resuming from `workdir`; returns this run's logged metrics."""
        import orbax.checkpoint as ocp

        os.makedirs(self.workdir, exist_ok=True)
        manager = self.checkpoint_manager()
        start = self.restore(manager)
        metrics_path = os.path.join(self.workdir, "metrics.jsonl")
        primary = jax.process_index() == 0  # the one writer of the logs (hosts share the workdir)
        if primary:
            truncate_log(metrics_path, start)
        writer = tensorboard(self.workdir) if primary else None
        total = self.cfg.train.steps
        tokens_per_step = self.cfg.train.batch_size * self.cfg.data.seq_len
        logged = []
        progress = Progress(start, total)
        window = Window(tokens_per_step, self._flops_per_step(), device_peak_flops(jax.devices()[0], self.config.dtype))
        stopped_at = None
        with open(metrics_path, "a") as log, _finishing_saves(manager), StopRequest() as stop:
            for step in range(start, total):
                k = block_size_for_step(self.cfg, step)
                batch = self.global_batch(self._checked(next(self.iterator), step + 1))
                rng = jax.random.fold_in(jax.random.key(self.cfg.seed), step)
                block_size = jax.device_put(jnp.int32(k), sharding.replicated(self.mesh))
                compiled, compile_seconds = self.compiled_step((self.state, batch, rng, block_size))
                self.state, metrics = compiled(self.state, batch, rng, block_size)
                window.add(step + 1, k, metrics, compile_seconds)  # stays on device: dispatch runs ahead
                checkpoint = (step + 1) % self.cfg.checkpoint.every == 0 or step + 1 == total
                sync_point = checkpoint or (step + 1) % self.cfg.train.log_every == 0
                if stop.agreed(sync_point):  # SIGTERM: save this step and stop
                    checkpoint, sync_point, stopped_at = True, True, step + 1
                if not sync_point:
                    continue
                rows = window.fetch()  # the one host sync; a non-finite step stops here, before any save
                logged += rows
                if primary:
                    for row in rows:
                        log.write(json.dumps(row) + "\n")
                        if writer is not None:
                            for name, value in row.items():
                                writer.add_scalar(name, value, row["step"])
                    log.flush()
                progress.update(rows[-1])
                if checkpoint:
                    manager.save(step + 1, force=True, args=ocp.args.Composite(
                        state=ocp.args.StandardSave(self.state), data=grain.checkpoint.CheckpointSave(streaming.Snapshot(self.iterator.get_state()))))
                if stopped_at is not None:
                    break
        progress.close()
        if stopped_at is not None:
            raise UserError(f"stopped by SIGTERM after step {stopped_at} of {total}: its checkpoint is saved in "
                            f"{self.workdir}; run the same command again to continue")
        if self.cfg.export_hf:
            self.export(os.path.join(self.workdir, "hf"))
        return logged

    def _flops_per_step(self) -> float:
        """Model FLOPs of one step (roofline formulas: 6 per weight per token, x2 for SBD's 2L layout)."""
        shape = shape_of(self.config)
        return training_flops_per_token(shape, self.cfg.objective.kind) * self.cfg.train.batch_size * self.cfg.data.seq_len

    def export_checkpoint(self, step: int, path: str) -> None:
        """Writes this run's checkpoint of `step` as an HF directory (milestones of a run, e.g. a trend)."""
        self._restore_from(self.checkpoint_manager(), step, self.workdir)
        self.export(path)

    def export(self, path: str) -> None:
        """Writes the trained model (with its mask token) as an HF directory. Every process takes part
        (parameters may be sharded across hosts); process 0 writes, one safetensors file at a time."""
        from sbd_jax.checkpoints.hf import save_hf

        save_hf(path, self.config.replace(param_dtype="float32"), self.state.params,
                tokenizer=self.tokenizer if jax.process_index() == 0 else None)


def _initialize_distributed(d: ml_collections.ConfigDict) -> None:
    """Joins the job's other processes; what the config leaves unset is detected from the cluster."""
    # CPU hosts need a collectives library for cross-process arrays; GPU and TPU runs are unaffected.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    given = dict(coordinator_address=d.coordinator_address or None, num_processes=d.num_processes or None,
                 process_id=d.process_id if d.process_id >= 0 else None)
    jax.distributed.initialize(**{name: value for name, value in given.items() if value is not None})


@contextlib.contextmanager
def _finishing_saves(manager) -> Iterator[None]:
    """Waits for in-flight async checkpoint saves also when the loop stops with an error, so the last
    good checkpoint is whole on disk."""
    try:
        yield
    finally:
        manager.wait_until_finished()



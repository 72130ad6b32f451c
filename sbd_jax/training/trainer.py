"""SBD fine-tuning: the run (model, data, sharded state) and its loop. The step itself is in
`step.py`, the checkpoints (state + data iterator) in `checkpoints.py`, the logs in `log.py`, the typed
config in `config.py`.

The same code runs on one CPU, one GPU or a `(data, fsdp, tensor)` mesh of many devices and hosts.
A run is a pure function of (config, step): the noise key is `fold_in(seed, step)`, the block size
is drawn from `(seed, step)`, and the Grain iterator is checkpointed with the state, so a resumed run
sees the same batches and computes the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.checkpoints.adapter import continued_adapter, fingerprint, save_adapter
from sbd_jax.checkpoints.load import load_model, resolve
from sbd_jax.checkpoints.tokenizer import load_tokenizer
from sbd_jax.data import streaming
from sbd_jax.errors import UserError
from sbd_jax.model import sharding
from sbd_jax.model.adapter import init_adapter
from sbd_jax.model.config import DType, ModelConfig, RopeScaling
from sbd_jax.model.mask_token import setup_mask_token
from sbd_jax.model.transformer import Transformer, init_params
from sbd_jax.roofline import device_peak_flops, shape_of, training_flops_per_token
from sbd_jax.training import checkpoints as train_checkpoints
from sbd_jax.training import run_identity
from sbd_jax.training.config import DistributedConfig, ModelToTrain, ObjectiveKind, TrainConfig
from sbd_jax.training.log import MetricsLog, Progress, Window
from sbd_jax.training.step import (
    block_size_for_step,
    global_batch,
    jitted_train_step,
    make_optimizer,
    sharded_state,
)
from sbd_jax.training.stop_request import Stopped, StopRequest
from sbd_jax.training.workdir_lock import WorkdirLock


def run_options(m: ModelToTrain) -> dict[str, Any]:
    """The ModelConfig fields a training config's `model` section sets (master weights stay float32)."""
    return dict(dtype=m.dtype, param_dtype=DType.FLOAT32, scan_layers=m.scan_layers)


def architecture_config(m: ModelToTrain, architecture: dict, tokenizer: Any = None) -> ModelConfig:
    """The ModelConfig of a model trained from scratch: `architecture` (ModelConfig fields; rope_scaling
    as a dict), its vocabulary size and EOS ids taken from the tokenizer where it leaves them out (the
    tokenizer `m.tokenizer` names is read only when the vocabulary size is missing and none is given)."""
    arch = dict(architecture)
    if arch.get("rope_scaling"):
        arch["rope_scaling"] = RopeScaling(**arch["rope_scaling"])
    if tokenizer is None and "vocab_size" not in arch:
        tokenizer = load_tokenizer(resolve(m.tokenizer))
    if tokenizer is not None:
        arch.setdefault("vocab_size", len(tokenizer))
        arch.setdefault("eos_token_ids", (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    return ModelConfig(**arch, **run_options(m))


def make_workdir(workdir: str) -> None:
    """Creates the run's directory before anything slow happens (a path under a file, or where nothing may
    be written, is a one-line error, not a traceback after the model is built)."""
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --workdir {workdir}: {e.strerror}; choose a directory you can write") from None
    if not os.access(workdir, os.W_OK):
        raise UserError(f"--workdir {workdir} is not writable; choose a directory you can write")


class Trainer:
    """Builds everything from a config, restores the latest checkpoint in `workdir`, and trains."""

    def __init__(self, cfg: TrainConfig | Any, workdir: str):
        """`cfg`: a `TrainConfig`, or the `ml_collections.ConfigDict` of a config file (converted here)."""
        if not isinstance(cfg, TrainConfig):
            cfg = TrainConfig.from_config_dict(cfg)
        make_workdir(workdir)
        if cfg.multihost:
            _initialize_distributed(cfg.distributed)
        self.cfg, self.workdir = cfg, workdir
        with self._workdir_lock():  # held by run(); tried here so a second run fails before loading anything
            pass
        self.mesh = sharding.make_mesh(tuple(cfg.mesh))
        batch_ways = math.prod(self.mesh.shape[a] for a in sharding.LOGICAL_RULES["batch"])
        micro = cfg.train.batch_size // cfg.train.grad_accum
        if micro % batch_ways:
            raise UserError(f"micro-batch {micro} (batch_size / grad_accum) is not divisible by the "
                            f"{batch_ways} data x fsdp devices of mesh {tuple(self.mesh.shape.values())}")
        # An adapter run is one whose model config has the adapter (`self.config.adapter`): the one flag of it.
        self.config, params, self.tokenizer = self._model()
        self.config = self.config.replace(adapter=cfg.adapter.model_config())
        # The user's weights as loaded (a random base of an adapter run too: its seed decides it).
        base_fingerprint = fingerprint(params) if cfg.model.name or self.config.adapter else ""
        if cfg.data.seq_len > self.config.max_position_embeddings:
            raise UserError(f"config data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
                            f"{self.config.max_position_embeddings}: lower data.seq_len"
                            + ("" if cfg.model.name else " or raise model.architecture's max_position_embeddings"))
        if cfg.objective.kind == ObjectiveKind.SBD:
            self.config, params, self.tokenizer = setup_mask_token(self.config, params, self.tokenizer,
                                                                   cfg.data.mask_token)
        self.frozen: Any = None  # an adapter run's base weights: an input of every step, never trained
        self.started_from: dict[str, Any] | None = None  # adapter.init_from and its steps, recorded in exports
        if self.config.adapter:
            self.base = {"name": cfg.model.name, "fingerprint": base_fingerprint, "mask_token": cfg.data.mask_token}
            self.frozen = jax.device_put(params, sharding.param_shardings(params, self.mesh))
            if cfg.adapter.init_from:  # a trained adapter's weights (a checkpoint in the workdir replaces them)
                params, meta = continued_adapter(cfg.adapter.init_from, self.config, self.base)
                self.started_from = {"source": cfg.adapter.init_from, "steps": meta.get("shipped", {}).get("steps")}
            else:
                params = init_adapter(Transformer(self.config), params, cfg.seed)
        self.iterator = streaming.host_batches(
            cfg.data, self.tokenizer, global_batch=cfg.train.batch_size, seed=cfg.seed,
            host=jax.process_index(), hosts=jax.process_count())
        self.identity = run_identity.run_identity(self.config, base_fingerprint, cfg.objective.kind.value)
        self.model = Transformer(self.config, mesh=self.mesh, attention=cfg.model.attention, remat=cfg.model.remat)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.state = sharded_state(params, self.tx, self.mesh)
        self._step: Any = None

    # ------------------------------------------------------------------ setup
    def _model(self) -> tuple[ModelConfig, dict, Any]:
        m = self.cfg.model
        if m.name:
            loaded = load_model(m.name, **run_options(m))
            return loaded.config, loaded.params, loaded.tokenizer
        tokenizer = load_tokenizer(resolve(m.tokenizer))
        assert m.architecture is not None  # ModelToTrain requires a name or an architecture
        config = architecture_config(m, m.architecture, tokenizer)
        return config, jax.device_get(init_params(config, self.cfg.seed)), tokenizer

    def compiled_step(self, example: tuple) -> tuple[Any, float]:
        """The compiled step (one for every block size), and its compile seconds (0 once compiled)."""
        if self._step is not None:
            return self._step, 0.0
        began = time.perf_counter()
        frozen = jax.tree.map(lambda x: x.sharding, self.frozen) if self.config.adapter else None
        step = jitted_train_step(self.cfg, self.model, self.tx, self.schedule, self.mesh,
                                 jax.tree.map(lambda x: x.sharding, self.state), frozen)
        self._step = step.lower(*example).compile()
        return self._step, time.perf_counter() - began

    # ------------------------------------------------------------------ loop
    def checkpoint_manager(self) -> Any:
        """The Orbax manager of this run's checkpoints."""
        return train_checkpoints.checkpoint_manager(self.cfg, self.workdir)

    def _workdir_lock(self) -> Any:
        """The workdir's lock (process 0's: hosts share the workdir), held while a run trains."""
        return WorkdirLock(self.workdir) if jax.process_index() == 0 else contextlib.nullcontext()

    def run(self, until: int | None = None) -> list[dict[str, float]]:
        """Trains to `train.steps` (or to step `until` of the same run, saved there: a long run spent in
        pieces), resuming from `workdir`; returns this invocation's logged metrics. Holds the workdir's
        lock throughout: a second run on the same workdir is refused, naming this one's process."""
        with self._workdir_lock():
            try:
                return self._run(until)
            except BaseException:  # the run ends here (a refusal, a failed save, SIGTERM)
                self.iterator.close()
                raise

    def _run(self, until: int | None) -> list[dict[str, float]]:
        manager = self.checkpoint_manager()
        total = self.cfg.train.steps
        try:
            own = bool(manager.all_steps())
            if own or self.cfg.init_from:  # what the checkpoints restored next were trained as
                run_identity.check_same_run(self.workdir if own else self.cfg.init_from, self.identity,
                                            "--workdir" if own else "init_from")
            self.state, start = train_checkpoints.resume(manager, self.cfg, self.workdir, self.state, self.iterator)
            if start > total or (start == total and not own):
                raise UserError(f"the checkpoint resumed from ({'--workdir' if own else 'init_from'}) is at step "
                                f"{start}, {'past' if start > total else 'already at'} train.steps={total}, which "
                                f"counts the whole run: set train.steps above {start} to train on")
        except UserError:
            manager.close()  # its background threads would otherwise print tracebacks at exit
            raise
        if jax.process_index() == 0 and not (own and run_identity.recorded(self.workdir)):
            run_identity.record(self.workdir, self.identity)  # a workdir from before identities: from now on
        if self.cfg.optimizer.warmup_steps > total and start == 0:
            print(f"note: optimizer.warmup_steps={self.cfg.optimizer.warmup_steps} > train.steps={total}: the "
                  "learning rate never reaches optimizer.lr", file=sys.stderr)
        end = total if until is None else min(until, total)
        logged = []
        progress = Progress(start, total)
        window = Window(self.cfg.train.batch_size * self.cfg.data.seq_len, self._flops_per_step(),
                        device_peak_flops(jax.devices()[0], self.config.dtype))
        stopped_at, previous = None, None
        with (MetricsLog(self.workdir, start, primary=jax.process_index() == 0) as log,
              train_checkpoints.finishing_saves(manager, self.workdir), StopRequest() as stop):
            for step in range(start, end):
                k = block_size_for_step(self.cfg, step)
                host_batch = streaming.check_batch(next(self.iterator), self.config.mask_token_id, step + 1)
                batch = global_batch(host_batch, self.mesh)
                rng = jax.random.fold_in(jax.random.key(self.cfg.seed), step)
                block_size = jax.device_put(jnp.int32(k), sharding.replicated(self.mesh))
                inputs = (self.state, batch, rng, block_size) + ((self.frozen,) if self.config.adapter else ())
                compiled, compile_seconds = self.compiled_step(inputs)
                self.state, metrics = compiled(*inputs)
                stop.unsaved = True
                window.add(step + 1, k, metrics, compile_seconds)  # stays on device until the window's fetch
                # Step N is queued; wait for N - 1. Unbounded, dispatch ran ahead to the next fetch and
                # waited there in C, where Python's SIGTERM handler cannot run (ten steps, not one).
                if previous is not None:
                    jax.block_until_ready(previous)
                previous = metrics["loss"]
                checkpoint = (step + 1) % self.cfg.checkpoint.every == 0 or step + 1 == end
                sync_point = checkpoint or (step + 1) % self.cfg.train.log_every == 0
                if stop.agreed(sync_point):  # SIGTERM or Ctrl-C: save this step and stop
                    checkpoint, sync_point, stopped_at = True, True, step + 1
                if not sync_point:
                    continue
                rows = window.fetch()  # the one host sync; a non-finite step stops here, before any save
                logged += rows
                log.write(rows)
                progress.update(rows[-1])
                train_checkpoints.check_saves(manager, self.workdir)  # a failed async save stops the run here
                if checkpoint:
                    train_checkpoints.save(manager, step + 1, self.state, self.iterator, self.workdir)
                    stop.unsaved = False
                if stopped_at is not None:
                    break
        progress.close()
        if stopped_at is not None:
            raise Stopped(f"stopped by {stop.signal} after step {stopped_at} of {total}: its checkpoint is saved "
                          f"in {self.workdir}; run the same command again to continue")
        if self.cfg.export_hf and end == total:
            self.export(os.path.join(self.workdir, "adapter" if self.config.adapter else "hf"))
        return logged

    def _flops_per_step(self) -> float:
        """Model FLOPs of one step (roofline formulas: 6 per weight per token, x2 for SBD's 2L layout but
        not for a gated adapter's)."""
        shape = shape_of(self.config)
        per_token = training_flops_per_token(shape, self.cfg.objective.kind == ObjectiveKind.SBD,
                                             adapter=self.config.adapter is not None)
        return per_token * self.cfg.train.batch_size * self.cfg.data.seq_len

    def export_checkpoint(self, step: int, path: str) -> None:
        """Writes this run's checkpoint of `step` as an HF directory (milestones of a run, e.g. a trend)."""
        run_identity.check_same_run(self.workdir, self.identity, "--workdir")
        self.state = train_checkpoints.restore(self.checkpoint_manager(), step, self.workdir, self.state, self.iterator)
        self.export(path)

    def export(self, path: str) -> None:
        """Writes the trained model (with its mask token) as an HF directory, or an adapter run's adapter
        (`sbd_jax.checkpoints.adapter`: load it onto the same base). Every process takes part (parameters may be
        sharded across hosts); process 0 writes, one safetensors file at a time."""
        from sbd_jax.checkpoints.hf import save_hf

        if self.config.adapter:
            from jax.experimental import multihost_utils

            adapter = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                                   self.state.params)
            if jax.process_index() == 0:
                save_adapter(path, self.config, adapter, self.base, self.started_from)
            return

        save_hf(path, self.config.replace(param_dtype=DType.FLOAT32), self.state.params,
                tokenizer=self.tokenizer if jax.process_index() == 0 else None)


def _initialize_distributed(d: DistributedConfig) -> None:
    """Joins the job's other processes; what the config leaves unset is detected from the cluster."""
    # CPU hosts need a collectives library for cross-process arrays; GPU and TPU runs are unaffected.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=d.coordinator_address or None, num_processes=d.num_processes or None,
                               process_id=d.process_id if d.process_id >= 0 else None)

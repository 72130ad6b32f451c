"""SBD fine-tuning: sharded jitted train step, the loop, Orbax checkpoints (state + data iterator), logs.

The same code runs on one CPU, one GPU or a `(data, fsdp, tensor)` mesh of many devices and hosts.
A run is a pure function of (config, step): the noise key is `fold_in(seed, step)`, the block size
is drawn from `(seed, step)`, and the Grain iterator is checkpointed with the state, so a resumed run
sees the same batches and computes the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Iterator

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from sbd_jax import sharding, streaming
from sbd_jax.data import Packed
from sbd_jax.checkpoints.load import load_model, resolve
from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.mask_token import setup_mask_token
from sbd_jax.model import Transformer, init_params
from sbd_jax.objective import Batch, check_objective, ntp_loss, sbd_loss
from sbd_jax.roofline import device_peak_flops, shape_of, training_flops_per_token
from sbd_jax.stop_request import StopRequest
from sbd_jax.tokenizer import load_tokenizer


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def make_optimizer(opt: ml_collections.ConfigDict, total_steps: int) -> tuple[optax.GradientTransformation, Any]:
    """AdamW with global-norm clipping and no decay on norms and biases; linear warmup, then cosine
    decay to `final_lr_ratio` at `total_steps`, or (wsd) constant until the last `decay_steps` steps,
    which decay linearly. A WSD run's state before its decay equals a longer WSD run's at that step."""
    warmup = max(opt.warmup_steps, 1)
    final = opt.lr * opt.final_lr_ratio
    if opt.schedule == "wsd":
        stable_end = max(total_steps - opt.decay_steps, warmup)
        schedule = optax.join_schedules([
            optax.linear_schedule(0.0, opt.lr, warmup), optax.constant_schedule(opt.lr),
            optax.linear_schedule(opt.lr, final, max(total_steps - stable_end, 1))], [warmup, stable_end])
    else:
        schedule = optax.warmup_cosine_decay_schedule(0.0, opt.lr, warmup, max(total_steps, warmup + 1), final)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask),
    )
    return tx, schedule


def block_size_for_step(cfg: ml_collections.ConfigDict, step: int) -> int:
    """k ~ U{min..max} per step, drawn from (seed, step) so a resumed run draws the same k.

    NTP training has no blocks: always 1.
    """
    if cfg.objective.kind == "ntp":
        return 1
    low, high = cfg.objective.block_size_min, cfg.objective.block_size_max
    return int(np.random.default_rng([cfg.seed, step]).integers(low, high + 1))


def train_step(state: TrainState, batch: Batch, rng: jax.Array, block_size: Any, *, model: Transformer,
               tx: optax.GradientTransformation, schedule: Any, objective: str, mask_id: int,
               weights: tuple[float, float], eta_range: tuple[float, float], grad_accum: int,
               end_ids: tuple[int, ...] = (),
               block_sizes: tuple[int, int] | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step; the batch is split into `grad_accum` micro-batches whose grads are averaged.

    `block_size`: a Python int (a step for that size) or a traced int32 scalar in `block_sizes`
    (min, max): one compiled step for every size.
    `end_ids` (the model's EOS ids): what the noisy half predicts after a document's end (objective.noisy_layout).
    """
    def loss_fn(params, micro, micro_rng):
        if objective == "ntp":
            return ntp_loss(params, model, micro)
        return sbd_loss(params, model, micro, micro_rng, block_size=block_size, mask_id=mask_id,
                        w_ntp=weights[0], w_matp=weights[1], eta_range=eta_range, end_ids=end_ids,
                        block_sizes=block_sizes)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum == 1:
        (_, metrics), grads = grad_fn(state.params, batch, rng)
    else:
        micro_batches = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)

        def accumulate(carry, inputs):
            micro, index = inputs
            (_, metrics), grads = grad_fn(state.params, micro, jax.random.fold_in(rng, index))
            return jax.tree.map(jnp.add, carry, (grads, metrics)), None

        (_, metric_shapes), grad_shapes = jax.eval_shape(
            grad_fn, state.params, jax.tree.map(lambda x: x[0], micro_batches), rng)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grad_shapes, metric_shapes))
        (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (micro_batches, jnp.arange(grad_accum)))
        grads, metrics = jax.tree.map(lambda x: x / grad_accum, (grads, metrics))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
    return TrainState(state.step + 1, params, opt_state), metrics


def jitted_train_step(cfg: ml_collections.ConfigDict, model: Transformer, tx: optax.GradientTransformation,
                      schedule: Any, mesh: Any, state_shardings: TrainState) -> Any:
    """`train_step(state, batch, rng, block_size)` jitted with the mesh's shardings and the state donated;
    the block size is a traced int32 argument, so every size of the config's range shares one compile."""
    obj = cfg.objective
    step = functools.partial(
        train_step, model=model, tx=tx, schedule=schedule, objective=obj.kind,
        mask_id=model.config.mask_token_id or 0, weights=(obj.w_ntp, obj.w_matp),
        eta_range=(obj.eta_min, obj.eta_max), grad_accum=cfg.train.grad_accum,
        end_ids=tuple(model.config.eos_token_ids or ()),
        block_sizes=(obj.block_size_min, obj.block_size_max))
    batch_sh = Batch(*[sharding.batch_sharding(mesh)] * 4)
    replicated = sharding.replicated(mesh)
    return jax.jit(step, in_shardings=(state_shardings, batch_sh, replicated, replicated),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))


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
    if cfg.train.log_every < 1:
        raise UserError(f"train.log_every={cfg.train.log_every} must be >= 1 (steps between metric fetches)")
    if cfg.train.batch_size % cfg.train.grad_accum:
        raise UserError(f"train.batch_size={cfg.train.batch_size} is not divisible by train.grad_accum="
                        f"{cfg.train.grad_accum}")


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
            cfg.data.files, self.tokenizer, cfg.data.seq_len, cfg.train.batch_size, cfg.seed, cfg.train.steps,
            cfg.data.shards, cfg.data.workers, jax.process_index(), jax.process_count())
        self.model = Transformer(self.config, mesh=self.mesh)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
        self.state = self._sharded_state(params)
        self._step: Any = None

    # ------------------------------------------------------------------ setup
    def _model(self) -> tuple[ModelConfig, dict, Any]:
        m = self.cfg.model
        run = dict(dtype=m.dtype, param_dtype="float32", scan_layers=m.scan_layers, remat=m.remat,
                   attention=m.attention)
        if m.name:
            loaded = load_model(m.name, **run)
            return loaded.config, loaded.params, loaded.tokenizer
        if not m.architecture:
            raise UserError("set config.model.name (a model to fine-tune) or config.model.architecture")
        tokenizer = load_tokenizer(resolve(m.tokenizer))
        arch = dict(m.architecture)
        arch.setdefault("vocab_size", len(tokenizer))
        arch.setdefault("eos_token_ids", (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        config = ModelConfig(**arch, **run)
        return config, jax.device_get(init_params(config.replace(param_dtype="float32"), self.cfg.seed)), tokenizer

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
            _truncate_log(metrics_path, start)
        writer = _tensorboard(self.workdir) if primary else None
        total = self.cfg.train.steps
        tokens_per_step = self.cfg.train.batch_size * self.cfg.data.seq_len
        logged = []
        progress = _Progress(start, total)
        window = _Window(tokens_per_step, self._flops_per_step(), device_peak_flops(jax.devices()[0], self.config.dtype))
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


def _truncate_log(path: str, completed: int) -> None:
    """Drops log lines of steps after the restored checkpoint: they are about to be recomputed."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= completed]
    with open(path, "w") as f:
        f.writelines(keep)


def _tensorboard(workdir: str) -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(workdir, "tensorboard"))


@dataclasses.dataclass
class _Window:
    """Steps dispatched since the last fetch, their metrics still on device. `fetch` brings them to the
    host in one transfer and times the window: per step, its wall time less compiles, divided evenly
    (steps overlap, so one step's own time is not observable without a sync per step)."""

    tokens_per_step: int
    flops_per_step: float
    peak_flops: float | None
    pending: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.began = time.perf_counter()

    def add(self, step: int, block_size: int, metrics: dict[str, jax.Array], compile_seconds: float) -> None:
        self.pending.append((step, block_size, metrics, compile_seconds))

    def fetch(self) -> list[dict[str, float]]:
        fetched = jax.device_get([metrics for _, _, metrics, _ in self.pending])
        now = time.perf_counter()
        compiles = sum(c for *_, c in self.pending)
        seconds = max(now - self.began - compiles, 1e-9) / len(self.pending)
        rows = []
        for (step, k, _, compile_seconds), metrics in zip(self.pending, fetched):
            metrics = {name: float(v) for name, v in metrics.items()}
            bad = [name for name in ("loss", "grad_norm") if not math.isfinite(metrics[name])]
            if bad:
                raise UserError(f"step {step}: non-finite {' and '.join(bad)} ({', '.join(f'{n}={metrics[n]}' for n in bad)}"
                                "); stopped without saving this state, the last checkpoint stays: lower "
                                "optimizer.lr or check the data, then rerun to resume from it")
            row = {"step": step, "block_size": k, **metrics, "seconds": seconds,
                   "tokens_per_s": self.tokens_per_step / seconds, "compile_seconds": compile_seconds}
            if self.peak_flops:
                row["mfu"] = self.flops_per_step / seconds / self.peak_flops
            rows.append(row)
        self.pending, self.began = [], time.perf_counter()
        return rows


@dataclasses.dataclass
class _Progress:
    """One status line per fetch: step, losses, step time, tokens/s, MFU, ETA (redrawn on a terminal)."""

    start: int
    total: int

    def __post_init__(self) -> None:
        self.began = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, row: dict[str, float]) -> None:
        done = row["step"] - self.start
        eta = (time.perf_counter() - self.began) / done * (self.total - row["step"])
        mfu = f" MFU {row['mfu']:.1%}" if "mfu" in row else ""
        line = (f"step {row['step']}/{self.total} loss {row['loss']:.4f} (ntp {row['ntp_loss']:.4f}, "
                f"matp {row['matp_loss']:.4f}) k={row['block_size']} {row['seconds']:.3f} s/step "
                f"{row['tokens_per_s']:.0f} tok/s{mfu} ETA {eta:.0f}s")
        print(("\r" if self.tty else "") + line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)

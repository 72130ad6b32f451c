"""The pure training step: state, optimizer and schedule, the per-step block size, the loss spec, and
the step itself (jitted with the mesh's shardings)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from sbd_jax.data.packing import Batch
from sbd_jax.model import sharding
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.transformer import Transformer
from sbd_jax.training.config import ObjectiveKind, OptimizerConfig, Schedule, TrainConfig
from sbd_jax.training.objective import DraftTraining, adapter_sbd_loss, ntp_loss, sbd_loss


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def sharded_state(params: dict, tx: optax.GradientTransformation, mesh: Any) -> TrainState:
    """Step 0's state laid out on `mesh`: parameters and optimizer moments by the logical sharding rules."""
    params = jax.device_put(params, sharding.param_shardings(params, mesh))
    opt_shardings = sharding.param_shardings(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(mesh)), params, opt_state)


def global_batch(host_batch: dict[str, np.ndarray], mesh: Any) -> Batch:
    """This host's rows of a batch (`Batch` field names) as one global array per field, split over the
    mesh's batch axes."""
    batch_sh = sharding.batch_sharding(mesh)
    return Batch(*[jax.make_array_from_process_local_data(batch_sh, host_batch[name]) for name in Batch._fields])


def make_optimizer(opt: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, Any]:
    """AdamW with global-norm clipping (unless clip_norm is 0) and no decay on norms and biases; linear warmup, then cosine
    decay to `final_lr_ratio` at `total_steps`, or (wsd) constant until the last `decay_steps` steps,
    which decay linearly. A WSD run's state before its decay equals a longer WSD run's at that step."""
    warmup = max(opt.warmup_steps, 1)
    final = opt.lr * opt.final_lr_ratio
    if opt.schedule == Schedule.WSD:
        stable_end = max(total_steps - opt.decay_steps, warmup)
        schedule = optax.join_schedules([
            optax.linear_schedule(0.0, opt.lr, warmup), optax.constant_schedule(opt.lr),
            optax.linear_schedule(opt.lr, final, max(total_steps - stable_end, 1))], [warmup, stable_end])
    else:
        schedule = optax.warmup_cosine_decay_schedule(0.0, opt.lr, warmup, max(total_steps, warmup + 1), final)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=decay_mask)
    # clip_norm 0 is "off": the chain keeps one shape (an identity in place of clipping) for the optimizer state.
    clip = optax.clip_by_global_norm(opt.clip_norm) if opt.clip_norm > 0 else optax.identity()
    tx = optax.chain(clip, adamw)
    return tx, schedule


def block_size_for_step(cfg: TrainConfig, step: int) -> int:
    """k ~ U{min..max} per step, drawn from (seed, step) so a resumed run draws the same k.

    NTP training has no blocks: always 1.
    """
    if cfg.objective.kind == ObjectiveKind.NTP:
        return 1
    low, high = cfg.objective.block_size_min, cfg.objective.block_size_max
    return int(np.random.default_rng([cfg.seed, step]).integers(low, high + 1))


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """What a step's loss needs besides its inputs, fixed for a run (hashable: part of the compiled step)."""

    kind: ObjectiveKind = ObjectiveKind.SBD  # the loss: SBD's joint NTP + MATP, or NTP alone
    mask_id: int = 0
    weights: tuple[float, float] = (1.0, 1.0)  # (NTP, MATP)
    eta_range: tuple[float, float] = (0.0, 1.0)  # the masking rate is drawn uniformly from it per row
    block_sizes: tuple[int, int] | None = None  # (min, max) of a traced block size; None: a Python int
    end_ids: tuple[int, ...] = ()  # the model's EOS ids: what the noisy half predicts after a document's end
    grad_accum: int = 1  # micro-batches whose gradients are averaged
    drafts: DraftTraining = DraftTraining()  # what the MATP term aims at beyond the paper's

    @classmethod
    def from_config(cls, cfg: TrainConfig, config: ModelConfig) -> "ObjectiveSpec":
        obj = cfg.objective
        return cls(kind=obj.kind, mask_id=config.mask_token_id or 0, weights=(obj.w_ntp, obj.w_matp),
                   eta_range=(obj.eta_min, obj.eta_max), block_sizes=(obj.block_size_min, obj.block_size_max),
                   end_ids=tuple(config.eos_token_ids or ()), grad_accum=cfg.train.grad_accum,
                   drafts=DraftTraining(obj.full_mask_share, obj.position_decay, obj.soft_target))


def train_step(state: TrainState, batch: Batch, rng: jax.Array, block_size: Any, frozen: Any = None, *,
               model: Transformer, tx: optax.GradientTransformation, schedule: Any,
               spec: ObjectiveSpec) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step; the batch is split into `spec.grad_accum` micro-batches whose grads are averaged.

    `block_size`: a Python int (a step for that size) or a traced int32 scalar in `spec.block_sizes`
    (min, max): one compiled step for every size. `frozen`: when the model's config has an adapter (an adapter
    run), the base weights the adapter in `state.params` sits on (an input, never updated: no gradient and no
    optimizer state).
    """
    def loss_fn(params, micro, micro_rng):
        if model.config.adapter is not None:
            return adapter_sbd_loss(params, frozen, model, micro, micro_rng, block_size=block_size,
                                    mask_id=spec.mask_id, w_matp=spec.weights[1], eta_range=spec.eta_range,
                                    end_ids=spec.end_ids, block_sizes=spec.block_sizes, drafts=spec.drafts)
        if spec.kind == ObjectiveKind.NTP:
            return ntp_loss(params, model, micro)
        return sbd_loss(params, model, micro, micro_rng, block_size=block_size, mask_id=spec.mask_id,
                        w_ntp=spec.weights[0], w_matp=spec.weights[1], eta_range=spec.eta_range,
                        end_ids=spec.end_ids, block_sizes=spec.block_sizes, drafts=spec.drafts)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    grad_accum = spec.grad_accum
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


def jitted_train_step(cfg: TrainConfig, model: Transformer, tx: optax.GradientTransformation,
                      schedule: Any, mesh: Any, state_shardings: TrainState, frozen_shardings: Any = None) -> Any:
    """`train_step(state, batch, rng, block_size[, frozen])` jitted with the mesh's shardings and the state
    donated; the block size is a traced int32 argument, so every size of the config's range shares one
    compile. An adapter run (`frozen_shardings` given) also takes the frozen base weights."""
    step = functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                             spec=ObjectiveSpec.from_config(cfg, model.config))
    batch_sh = Batch(*[sharding.batch_sharding(mesh)] * 4)
    replicated = sharding.replicated(mesh)
    shardings: tuple[Any, ...] = (state_shardings, batch_sh, replicated, replicated)
    if frozen_shardings is not None:
        shardings += (frozen_shardings,)
    return jax.jit(step, in_shardings=shardings, out_shardings=(state_shardings, replicated), donate_argnums=(0,))

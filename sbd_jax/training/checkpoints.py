"""A training run's Orbax checkpoints: the train state and the data iterator's position, saved and
restored together, so a resumed run sees the batches an uninterrupted one would have seen."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import grain
import jax

from sbd_jax.data import streaming
from sbd_jax.errors import UserError
from sbd_jax.training.config import TrainConfig


def checkpoint_manager(cfg: TrainConfig, workdir: str) -> Any:
    """The Orbax manager of `workdir/checkpoints` with the run's save interval and retention."""
    import orbax.checkpoint as ocp

    ck = cfg.checkpoint
    options = ocp.CheckpointManagerOptions(save_interval_steps=ck.every, max_to_keep=ck.keep,
                                           keep_period=ck.keep_period or None, enable_async_checkpointing=ck.async_save)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def restore(manager: Any, step: int, where: str, state: Any, iterator: Any) -> Any:
    """The state of checkpoint `step` (shaped and sharded like `state`); moves `iterator` to its position."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(iterator)))
    except Exception as e:  # orbax raises many types for a foreign or damaged checkpoint
        raise UserError(f"cannot restore the checkpoint of step {step} in {where} "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it does not match this "
                        "config or is damaged: use another --workdir or delete it") from None
    return restored["state"]


def resume(manager: Any, cfg: TrainConfig, workdir: str, state: Any, iterator: Any) -> tuple[Any, int]:
    """(state, completed steps): the latest checkpoint in `workdir`, else `cfg.init_from`'s (a branch off
    another run), else `state` at step 0."""
    latest = manager.latest_step()
    if latest is not None:
        return restore(manager, latest, workdir, state, iterator), latest
    if not cfg.init_from:
        return state, 0
    source = checkpoint_manager(cfg, cfg.init_from)
    step = cfg.init_step or source.latest_step()
    if step not in source.all_steps():
        raise UserError(f"init_from={cfg.init_from!r} has no checkpoint of step {step} "
                        f"(it has {sorted(source.all_steps())})")
    return restore(source, step, cfg.init_from, state, iterator), step


def save(manager: Any, step: int, state: Any, iterator: Any) -> None:
    """Saves `state` and the iterator's position as checkpoint `step` (asynchronously where configured)."""
    import orbax.checkpoint as ocp

    manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(streaming.Snapshot(iterator.get_state()))))


@contextlib.contextmanager
def finishing_saves(manager: Any) -> Iterator[None]:
    """Waits for in-flight async saves also when the loop stops with an error, so the last good
    checkpoint is whole on disk."""
    try:
        yield
    finally:
        manager.wait_until_finished()

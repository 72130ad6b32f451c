"""A training run's Orbax checkpoints: the train state and the data iterator's position, saved and
restored together, so a resumed run sees the batches an uninterrupted one would have seen."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
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


class Unrestorable(UserError):
    """A checkpoint that cannot be restored into this run: written for another config, or damaged.
    `step` is its step, `cause` what restoring it raised (one line)."""

    def __init__(self, message: str, step: int, cause: str):
        super().__init__(message)
        self.step, self.cause = step, cause


def restore(manager: Any, step: int, where: str, state: Any, iterator: Any) -> Any:
    """The state of checkpoint `step` (shaped and sharded like `state`); moves `iterator` to its position."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(iterator)))
    except UserError:  # the data stream's own refusal (other batch shapes, other files): already one line
        raise
    except Exception as e:  # orbax raises many types for a foreign or damaged checkpoint
        cause = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        raise Unrestorable(f"cannot restore the checkpoint of step {step} in {where} ({cause}); it was written "
                           "for another config or is damaged: resume with the config that wrote it, or start a "
                           "new run in another --workdir", step, cause) from None
    return restored["state"]


def resume(manager: Any, cfg: TrainConfig, workdir: str, state: Any, iterator: Any) -> tuple[Any, int]:
    """(state, completed steps): the newest checkpoint in `workdir` that restores, else `cfg.init_from`'s
    (a branch off another run), else `state` at step 0 with `iterator` moved past `cfg.data.skip` batches
    (a run that continues earlier training, `adapter.init_from`, reads on where that stopped). Newer
    checkpoints that do not restore while an older one does are damaged (this config restores the older
    one): they are moved to `workdir/damaged_checkpoints` (the run saves those steps again) and the fallback
    is announced."""
    steps = sorted(manager.all_steps(), reverse=True)
    failed: list[Unrestorable] = []
    for step in steps:
        try:
            restored = restore(manager, step, workdir, state, iterator)
        except Unrestorable as e:
            failed.append(e)
            continue
        if failed:
            damaged = [e.step for e in failed]
            _set_aside(manager, workdir, damaged)
            print(f"note: the checkpoint{'s' * (len(damaged) > 1)} of step {', '.join(map(str, damaged))} in "
                  f"{workdir} cannot be restored ({failed[0].cause}) and {'are' if len(damaged) > 1 else 'is'} "
                  f"damaged (the older one of step {step} restores): resumed from step {step}; moved "
                  f"{'them' if len(damaged) > 1 else 'it'} to {os.path.join(workdir, DAMAGED)}", file=sys.stderr)
        return restored, step
    if len(failed) > 1:
        raise Unrestorable(f"cannot restore any of the checkpoints in {workdir} (steps {', '.join(map(str, steps))}; "
                           f"step {steps[0]}: {failed[0].cause}); they were written for another config or are "
                           "damaged: resume with the config that wrote them, or start a new run in another "
                           "--workdir", steps[0], failed[0].cause)
    if failed:
        raise failed[0]
    if not cfg.init_from:
        for _ in range(cfg.data.skip):
            next(iterator)
        return state, 0
    source = checkpoint_manager(cfg, cfg.init_from)
    step = cfg.init_step or source.latest_step()
    if step not in source.all_steps():
        raise UserError(f"init_from={cfg.init_from!r} has no checkpoint of step {step} "
                        f"(it has {sorted(source.all_steps())})")
    return restore(source, step, cfg.init_from, state, iterator), step


DAMAGED = "damaged_checkpoints"  # in the workdir: checkpoints that did not restore while an older one did


def _set_aside(manager: Any, workdir: str, steps: list[int]) -> None:
    """Moves damaged checkpoints out of the manager's directory (kept for a look, never deleted), so the
    run saves those steps again. Process 0 moves them (hosts share the workdir), then every host rereads."""
    if jax.process_index() == 0:
        aside = os.path.join(workdir, DAMAGED)
        os.makedirs(aside, exist_ok=True)
        for step in steps:
            target = os.path.join(aside, str(step))
            if os.path.exists(target):  # one set aside before: keep both
                target += f".{len(os.listdir(aside))}"
            os.replace(os.path.join(str(manager.directory), str(step)), target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("damaged checkpoints set aside")
    manager.reload()


def save(manager: Any, step: int, state: Any, iterator: Any, workdir: str) -> None:
    """Saves `state` and the iterator's position as checkpoint `step` (asynchronously where configured);
    a failed save (a full disk) is a `SaveFailed`."""
    import orbax.checkpoint as ocp

    check_saves(manager, workdir, wait=True)  # Orbax waits for the save in flight anyway: report it as its own
    with reported_save_errors(manager, workdir, step):
        _check_room(str(manager.directory), state)
        manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(streaming.Snapshot(iterator.get_state()))))


def _check_room(directory: str, state: Any) -> None:
    """An `ENOSPC` before writing when the state cannot fit in the free space of a local `directory`: a
    save that fills the disk fails in Orbax's background threads, which print a hundred tracebacks.
    Orbax writes the arrays as they are (about their bytes on disk; older checkpoints go only after)."""
    if not os.path.isdir(directory):  # a bucket (gs://...): no free-space figure
        return
    need = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(state))
    free = shutil.disk_usage(directory).free
    short = free < need
    if jax.process_count() > 1:  # every host stops, or none: process 0's disk decides
        from jax.experimental import multihost_utils

        short = bool(multihost_utils.broadcast_one_to_all(short))
    if short:
        raise OSError(errno.ENOSPC, f"No space left on device: the checkpoint needs {need / 2**20:.1f} MiB, "
                                    f"{free / 2**20:.1f} MiB are free")


class SaveFailed(UserError):
    """A checkpoint save that failed (a full disk, a lost mount): the run stops at once, in one line."""


@contextlib.contextmanager
def reported_save_errors(manager: Any, workdir: str, step: int | None = None) -> Iterator[None]:
    """Turns a failure of a save (or of an earlier async one) into one `SaveFailed` line that says what is
    safe: the newest checkpoint that was finished before it."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # orbax and the filesystem raise many types; async ones come back wrapped
        cause: BaseException = e
        while isinstance(cause.__cause__, Exception):
            cause = cause.__cause__
        try:  # what is on disk, whole (a step whose save failed may be listed)
            manager.reload()
            finished = [s for s in manager.all_steps() if s != step]
            resume_from = f"step {max(finished)}" if finished else "the start"
        except Exception:  # the same trouble (a lost mount)
            resume_from = "its newest whole checkpoint"
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        raise SaveFailed(f"cannot save {what} in {workdir} ({type(cause).__name__}: "
                         f"{(str(cause).splitlines() or [''])[0][:200]}); training stopped: free space or fix the "
                         f"directory, then run the same command again to resume from {resume_from}") from None


@contextlib.contextmanager
def finishing_saves(manager: Any, workdir: str) -> Iterator[None]:
    """Waits for in-flight async saves, also when the loop stops with an error, so the last good
    checkpoint is whole on disk; then closes the manager (its background threads, left running, print
    tracebacks at exit). A failed async save not reported yet is a `SaveFailed` when the loop ends."""
    try:
        yield
        check_saves(manager, workdir, wait=True)
    finally:
        with contextlib.suppress(Exception):
            manager.wait_until_finished()
        with contextlib.suppress(Exception):
            manager.close()


def check_saves(manager: Any, workdir: str, wait: bool = False) -> None:
    """Raises `SaveFailed`, naming the save's step, if an async save has failed (after waiting for those in
    flight, with `wait`). The newest step the manager lists is the one an async save can still be writing."""
    with reported_save_errors(manager, workdir, manager.latest_step()):
        if wait:
            manager.wait_until_finished()
        manager.check_for_errors()

"""SIGTERM as a request to stop training cleanly: the loop saves a checkpoint of the step it finished and
exits, so a preempted VM, a scheduler's `kill` or a session that ends loses no finished step."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
import numpy as np

from sbd_jax.errors import UserError


class Stopped(UserError):
    """SIGTERM where no finished step is left unsaved: the run ends now (one line, exit code 2)."""


class StopRequest:
    """While entered, SIGTERM sets `requested` instead of ending the process (the previous handler is
    restored on exit), so the loop can save the steps it finished. With nothing to save (`unsaved` False:
    no step since the last checkpoint, e.g. still waiting for the first batch) or on a second SIGTERM, it
    raises `Stopped` at once instead: a run that never reaches a step still ends within seconds.
    Outside the main thread no handler can be installed, and it never fires."""

    def __init__(self) -> None:
        self.requested = False
        self.unsaved = False  # the loop sets it after a step and clears it after a checkpoint
        self._previous: Any = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested or not self.unsaved:
            raise Stopped("stopped by SIGTERM" + (" again" if self.requested else " with no unsaved step"))
        self.requested = True

    def agreed(self, at_sync_point: bool) -> bool:
        """Whether every process stops after this step. One process: as soon as SIGTERM arrived. Several:
        only at sync points (where they all fetch metrics anyway), and then if any process got it, so
        all of them save the same step together."""
        if jax.process_count() == 1:
            return self.requested
        if not at_sync_point:
            return False
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.array(self.requested))))

"""SIGTERM and SIGINT (Ctrl-C) as a request to stop training cleanly: the loop saves a checkpoint of the
step it finished and exits, so a preempted VM, a scheduler's `kill`, Ctrl-C or a session that ends loses
no finished step. The run then ends in one line with exit code 75 (EX_TEMPFAIL, sysexits.h: "try again
later"), not bad input's 2: a scheduler that requeues temporary failures reruns the command, which resumes."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
import numpy as np

from sbd_jax.errors import UserError

SIGNALS: dict[int, str] = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT (Ctrl-C)"}


class Stopped(UserError):
    """A run stopped by a signal: at once (no finished step left unsaved, or a second signal), or after
    saving its last finished step. One line, exit code 75 (`run_cli`)."""

    exit_code = 75


class StopRequest:
    """While entered, SIGTERM or SIGINT sets `requested` (and `signal`, its name) instead of ending the
    process (the previous handlers are restored on exit), so the loop can save the steps it finished.
    With nothing to save (`unsaved` False: no step since the last checkpoint, e.g. still waiting for the
    first batch) or on a second signal, it raises `Stopped` at once instead: a run that never reaches a
    step still ends within seconds. Outside the main thread no handler can be installed, and it never fires."""

    def __init__(self) -> None:
        self.requested = False
        self.signal = "SIGTERM"  # the name of the signal that asked to stop
        self.unsaved = False  # the loop sets it after a step and clears it after a checkpoint
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for number, previous in self._previous.items():
            if previous is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(number, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = SIGNALS.get(signum, f"signal {signum}")
        if self.requested or not self.unsaved:
            raise Stopped(f"stopped by {name}" + (" again" if self.requested else " with no unsaved step"))
        self.requested, self.signal = True, name

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

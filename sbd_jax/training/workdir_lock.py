"""One training run per workdir: two runs sharing one would interleave their metrics.jsonl and take each
other's checkpoints. The lock is an advisory `flock` on `workdir/train.lock`, which holds the process and
host of the run holding it (named in the refusal). The kernel releases the lock when that process dies,
however it dies, so a lock file left by a killed run is simply taken over: no stale lock to remove."""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from typing import Any

from sbd_jax.errors import UserError

LOCK_FILE = "train.lock"


class WorkdirLock:
    """`with WorkdirLock(workdir):` holds the workdir's lock, or raises a UserError naming its holder."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by worker processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"--workdir {self.workdir} is in use by {holder}, another training run "
                            f"({self.path}): wait for it to end or stop it, or choose another --workdir") from None
        except OSError as e:  # a filesystem without locks (some network mounts): run unguarded, and say so
            os.close(fd)
            print(f"note: cannot lock {self.path} ({e.strerror}): nothing keeps a second run out of this "
                  "--workdir", file=sys.stderr)
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on host {socket.gethostname()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock; the file stays (removing it would race a new run)
            self._fd = None

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

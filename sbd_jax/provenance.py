"""Where a result came from: the commit it was measured at, when, and with which JAX on which device."""

from __future__ import annotations

import datetime
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """This checkout's commit, `+dirty` if tracked files differ from it. Outside a git checkout (a copy
    of the tree on a device machine): $SBD_COMMIT if set, else "unknown"."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return os.environ.get("SBD_COMMIT", "unknown")
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def provenance() -> dict[str, str]:
    """`commit`, `measured_at` (UTC, ISO 8601), `jax` version and the first `device`."""
    import jax

    return {"commit": commit(), "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "device": str(jax.devices()[0])}

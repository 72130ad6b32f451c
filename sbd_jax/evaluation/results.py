"""Where a result came from, and the one writer of result files: every JSON a benchmark, study or recipe
writes carries the commit it was measured at, when, the command, the machine and the device."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


CODE_FILES = ("*.py", "*.sh", "pyproject.toml")  # what a measurement depends on; results and prose do not count


def commit() -> str:
    """This checkout's commit, `+dirty` if tracked code files differ from it (a result written earlier in
    the same session, or an edited README, does not make the next measurement dirty). Outside a git
    checkout (a copy of the tree on a device machine): $SBD_COMMIT if set, else "unknown"."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return os.environ.get("SBD_COMMIT", "unknown")
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", *CODE_FILES) else "")


STARTED_AT_COMMIT = commit()  # at import, i.e. when the run began: a run may outlast a commit made meanwhile


def provenance() -> dict[str, str]:
    """`commit` (the code the run began with), `measured_at` (UTC, ISO 8601), the `command` that ran, the
    `machine` (host, CPUs), the `jax` version and the first `device`; `written_at_commit` too where the checkout
    moved on while the run went (the file is written at the end, the code was read at the start)."""
    import jax

    now = commit()
    return {"commit": STARTED_AT_COMMIT, **({"written_at_commit": now} if now != STARTED_AT_COMMIT else {}),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([os.path.basename(sys.executable), *sys.orig_argv[1:]]),
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
            "jax": jax.__version__, "device": str(jax.devices()[0])}


def write_json(path: str, data: dict) -> None:
    """Rewrites `path` whole (a temporary file, then a rename), so a reader never sees half a file;
    adds `provenance` unless `data` has it."""
    data = data if "provenance" in data else {"provenance": provenance(), **data}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)


def render_from_json(write_report: Callable[[dict, str], None], directory: str) -> None:
    """Rewrites a study's report (results.md, plots) from the results.json in `directory`, without rerunning."""
    with open(os.path.join(directory, "results.json")) as f:
        write_report(json.load(f), directory)
    print(f"wrote the report in {directory} from its results.json")

"""Shared helpers of the benchmarks: synchronised timing (warm-up excluded, median) and result files."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_json(path: str, data: dict) -> None:
    """Rewrites `path` whole (a temporary file, then a rename), so a reader never sees half a file;
    adds `provenance` (commit, time, JAX, device) unless `data` has it."""
    from sbd_jax.provenance import provenance

    data = data if "provenance" in data else {"provenance": provenance(), **data}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)


def save_result(name: str, data: dict) -> str:
    """Writes benchmarks/results/<name>.json; returns its path."""
    path = os.path.join(RESULTS, name + ".json")
    write_json(path, data)
    return path

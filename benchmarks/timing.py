"""Shared timing helper for the benchmarks: synchronised calls, warm-up excluded, median."""

from __future__ import annotations

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

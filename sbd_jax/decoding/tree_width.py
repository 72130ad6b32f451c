"""The cost curve tree verification chooses its pass width from: seconds of a bare forward at each width,
measured once per model, machine and batch (as `--block-size auto` times blocks), in the cache a decode of
these prompts gets. On a GPU at small batch the curve is nearly flat and the rule runs wide trees; on a CPU a
wider pass costs more and the rule runs wide only where candidates are likely to be kept."""

from __future__ import annotations

from typing import Sequence

from sbd_jax.decoding.timing import forward_seconds
from sbd_jax.model.config import WithWeights

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # pass widths (the exact token and candidates) compiled and timed


def measure_pass_costs(model: WithWeights, prompts: Sequence[Sequence[int]], batch: int, max_new_tokens: int,
                       draft_nodes: int, calls: int = 10) -> tuple[tuple[int, float], ...]:
    """`(width, seconds)` of one bare forward at each width up to 1 + `draft_nodes`, at `batch` rows, halfway
    through decoding these prompts (`Settings.pass_costs`)."""
    context = max(map(len, prompts)) + max_new_tokens // 2
    widths = [w for w in WIDTHS if w <= draft_nodes] + [1 + draft_nodes]
    return tuple((w, forward_seconds(model, batch, w, context, calls)) for w in sorted(set(widths)))

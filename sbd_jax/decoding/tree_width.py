"""The cost curve tree verification chooses its pass width from: seconds of a bare forward at each width,
measured once per model, machine and batch (as `--block-size auto` times blocks), in the cache a decode of
these prompts gets. On a GPU at small batch the curve is nearly flat and the rule runs wide trees; on a CPU a
wider pass costs more and the rule runs wide only where candidates are likely to be kept. `modeled_pass_costs`
gives the curve another machine would have, from the roofline model, so that the widths its rule picks can be
studied (in tokens per forward, never in seconds) where that machine is not at hand."""

from __future__ import annotations

from typing import Sequence

from sbd_jax import roofline
from sbd_jax.decoding.timing import forward_seconds
from sbd_jax.model.config import WithWeights

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # pass widths (the exact token and candidates) compiled and timed


def timed_widths(draft_nodes: int) -> list[int]:
    """The widths a curve has for trees of `draft_nodes`: `WIDTHS` up to it, and the full pass."""
    return sorted({w for w in WIDTHS if w <= draft_nodes} | {1 + draft_nodes})


def measure_pass_costs(model: WithWeights, prompts: Sequence[Sequence[int]], batch: int, max_new_tokens: int,
                       draft_nodes: int, calls: int = 10) -> tuple[tuple[int, float], ...]:
    """`(width, seconds)` of one bare forward at each width up to 1 + `draft_nodes`, at `batch` rows, halfway
    through decoding these prompts (`Settings.pass_costs`)."""
    context = max(map(len, prompts)) + max_new_tokens // 2
    return tuple((w, forward_seconds(model, batch, w, context, calls)) for w in timed_widths(draft_nodes))


def modeled_pass_costs(hardware: str, model: str, batch: int, draft_nodes: int,
                       context: int) -> tuple[tuple[int, float], ...]:
    """`(width, seconds)` as `measure_pass_costs` gives them, predicted by `sbd_jax.roofline` for `hardware`
    (e.g. "h100-bf16") and `model` (a name it knows, or a config.json) at `batch` rows and `context` cached
    tokens: modeled, not measured (UserError for an unknown hardware or model)."""
    hw, shape = roofline.lookup(hardware, model)
    return tuple((w, roofline.forward_time(hw, shape, batch, w, context)) for w in timed_widths(draft_nodes))

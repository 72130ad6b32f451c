"""The cost curve tree verification chooses its pass width from: seconds of a bare forward at each width,
measured once per model, machine and batch (as `--block-size auto` times blocks), in the cache a decode of
these prompts gets. On a GPU at small batch the curve is nearly flat and the rule runs wide trees; on a CPU a
wider pass costs more and the rule runs wide only where candidates are likely to be kept. `modeled_pass_costs`
gives the curve another machine would have, from the roofline model, so that the widths its rule picks can be
studied (in tokens per forward, never in seconds) where that machine is not at hand.

The curve prices the forwards only; the loop's own work a pass (the candidates, the walk, a draft memory's
search) is not in it, and where drafts are seldom kept no width beats NTP. So `choose_draft_widths` (what
`--draft-nodes auto` runs) also times a short greedy decode of the first batch with the rule and with NTP,
and decodes with NTP where the tree was not faster: the output is the same either way."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from sbd_jax import roofline
from sbd_jax.decoding.settings import Mode, Settings
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


CALIBRATION_TOKENS = 64  # tokens a row of the timed decodes `choose_draft_widths` compares


@dataclasses.dataclass(frozen=True)
class WidthChoice:
    """What `choose_draft_widths` measured and chose (print `describe()`: a server can pin the choice)."""

    settings: Settings  # the tree with `pass_costs`, or NTP where the tree was not faster in calibration
    pass_costs: tuple[tuple[int, float], ...]
    tokens_per_forward: float  # the tree's, with the width rule, on the calibration decode
    speedup: float  # the tree's decoding tokens/s over NTP's on the calibration decode (same tokens)

    def describe(self) -> str:
        costs = ", ".join(f"{w}: {s * 1e3:.1f} ms" for w, s in self.pass_costs)
        picked = "NTP" if self.settings.mode == Mode.NTP else "the tree"
        return (f"pass costs {costs}; calibration: {self.tokens_per_forward:.2f} tokens/forward, "
                f"{self.speedup:.2f}x NTP's tokens/s; decoding with {picked}")


def choose_draft_widths(model: WithWeights, prompts: Sequence[Sequence[int]], batch: int, settings: Settings,
                        calibration_tokens: int = CALIBRATION_TOKENS) -> WidthChoice:
    """`settings` (verified tree drafts) with each width's pass cost timed here at `batch` rows
    (`measure_pass_costs`), kept if a greedy decode of the first `batch` prompts, `calibration_tokens` a row,
    runs faster with the width rule than with NTP, else `settings.as_ntp()`. The calibration starts without a
    draft memory, so it can undersell `draft_memory`, whose drafts improve from batch to batch. Costs the
    compilation and the short decode of each, and a few hundred bare forwards."""
    from sbd_jax.decoding.generate import generate_batched

    first = prompts[:batch]
    costs = measure_pass_costs(model, first, batch, settings.max_new_tokens, settings.draft_nodes)
    tree = dataclasses.replace(settings, pass_costs=costs)
    short = dict(max_new_tokens=min(calibration_tokens, settings.max_new_tokens), temperature=0.0, top_p=1.0)
    runs = {}
    for name, s in (("ntp", settings.as_ntp()), ("tree", dataclasses.replace(tree, draft_memory=False))):
        generations, timing = generate_batched(dataclasses.replace(s, **short).decoder(model.config), model.params,
                                               first, batch)
        runs[name] = (sum(len(g.token_ids) for g in generations), sum(g.nfe for g in generations),
                      timing.decode_seconds)
    tokens, forwards, seconds = runs["tree"]
    speedup = runs["ntp"][2] / seconds  # greedy: both decoded the same tokens
    return WidthChoice(tree if speedup > 1 else settings.as_ntp(), costs, tokens / max(forwards, 1), speedup)

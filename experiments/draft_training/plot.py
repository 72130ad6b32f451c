"""The decision experiment's plot: each arm's drafts against the CPU time it trained, beside free lookup drafts.

    python -m experiments.draft_training.plot      # results.json -> results.png, beside this file

Left: verified tokens per forward at block 8 with SBD drafts (the rule's measure) at each measured point,
x = steps x the arm's own seconds per step; black: the winner's long runs (`long_run.py`), dotted: theirs
with SBD drafts at block 4 and 3 fallback blocks.
Right: the chance draft 1 is right (block 8, teacher-forced).
The dashed line is verified decoding with prompt-lookup drafts (no training) on the same 24 validation
prompts, from `benchmarks/results/hybrid_rule_cpu.json` (measured with the recipe's gated adapter, whose NTP
outputs are the base model's; lookup reads only the model's own NTP output, which every full fine-tune barely
moves: the paper arm's last model is in `results.json`).
"""

from __future__ import annotations

import json
import os

from experiments.draft_training.run import FALLBACK_KEY
from sbd_jax.decoding.drafts import Drafts

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LOOKUP = os.path.join(ROOT, "benchmarks", "results", "hybrid_rule_cpu.json")


def lookup_tokens_per_forward(block_size: int) -> float:
    with open(LOOKUP) as f:
        rows = json.load(f)["real_text"]
    return next(r["tokens_per_forward"] for r in rows if r["drafts"] == Drafts.LOOKUP and r["block_size"] == block_size)


def plot(results: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 5.5))
    for name, arm in results["arms"].items():
        minutes = [p["step"] * arm["seconds_per_step"] / 60 for p in arm["points"]]
        left.plot(minutes, [p["verified_sbd_8"] for p in arm["points"]], marker="o", label=name)
        right.plot(minutes, [100 * p["acceptance_8"][0] for p in arm["points"]], marker="o", label=name)
    for (name, run), marker in zip(results.get("long_runs", {}).items(), "sD^v"):  # the winner's (long_run.py)
        minutes = [p["step"] * run["seconds_per_step"] / 60 for p in run["points"]]
        for axis, values in ((left, [p["verified_sbd_8"] for p in run["points"]]),
                             (right, [100 * p["acceptance_8"][0] for p in run["points"]])):
            axis.plot(minutes, values, marker=marker, color="black",
                      label=f"long run {name} (adapter_lr10, {run['steps']} steps)")
        fallback = [(m, p[FALLBACK_KEY]) for m, p in zip(minutes, run["points"]) if FALLBACK_KEY in p]
        if fallback:  # measured since fallback blocks exist (older points back-filled)
            left.plot(*zip(*fallback), marker=marker, color="black", linestyle=":", markerfacecolor="none",
                      label=f"long run {name}, {FALLBACK_KEY}")
    left.axhline(lookup_tokens_per_forward(8), color="gray", linestyle="--", label="lookup drafts, block 8 (no training)")
    left.axhline(1.0, color="black", linewidth=0.5)
    left.set(xlabel="CPU minutes of training", ylabel="verified tokens per forward, SBD drafts",
             title="SBD drafts vs free lookup drafts")
    right.set(xlabel="CPU minutes of training", ylabel="draft 1 right (%)", title="first draft accepted")
    left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.17), ncol=2)  # below: clear of the data
    fig.suptitle(f"SmolLM2-135M, {results['sizes']['valid']} validation prompts, "
                 f"{results['sizes']['max_new']} new tokens, greedy (commit {results['provenance']['commit']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    with open(os.path.join(HERE, "results.json")) as f:
        plot(json.load(f), os.path.join(HERE, "results.png"))
    print(f"wrote {os.path.join(HERE, 'results.png')}")

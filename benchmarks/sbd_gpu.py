"""A trained SBD model on the machine at hand (written for one H200): accuracy, tokens per pass and
wall-clock tokens/s of NTP, plain SBD and verified SBD at batch 1, 8 and 32, then SBD training throughput.

    python -m benchmarks.sbd_gpu [--dtype bfloat16] [--problems 500] [--batches 1 8 32] [--train-steps 200]
    python -m benchmarks.sbd_gpu --smoke      # tiny sizes, any machine (the tests run it on CPU)
    python -m benchmarks.sbd_gpu --dry-run    # the plan: compiles, decode runs, an estimate of minutes

The model is the small-scale study's shipped SBD model (experiments/small_scale/models/sbd_arith, 3 MB,
trained on this project's CPUs on worked-step addition and code); SmolLM2's 98 MB GGUF does not fit the
device tool's 64 MiB a call. Settings: NTP; plain SBD at the γ per block that the study chose on its
validation problems (read from experiments/small_scale/results.json, never from these test problems);
verified SBD (drafts from one pass, output equal to NTP's). Problems: the study's test split.
Stages, each point written to --out as soon as it is measured, in the order that keeps the most valuable
numbers if the run is cut short: (1) accuracy and tokens per pass; (2) decoding tokens/s (compile excluded)
per batch size; (3) training: the SBD fine-tune step of this model on the task's problems (throughput
only: step seconds, tokens/s, MFU; the trained weights are not evaluated).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.evaluation.recorded import describe, record
from sbd_jax.evaluation.results import write_json
from sbd_jax.model.config import RUN_DTYPES, backend_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith")
BLOCKS = (4, 8, 16)


def chosen_settings() -> list[Settings]:
    """NTP, plain SBD at the study's validation-chosen γ per block (its speed settings), verified SBD."""
    with open(os.path.join(ROOT, "experiments", "small_scale", "results.json")) as f:
        study = json.load(f)
    chosen = sorted({(e["block_size"], e["gamma"]) for e in study["entries"]
                     if e["model"] == study["headline_model"] and e["split"] == "speed" and e["mode"] == Mode.SBD
                     and not e["verify"] and e["proxy"] == Proxy.ENTROPY})
    return ([Settings(mode=Mode.NTP)] + [Settings(mode=Mode.SBD, block_size=k, gamma=g) for k, g in chosen]
            + [Settings(mode=Mode.SBD, block_size=k, verify=True) for k in BLOCKS])


def plan(settings: list[Settings], batches: list[int], compile_seconds: float) -> dict:
    compiles = 2 * len(settings) * (1 + len(batches)) + 1  # prefill + decode per shape; the train step
    return {"settings": len(settings), "compiles": compiles, "estimated_minutes": compiles * compile_seconds / 60,
            "assumption": f"{compile_seconds:g} s per compile; decode runs and 200 train steps are seconds on an H200"}


def train_throughput(steps: int, dtype: str, batch: int, workdir: str) -> dict:
    """`steps` SBD fine-tuning steps of the model on the task's training problems (chat prompts)."""
    from sbd_jax.evaluation.arithmetic import problems
    from sbd_jax.training.config import default_config_dict
    from sbd_jax.training.trainer import Trainer

    data = os.path.join(workdir, "train.jsonl")
    with open(data, "w") as f:
        for p in problems(20 * batch, 5, seed=0):  # the study's training seed
            f.write(json.dumps({"messages": [{"role": "user", "content": p.question},
                                             {"role": "assistant", "content": p.answer}]}) + "\n")
    cfg = default_config_dict()
    cfg.model.name, cfg.model.dtype = MODEL, dtype
    cfg.data.files, cfg.data.seq_len, cfg.data.workers = (data,), 128, 0
    cfg.train.steps, cfg.train.batch_size, cfg.train.log_every = steps, batch, max(steps // 10, 1)
    cfg.checkpoint.every, cfg.export_hf = steps, False
    cfg.mesh = (1, 1, 1)
    run_dir = os.path.join(workdir, "run")
    Trainer(cfg, run_dir).run()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]  # the first step holds the compile
    median = sorted(r["seconds"] for r in rows)[len(rows) // 2]
    return {"steps": steps, "batch": batch, "seq_len": 128, "dtype": dtype, "median_step_seconds": median,
            "tokens_per_second": batch * 128 / median, "mfu": sorted(r.get("mfu", 0.0) for r in rows)[len(rows) // 2],
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default=None, choices=RUN_DTYPES,
                        help="default: bfloat16 on a GPU or TPU, float32 on a CPU")
    parser.add_argument("--problems", type=int, default=500, help="test problems for accuracy")
    parser.add_argument("--speed-problems", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks every stage")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--compile-seconds", type=float, default=3.0, help="--dry-run's assumption per compile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.problems, args.speed_problems, args.batches, args.train_steps, args.train_batch = 4, 2, [1, 2], 3, 4
    settings = chosen_settings()
    if args.dry_run:
        print("sbd plan:", json.dumps(plan(settings, args.batches, args.compile_seconds)))
        return

    import jax

    from experiments.small_scale.task import STUDY, study_splits
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.evaluation.measure import (
        EvaluatedModel,
        arithmetic_metrics,
        tokens_per_second,
    )

    dtype = args.dtype or backend_dtype(jax.default_backend())
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"sbd_{jax.devices()[0].platform}.json")
    loaded = load_model(MODEL, dtype=dtype)
    model = EvaluatedModel("sbd_arith", loaded.config, jax.device_put(loaded.params), loaded.tokenizer)
    test = study_splits().test
    result = {"command": "python -m benchmarks.sbd_gpu " + " ".join(sys.argv[1:]), "device": str(jax.devices()[0]),
              "jax": jax.__version__, "dtype": dtype, "model": "experiments/small_scale/models/sbd_arith",
              "accuracy": [], "speed": [], "train": None}
    began = time.perf_counter()
    for setting in settings:
        metrics = arithmetic_metrics(model, setting, test[: args.problems], STUDY["max_new_tokens"], batch_size=64)
        result["accuracy"].append({**record(setting), **{k: metrics[k] for k in ("n", "accuracy", "ci95", "tokens_per_pass",
                                                                         "accepted_fraction")}})
        write_json(out, result)
        print(f"{describe(record(setting))} k={setting.block_size} γ={setting.gamma}: accuracy {metrics['accuracy']:.3f}, "
              f"{metrics['tokens_per_pass']:.2f} tokens/pass", flush=True)
    speed_problems = test[: args.speed_problems]
    for batch in args.batches:
        for setting in settings:
            tokens_per_second(model, setting, speed_problems[:batch], STUDY["max_new_tokens"], batch, 1)  # compile
            rate, with_prefill = tokens_per_second(model, setting, speed_problems, STUDY["max_new_tokens"], batch, 3)
            result["speed"].append({**record(setting), "batch": batch, "problems": len(speed_problems),
                                    "decode_tokens_per_second": rate, "tokens_per_second_with_prefill": with_prefill})
            ntp = next(r for r in result["speed"] if r["batch"] == batch and r["mode"] == Mode.NTP)
            result["speed"][-1]["decode_vs_ntp"] = rate / ntp["decode_tokens_per_second"]
            write_json(out, result)
            print(f"batch {batch} {describe(record(setting))} k={setting.block_size}: {rate:.0f} tokens/s "
                  f"({result['speed'][-1]['decode_vs_ntp']:.2f}x NTP)", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        result["train"] = train_throughput(args.train_steps, dtype, args.train_batch, workdir)
    result["seconds"] = time.perf_counter() - began
    write_json(out, result)
    print(f"train: {result['train']['median_step_seconds'] * 1e3:.1f} ms/step, "
          f"{result['train']['tokens_per_second']:.0f} tokens/s; wrote {out}", flush=True)


if __name__ == "__main__":
    main()

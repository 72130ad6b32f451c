"""A real pretrained model turned into an SBD model on a CPU: SmolLM2-135M-Instruct on worked-step addition.

    python -m experiments.smollm2_arith.run --workdir runs/smollm2_arith      # about 2 h on a 2-core CPU (resumable)
    python -m experiments.smollm2_arith.run --workdir runs/smollm2_arith --train-only
    python -m experiments.smollm2_arith.run --workdir /tmp/smoke --smoke --base DIR   # toy sizes (the tests)

Stage 1 fine-tunes the base model with next-token loss on the addition task of
sbd_jax/evaluation/arithmetic.py; stage 2 fine-tunes stage 1 with the SBD objective (the
paper's setting: an NTP model first). Problems are plain prompts, `question=` then the worked answer
(`prompt` / `completion` records, loss on the answer and its EOS): 65 tokens a problem on average
against 95 through SmolLM2's chat template, whose default system prompt is 30 tokens of every row.
Evaluation (greedy): whole-answer exact match on held-out test problems for the base model, stage 1,
stage 2 in NTP mode, stage 2 in SBD mode (γ chosen per block on a validation split) and verified SBD;
tokens per pass; wall-clock tokens/s at batch 1 and 8 against stage 2's own NTP decoding, with
time(k)/time(1) of this model on this CPU and on an H100 (roofline) beside it.
Training resumes from its checkpoints (Orbax); finished evaluations are cached in --workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.evaluation.recorded import cache_key, describe, record
from sbd_jax.evaluation.results import write_json
from sbd_jax.evaluation.scoring import find, one

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

FULL = dict(train_problems=20000, valid_problems=200, test_problems=1000, max_digits=5, seq_len=128, batch=8,
            stage1_steps=250, stage2_steps=300, lr=3e-4, warmup=20, max_new_tokens=72, eval_batch=100,
            block_sizes=(4, 8, 16), gammas=(0.0, 0.1, 0.35, 0.6, 1.0), verify_problems=1000,
            speed_problems=16)
SMOKE = dict(train_problems=200, valid_problems=6, test_problems=8, max_digits=2, seq_len=64, batch=4,
             stage1_steps=3, stage2_steps=3, lr=1e-3, warmup=1, max_new_tokens=16, eval_batch=4,
             block_sizes=(4,), gammas=(0.0, 1.0), verify_problems=4, speed_problems=2)


def plain_prompt(tokenizer, question: str) -> list[int]:
    """The prompt the recipe trains on and decodes from: the question and '=', as raw text."""
    from sbd_jax.checkpoints.tokenizer import encode_prompt

    return encode_prompt(tokenizer, question + "=", chat=False)


def write_data(out: str, sizes: dict) -> dict:
    """Training problems as prompt/completion JSONL; validation and test problems disjoint from them."""
    from sbd_jax.evaluation.arithmetic import splits

    os.makedirs(out, exist_ok=True)
    train, valid, test = splits(sizes["train_problems"], sizes["valid_problems"], sizes["test_problems"],
                                sizes["max_digits"])
    path = os.path.join(out, "train.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p.question + "=", "completion": p.answer}) + "\n" for p in train)
    return {"train_file": path, "valid": valid, "test": test}


def stage_config(stage: int, model: str, train_file: str, sizes: dict):
    """Stage 1: NTP fine-tune of `model`; stage 2: SBD fine-tune of stage 1 (a new mask-token row).
    Float32, unrolled layers, no remat: the fastest settings on a CPU (benchmarks/cpu_train_levers.py)."""
    from sbd_jax.training.config import ObjectiveKind, default_config_dict

    c = default_config_dict()
    c.seed = stage  # stage 2 sees the problems in another order
    c.model.name = model
    c.data.files = (train_file,)
    c.data.seq_len = sizes["seq_len"]
    c.objective.kind = ObjectiveKind.NTP if stage == 1 else ObjectiveKind.SBD
    c.objective.block_size_max = min(16, sizes["seq_len"] // 2)
    c.train.steps = sizes[f"stage{stage}_steps"]
    c.train.batch_size = sizes["batch"]
    c.optimizer.lr = sizes["lr"]
    c.optimizer.warmup_steps = sizes["warmup"]
    c.checkpoint.every = max(c.train.steps // 5, 1)  # a kill loses at most a fifth of a stage
    c.checkpoint.keep = 1
    return c


def train_stage(stage: int, model: str, train_file: str, sizes: dict, workdir: str) -> dict:
    from sbd_jax.training.trainer import Trainer

    run_dir = os.path.join(workdir, f"stage{stage}")
    if not os.path.exists(os.path.join(run_dir, "hf", "config.json")):
        Trainer(stage_config(stage, model, train_file, sizes), run_dir).run()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"hf": os.path.join(run_dir, "hf"), "seconds": sum(r["seconds"] + r["compile_seconds"] for r in rows),
            "curve": [{k: r[k] for k in ("step", "ntp_loss", "matp_loss")} for r in rows]}


def load(name: str, spec: str, scan_layers: bool):
    """A model for evaluation: scanned layers compile each decoder in a fraction of the time (accuracy
    runs); unrolled layers for wall-clock (no per-layer slicing of stacked weights)."""
    import jax

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.evaluation.measure import EvaluatedModel

    loaded = load_model(spec, scan_layers=scan_layers)
    return EvaluatedModel(name, loaded.config, jax.device_put(loaded.params), loaded.tokenizer)


def choose_gamma(entries: list[dict], block_size: int) -> float | None:
    """The γ with the most tokens per pass within 1 point of stage 2's NTP accuracy on validation,
    among γ > 0 (γ 0 reveals one token per pass: no fewer passes than NTP); None if there is none."""
    ntp = one(entries, model="stage2", mode=Mode.NTP, split="valid")
    within = [e for e in find(entries, model="stage2", mode=Mode.SBD, verify=False, split="valid", block_size=block_size)
              if e["gamma"] > 0 and e["accuracy"] >= ntp["accuracy"] - 0.01]
    return max(within, key=lambda e: e["tokens_per_pass"])["gamma"] if within else None


class Evaluations:
    """Entries (one per model x setting x split), each computed once and cached in a JSON file."""

    def __init__(self, path: str, sizes: dict, data: dict):
        from sbd_jax.evaluation.entries import EntryCache

        self.sizes, self.data, self.cache = sizes, data, EntryCache(path)

    def get(self, model, setting: Settings, split: str, limit: int | None = None) -> dict:
        """The entry of `model` decoding the split's problems (the first `limit` of them) with `setting`."""
        from sbd_jax.evaluation.measure import arithmetic_metrics

        problems = self.data[split][:limit]
        key = f"{model.name}|{cache_key(setting)}|{split}|{len(problems)}"

        def compute() -> dict:
            metrics = arithmetic_metrics(model, setting, problems, self.sizes["max_new_tokens"],
                                         prompt=plain_prompt, batch_size=self.sizes["eval_batch"])
            return {"model": model.name, **record(setting), "split": split, **metrics, "batch": self.sizes["eval_batch"]}

        def line(e: dict) -> str:
            return (f"{e['model']:>7} {split:>5} {describe(e):>12} k={e['block_size']:>2} γ={e['gamma']}: whole "
                    f"{e['accuracy']:.3f} final {e['accuracy_final_number']:.3f}, {e['tokens_per_pass']:.2f} tokens/pass")

        return self.cache.get(key, compute, line)


def evaluate(models: dict, evaluations: Evaluations, sizes: dict) -> list[dict]:
    """NTP on test for every model; stage 2's SBD grid on validation, its γ per block on test, and
    verified SBD (verification decides what is kept: no γ) on the first
    `verify_problems` test problems (all of them in the full run)."""
    entries = [evaluations.get(models[m], Settings.ntp(), "test") for m in ("stage1", "stage2")]
    entries.append(evaluations.get(models["stage2"], Settings.ntp(), "valid"))
    for k in sizes["block_sizes"]:
        entries += [evaluations.get(models["stage2"], Settings.plain_sbd(k, g), "valid") for g in sizes["gammas"]]
    for k in sizes["block_sizes"]:
        gamma = choose_gamma(entries, k)
        if gamma is not None:
            entries.append(evaluations.get(models["stage2"], Settings.plain_sbd(k, gamma), "test"))
    for k in sizes["block_sizes"]:
        entries.append(evaluations.get(models["stage2"], Settings.verified(k), "test", sizes["verify_problems"]))
    entries.append(evaluations.get(models["base"], Settings.ntp(), "test"))  # last: the slowest, no EOS learned
    return entries


def speed(model, entries: list[dict], sizes: dict, test: list) -> list[dict]:
    """Decoding tokens/s of stage 2 at batch 1 and 8: NTP, SBD at each block's chosen γ and verified
    SBD, in this one run; time(k)/time(1) of one forward on this CPU and on an H100 (roofline)."""
    from sbd_jax.decoding.timing import forward_cost_ratio
    from sbd_jax.evaluation.measure import tokens_per_second
    from sbd_jax.roofline import lookup, slowdown

    h100, shape = lookup("h100-bf16", "smollm2-135m")
    settings = [Settings.ntp()]
    for k in sizes["block_sizes"]:
        gamma = choose_gamma(entries, k)
        settings += [Settings.plain_sbd(k, gamma)] if gamma is not None else []
        settings.append(Settings.verified(k))
    problems, context = test[: sizes["speed_problems"]], 64  # a prompt and the first answer tokens
    out = []
    for batch in (1, 8):
        for setting in settings:
            rate, with_prefill = tokens_per_second(model, setting, problems, sizes["max_new_tokens"], batch,
                                                   repeats=1, prompt=plain_prompt)
            row = record(setting)
            k = row["block_size"]
            cost = forward_cost_ratio(model, k, context=context, calls=20) if k > 1 else 1.0
            out.append({"model": "stage2", **row, "split": "speed", "n": len(problems), "batch": batch,
                        "tokens_per_second": rate, "tokens_per_second_with_prefill": with_prefill,
                        "forward_cost_ratio_cpu": cost,
                        "forward_cost_ratio_h100_roofline": slowdown(h100, shape, batch, k, context)})
            print(f"speed batch {batch} {describe(row)} k={k} γ={row['gamma']}: {rate:.1f} tokens/s "
                  f"({with_prefill:.1f} with prefill), time(k)/time(1) {cost:.2f} CPU, "
                  f"{out[-1]['forward_cost_ratio_h100_roofline']:.2f} H100", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="data, checkpoints, cached evaluations (resumable)")
    parser.add_argument("--base", default="smollm2-135m", help="known name, HF directory or GGUF file")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: checks every stage in about a minute")
    parser.add_argument("--train-only", action="store_true", help="train (or resume) both stages, then stop")
    parser.add_argument("--results", default=None, help="where results.{json,md} and the plot go "
                        "(default: this folder; with --smoke, --workdir)")
    args = parser.parse_args()
    began = time.perf_counter()
    sizes = SMOKE if args.smoke else FULL
    data = write_data(os.path.join(args.workdir, "data"), sizes)
    stages = {"stage1": train_stage(1, args.base, data["train_file"], sizes, args.workdir)}
    stages["stage2"] = train_stage(2, stages["stage1"]["hf"], data["train_file"], sizes, args.workdir)
    if args.train_only:
        return

    import jax

    from experiments.smollm2_arith.report import write_report

    models = {"base": load("base", args.base, True), **{n: load(n, s["hf"], True) for n, s in stages.items()}}
    evaluations = Evaluations(os.path.join(args.workdir, "entries.json"), sizes, data)
    entries = evaluate(models, evaluations, sizes)
    del models
    entries += speed(load("stage2", stages["stage2"]["hf"], False), entries, sizes, data["test"])
    results = {
        "command": "python -m experiments.smollm2_arith.run --workdir runs/smollm2_arith" + (" --smoke" if args.smoke else ""),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "jax": jax.__version__, "device": str(jax.devices()[0])},
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        "runtime_seconds": {"train": {name: s["seconds"] for name, s in stages.items()},
                            "total_this_invocation": time.perf_counter() - began},
        "loss_curves": {name: s["curve"] for name, s in stages.items()},
        "entries": entries,
    }
    out = args.results or (args.workdir if args.smoke else HERE)
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "results.json"), results)
    write_report(results, out)
    print(f"wrote {out}/results.json, results.md and accuracy_vs_passes.png")


if __name__ == "__main__":
    main()

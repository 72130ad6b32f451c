"""The whole recipe, one command: self-distilled data -> SBD fine-tune -> evaluation against the base model.

    python recipes/smollm2_sbd/run.py --workdir runs/smollm2_sbd     # sized for one H200 (~8 min; not yet measured)
    python recipes/smollm2_sbd/run.py --workdir runs/cpu --cpu      # a few hundred small steps on a CPU
    python recipes/smollm2_sbd/run.py --workdir /tmp/smoke --smoke  # toy sizes: checks every stage

Stages skip what is already done in --workdir: distilled data is reused, training resumes from its
last checkpoint (Orbax), evaluation always reruns. Any Llama/Qwen HF directory works as --base (with
--config configs/llama3_8b.py or configs/qwen3_8b.py for 8B models: their mesh, remat and optimizer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# prompts, answer_tokens: distillation; steps, batch, seq_len: training (GPU: the config's own);
# problems, heldout (None = all), max_new: evaluation.
GPU = dict(prompts=4000, answer_tokens=256, keep_unfinished=False, distill_batch=128,
           problems=None, heldout=None, max_new=256, eval_batch=64, gammas=(0.1, 0.35, 0.6, 1.0), block=16)
CPU = dict(prompts=320, answer_tokens=96, keep_unfinished=False, distill_batch=32, steps=200, batch=2, seq_len=128,
           problems=8, heldout=8, max_new=96, eval_batch=8, gammas=(0.1, 0.35, 0.6, 1.0), block=16)
# Smoke answers are too short to finish: keep them anyway, so there is something to train on.
SMOKE = dict(prompts=12, answer_tokens=12, keep_unfinished=True, distill_batch=12, steps=2, batch=2, seq_len=64,
             problems=2, heldout=2, max_new=12, eval_batch=2, gammas=(0.35,), block=4)


def distill(base: str, out: str, sizes: dict, dtype: str) -> dict:
    import jax

    from recipes.smollm2_sbd.distill import chat_answers, write_distilled
    from recipes.smollm2_sbd.prompts import make_prompts
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.decoders import NTPDecoder

    model = load_model(base, dtype=dtype)
    prompts = make_prompts(sizes["prompts"], seed=0)
    decoder = NTPDecoder(model.config, max_new_tokens=sizes["answer_tokens"], eos_ids=model.config.eos_token_ids)
    answers, generations = chat_answers(decoder, jax.device_put(model.params), model.tokenizer, prompts,
                                        sizes["distill_batch"])
    return write_distilled(out, prompts, answers, generations, model.config.eos_token_ids, sizes["keep_unfinished"])


def load_config(path: str):
    """`get_config()` of a config file (configs/*.py): its optimizer, mesh, remat and objective settings."""
    import importlib.util

    from sbd_jax.errors import UserError

    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist; use one of configs/*.py")
    spec = importlib.util.spec_from_file_location("recipe_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def train(config: str, base: str, data: str, workdir: str, sizes: dict, dtype: str) -> list[dict]:
    from sbd_jax.trainer import Trainer

    cfg = load_config(config)
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
        cfg.checkpoint.every = max(cfg.train.steps // 4, 1)
    Trainer(cfg, workdir).run()
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--base", default="smollm2-135m", help="known name, HF directory or GGUF file")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2_135m.py"),
                        help="training config file; the recipe sets its model, data, steps, batch and seq_len")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--cpu", action="store_true", help="CPU sizes: small batches, a subset of the evaluation")
    size.add_argument("--smoke", action="store_true", help="toy sizes: checks every stage")
    parser.add_argument("--steps", type=int, default=None, help="override the number of training steps")
    args = parser.parse_args(argv)

    import jax

    sizes = dict(SMOKE if args.smoke else CPU if args.cpu else GPU)
    if args.steps:
        sizes["steps"] = args.steps
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    data, train_dir, results = (os.path.join(args.workdir, d) for d in ("data", "train", "results"))
    seconds = {}
    began = time.perf_counter()
    if not os.path.exists(os.path.join(data, "train.jsonl")):
        print("distill:", distill(args.base, data, sizes, dtype), flush=True)
    seconds["distill"] = time.perf_counter() - began
    curve = train(args.config, args.base, data, train_dir, sizes, dtype)
    seconds["train"] = time.perf_counter() - began - seconds["distill"]
    from recipes.smollm2_sbd import eval as evaluation

    argv = ["--base", args.base, "--tuned", os.path.join(train_dir, "hf"), "--heldout",
            os.path.join(data, "heldout.jsonl"), "--out", results, "--gammas", *map(str, sizes["gammas"]),
            "--block-size", str(sizes["block"]), "--max-new-tokens", str(sizes["max_new"]),
            "--batch-size", str(sizes["eval_batch"]), "--dtype", dtype]
    argv += ["--problems", str(sizes["problems"])] if sizes["problems"] else []
    argv += ["--heldout-prompts", str(sizes["heldout"])] if sizes["heldout"] else []
    evaluation.main(argv)
    seconds["eval"] = time.perf_counter() - began - seconds["distill"] - seconds["train"]
    first, last = curve[: max(len(curve) // 10, 1)], curve[-max(len(curve) // 10, 1):]
    summary = {"sizes": sizes, "seconds": seconds, "dtype": dtype, "device": str(jax.devices()[0]),
               "loss_first_tenth": {k: sum(r[k] for r in first) / len(first) for k in ("ntp_loss", "matp_loss")},
               "loss_last_tenth": {k: sum(r[k] for r in last) / len(last) for k in ("ntp_loss", "matp_loss")}}
    with open(os.path.join(results, "run.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

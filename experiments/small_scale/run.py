"""Small-scale evidence for SBD on a CPU: tiny models trained on the same data, evaluated side by side.

    python experiments/small_scale/run.py            # ~45 min on 2 CPU cores; writes results.{json,md}, *.png here
    python experiments/small_scale/run.py --smoke    # about a minute: the same pipeline on toy sizes (tests run it)

Trains NTP-only, SBD (NTP + MATP) and SBD without the NTP term from scratch on the same data
(worked-step addition chats + standard-library code), steps and seed, then SBD fine-tuned from the
trained NTP model (the paper's setting) for half as many steps. Measures held-out NTP loss,
arithmetic exact match and code continuation for NTP decoding and SBD decoding over block size x γ.
Training checkpoints live in --workdir, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

FULL = dict(steps=1200, batch_size=16, seq_len=128, train_problems=40000, test_problems=500, max_digits=5,
            code_chars=500_000, heldout_code_chars=100_000, code_prompts=64, prompt_chars=96,
            code_new_tokens=64, max_new_tokens=72, block_sizes=(4, 8, 16),
            gammas=(0.0, 0.1, 0.2, 0.35, 0.6, 1.0, 1.5))
SMOKE = dict(steps=6, batch_size=4, seq_len=64, train_problems=300, test_problems=12, max_digits=3,
             code_chars=6000, heldout_code_chars=3000, code_prompts=3, prompt_chars=32, code_new_tokens=16,
             max_new_tokens=40, block_sizes=(2, 4), gammas=(0.0, 1.0))


def train(variant: str, sizes: dict, corpus, tokenizer_dir: str, workdir: str, smoke: bool):
    """Trains (or resumes) one model; returns it and its whole loss curve."""
    import jax

    from experiments.small_scale.config import get_config
    from experiments.small_scale.evaluate import Trained
    from sbd_jax.trainer import Trainer

    cfg = get_config(variant, files=corpus.train_files, tokenizer=tokenizer_dir, steps=sizes["steps"],
                     batch_size=sizes["batch_size"], seq_len=sizes["seq_len"], smoke=smoke,
                     ntp_model=os.path.join(workdir, "runs", "ntp", "hf"))
    cfg.objective.block_size_max = max(sizes["block_sizes"])
    trainer = Trainer(cfg, os.path.join(workdir, "runs", variant))
    trainer.run()
    with open(os.path.join(workdir, "runs", variant, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    curve = [{key: row[key] for key in ("step", "ntp_loss", "matp_loss")} for row in rows]
    seconds = sum(row["seconds"] + row["compile_seconds"] for row in rows)  # also right for a resumed run
    return Trained(variant, trainer.config, jax.device_get(trainer.state.params), trainer.tokenizer), curve, seconds


def evaluate_all(models: dict, corpus, sizes: dict) -> list[dict]:
    """One entry per model x decoding setting: arithmetic metrics and code-continuation metrics."""
    from experiments.small_scale import evaluate as ev

    scorer = models["ntp"]
    entries = []
    for name, model in models.items():
        prompts = ev.code_prompts(corpus.heldout_code, model.tokenizer, sizes["code_prompts"],
                                  sizes["prompt_chars"], seed=0)
        reference = None
        for setting, decoder in ev.decoders(model, sizes["max_new_tokens"], sizes["block_sizes"], sizes["gammas"]):
            began = time.perf_counter()
            entry = {"model": name, **setting, **ev.arithmetic_metrics(model, decoder, corpus.test_problems)}
            code_decoder = dataclasses.replace(decoder, max_new_tokens=sizes["code_new_tokens"])
            outputs, per_pass = ev.code_continuations(model, code_decoder, prompts)
            reference = outputs if reference is None else reference  # the NTP-mode output comes first
            entry.update(code_tokens_per_pass=per_pass, code_agreement_with_ntp=ev.agreement(outputs, reference),
                         code_ntp_model_logprob=ev.mean_logprob(scorer, prompts, outputs),
                         seconds=time.perf_counter() - began)
            print(f"{name:>10} {setting['mode']} k={setting['block_size']:>2} gamma={setting['gamma']}: "
                  f"accuracy {entry['accuracy']:.3f}, {entry['tokens_per_pass']:.2f} tokens/pass, code "
                  f"{per_pass:.2f} tokens/pass, agreement {entry['code_agreement_with_ntp']:.3f}", flush=True)
            entries.append(entry)
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes: checks the pipeline in seconds")
    parser.add_argument("--workdir", default="/tmp/sbd_small_scale", help="data, checkpoints (resumable)")
    parser.add_argument("--results", default=None, help="where results.{json,md} and plots go "
                        "(default: this folder; with --smoke, --workdir)")
    args = parser.parse_args()
    began = time.perf_counter()

    import jax

    from experiments.small_scale import evaluate as ev
    from experiments.small_scale.char_tokenizer import save_char_tokenizer
    from experiments.small_scale.config import VARIANTS
    from experiments.small_scale.corpus import build_corpus
    from experiments.small_scale.report import write_report

    sizes = SMOKE if args.smoke else FULL
    results_dir = args.results or (args.workdir if args.smoke else HERE)
    os.makedirs(results_dir, exist_ok=True)
    tokenizer_dir = save_char_tokenizer(os.path.join(args.workdir, "tokenizer"))
    corpus = build_corpus(os.path.join(args.workdir, "data"), train_problems=sizes["train_problems"],
                          test_problems=sizes["test_problems"], max_digits=sizes["max_digits"],
                          code_chars=sizes["code_chars"], heldout_code_chars=sizes["heldout_code_chars"], seed=0)
    models, curves, train_seconds = {}, {}, {}
    for variant in VARIANTS:
        models[variant], curves[variant], train_seconds[variant] = train(variant, sizes, corpus, tokenizer_dir,
                                                                         args.workdir, args.smoke)
    heldout = {name: {"arithmetic": ev.heldout_ntp_loss(m, corpus.heldout_files[:1], sizes["seq_len"]),
                      "code": ev.heldout_ntp_loss(m, corpus.heldout_files[1:], sizes["seq_len"])}
               for name, m in models.items()}
    entries = evaluate_all(models, corpus, sizes)
    results = {
        "command": "python experiments/small_scale/run.py" + (" --smoke" if args.smoke else ""),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
                    "device": str(jax.devices()[0])},
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
        "parameters": {name: int(sum(x.size for x in jax.tree.leaves(m.params))) for name, m in models.items()},
        # train: step + compile seconds from each run's log; total: this invocation (less if runs resumed)
        "runtime_seconds": {"train": train_seconds, "total": time.perf_counter() - began},
        "heldout_ntp_loss": heldout,
        "loss_curves": curves,
        "entries": entries,
    }
    with open(os.path.join(results_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_report(results, results_dir)
    print(f"wrote {results_dir}/results.json, results.md and plots in {results['runtime_seconds']['total']:.0f} s")


if __name__ == "__main__":
    main()

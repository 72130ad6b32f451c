"""Base model (NTP) vs its SBD fine-tune (NTP mode, and SBD over γ at one block size), on what users
care about: HumanEval pass@1, exact agreement with the base model's answers on held-out prompts,
tokens per pass, and wall-clock tokens/s at batch 1 and 8. Greedy decoding throughout.

    python recipes/smollm2_sbd/eval.py --tuned runs/smollm2_sbd/train/hf [--base smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

GAMMAS = (0.1, 0.35, 0.6, 1.0)


def settings(base: Any, tuned: Any, gammas: Sequence[float], block_size: int, max_new_tokens: int) -> list[tuple]:
    """(row label, model, decoder) for base NTP, fine-tuned NTP, and fine-tuned SBD at each γ."""
    from sbd_jax.decoders import NTPDecoder, SBDDecoder

    def common(model):
        return dict(max_new_tokens=max_new_tokens, eos_ids=model.config.eos_token_ids)

    rows = [({"model": "base", "mode": "ntp", "gamma": None}, base, NTPDecoder(base.config, **common(base))),
            ({"model": "sbd-tuned", "mode": "ntp", "gamma": None}, tuned, NTPDecoder(tuned.config, **common(tuned)))]
    rows += [({"model": "sbd-tuned", "mode": "sbd", "gamma": g}, tuned,
              SBDDecoder(tuned.config, block_size=block_size, **common(tuned))) for g in gammas]
    return rows


def tokens_per_second(decoder: Any, model: Any, prompts: Sequence[str], batch: int, gamma: float,
                      repeats: int = 2) -> float:
    """Generated tokens / wall seconds (prefill + decode, compile excluded) over `prompts`, `batch` at a time."""
    from sbd_jax.sampler import generate
    from sbd_jax.tokenizer import encode_prompt

    encoded = [encode_prompt(model.tokenizer, p, chat=True) for p in prompts]
    tokens = seconds = 0.0
    for start in range(0, len(encoded), batch):
        runs = [generate(decoder, model.params, encoded[start: start + batch], gamma=gamma) for _ in range(repeats)]
        results, timing = min(runs, key=lambda r: r[1].seconds)
        tokens += sum(len(r.token_ids) for r in results)
        seconds += timing.seconds
    return tokens / seconds


def evaluate(base: Any, tuned: Any, heldout: list[dict], problems: list[dict], *, gammas: Sequence[float],
             block_size: int, max_new_tokens: int, batch_size: int, timing_prompts: int) -> list[dict]:
    from recipes.smollm2_sbd.distill import chat_answers
    from recipes.smollm2_sbd.humaneval import INSTRUCTION, completion_from_answer, pass_rate
    from sbd_jax.sampler import tokens_per_pass

    coding = [INSTRUCTION.format(prompt=p["prompt"]) for p in problems]
    timing = [h["prompt"] for h in heldout[:timing_prompts]]
    rows = []
    for label, model, decoder in settings(base, tuned, gammas, block_size, max_new_tokens):
        gamma = label["gamma"] or 0.0
        answers, code_gens = chat_answers(decoder, model.params, model.tokenizer, coding, batch_size, gamma)
        passed = pass_rate([p["task_id"] for p in problems], [completion_from_answer(a) for a in answers])
        held, held_gens = chat_answers(decoder, model.params, model.tokenizer, [h["prompt"] for h in heldout],
                                       batch_size, gamma)
        row = {**label, "block_size": block_size if label["mode"] == "sbd" else 1,
               "humaneval_pass_at_1": sum(passed) / len(passed), "humaneval_problems": len(passed),
               "agreement_with_base": sum(a == h["answer"] for a, h in zip(held, heldout)) / len(heldout),
               "tokens_per_pass": tokens_per_pass(code_gens + held_gens),
               "tokens_per_s_batch1": tokens_per_second(decoder, model, timing[:4], 1, gamma),
               "tokens_per_s_batch8": tokens_per_second(decoder, model, timing, 8, gamma)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    reference = next(r for r in rows if r["model"] == "sbd-tuned" and r["mode"] == "ntp")
    for row in rows:
        row["speedup_batch1"] = row["tokens_per_s_batch1"] / reference["tokens_per_s_batch1"]
        row["speedup_batch8"] = row["tokens_per_s_batch8"] / reference["tokens_per_s_batch8"]
    return rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| model | mode | γ | HumanEval pass@1 | agreement with base | tokens/pass | tok/s b1 | "
             "speedup b1 | tok/s b8 | speedup b8 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {'' if r['gamma'] is None else r['gamma']} | "
                     f"{r['humaneval_pass_at_1']:.1%} ({r['humaneval_problems']}) | {r['agreement_with_base']:.1%} | "
                     f"{r['tokens_per_pass']:.2f} | {r['tokens_per_s_batch1']:.1f} | {r['speedup_batch1']:.2f}x | "
                     f"{r['tokens_per_s_batch8']:.1f} | {r['speedup_batch8']:.2f}x |")
    lines += ["", "Speedups are wall clock against the fine-tuned model's own NTP decoding, same prompts and batch."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--tuned", required=True, help="the fine-tune's HF directory (train workdir/hf)")
    parser.add_argument("--heldout", required=True, help="heldout.jsonl written by the recipe's distillation")
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--gammas", type=float, nargs="+", default=list(GAMMAS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--problems", type=int, default=None, help="first N HumanEval problems (default all 164)")
    parser.add_argument("--heldout-prompts", type=int, default=None, help="first N held-out prompts (default all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU/TPU, float32 on CPU")
    args = parser.parse_args(argv)

    import jax

    from recipes.smollm2_sbd.humaneval import problems
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.jsonl import iter_jsonl

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    base, tuned = (load_model(spec, dtype=dtype) for spec in (args.base, args.tuned))
    base, tuned = (m._replace(params=jax.device_put(m.params)) for m in (base, tuned))
    heldout = [record for _, record in iter_jsonl(args.heldout)][: args.heldout_prompts]
    rows = evaluate(base, tuned, heldout, problems(args.problems), gammas=args.gammas, block_size=args.block_size,
                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, timing_prompts=8)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "dtype": dtype, "rows": rows}, f, indent=1)
    header = (f"# SmolLM2-135M-Instruct -> SBD: evaluation\n\nDevice: {jax.devices()[0]}, {dtype}; block "
              f"{args.block_size}; {len(heldout)} held-out prompts; max {args.max_new_tokens} new tokens.")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(rows, header))
    print(markdown(rows, header))


if __name__ == "__main__":
    main()

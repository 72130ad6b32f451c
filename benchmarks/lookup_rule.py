"""Which prompt-lookup rule verified decoding should use: replayed on the real-text study's greedy outputs.

    python -m benchmarks.lookup_rule            # writes benchmarks/results/lookup_rule.json

Verification keeps the output fixed (greedy: NTP's tokens), so a draft source's tokens per forward on a
prompt follows from the prompt, the output and the rule alone: `sbd_jax.decoding.lookup.replay_lookup` replays it
with no model. Outputs: the committed greedy NTP outputs of the recipe `recipes/smollm2_sbd` (the base
SmolLM2 and its SBD fine-tune) on the *validation* prompts (the rule is chosen there) and, reported beside
it, on the held-out test prompts and HumanEval. Rules: the latest or the earliest earlier occurrence;
n-grams from 1..MAX down to 1 for MAX = 1..4; with or without the periodic extension (a match P tokens
back whose continuation runs out is read as a repeat with period P). Block k proposes up to k - 1 drafts
a forward, as the decoder does. Tokens per forward is EAGLE's τ: accepted drafts + 1 per forward.

Then, for the chosen rule, the shortest match that proposes drafts (`lookup_min_match` 1..4): tokens per
forward, passes that carry drafts, and the batch-1 decode speed-up over NTP this CPU predicts from them
(a drafting pass costs time(k)/time(1) one-token passes, measured by `benchmarks/lookup_decode.py`; the
others run one token). Chosen on validation; `benchmarks/lookup_decode.py --parts speed` measures it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from sbd_jax.decoding.settings import Mode
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = os.path.join(ROOT, "recipes", "smollm2_sbd", "results", "cpu_paper_objective", "entries.json")
DATA = os.path.join(ROOT, "recipes", "smollm2_sbd", "data", "cpu")
BLOCK_SIZES = (4, 8, 16)


def split_prompts(tokenizer, split: str, count: int) -> list[list[int]]:
    """The chat-encoded prompts of a split, as the recipe's evaluation encoded them."""
    from recipes.smollm2_sbd.humaneval import problems
    from recipes.smollm2_sbd.inputs import chat, humaneval_prompts
    from sbd_jax.data.jsonl import iter_jsonl

    if split == "humaneval":
        texts = [p.question for p in humaneval_prompts(problems(count))]
    else:
        texts = [row["prompt"] for _, row in iter_jsonl(os.path.join(DATA, f"{split}.jsonl"))][:count]
    return [chat(tokenizer, t) for t in texts]


def ntp_outputs(entries: dict, model: str, split: str) -> list[list[int]] | None:
    """`model`'s greedy NTP outputs on `split` in the recipe's entries (None if it has none)."""
    for entry in entries.values():
        if entry.get("model") == model and entry.get("mode") == Mode.NTP and entry.get("split") == split:
            return entry["outputs"]
    return None


def replay(prompts, outputs, k: int, max_new_tokens: int, **rule) -> dict:
    from sbd_jax.decoding.lookup import replay_lookup

    totals = [replay_lookup(p, o, k - 1, max_new_tokens, **rule) for p, o in zip(prompts, outputs)]
    forwards, drafted, accepted, drafting = (sum(column) for column in zip(*totals))
    tokens = sum(map(len, outputs))
    return {"tokens_per_forward": tokens / forwards, "accepted_fraction": accepted / max(drafted, 1),
            "forwards": forwards, "drafting_passes": drafting, "tokens": tokens}


def batch1_speedup(row: dict, wide_cost: float) -> float:
    """Predicted decode speed-up over NTP at batch 1: NTP's one-token passes against drafting passes
    costing `wide_cost` one-token passes each (time(k)/time(1), measured) and the others one."""
    narrow = row["forwards"] - row["drafting_passes"]
    return row["tokens"] / (row["drafting_passes"] * wide_cost + narrow)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lookup_rule.json"))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    from sbd_jax.checkpoints.load import resolve
    from sbd_jax.checkpoints.tokenizer import load_tokenizer

    entries = json.load(open(ENTRIES))
    tokenizer = load_tokenizer(resolve("smollm2-135m"))
    rules = [dict(max_ngram=n, latest=latest, extend=extend)
             for n, latest, extend in itertools.product((1, 2, 3, 4), (True, False), (False, True))]
    rows, encoded = [], {}  # (model, split) -> (prompts, NTP outputs)
    for model, split in itertools.product(("tuned", "base"), ("valid", "test", "humaneval")):
        outputs = ntp_outputs(entries, model, split)
        if outputs is None:
            continue
        prompts = split_prompts(tokenizer, split, len(outputs))
        encoded[model, split] = prompts, outputs
        for rule, k in itertools.product(rules, BLOCK_SIZES):
            row = {"model": model, "split": split, "block_size": k, **rule,
                   **replay(prompts, outputs, k, args.max_new_tokens, **rule)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    # The rule: most tokens per forward at block 8 on the fine-tune's validation outputs (fixed before looking).
    valid = [r for r in rows if r["model"] == "tuned" and r["split"] == "valid" and r["block_size"] == 8]
    best = max(valid, key=lambda r: r["tokens_per_forward"])
    chosen = {k: best[k] for k in ("max_ngram", "latest", "extend")}
    print(f"chosen on validation (tuned, block 8): {chosen} at {best['tokens_per_forward']:.3f} tokens/forward")
    # The shortest match that drafts, for a machine where a wide pass costs more than a narrow one (this CPU:
    # time(k)/time(1) from benchmarks/lookup_decode.py): most predicted batch-1 speed on validation.
    with open(os.path.join(ROOT, "benchmarks", "results", "lookup_decode_cpu.json")) as f:
        cost = {int(k): v for k, v in json.load(f)["smollm2_base"]["forward_cost_ratio_cpu"].items()}
    prompts, outputs = encoded["tuned", "valid"]
    match_rows = []
    for min_match, k in itertools.product(range(1, chosen["max_ngram"] + 1), BLOCK_SIZES):
        row = {"min_match": min_match, "block_size": k, **replay(prompts, outputs, k, args.max_new_tokens, **chosen,
                                                                min_match=min_match)}
        row["predicted_batch1_speedup_cpu"] = batch1_speedup(row, cost[k])
        match_rows.append(row)
        print(json.dumps(row), flush=True)
    fastest = max(match_rows, key=lambda r: r["predicted_batch1_speedup_cpu"])
    print(f"fastest on this CPU at batch 1 (validation): min match {fastest['min_match']} at block "
          f"{fastest['block_size']}, predicted {fastest['predicted_batch1_speedup_cpu']:.3f}x NTP")
    result = {"chosen_on_validation": chosen, "rows": rows, "forward_cost_ratio_cpu": cost,
              "min_match_rows": match_rows,
              "fastest_cpu_batch1_on_validation": {k: fastest[k] for k in ("min_match", "block_size")}}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

"""Hybrid drafts against each source alone, where each wins: the shipped small-scale model (SBD's drafts
nearly always right, lookup's rarely) and a real-text SmolLM2 fine-tune (SBD's drafts rarely right).

    python -m benchmarks.hybrid_rule --tuned DIR     # writes benchmarks/results/hybrid_rule_cpu.json

1. Small-scale model, the study's validation arithmetic problems: SBD, lookup and hybrid drafts at blocks
   4 / 8 / 16 (`benchmarks.lookup_decode.arithmetic_rows`).
2. `--tuned DIR` (an exported real-text fine-tune, e.g. the draft-training experiment's, or a gated adapter's
   directory on the base SmolLM2, e.g. the recipe's `WORKDIR/train/adapter`), the first
   `--prompts` validation prompts of `recipes/smollm2_sbd` (never its test prompts), greedy, `--max-new`
   tokens: lookup, hybrid and SBD drafts at blocks 4 / 8; tokens per forward, accepted fraction by source,
   outputs against the model's NTP.
"""

from __future__ import annotations

import argparse
import os
import sys

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def real_text_rows(args) -> list[dict]:
    from benchmarks.lookup_decode import draft_source_rows

    model, prompts, reference = tuned_validation(args)
    return draft_source_rows(model, prompts, reference, (4, 8), (Drafts.LOOKUP, Drafts.HYBRID, Drafts.SBD), args.max_new,
                             len(prompts))


def tuned_validation(args):
    """The `--tuned` model, the first `--prompts` validation prompts of the real-text recipe and its greedy NTP
    outputs of `--max-new` tokens."""
    from benchmarks.lookup_decode import decode_rows
    from recipes.smollm2_sbd.inputs import chat
    from sbd_jax.api import load
    from sbd_jax.checkpoints.adapter import CONFIG
    from sbd_jax.data.jsonl import iter_jsonl
    from sbd_jax.decoding.settings import Settings

    adapter = os.path.isfile(os.path.join(args.tuned, CONFIG))
    model = load(adapter=args.tuned) if adapter else load(args.tuned)
    valid = os.path.join(ROOT, "recipes", "smollm2_sbd", "data", "cpu", "valid.jsonl")
    prompts = [chat(model.tokenizer, row["prompt"]) for _, row in iter_jsonl(valid)][: args.prompts]
    reference = [r.token_ids for r in decode_rows(model, Settings(max_new_tokens=args.max_new), prompts,
                                                  len(prompts))[0]]
    return model, prompts, reference


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tuned_validation` and of the arithmetic part (`benchmarks.lookup_decode.arithmetic_problems`)."""
    parser.add_argument("--tuned", required=True, help="an exported real-text SBD fine-tune of SmolLM2, or a "
                        "gated adapter's directory (on the base SmolLM2)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--arith-problems", type=int, default=256)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "hybrid_rule_cpu.json"))
    args = parser.parse_args(argv)
    from benchmarks.lookup_decode import arithmetic_rows

    result = {"tuned": os.path.abspath(args.tuned), "arithmetic": arithmetic_rows(args),
              "real_text": real_text_rows(args)}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

"""Fallback blocks: drafts after a rejection from blocks placed after each accepted prefix, in the same pass.

    python -m benchmarks.fallback_blocks --tuned DIR   # writes benchmarks/results/fallback_blocks_cpu.json

Verified decoding with SBD's drafts uses the block after all the drafts, which holds only where every draft
was accepted; after a rejection the next pass has nothing to verify. `fallback_blocks` n adds n masked blocks
to the same pass, block a after the exact token and drafts 1..a, so the next pass drafts after whatever
prefix was kept. This measures, greedy, every output against the model's own NTP output:

1. `--tuned DIR` (a gated adapter directory on the base SmolLM2, e.g. the recipe's `WORKDIR/train/adapter`,
   or an exported fine-tune), the first `--prompts` validation prompts of `recipes/smollm2_sbd` (never its
   test prompts), `--max-new` tokens: lookup (the baseline that needs no training), then SBD and hybrid
   drafts with 0, 1 and k - 1 fallback blocks at blocks 4 / 8: tokens per forward, accepted fractions,
   and the batch-1 speed over NTP predicted from bare forwards timed here (the block-size rule's
   prediction: tokens per forward x time(NTP step) / time(pass); the pass is (2 + n) k tokens).
2. The shipped small-scale model on 256 validation arithmetic problems (its SBD drafts are nearly always
   right, so fallback blocks have little to do): SBD and hybrid drafts, 0 and k - 1 fallback blocks, at
   blocks 4 / 8 / 16.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.hybrid_rule import add_model_arguments
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows_for(model, prompts, reference, block_sizes, fallbacks_of, max_new_tokens, batch, timed=False) -> list[dict]:
    """Lookup, then SBD and hybrid drafts at each block size k with each fallback count `fallbacks_of(k)`."""
    from benchmarks.lookup_decode import decode_rows, summary, verified
    from sbd_jax.decoding.block_choice import bare_forward_seconds, predicted_speedup

    rows = []
    for k in block_sizes:
        for drafts, fallback in [(Drafts.LOOKUP, 0)] + [(d, n) for d in (Drafts.SBD, Drafts.HYBRID) for n in fallbacks_of(k)]:
            settings = verified(drafts, k, max_new_tokens, fallback_blocks=fallback)
            results, _ = decode_rows(model, settings, prompts, batch)
            row = {"drafts": drafts, "block_size": k, "fallback_blocks": fallback, "prompts": len(prompts),
                   **summary(results), "identical_to_ntp": sum(r.token_ids == o for r, o in zip(results, reference))}
            if timed and drafts != Drafts.LOOKUP:  # lookup's narrow passes depend on the batch: measured elsewhere
                bare = bare_forward_seconds(model, prompts, (k,), 1, max_new_tokens, verified=settings)
                row.update(pass_over_ntp_step=bare[k] / bare[1],
                           predicted_batch1_speedup=predicted_speedup(row["tokens_per_forward"], bare[k], bare[1]))
            rows.append(row)
            print(row, flush=True)
    return rows


def real_text_rows(args) -> list[dict]:
    from benchmarks.hybrid_rule import tuned_validation

    model, prompts, reference = tuned_validation(args)
    return rows_for(model, prompts, reference, (4, 8), lambda k: sorted({0, 1, k - 1}), args.max_new, len(prompts),
                    timed=True)


def arithmetic_rows(args) -> list[dict]:
    from benchmarks.lookup_decode import arithmetic_problems

    model, prompts, reference = arithmetic_problems(args)
    return rows_for(model, prompts, reference, (4, 8, 16), lambda k: (0, k - 1), 72, 64)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--skip-arithmetic", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fallback_blocks_cpu.json"))
    args = parser.parse_args(argv)
    import jax

    result = {"command": "python -m benchmarks.fallback_blocks " + " ".join(argv if argv is not None else sys.argv[1:]),
              "tuned": os.path.abspath(args.tuned), "device": str(jax.devices()[0]), "real_text": real_text_rows(args)}
    if not args.skip_arithmetic:
        result["arithmetic"] = arithmetic_rows(args)
    write_json(args.out, result)
    print("wrote", args.out)
    return result


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

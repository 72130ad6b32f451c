"""Plain SBD (no verification) against NTP, at one block size: γ chosen on the validation prompts, then the
test prompts at that γ — the question "does the fine-tune's own SBD output equal its NTP output?" without
the full evaluation's ten hours.

    python -m recipes.smollm2_sbd.plain --tuned runs/a/train/adapter --data runs/a/data \\
        --cache recipes/smollm2_sbd/results/cpu_adapter/entries.json --block-size 4

The rule, fixed before any result: the full evaluation's (`eval.choose_gamma`: the most tokens per forward
among the γ whose outputs equal NTP's on at least `AGREEMENT_FLOOR` of the validation prompts). Where no γ
reaches the floor, the γ that stays with NTP longest on validation (the most identical outputs, then the
most tokens before the first difference on average, then the most tokens per forward) is measured on test,
so that the table says how far plain SBD is. NTP is the base model's for a gated adapter (its NTP is the base's,
exactly) and the fine-tune's own otherwise. Entries are shared with `eval.py` and `headline.py` (same
cache, same keys). Writes `plain_sbd_BLOCK.json` beside the cache.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from recipes.smollm2_sbd.eval import AGREEMENT_FLOOR, VALIDATION_GAMMAS, Evaluations, choose_gamma, plain_rows, summary
from recipes.smollm2_sbd.inputs import add_model_arguments, models_and_prompts
from sbd_jax.decoding.settings import Settings
from sbd_jax.evaluation.results import provenance, write_json


def closest_to_ntp(validation: list[dict], block_size: int) -> tuple[float, str]:
    """`choose_gamma`'s γ and the rule that picked it; where none reaches the floor, the γ closest to NTP."""
    chosen = choose_gamma(validation, block_size)
    if chosen is not None:
        return chosen, f"the most tokens per forward with agreement >= {AGREEMENT_FLOOR:.0%} on validation"
    rows = plain_rows(validation, block_size)
    if not rows:
        raise ValueError(f"no plain SBD row at block {block_size} with γ > 0 on validation to choose from")
    best = max(rows, key=lambda s: (s["agreement_with_ntp"], s["mean_tokens_before_difference"],
                                    s["tokens_per_forward"]))
    return best["gamma"], (f"no γ agrees on {AGREEMENT_FLOOR:.0%} of validation: the one closest to NTP there "
                           "(identical outputs, then mean tokens before the first difference, then tokens per forward)")


def measure(evaluations: Evaluations, block_size: int, gammas: Sequence[float], adapter: bool,
            progress: Callable[[dict], None] | None = None) -> dict:
    """The validation grid ("valid"), the chosen γ and its row on the test prompts ("test"), each summarised
    against NTP on the same prompts; `progress(results so far)` after each row."""
    reference = "base" if adapter else "tuned"
    results: dict = {"reference": f"{reference} NTP", "valid": [], "test": []}

    def add(split: str, gamma: float) -> None:
        ntp = evaluations.get(reference, Settings.ntp(), split)
        results[split].append(summary(evaluations.get("tuned", Settings.plain_sbd(block_size, gamma), split), ntp))
        if progress:
            progress(results)

    for gamma in gammas:
        add("valid", gamma)
    results["chosen_gamma"], results["rule"] = closest_to_ntp(results["valid"], block_size)
    add("test", results["chosen_gamma"])
    return results


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, partial=True)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--gammas", type=float, nargs="+", default=list(VALIDATION_GAMMAS),
                        help="the validation grid γ is chosen from")
    args = parser.parse_args(argv)
    if any(g <= 0 for g in args.gammas):
        parser.error(f"--gammas {args.gammas}: every γ must be > 0 (γ 0 decodes one token per pass)")

    models, prompts, adapter, _ = models_and_prompts(args, ("valid", "test"), args.prompts)
    evaluations = Evaluations(args.cache, models, prompts, args.max_new_tokens, args.batch_size)

    def write(results: dict) -> None:  # after every row: a run cut short keeps what it measured
        write_json(os.path.join(os.path.dirname(args.cache), f"plain_sbd_{args.block_size}.json"),
                   {"provenance": provenance(), "command": "python -m recipes.smollm2_sbd.plain " + " ".join(argv),
                    "tuned": "gated adapter" if adapter else "full fine-tune", "block_size": args.block_size,
                    "prompts": {k: len(v) for k, v in prompts.items()}, "max_new_tokens": args.max_new_tokens,
                    **results})

    results = measure(evaluations, args.block_size, args.gammas, adapter, write)
    print(f"| split | γ | tokens/forward | identical to {results['reference']} | mean tokens before the first "
          "difference |\n|---|---|---|---|---|")
    for split in ("valid", "test"):
        for r in results[split]:
            print(f"| {split} | {r['gamma']} | {r['tokens_per_forward']:.3f} | {r['agreement_with_ntp']:.1%} | "
                  f"{r['mean_tokens_before_difference']:.1f} |")
    print(f"chosen γ {results['chosen_gamma']}: {results['rule']}")


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

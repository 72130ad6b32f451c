"""The recipe's headline at one block size, before (or without) the full evaluation: verified decoding of the
fine-tune with SBD's block (as a chain, as a tree, and in one tree with the context and the model's successors),
lookup and hybrid drafts beside the base model's NTP and
lookup, on one split (the validation or test prompts, or HumanEval).

    python -m recipes.smollm2_sbd.headline --tuned runs/a/train/adapter --data runs/a/data \\
        --cache recipes/smollm2_sbd/results/cpu_adapter/entries.json --block-size 8 --split test

The full evaluation (`eval.py`) measures these rows too, on HumanEval as well, with every γ and block, and
takes many times longer (each run's `results.md` records its stages' times). These rows are cached in the
same `entries.json` (same keys): the full evaluation reuses them. Every row is compared with the *base*
model's NTP outputs: a verified row of a gated adapter must equal them exactly (its NTP is
the base's); a full fine-tune's verified rows equal its own NTP, which is computed too, as `tuned, NTP`.
Writes `headline_SPLIT_BLOCK.json` beside the cache (one file per split and block size).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable, Sequence

from recipes.smollm2_sbd.eval import Evaluations, summary
from recipes.smollm2_sbd.inputs import add_model_arguments, models_and_prompts
from sbd_jax.checkpoints.adapter import shipped_steps
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Settings
from sbd_jax.evaluation.recorded import describe
from sbd_jax.evaluation.results import provenance, write_json


def rows(block_size: int, adapter: bool, fallback_blocks: int = 0,
         draft_memory: bool = False) -> list[tuple[str, Settings]]:
    """(model, setting) in the order measured after the base model's NTP (the reference): SBD's block as a chain,
    the base's lookup (often cached already), every source in one tree (`tree-sbd`), hybrid, SBD's block as a
    tree. An adapter's NTP (and so its lookup
    row) is the base's exactly: lookup drafts depend on the context alone, so on the same outputs they are
    accepted the same. With `fallback_blocks`, hybrid and SBD drafts with them come last (hybrid first: the rows
    are cached one by one, and hybrid is the one to compare with lookup). With `draft_memory`, right after
    `tree-sbd`, `tree-sbd` with its draft memory (the model's successors, earlier answers) kept from batch to
    batch (`--draft-memory`)."""
    tree_sbd = Settings.verified(block_size, Drafts.TREE_SBD)
    out = [("tuned", Settings.verified(block_size)), ("base", Settings.verified(block_size, Drafts.LOOKUP)),
           ("tuned", tree_sbd)]
    if draft_memory:
        out.append(("tuned", dataclasses.replace(tree_sbd, draft_memory=True)))
    out += [("tuned", Settings.verified(block_size, Drafts.HYBRID)), ("tuned", Settings.verified(block_size, Drafts.SBD_TREE))]
    if not adapter:
        out += [("tuned", Settings.ntp()), ("tuned", Settings.verified(block_size, Drafts.LOOKUP))]
    if fallback_blocks:
        out += [("tuned", Settings.verified(block_size, Drafts.HYBRID, fallback_blocks=fallback_blocks)),
                ("tuned", Settings.verified(block_size, Drafts.SBD, fallback_blocks=fallback_blocks))]
    return out


def measure(evaluations: Evaluations, split: str, block_size: int, adapter: bool,
            progress: Callable[[list[dict]], None] | None = None, fallback_blocks: int = 0,
            draft_memory: bool = False) -> list[dict]:
    """`rows`, each decoded (or read from the cache) and summarised against the base model's NTP outputs;
    `progress(rows so far)` after each."""
    base_ntp = evaluations.get("base", Settings.ntp(), split)
    table = [summary(base_ntp, base_ntp)]
    for model, setting in rows(block_size, adapter, fallback_blocks, draft_memory):
        table.append(summary(evaluations.get(model, setting, split), base_ntp))
        if progress:
            progress(table)
    return table


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, partial=True)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--split", choices=("valid", "test", "humaneval"), default="test")
    parser.add_argument("--fallback-blocks", type=int, default=0, metavar="N",
                        help="also SBD and hybrid drafts with N fallback blocks (sample.py --fallback-blocks)")
    parser.add_argument("--draft-memory", action="store_true",
                        help="also tree-sbd with its draft memory kept batch to batch (--draft-memory)")
    args = parser.parse_args(argv)

    models, split_prompts, adapter, _ = models_and_prompts(args, (args.split,), args.prompts)
    prompts = split_prompts[args.split]
    evaluations = Evaluations(args.cache, models, split_prompts, args.max_new_tokens, args.batch_size)

    steps = shipped_steps(args.tuned) if adapter else None

    def write(table: list[dict]) -> None:  # after every row: a run cut short keeps what it measured
        write_json(os.path.join(os.path.dirname(args.cache), f"headline_{args.split}_{args.block_size}.json"),
                   {"provenance": provenance(), "command": "python -m recipes.smollm2_sbd.headline " + " ".join(argv),
                    "tuned": "gated adapter" if adapter else "full fine-tune", "adapter_steps": steps,
                    "block_size": args.block_size,
                    "split": args.split, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                    "reference": "the base model's NTP outputs", "rows": table})

    table = measure(evaluations, args.split, args.block_size, adapter, write, args.fallback_blocks, args.draft_memory)
    print("| model | decoding | tokens/forward | accepted drafts | identical to base NTP |\n|---|---|---|---|---|")
    for r in table:
        accepted = "" if r["accepted_fraction"] is None else f"{r['accepted_fraction']:.1%}"
        print(f"| {r['model']} | {describe(r)} | {r['tokens_per_forward']:.3f} | {accepted} | "
              f"{r['agreement_with_ntp']:.1%} |")


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

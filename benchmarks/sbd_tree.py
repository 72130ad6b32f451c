"""SBD's masked block as a tree (DDTree: each position's top tokens, best first), alone or in one tree with the
context's matches and the model's successors, against its chain at equal block size: tokens per forward, every
output checked against NTP's.

    python -m benchmarks.sbd_tree                                   # the small-scale study's SBD model
    python -m benchmarks.sbd_tree --adapter DIR --out FILE          # SmolLM2 with an SBD adapter, validation prompts

- arithmetic (default): the shipped `experiments/small_scale/models/sbd_arith` on the study's first
  `--arith-problems` validation problems, 72 new tokens, batch 64.
- `--adapter DIR`: the base SmolLM2 with that adapter on the recipe's first `--valid` validation prompts (never the
  test prompts), 128 new tokens, batch 16.
Rows: the chain (`--drafts sbd`) and each of `--sources` at each `--nodes`, each without and with `--fallback`
fallback blocks: `sbd-tree` (the block as a tree), `tree-sbd` (the block's tree with the context's matches and the
model's successors in one tree) and `tree` (those two without the block: what no fine-tune gives; its rows do not
change with the fallback blocks, so they run once per block size).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(model, prompts, reference, args, max_new_tokens: int, batch: int, progress) -> list[dict]:
    from benchmarks.lookup_decode import decode_rows, summary, verified

    out: list[dict] = []
    for k in args.block_sizes:
        for fallback in sorted({0, min(args.fallback, k - 1)}):
            chain = verified(Drafts.SBD, k, max_new_tokens, fallback_blocks=fallback)
            sources = [d for d in map(Drafts, args.sources) if d.reads_masked_block or not fallback]
            settings = [("sbd chain", chain)] + [
                (f"{d.value} n={n}", dataclasses.replace(chain, drafts=d, draft_nodes=n, fallback_blocks=(
                    fallback if d.reads_masked_block else 0))) for d in sources for n in args.nodes]
            for name, s in settings:
                results, _ = decode_rows(model, s, prompts, batch)
                out.append({"decoder": name, "block_size": k, "fallback_blocks": fallback, "prompts": len(prompts),
                            **summary(results),
                            "identical_to_ntp": sum(r.token_ids == o for r, o in zip(results, reference))})
                chain_row = next(r for r in out if r["decoder"] == "sbd chain" and r["block_size"] == k
                                 and r["fallback_blocks"] == fallback)
                out[-1]["vs_chain"] = out[-1]["tokens_per_forward"] / chain_row["tokens_per_forward"]
                print(out[-1], flush=True)
                progress(out)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", default=None, help="an SBD adapter for the base SmolLM2 (default: sbd_arith)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--fallback", type=int, default=3, help="fallback blocks of the second row set")
    trees = [d.value for d in (Drafts.SBD_TREE, Drafts.TREE_SBD, Drafts.TREE)]
    parser.add_argument("--sources", nargs="+", choices=trees, default=trees[:1], help="the trees measured")
    parser.add_argument("--arith-problems", type=int, default=256)
    parser.add_argument("--valid", type=int, default=48)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "sbd_tree_arith_cpu.json"))
    args = parser.parse_args(argv)
    from benchmarks.lookup_decode import arithmetic_problems, decode_rows

    def progress(out: list[dict]) -> None:
        write_json(args.out, {"args": vars(args), "rows": out})

    if args.adapter is None:
        model, prompts, reference = arithmetic_problems(args)
        return rows(model, prompts, reference, args, 72, 64, progress)
    from benchmarks.lookup_rule import split_prompts
    from sbd_jax.api import load
    from sbd_jax.decoding.settings import Settings

    model = load("smollm2-135m", adapter=args.adapter)
    prompts = split_prompts(model.tokenizer, "valid", args.valid)
    reference = [r.token_ids for r in decode_rows(model, Settings(max_new_tokens=128), prompts, 16)[0]]
    return rows(model, prompts, reference, args, 128, 16, progress)


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

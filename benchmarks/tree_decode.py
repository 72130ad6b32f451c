"""Tree-verified decoding on the base SmolLM2 (no training, no mask token): tokens per forward and CPU speed
against NTP, chain lookup and `transformers`' own prompt lookup, every output checked against NTP's.

    python -m benchmarks.tree_decode --parts validation      # settings are chosen here, on validation prompts
    python -m benchmarks.tree_decode --parts forwards        # test prompts and HumanEval: tokens per forward
    python -m benchmarks.tree_decode --parts speed           # tokens/s against NTP in one run (batch 1 and 8)
    python -m benchmarks.tree_decode --parts forwards --modeled-costs h100-bf16 --nodes 16 --no-chain \
        --sources --draft-memory only                        # the width rule on a GPU's modeled pass costs

- validation: the recipe's first `--valid` validation prompts, 128 new tokens, greedy: chain lookup and each
  tree source at several node counts (depth `--depth`), for choosing a source, a node count and the context
  match's score (`sbd_jax.decoding.context_drafts.CONTEXT_KEEP`). Never the test prompts.
- forwards: the 200 held-out test prompts and 164 HumanEval problems of `recipes/smollm2_sbd`, 256 new tokens:
  tokens per forward, and outputs against the committed base NTP outputs (the same ones `lookup_decode` uses).
  `--modeled-costs HW` adds the tree with the width rule on the pass costs `sbd_jax.roofline` predicts for HW at
  this batch (`tree_width.modeled_pass_costs`): the widths its rule would pick there, in tokens per forward.
- speed: decode tokens/s at batch 1 (`--batch1-prompts` prompts one at a time) and batch 8 (16 prompts), of the
  test prompts or, with `--speed-split humaneval`, the HumanEval problems (the pass costs are timed on them too):
  NTP, chain lookup (block 8, shortest match 2: the chain's best at batch 1 on a CPU,
  `benchmarks/results/lookup_decode_speed_run4_cpu.json`) and the tree at fixed widths and with the width rule
  on costs measured here (`sbd_jax.decoding.tree_width`); with `--draft-memory`, the width rule also with the
  draft memory (the successor table and earlier answers) kept from prompt to prompt (batch 1) or batch to batch
  (batch 8); with `--adapter NAME`, that gated adapter's SBD block as a chain and its tree-sbd (block
  `--adapter-block-size`), timed against the base's NTP (the adapter acts on block positions only).
- overhead: what the verifying loop costs beyond the forward: NTP against each tree source with every pass
  forced to the root alone (a cost curve on which any wider pass costs 10^9 times the root), first 16 test
  prompts at batch 8 and 4 at batch 1 (`--speed-batches`), same tokens, so the time ratio is the loop's
  own per-pass cost (candidates, tree, walk, the source's harvest) over NTP's step.
"""

from __future__ import annotations

import argparse
import os
import sys

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode
from sbd_jax.decoding.verified import DEFAULT_DRAFT_NODES
from sbd_jax.evaluation.results import write_json
from sbd_jax.roofline import HARDWARE, lookup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("validation", "forwards", "speed", "overhead")
NODES = (4, 8, 16, 32, 64)


def settings(drafts: str, depth: int, max_new_tokens: int, nodes: int = 16, min_match: int = 1, costs=(),
             memory: bool = False):
    from sbd_jax.decoding.settings import Settings

    return Settings(mode=Mode.SBD, verify=True, drafts=drafts, block_size=depth + 1, max_new_tokens=max_new_tokens,
                    draft_nodes=nodes, lookup_min_match=min_match, pass_costs=costs, draft_memory=memory)


MEMORIES = {None: (False,), "also": (False, True), "only": (True,)}  # --draft-memory's value: the rows it runs


def named(name: str, memory: bool) -> str:
    return name + (", draft memory" if memory else "")


def candidates(depth: int, max_new_tokens: int, nodes=NODES, sources=(Drafts.CONTEXT_TREE, Drafts.SUCCESSORS, Drafts.TREE),
               chain: bool = True, memories: tuple[bool, ...] = (False,)) -> list[tuple[str, object]]:
    """(name, settings) of chain lookup and each tree source at each node count, for each of `memories`: with
    True, a source that keeps a memory runs with `--draft-memory` (kept from batch to batch)."""
    rows = [("lookup chain", settings(Drafts.LOOKUP, depth, max_new_tokens))] if chain else []
    for drafts in map(Drafts, sources):
        for memory in memories:
            if memory and not drafts.keeps_memory:
                continue  # a source that keeps no memory (sbd-tree) has no memory twin
            rows += [(named(f"{drafts.value} n={n}", memory), settings(drafts, depth, max_new_tokens, n, memory=memory))
                     for n in nodes]
    return rows


def decode(model, s, prompts, batch):
    from benchmarks.lookup_decode import decode_rows

    return decode_rows(model, s, prompts, batch)


def validation_rows(model, args) -> list[dict]:
    from benchmarks.lookup_decode import summary
    from benchmarks.lookup_rule import split_prompts

    prompts = split_prompts(model.tokenizer, "valid", args.valid)
    rows = []
    for name, s in candidates(args.depth, 128, args.nodes, args.sources, chain=not args.no_chain,
                              memories=MEMORIES[args.draft_memory]):
        results, _ = decode(model, s, prompts, args.batch)
        rows.append({"decoder": name, "draft_memory": s.draft_memory, "prompts": len(prompts), **summary(results)})
        print(rows[-1], flush=True)
    return rows


def forwards_rows(model, args, progress) -> list[dict]:
    import json

    from benchmarks.lookup_decode import summary
    from benchmarks.lookup_rule import ENTRIES, ntp_outputs, split_prompts
    from sbd_jax.decoding.tree_width import modeled_pass_costs

    entries = json.load(open(ENTRIES))
    rows: list[dict] = []
    for split in ("test", "humaneval"):
        reference = ntp_outputs(entries, "base", split)[: args.prompts]
        prompts = split_prompts(model.tokenizer, split, len(reference))
        deciders = candidates(args.depth, 256, args.nodes, args.sources, chain=not args.no_chain,
                              memories=MEMORIES[args.draft_memory])
        if args.modeled_costs:
            costs = modeled_pass_costs(args.modeled_costs, args.model, args.batch, max(args.nodes),
                                       max(map(len, prompts)) + 256 // 2)
            deciders += [(named(f"tree, width rule on {args.modeled_costs}'s modeled costs", memory),
                          settings(Drafts.TREE, args.depth, 256, max(args.nodes), costs=costs, memory=memory))
                         for memory in MEMORIES[args.draft_memory]]
        for name, s in deciders:
            results, _ = decode(model, s, prompts, args.batch)
            rows.append({"split": split, "decoder": name, "draft_memory": s.draft_memory, "prompts": len(prompts),
                         **summary(results),
                         "identical_to_committed_ntp": sum(r.token_ids == o for r, o in zip(results, reference)),
                         **({"pass_costs": s.pass_costs} if s.pass_costs else {})})
            print(rows[-1], flush=True)
            progress(rows)
    return rows


def speed_rows(model, args, progress, drafter=None) -> list[dict]:
    """The speed part; with `drafter` (the model with `--adapter`), also its SBD block as a chain and its tree-sbd
    (the default 16 nodes, whatever `--nodes`) at `--adapter-block-size`, right after chain lookup: the rows the
    recipe's headline counts forwards of."""
    from benchmarks.lookup_rule import split_prompts
    from sbd_jax.decoding.settings import Settings
    from sbd_jax.decoding.tree_width import measure_pass_costs

    prompts = split_prompts(model.tokenizer, args.speed_split, max(args.batch1_prompts, 16))
    rows: list[dict] = []
    for batch, n in ((b, args.batch1_prompts if b == 1 else 16) for b in args.speed_batches):
        costs = measure_pass_costs(model, prompts[:batch], batch, args.max_new_tokens, max(args.nodes))
        deciders = [(Mode.NTP.value, Settings(max_new_tokens=args.max_new_tokens), model),
                    ("lookup chain k=8 min match 2", settings(Drafts.LOOKUP, 7, args.max_new_tokens, min_match=2),
                     model)]
        if drafter is not None:
            k = args.adapter_block_size
            deciders += [(f"adapter, sbd chain k={k}", settings(Drafts.SBD, k - 1, args.max_new_tokens), drafter),
                         (f"adapter, tree-sbd n={DEFAULT_DRAFT_NODES} k={k}",
                          settings(Drafts.TREE_SBD, k - 1, args.max_new_tokens, DEFAULT_DRAFT_NODES), drafter)]
        deciders += [(f"tree n={m}", settings(Drafts.TREE, args.depth, args.max_new_tokens, m), model)
                     for m in args.nodes]
        deciders += [(named("tree, width rule", memory), settings(Drafts.TREE, args.depth, args.max_new_tokens,
                                                                   max(args.nodes), costs=costs, memory=memory), model)
                     for memory in MEMORIES[args.draft_memory]]
        timed_rows(deciders, prompts[:n], batch, rows, progress)
    return rows


def timed_rows(deciders, prompts, batch: int, rows: list[dict], progress) -> None:
    """Each (name, settings, model) of `deciders` compiled and warmed on one batch, then timed on `prompts`; a row
    each appended to `rows` (and `progress(rows)` after each) with its outputs against the first decider's (NTP)
    and its tokens/s (`vs_ntp`) and seconds (`seconds_vs_ntp`) against NTP's."""
    from benchmarks.lookup_decode import summary

    reference = None
    for name, s, model in deciders:
        decode(model, s, prompts[:batch], batch)  # compile and warm apart from the timed run
        results, timing = decode(model, s, prompts, batch)
        reference = reference or [r.token_ids for r in results]
        rows.append({"decoder": name, "batch": batch, "prompts": len(prompts), **summary(results, timing),
                     "identical_to_ntp": sum(r.token_ids == o for r, o in zip(results, reference)),
                     **({"pass_costs": [list(c) for c in s.pass_costs]} if s.pass_costs else {})})
        ntp = next(r for r in rows if r["batch"] == batch and r["decoder"] == Mode.NTP)
        rows[-1]["vs_ntp"] = rows[-1]["tokens_per_second"] / ntp["tokens_per_second"]
        rows[-1]["seconds_vs_ntp"] = rows[-1]["decode_seconds"] / ntp["decode_seconds"]
        print(rows[-1], flush=True)
        progress(rows)


ROOT_ALONE = 1e-9  # overhead: the root's cost on a curve where the widest pass costs 1 s


def overhead_rows(model, args, progress) -> list[dict]:
    from benchmarks.lookup_rule import split_prompts
    from sbd_jax.decoding.settings import Settings

    test = split_prompts(model.tokenizer, "test", 16)
    n = max(args.nodes)
    rows: list[dict] = []
    for batch in args.speed_batches:
        prompts = test[:16 if batch > 1 else 4]
        deciders = [(Mode.NTP.value, Settings(max_new_tokens=args.max_new_tokens), model)]
        deciders += [(named(f"{drafts} n={n}, root alone", memory),
                      settings(drafts, args.depth, args.max_new_tokens, n, costs=((1, ROOT_ALONE), (1 + n, 1.0)),
                               memory=memory), model)
                     for drafts in args.sources for memory in MEMORIES[args.draft_memory]
                     if not memory or Drafts(drafts).keeps_memory]
        timed_rows(deciders, prompts, batch, rows, progress)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["forwards"])
    parser.add_argument("--valid", type=int, default=48, help="validation: the first N validation prompts")
    parser.add_argument("--prompts", type=int, default=200, help="forwards: the first N test / HumanEval prompts")
    parser.add_argument("--depth", type=int, default=7, help="tree depth (the chain's block size - 1)")
    parser.add_argument("--nodes", type=int, nargs="+", default=list(NODES), help="node counts to measure")
    parser.add_argument("--sources", nargs="*", default=["context-tree", "successors", "tree"])
    parser.add_argument("--draft-memory", nargs="?", const="also", choices=("also", "only"), default=None,
                        help="each tree source (and the width rule) also (or only) with its draft memory kept "
                             "from batch to batch")
    parser.add_argument("--modeled-costs", default=None, metavar="HW", choices=sorted(HARDWARE),
                        help="forwards: also the width rule on HW's pass costs as sbd_jax.roofline models them")
    parser.add_argument("--no-chain", action="store_true", help="leave out chain lookup (measured already)")
    parser.add_argument("--batch", type=int, default=16, help="validation / forwards: rows a batch")
    parser.add_argument("--batch1-prompts", type=int, default=40, help="speed: prompts of --speed-split decoded at batch 1")
    parser.add_argument("--speed-split", choices=("test", "humaneval"), default="test",
                        help="speed: the recipe's test prompts or its HumanEval problems")
    parser.add_argument("--speed-batches", type=int, nargs="+", default=[1, 8], choices=(1, 8),
                        help="speed / overhead: the batch sizes measured")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="speed / overhead: tokens a prompt")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default=None, help="speed: also this gated adapter of --model (a shipped name "
                        "or directory): its SBD block as a chain and tree-sbd, against the base's NTP")
    parser.add_argument("--adapter-block-size", type=int, default=4, help="the adapter rows' block size")
    parser.add_argument("--out", default=None, help="default benchmarks/results/tree_decode_{part}_cpu.json")
    args = parser.parse_args(argv)
    if args.adapter and "speed" not in args.parts:
        parser.error("--adapter adds rows to the speed part: add --parts speed")
    if args.modeled_costs:  # before the slow parts: the roofline must know the model
        if "forwards" not in args.parts:
            parser.error("--modeled-costs adds a row to the forwards part: add --parts forwards")
        lookup(args.modeled_costs, args.model)
    from sbd_jax.api import load
    from sbd_jax.checkpoints.adapter import shipped_steps

    model = load(args.model)
    drafter = load(args.model, adapter=args.adapter) if args.adapter else None
    steps = {"adapter_steps": shipped_steps(args.adapter)} if args.adapter else {}  # which version ran
    result: dict = {}
    for part in args.parts:
        out = args.out or os.path.join(ROOT, "benchmarks", "results", f"tree_decode_{part}_cpu.json")

        def progress(rows: list[dict], part: str = part, out: str = out) -> None:
            write_json(out, {"args": vars(args), **steps, part: rows})

        rows = {"validation": lambda: validation_rows(model, args), "forwards": lambda: forwards_rows(model, args, progress),
                "speed": lambda: speed_rows(model, args, progress, drafter),
                "overhead": lambda: overhead_rows(model, args, progress)}[part]()
        progress(rows)
        result[part] = rows
    return result


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

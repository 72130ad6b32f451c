"""Verified SBD for serving, per batch size: tokens/s, pass overhead, efficiency, and the block-size rule.

    python -m benchmarks.verify_batches                        # the small-scale SBD model, then SmolLM2
    python -m benchmarks.verify_batches --batches 1 8 --skip-smollm2

For each model, batch size (1, 2, 4, 8, 16, 32) and decoder (NTP; verified decoding at blocks 4 / 8 / 16 with
each draft source of `--drafts`: SBD's block, prompt lookup (no training; a pass of k tokens, not 2k) and
hybrid), in one run on this machine:
- decoding tokens/s (prefill apart: both decoders share it) and its ratio to NTP's at the same batch;
- tokens per forward, the accepted fraction of the drafts (and of lookup's alone) and seconds per pass (decode seconds / loop iterations: a batch runs until its
  slowest row is done, so every iteration is one forward of every row);
- **pass overhead** = seconds per pass / seconds of the bare model forward of the same tokens (NTP: one
  token a row; verified SBD and hybrid: the 2k tokens of its pass: k pending, k masked; lookup: k, or one where
  no row has drafts, weighted by the measured **narrow share** of such passes), with as many cached tokens
  as the middle of a decode, in a cache as large as the decoder's (attention reads every slot: a smaller
  cache would charge the cache's size to the loop). 1.0 means the loop adds nothing to the model;
- **ideal** speed-up = tokens per forward x bare(1) / that mean bare pass, and **efficiency** = measured speed-up /
  ideal (what the loop and the rows that finish early keep of what the passes promise);
- the H100 roofline's prediction of the same speed-up (tokens per forward / its time(2k) / time(1));
- **the block-size rule** (`sbd_jax.decoding.block_choice`): from the measured tokens per forward at each k
  and the bare forward times at this batch, the k with the highest ideal speed-up (NTP where none
  beats 1), for SBD's drafts; the table says how far its measured tokens/s is from the best fixed choice's. Beside it
  (`loop_rule_choice`) the same rule fed with the decoding loop's seconds per pass, timed on the
  calibration prompts at this batch: the loop's overhead included, at the cost of decoding them.

Models: the shipped small-scale SBD model on held-out arithmetic problems (trained drafts), and
SmolLM2-135M with an untrained mask token (`--smollm2-mask-token-id`; drafts are poor, ~1 token per
forward: the timing floor), or an SBD fine-tune of it (`--smollm2 DIR`, its own mask token). Writes
benchmarks/results/verify_batches_<platform>.json (`--out` for another file).

    python -m benchmarks.verify_batches --skip-arithmetic --smollm2 runs/cpu/train/hf --batches 1 8 \
        --out benchmarks/results/verify_batches_smollm2_realtext_cpu.json   # the real-text fine-tune
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.verify import run
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.evaluation.recorded import record
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pass_kind(drafts: Drafts) -> Drafts:
    """The draft source whose pass has the same tokens as `drafts`' (hybrid's pass is SBD's)."""
    return Drafts.LOOKUP if drafts == Drafts.LOOKUP else Drafts.SBD


def setting_at(block_size: int, drafts: Drafts) -> Settings:
    """NTP at block 1, else verified decoding with `drafts`."""
    return Settings.ntp() if block_size == 1 else Settings.verified(block_size, drafts)


def decode_all(model, prompts, block_size, max_new_tokens, batch, longest, executables, drafts=Drafts.SBD):
    """All prompts `batch` at a time after a warm-up batch: (generations, decode seconds, loop iterations),
    compile excluded (`executables` holds what earlier calls compiled: repeats compile nothing)."""
    setting = setting_at(block_size, drafts)
    run(model, prompts[:batch], setting, max_new_tokens, batch, longest, executables)
    generations, (_, seconds) = run(model, prompts, setting, max_new_tokens, batch, longest, executables)
    iterations = sum(max(g.nfe for g in generations[s: s + batch]) for s in range(0, len(generations), batch))
    return generations, seconds, iterations


def measure(model, shape, prompts, calibration, blocks, batches, max_new_tokens, repeats, calls,
            min_prompts, others=()) -> dict:
    """Tokens per forward at each block on the `calibration` prompts (what the block-size rule reads), and
    one row per (batch, decoder) on the first `min_prompts` of `prompts` (rounded up to whole batches), with
    SBD's drafts and each draft source of `others`; see the module docstring for the columns."""
    from sbd_jax.decoding.block_choice import (
        bare_forward_seconds,
        cache_slots,
        calibrate,
        choose_block_size,
        mean_pass_seconds,
        pass_tokens,
    )
    from sbd_jax.decoding.generate import Executables
    from sbd_jax.roofline import HARDWARE, slowdown

    longest = max(map(len, prompts + calibration))
    context = longest + max_new_tokens // 2  # cached tokens in the middle of a decode
    calibrated = calibrate(model, calibration, blocks, max_new_tokens, batch=len(calibration)).tokens_per_forward
    slots = {k: cache_slots(model.config, prompts, k, max_new_tokens, longest) for k in (1, *blocks)}
    rows, sources = [], (Drafts.SBD, *map(Drafts, others))
    verified = {drafts: Settings(mode=Mode.SBD, verify=True, drafts=drafts) for drafts in sources}
    for batch in batches:
        n_prompts = min(-(-min_prompts // batch) * batch, len(prompts) // batch * batch)
        # sbd and hybrid passes have the same 2k tokens: one timing serves both
        bare_of = {kind: bare_forward_seconds(model, prompts, blocks, batch, max_new_tokens, calls, pad_to=longest,
                                              verified=verified[kind]) for kind in {pass_kind(d) for d in sources}}
        ntp_bare = bare_of[Drafts.SBD][1]  # one timing of NTP's forward for every row's ideal speed-up
        group = []
        for k, drafts in [(1, Drafts.SBD)] + [(k, d) for d in sources for k in blocks]:
            bare = ntp_bare if k == 1 else bare_of[pass_kind(drafts)][k]
            executables = Executables(capacity=2)  # this row's prefill and decode, compiled once
            runs = sorted((decode_all(model, prompts[:n_prompts], k, max_new_tokens, batch, longest, executables,
                                      drafts) for _ in range(repeats)), key=lambda r: r[1])
            generations, seconds, iterations = runs[len(runs) // 2]
            tokens, nfe = sum(len(g.token_ids) for g in generations), sum(g.nfe for g in generations)
            drafted, lookup_drafted = sum(g.drafted for g in generations), sum(g.lookup_drafted for g in generations)
            narrow = sum(g.narrow_passes for g in generations) / nfe  # lookup: passes run as one token
            mean_bare = mean_pass_seconds(bare, ntp_bare, narrow)
            group.append({"batch": batch, **record(setting_at(k, drafts)), "prompts": n_prompts, "tokens": tokens, "tokens_per_second": tokens / seconds,
                          "tokens_per_forward": tokens / nfe, "seconds_per_pass": seconds / iterations,
                          "accepted_fraction": sum(g.accepted for g in generations) / drafted if drafted else None,
                          "lookup_accepted_fraction": (sum(g.lookup_accepted for g in generations) / lookup_drafted
                                                       if lookup_drafted else None),
                          "bare_forward_seconds": bare, "narrow_share": narrow, "cache_slots": slots[k],
                          "pass_overhead": seconds / iterations / mean_bare,
                          "ideal_speedup": tokens / nfe * ntp_bare / mean_bare,
                          "h100_roofline_speedup": tokens / nfe / slowdown(
                              HARDWARE["h100-bf16"], shape, batch, pass_tokens(k, verified[drafts]), context)})
        ntp = group[0]
        for row in group:
            row["speedup"] = row["tokens_per_second"] / ntp["tokens_per_second"]
            row["efficiency"] = row["speedup"] / row["ideal_speedup"]
        sbd_rows = [r for r in group if r["drafts"] in (None, Drafts.SBD)]  # what the block-size rule chooses among
        sbd_bare = bare_of[Drafts.SBD]
        chosen = choose_block_size(calibrated, {k: sbd_bare[k] for k in blocks}, ntp_bare)
        # The same rule fed with the decoding loop's own seconds per pass, timed on the calibration prompts at
        # this batch (the loop's overhead included, which bare forwards do not see): which input predicts better?
        loop = {k: decode_all(model, calibration, k, max_new_tokens, batch, longest, Executables(capacity=2))
                for k in (1, *blocks)}
        loop_pass = {k: seconds / iterations for k, (_, seconds, iterations) in loop.items()}
        chosen_by_loop = choose_block_size(calibrated, {k: loop_pass[k] for k in blocks}, loop_pass[1])
        best = max(sbd_rows, key=lambda r: r["tokens_per_second"])
        for row in group:  # None: the rule does not choose among other sources' rows
            row["rule_choice"] = row["block_size"] == chosen if row in sbd_rows else None
            row["loop_rule_choice"] = row["block_size"] == chosen_by_loop if row in sbd_rows else None
        rows += group
        share = {c: next(r for r in sbd_rows if r["block_size"] == c)["tokens_per_second"] / best["tokens_per_second"]
                 for c in (chosen, chosen_by_loop)}
        print(f"batch {batch:>2}: " + "  ".join(
            f"{'NTP' if r['block_size'] == 1 else r['drafts'] + ' k=' + str(r['block_size'])} "
            f"{r['tokens_per_second']:.0f} t/s "
            f"({r['tokens_per_forward']:.2f}/fwd, overhead {r['pass_overhead']:.2f}, eff {r['efficiency']:.2f})"
            for r in group) + f"; rule picks {chosen}: {share[chosen]:.0%} of the best fixed choice "
              f"({best['block_size']}); from loop timings {chosen_by_loop}: {share[chosen_by_loop]:.0%}", flush=True)
    return {"calibration_prompts": len(calibration), "calibration_tokens_per_forward": calibrated, "rows": rows}


def arithmetic_part(args) -> dict:
    import jax

    from experiments.small_scale.task import STUDY, study_splits
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.evaluation.measure import chat_prompt
    from sbd_jax.roofline import shape_of

    loaded = load_model(args.model)
    model = loaded._replace(params=jax.device_put(loaded.params))
    splits = study_splits()
    prompts = [chat_prompt(loaded.tokenizer, p.question) for p in splits.test[: max(args.problems, *args.batches)]]
    calibration = [chat_prompt(loaded.tokenizer, p.question) for p in splits.valid[:32]]
    measured = measure(model, shape_of(loaded.config, "small-scale"), prompts, calibration, args.blocks,
                       args.batches, STUDY["max_new_tokens"], args.repeats, args.calls, args.problems, args.drafts)
    return {"model": os.path.relpath(args.model, ROOT), "prompts": "held-out arithmetic test problems",
            "calibration": "validation problems", "max_new_tokens": STUDY["max_new_tokens"], **measured}


def smollm2_part(args) -> dict:
    import jax

    from benchmarks.decode import PROMPTS
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.checkpoints.tokenizer import encode_prompt
    from sbd_jax.roofline import MODELS

    loaded = load_model(args.smollm2)
    mask_token_id = (args.smollm2_mask_token_id if args.smollm2_mask_token_id is not None
                     else loaded.config.mask_token_id if loaded.config.mask_token_id is not None else 0)
    model = loaded._replace(params=jax.device_put(loaded.params),
                            config=loaded.config.replace(mask_token_id=mask_token_id))
    encoded = [encode_prompt(loaded.tokenizer, p, chat=True) for p in PROMPTS]
    prompts = [encoded[i % len(encoded)] for i in range(max(max(args.batches), args.smollm2_prompts))]
    measured = measure(model, MODELS["smollm2-135m"], prompts, encoded, args.blocks, args.batches,
                       args.smollm2_new_tokens, args.smollm2_repeats, args.calls, args.smollm2_prompts, args.drafts)
    trained = loaded.config.mask_token_id is not None and args.smollm2_mask_token_id is None
    return {"model": args.smollm2, "mask_token_id": mask_token_id,
            "prompts": f"benchmarks.decode.PROMPTS, cycled to {len(prompts)}",
            "calibration": "the same 8 prompts" + ("" if trained else
                                                   " (an untrained mask token: ~1 token per forward at every k)"),
            "max_new_tokens": args.smollm2_new_tokens, **measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith"))
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--drafts", nargs="*", choices=("lookup", "hybrid"), default=["lookup", "hybrid"],
                        help="draft sources measured beside SBD's block (lookup needs no fine-tune)")
    parser.add_argument("--problems", type=int, default=64,
                        help="arithmetic prompts per (batch, decoder), at least a batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median is kept)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls of each bare forward (median)")
    parser.add_argument("--skip-arithmetic", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--smollm2", default="smollm2-135m",
                        help="the SmolLM2 part's model: the base (timing floor) or an SBD fine-tune's HF directory")
    parser.add_argument("--smollm2-mask-token-id", type=int, default=None,
                        help="default: the model's own mask token (a fine-tune's), else 0 (untrained: the floor)")
    parser.add_argument("--smollm2-new-tokens", type=int, default=48)
    parser.add_argument("--smollm2-prompts", type=int, default=8, help="SmolLM2 prompts per row (at least a batch)")
    parser.add_argument("--smollm2-repeats", type=int, default=1, help="SmolLM2 timed runs per row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax

    result = {"device": str(jax.devices()[0])}
    if not args.skip_arithmetic:
        result["arithmetic"] = arithmetic_part(args)
    if not args.skip_smollm2:
        result["smollm2"] = smollm2_part(args)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"verify_batches_{jax.devices()[0].platform}.json")
    write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())

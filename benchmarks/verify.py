"""Verified (lossless) SBD against greedy NTP decoding of the same model, measured in one run.

    python -m benchmarks.verify                                    # the small-scale SBD model, then SmolLM2
    python -m benchmarks.verify --skip-smollm2 --valid 100 --test 300

Part 1, the small-scale SBD model (`experiments/small_scale/models/sbd_arith`, trained on worked-step
addition): for block 4/8/16 (drafts from one pass; γ plays no part under verification), tokens per
pass and draft acceptance on validation and test problems (the output must equal NTP's on every
problem), and wall-clock tokens/s of NTP and of each block are measured at
batch 1 and 8 (decoding alone, which is what SBD changes, and with the prompt's prefill, which both
modes share), beside time(k)/time(1) and time(2k)/time(1) of this model's forward on this machine.
Part 2, SmolLM2-135M with an untrained mask token (`--mask-token-id`): drafts are poor, so this is the
floor (~1 token per pass) and the output must still equal NTP's.
Writes benchmarks/results/verify_<platform>.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from benchmarks.decode import PROMPTS as SMOLLM2_PROMPTS
from sbd_jax.decoding.settings import Settings
from sbd_jax.evaluation.recorded import describe, record
from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(model, prompts, settings: Settings, max_new_tokens, batch, longest, executables=None):
    """Decodes `prompts` `batch` at a time: (generations, (prefill seconds, decode seconds)), compile excluded
    (pass one `executables` to calls that should share what earlier ones compiled)."""
    from sbd_jax.decoding.generate import Executables, generate_batched

    decoder = dataclasses.replace(settings, max_new_tokens=max_new_tokens).decoder(model.config)
    generations, timing = generate_batched(decoder, model.params, prompts, batch, pad_to=longest,
                                           executables=Executables() if executables is None else executables)
    return generations, (timing.prefill_seconds, timing.decode_seconds)


def summary(generations, reference) -> dict:
    tokens = sum(len(g.token_ids) for g in generations)
    drafted = sum(g.drafted for g in generations)
    return {"tokens": tokens, "nfe": sum(g.nfe for g in generations),
            "tokens_per_pass": tokens / max(sum(g.nfe for g in generations), 1),
            "accepted_fraction": sum(g.accepted for g in generations) / max(drafted, 1),
            "identical_to_ntp": sum(g.token_ids == r.token_ids for g, r in zip(generations, reference)),
            "n": len(generations)}


def arithmetic_part(args) -> dict:
    import jax

    from experiments.small_scale.task import STUDY, study_splits
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.decoding.timing import forward_cost_ratio
    from sbd_jax.evaluation.measure import chat_prompt

    loaded = load_model(args.model)
    model = loaded._replace(params=jax.device_put(loaded.params))
    study = study_splits()
    valid, test = study.valid[: args.valid], study.test[: args.test]
    prompts = {name: [chat_prompt(loaded.tokenizer, p.question) for p in split]
               for name, split in (("valid", valid), ("test", test))}
    longest = max(len(p) for split in prompts.values() for p in split)
    batch = 64  # accuracy runs: batched, the output does not depend on the batch
    ntp = {name: run(model, p, Settings.ntp(), STUDY["max_new_tokens"], batch, longest)[0]
           for name, p in prompts.items()}
    rows = []
    for k in args.blocks:
        row = record(Settings.verified(k))
        for name, p in prompts.items():
            generations, _ = run(model, p, Settings.verified(k), STUDY["max_new_tokens"], batch, longest)
            row[name] = summary(generations, ntp[name])
        rows.append(row)
        print(f"verified k={k:>2}: valid {row['valid']['tokens_per_pass']:.2f} tokens/pass "
              f"(accepted {row['valid']['accepted_fraction']:.0%}), test {row['test']['tokens_per_pass']:.2f}; "
              f"identical to NTP on {row['test']['identical_to_ntp']}/{row['test']['n']} test problems", flush=True)
    speed_prompts = prompts["test"][: args.speed_problems]
    speed = []
    for batch_size in (1, 8):
        settings = [Settings.ntp()] + [Settings.verified(k) for k in args.blocks]
        for setting in settings:
            run(model, speed_prompts[:batch_size], setting, STUDY["max_new_tokens"], batch_size, longest)  # compile
            runs = []
            for _ in range(args.repeats):
                generations, (prefill, decode) = run(model, speed_prompts, setting, STUDY["max_new_tokens"],
                                                     batch_size, longest)
                tokens = sum(len(g.token_ids) for g in generations)
                runs.append((tokens / decode, tokens / (prefill + decode)))
            runs.sort()
            decode_rate, total_rate = runs[len(runs) // 2]
            speed.append({**record(setting), "batch": batch_size, "decode_tokens_per_second": decode_rate,
                          "tokens_per_second_with_prefill": total_rate})
        reference = speed[-len(settings)]
        for row in speed[-len(settings):]:
            row["decode_vs_ntp"] = row["decode_tokens_per_second"] / reference["decode_tokens_per_second"]
            row["with_prefill_vs_ntp"] = (row["tokens_per_second_with_prefill"]
                                          / reference["tokens_per_second_with_prefill"])
            print(f"batch {batch_size} {describe(row)} k={row['block_size']}: decoding "
                  f"{row['decode_tokens_per_second']:.0f} tokens/s ({row['decode_vs_ntp']:.2f}x NTP); with prefill "
                  f"{row['tokens_per_second_with_prefill']:.0f} ({row['with_prefill_vs_ntp']:.2f}x)", flush=True)
    return {"model": args.model, "valid_problems": len(valid), "test_problems": len(test),
            "speed_problems": len(speed_prompts), "rows": rows,
            "speed": speed,
            "forward_cost_ratio": {str(k): {"k": forward_cost_ratio(model, k), "2k": forward_cost_ratio(model, 2 * k)}
                                   for k in args.blocks}}


def smollm2_part(args) -> dict:
    import jax

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.checkpoints.tokenizer import encode_prompt

    loaded = load_model("smollm2-135m")
    model = loaded._replace(params=jax.device_put(loaded.params),
                            config=loaded.config.replace(mask_token_id=args.smollm2_mask_token_id))
    prompts = [encode_prompt(loaded.tokenizer, p, chat=True) for p in SMOLLM2_PROMPTS]
    longest = max(len(p) for p in prompts)
    began = time.perf_counter()
    ntp, (_, ntp_seconds) = run(model, prompts, Settings.ntp(), args.smollm2_new_tokens, 1, longest)
    ntp_rate = sum(len(g.token_ids) for g in ntp) / ntp_seconds
    rows = []
    for k in args.blocks:
        generations, (_, seconds) = run(model, prompts, Settings.verified(k), args.smollm2_new_tokens, 1, longest)
        row = {**record(Settings.verified(k)), **summary(generations, ntp), "batch": 1,
               "decode_tokens_per_second": sum(len(g.token_ids) for g in generations) / seconds}
        row["decode_vs_ntp"] = row["decode_tokens_per_second"] / ntp_rate
        rows.append(row)
        print(f"SmolLM2 (untrained mask) verified k={k}: {row['tokens_per_pass']:.2f} tokens/pass, accepted "
              f"{row['accepted_fraction']:.0%}, identical {row['identical_to_ntp']}/{row['n']}, "
              f"decoding {row['decode_tokens_per_second']:.1f} tokens/s ({row['decode_vs_ntp']:.2f}x NTP)", flush=True)
    return {"mask_token_id": args.smollm2_mask_token_id, "prompts": len(prompts),
            "ntp_decode_tokens_per_second": ntp_rate,
            "rows": rows, "seconds": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith"))
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--valid", type=int, default=200, help="validation problems (choosing γ)")
    parser.add_argument("--test", type=int, default=500, help="test problems")
    parser.add_argument("--speed-problems", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--smollm2-mask-token-id", type=int, default=0)
    parser.add_argument("--smollm2-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax

    result = {"command": "python -m benchmarks.verify " + " ".join(sys.argv[1:]),
              "device": str(jax.devices()[0]), "arithmetic": arithmetic_part(args)}
    if not args.skip_smollm2:
        result["smollm2"] = smollm2_part(args)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"verify_{jax.devices()[0].platform}.json")
    write_json(out, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

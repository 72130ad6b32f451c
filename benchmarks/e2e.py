"""End-to-end decode time, NTP vs SBD, same model and prompts: tokens/s, NFE, and the roofline's view.

    python -m benchmarks.e2e [--model smollm2-135m] [--mask-token-id 4] [--batches 1 8] [--gammas 0.35]
                             [--block-size 16] [--max-new-tokens 128]

Both modes decode the same chat prompts greedily (EOS stops a row); time is prefill + decode of the
batch, best of --repeats, compile excluded. For SBD it also prints the speedup the roofline predicts
for the passes actually observed (ℓ = k · nfe / tokens per block, on the measured or tabled hardware),
so the gap between model and reality is one number. A model that was never SBD-trained (SmolLM2 with
--mask-token-id) gives real timings but poor blocks. With --verify, every γ is also run in the verified
(lossless) mode, whose output must equal NTP's (checked, and recorded per row). The JSON
(benchmarks/results/e2e_<platform>.json or --out) is rewritten after every row; --dry-run prints the plan.
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.decode import PROMPTS
from benchmarks.forward_cost import hardware_for, model_config
from sbd_jax.evaluation.results import write_json
from sbd_jax.model.config import RUN_DTYPES, DType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(batches, gammas, verify: bool, repeats: int, compile_seconds: float) -> dict:
    """Compiles and decode runs a call will do, and an estimate of its minutes."""
    modes = 1 + len(gammas) * (2 if verify else 1)  # NTP, then SBD (and verified SBD) per γ
    compiles = len(batches) * modes * 2  # prefill and decode of each decoder and batch shape
    return {"compiles": compiles, "decode_runs": len(batches) * modes * repeats,
            "estimated_minutes": compiles * compile_seconds / 60,
            "assumption": f"{compile_seconds:g} s per compile; the decode runs themselves are seconds"}


def best_run(decoder, params, prompts, repeats, gamma=0.35):
    from sbd_jax.decoding.generate import Executables, generate

    executables = Executables()
    runs = [generate(decoder, params, prompts, gamma=gamma, executables=executables) for _ in range(repeats)]
    return min(runs, key=lambda r: r[1].seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gammas", type=float, nargs="+", default=[0.35])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=DType.FLOAT32, choices=RUN_DTYPES)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--random", action="store_true",
                        help="random weights of the model's shape and random prompt ids (no files needed)")
    parser.add_argument("--verify", action="store_true", help="also each γ in the verified (lossless) mode")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the plan (compiles, runs, minutes) only")
    parser.add_argument("--compile-seconds", type=float, default=5.0, help="--dry-run's assumption per compile")
    args = parser.parse_args()
    if args.dry_run:
        print("e2e plan:", json.dumps(plan(args.batches, args.gammas, args.verify, args.repeats, args.compile_seconds)))
        return

    import jax
    import numpy as np

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.checkpoints.tokenizer import encode_prompt
    from sbd_jax.decoding.base import NTPDecoder
    from sbd_jax.decoding.sbd import SBDDecoder
    from sbd_jax.decoding.verified import VerifiedSBDDecoder
    from sbd_jax.model.transformer import init_params
    from sbd_jax.roofline import MODELS, ModelShape, speedup

    if args.random:
        config, _ = model_config(args.model, args.dtype)
        config = config.replace(mask_token_id=config.vocab_size - 1, scan_layers=False)
        params = jax.jit(lambda: init_params(config))()
        rng = np.random.RandomState(0)
        encoded = [rng.randint(0, config.vocab_size - 1, 30 + 5 * i).tolist() for i in range(len(PROMPTS))]
    else:
        model = load_model(args.model, dtype=args.dtype)
        config = model.config
        params = jax.device_put(model.params)
        encoded = [encode_prompt(model.tokenizer, p, chat=True) for p in PROMPTS]
    if args.mask_token_id is not None:
        config = config.replace(mask_token_id=args.mask_token_id)
    hw = hardware_for(jax.devices()[0], args.dtype)
    shape = MODELS.get(args.model) or ModelShape(args.model, config.vocab_size, config.hidden_size,
                                                 config.intermediate_size, config.num_layers, config.num_heads,
                                                 config.num_kv_heads, config.head_dim, config.tie_word_embeddings)
    common = dict(max_new_tokens=args.max_new_tokens, eos_ids=config.eos_token_ids)
    device = jax.devices()[0]
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"e2e_{device.platform}.json")
    report = {"model": args.model, "random_weights": args.random, "dtype": args.dtype, "platform": device.platform,
              "device": device.device_kind, "rows": []}
    for batch in args.batches:
        prompts = [encoded[i % len(encoded)] for i in range(batch)]
        ntp_results, ntp_time = best_run(NTPDecoder(config, **common), params, prompts, args.repeats)
        ntp_tokens = sum(len(r.token_ids) for r in ntp_results)
        ntp_rate = ntp_tokens / ntp_time.seconds
        for verify in (False, True) if args.verify else (False,):
            for gamma in args.gammas:
                decoder = (VerifiedSBDDecoder if verify else SBDDecoder)(config, block_size=args.block_size, **common)
                results, timing = best_run(decoder, params, prompts, args.repeats, gamma)
                tokens = sum(len(r.token_ids) for r in results)
                nfe = sum(r.nfe for r in results)
                passes_per_block = args.block_size * nfe / max(tokens, 1)
                kv = int(sum(len(p) for p in prompts) / batch + args.max_new_tokens / 2)
                predicted = speedup(hw, shape, batch, args.block_size, kv,
                                    min(max(passes_per_block, 1), args.block_size))
                row = {"batch": batch, "gamma": gamma, "block_size": args.block_size, "verify": verify,
                       "ntp_tokens": ntp_tokens, "ntp_seconds": ntp_time.seconds, "ntp_tokens_per_s": ntp_rate,
                       "sbd_tokens": tokens, "sbd_nfe": nfe, "sbd_seconds": timing.seconds,
                       "sbd_tokens_per_s": tokens / timing.seconds, "tokens_per_pass": tokens / max(nfe, 1),
                       "measured_speedup": (tokens / timing.seconds) / ntp_rate,
                       "roofline_speedup_for_observed_nfe": predicted, "hardware": hw.name,
                       "compile_seconds": timing.compile_seconds}
                if verify:
                    row["identical_to_ntp"] = all(r.token_ids == n.token_ids for r, n in zip(results, ntp_results))
                    row["accepted_fraction"] = sum(r.accepted for r in results) / max(sum(r.drafted for r in results), 1)
                row["measured_over_roofline"] = row["measured_speedup"] / predicted
                report["rows"].append(row)
                write_json(out, report)
                print(f"batch {batch} γ={gamma:g} k={args.block_size}{' verified' if verify else ''}: NTP "
                      f"{ntp_rate:.1f} tok/s ({ntp_tokens} tok) | SBD {row['sbd_tokens_per_s']:.1f} tok/s ({tokens} tok, "
                      f"{row['tokens_per_pass']:.2f} tok/pass) | wall-clock speedup {row['measured_speedup']:.2f}x vs "
                      f"roofline {predicted:.2f}x", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

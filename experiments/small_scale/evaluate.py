"""The small-scale study's decoding grid, and re-evaluation of a saved model on its test problems: NTP
decoding and SBD over (block size, γ), whole-answer exact match and tokens per pass. Every decode is greedy.

    python -m experiments.small_scale.evaluate --model experiments/small_scale/models/sbd_arith
        [--block-size 16 --gamma 0.1 ...] [--problems 2000]   # re-evaluate a saved model, no training
"""

from __future__ import annotations

import argparse
from typing import Sequence

import jax

from experiments.small_scale.task import STUDY, study_splits
from sbd_jax.checkpoints.load import load_model
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.evaluation.measure import EvaluatedModel, arithmetic_metrics
from sbd_jax.evaluation.recorded import describe, record


def settings(model: EvaluatedModel, block_sizes: Sequence[int], gammas: Sequence[float],
             diagnostic_block: int) -> list[Settings]:
    """Decoding settings: NTP; for a model with a mask token, the left-to-right γ = 0 diagnostic at
    `diagnostic_block` and the Entropy-Bounded grid."""
    out = [Settings(mode=Mode.NTP)]
    if model.config.mask_token_id is not None:
        out.append(Settings(mode=Mode.SBD, block_size=diagnostic_block, gamma=0.0, proxy=Proxy.LEFT_TO_RIGHT))
        out += [Settings(mode=Mode.SBD, block_size=k, gamma=g) for k in block_sizes for g in gammas]
    return out


def main() -> None:
    """Re-evaluates a saved model (e.g. the shipped one) on the study's test problems, no training."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF directory with a mask token (sbd_mask_token_id)")
    parser.add_argument("--block-size", type=int, nargs="+", default=[16])
    parser.add_argument("--gamma", type=float, nargs="+", default=[0.0, 0.1, 0.35, 0.6, 1.0])
    parser.add_argument("--verify", action="store_true", help="also the verified (lossless) mode at each block size")
    parser.add_argument("--problems", type=int, default=STUDY["test_problems"], help="how many test problems")
    args = parser.parse_args()
    loaded = load_model(args.model)
    model = EvaluatedModel(args.model, loaded.config, jax.device_put(loaded.params), loaded.tokenizer)
    test = study_splits().test
    test = test[: args.problems]
    grid = [Settings(mode=Mode.NTP)]
    grid += [Settings(mode=Mode.SBD, block_size=k, gamma=g) for k in args.block_size for g in args.gamma]
    grid += [Settings(mode=Mode.SBD, block_size=k, verify=True) for k in args.block_size if args.verify]
    for setting in grid:
        m = arithmetic_metrics(model, setting, test, STUDY["max_new_tokens"])
        row = record(setting)
        print(f"{describe(row):>12} k={row['block_size']:>2} γ={row['gamma']}: whole-answer {m['accuracy']:.1%} "
              f"[{m['ci95'][0]:.1%}, {m['ci95'][1]:.1%}], final number {m['accuracy_final_number']:.1%}, "
              f"{m['tokens_per_pass']:.2f} tokens/pass (n={m['n']})", flush=True)


if __name__ == "__main__":
    main()

"""The third draft-training decision: train the last adapter version on new answers of the base, or on more passes?

The repository's history budget holds one more version of the shipped adapter, which has read its 597 training
answers 8.3 times (README).

    python -m recipes.smollm2_sbd.run --workdir runs/more_data --cpu --train-prompts 3200 --stop-after distill
    python -m experiments.draft_training.data_or_passes --workdir runs/data_or_passes          # both arms (resumable)
    python -m experiments.draft_training.data_or_passes --workdir runs/data_or_passes --ship   # the winner, shipped

Fixed on 2026-12-07, before either arm trained and before the new answers existed:

- **Arms**: `passes`, a piece (`piece.py`) of `STEPS` steps from the shipped adapter on the recipe's CPU data
  (`data/cpu`), and `data`, the same piece on `DATA` (the 3,200-prompt distillation: the same first 800 prompts
  and 2,400 more, so about a quarter of what it reads is the old answers). Everything else is the piece's: the decided arm's objective, rank, 10x learning rate, batch
  4 x 512, seed; constant after warm-up with the last `DECAY` steps decayed to a tenth, as the shipped
  adapter's last piece. Equal steps are equal CPU time (the same shapes); the distillation, once, is extra.
- **Measured** at the end on the recipe's validation prompts, never the test prompts (`run.measure`, the
  second decision's measure: verified tokens per forward at blocks 4 and 8, SBD and hybrid drafts, fallback
  blocks, acceptance by position, plain SBD), against the base's NTP outputs in `results.json`; the float32
  export is measured, the winner ships in bfloat16 (as every piece before).
- **Rule**: `data` if its verified SBD tokens per forward at block 4 exceed `passes`' by more than 0.02;
  otherwise `passes`, which needs no new data in the repository.

Results: `experiments/draft_training/data_or_passes.json`, written after each arm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments.draft_training import piece, run
from sbd_jax.errors import UserError
from sbd_jax.evaluation.results import provenance, write_json

STEPS = 150  # the shipped adapter's last piece: about 70 CPU minutes
DECAY = 50
DATA = os.path.join("recipes", "smollm2_sbd", "data", "cpu_3200prompts")
ARMS = {"passes": piece.DEFAULT_DATA, "data": DATA}
CRITERION = "verified_sbd_4"  # `run.verified_row`'s name for SBD drafts at block 4
MARGIN = 0.02
OUT = os.path.join(run.HERE, "data_or_passes.json")


def choose(results: dict) -> str | None:
    """The rule (module docstring) over `results`; None until both arms are measured."""
    points = {name: results["arms"].get(name, {}).get("point") for name in ARMS}
    if any(p is None for p in points.values()):
        return None
    return "data" if points["data"][CRITERION] - points["passes"][CRITERION] > MARGIN else "passes"


def piece_argv(name: str, workdir: str) -> list[str]:
    """`piece.py`'s arguments for arm `name` (shipping left to `--ship`)."""
    return ["--steps", str(STEPS), "--decay-steps", str(DECAY), "--workdir", os.path.join(workdir, name),
            "--data", ARMS[name]]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the arms' piece folders (WORKDIR/passes, WORKDIR/data)")
    parser.add_argument("--ship", action="store_true", help="ship the winner over the packaged adapter")
    args = parser.parse_args(argv)
    results = json.load(open(OUT)) if os.path.exists(OUT) else {
        "provenance": provenance(), "steps": STEPS, "decay_steps": DECAY, "criterion": CRITERION,
        "margin": MARGIN, "arms": {}}
    if args.ship:
        winner = choose(results)
        if winner is None:
            raise UserError(f"{OUT} does not hold both arms' measurements yet: run without --ship first")
        trained = results["arms"][winner]["workdir"]
        if not os.path.isfile(os.path.join(trained, piece.PIECE)) or os.path.abspath(
                os.path.join(args.workdir, winner)) != trained:
            raise UserError(f"the measured {winner} arm was trained in {trained}, which this --workdir does not "
                            f"hold: ship from --workdir {os.path.dirname(trained)} (another would train it again)")
        return {"shipped": piece.main(piece_argv(winner, args.workdir)), "winner": winner}
    if not os.path.isfile(os.path.join(run.ROOT, DATA, "train.jsonl")):
        raise UserError(f"{DATA} is not distilled yet: python -m recipes.smollm2_sbd.run --workdir runs/more_data "
                        "--cpu --train-prompts 3200 --stop-after distill")
    # the base's NTP outputs on the validation prompts at the decisions' sizes (run.STUDY)
    base = json.load(open(os.path.join(run.HERE, "results.json")))["base"]
    for name in ARMS:
        arm = results["arms"].setdefault(name, {"data": ARMS[name]})
        if "point" in arm:
            continue
        export = piece.main(piece_argv(name, args.workdir) + ["--no-ship"])
        workdir = os.path.abspath(os.path.join(args.workdir, name))
        recorded = json.load(open(os.path.join(workdir, piece.PIECE)))  # the decided arm, the commit it began at
        arm.update(workdir=workdir, commit=recorded["commit"])
        arm["point"] = run.measure(recorded["arm"], export, STEPS, run.STUDY, base)
        write_json(OUT, results)
        print(json.dumps({"arm": name, **arm["point"]}), flush=True)
    results["winner"] = choose(results)
    write_json(OUT, results)
    print(f"winner: {results['winner']} (by {CRITERION}; ship it with --ship)", flush=True)
    return results


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

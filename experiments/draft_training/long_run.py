"""The winner's long run measured as the arms were: the recipe's CPU run as a gated adapter
(`python -m recipes.smollm2_sbd.run --workdir W --cpu --adapter-rank 16`, the `adapter_lr10` arm's objective,
rank and learning rate, 150 steps) at each of its milestones, on the arms' 24 validation prompts with their
measure (`run.measure`), so that its curve continues theirs.

    python -m experiments.draft_training.long_run --workdir runs/cpu_adapter    # adds "long_run" to results.json

Resumable: a milestone already in results.json is not measured again. Minutes of training per point are its
step times the run's median seconds per step (from the recipe's results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments.draft_training.run import HERE, STUDY, measure
from sbd_jax.evaluation.results import commit, write_json

ROOT = os.path.dirname(os.path.dirname(HERE))
RECIPE_RESULTS = os.path.join(ROOT, "recipes", "smollm2_sbd", "results", "cpu_adapter", "results.json")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the recipe run's workdir (its train/adapter_STEP milestones)")
    parser.add_argument("--results", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    with open(RECIPE_RESULTS) as f:
        recipe = json.load(f)
    run = results.setdefault("long_run", {"points": []})
    run.update(command="python -m recipes.smollm2_sbd.run --workdir WORKDIR --cpu --adapter-rank 16",
               seconds_per_step=recipe["train"]["median_seconds_per_step"], steps=recipe["train"]["steps"],
               trained_at=recipe["provenance"]["commit"])
    for step in sorted(map(int, recipe["train"]["milestones"])):
        if any(p["step"] == step for p in run["points"]):
            continue
        export = os.path.join(args.workdir, "train", f"adapter_{step}")
        if not os.path.isdir(export):
            raise SystemExit(f"{export} is missing: train it with the command above (--train-until {step})")
        # commit: the hybrid columns depend on the decoder's rule at the time of measuring
        run["points"].append({**measure("adapter_lr10", export, step, STUDY, results["base"]), "commit": commit()})
        write_json(args.results, results)
        print(json.dumps({"long_run": run["points"][-1]}), flush=True)
    return results


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

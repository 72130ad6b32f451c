"""The winner's long runs measured as the arms were: a recipe run of the gated adapter
(`python -m recipes.smollm2_sbd.run --workdir W --cpu --adapter-rank 16 [--steps N]`, the `adapter_lr10` arm's
objective, rank and learning rate) at each milestone it recorded, on the arms' 24 validation prompts with their
measure (`run.measure`), so that its curve continues theirs.

    python -m experiments.draft_training.long_run \
        --recipe-results recipes/smollm2_sbd/results/cpu_adapter/results.json   # -> long_runs.cpu_adapter

Each run is named by its results folder and kept under "long_runs" in results.json. Resumable: a milestone
already there is not measured again. Minutes of training per point are its step times the run's median seconds
per step (from the recipe's results.json). A point measured before fallback blocks existed gets their rows
(`run.fallback_rows`) added, with the commit that measured them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments.draft_training.run import FALLBACK_KEY, HERE, STUDY, fallback_rows, measure, model_and_prompts
from sbd_jax.evaluation.results import commit, write_json


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe-results", required=True,
                        help="the recipe run's results.json (its command, schedule and milestone exports)")
    parser.add_argument("--results", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    with open(args.recipe_results) as f:
        recipe = json.load(f)
    if not recipe.get("adapter_rank"):
        raise SystemExit(f"{args.recipe_results} is not a gated adapter's run: the long run continues the "
                         "adapter_lr10 arm (run the recipe with --adapter-rank 16)")
    name = os.path.basename(os.path.dirname(os.path.abspath(args.recipe_results)))
    run = results.setdefault("long_runs", {}).setdefault(name, {"points": []})
    run.update(command=recipe["command"], seconds_per_step=recipe["train"]["median_seconds_per_step"],
               steps=recipe["train"]["steps"], trained_at=recipe["provenance"]["commit"])
    for step, export in sorted((int(s), path) for s, path in recipe["train"]["milestones"].items()):
        point = next((p for p in run["points"] if p["step"] == step), None)
        if point is not None and FALLBACK_KEY not in point and os.path.isdir(export):
            model, prompts = model_and_prompts("adapter_lr10", export, STUDY)
            point.update(fallback_rows(model, prompts, results["base"]["outputs"], STUDY), fallback_commit=commit())
            write_json(args.results, results)
            print(json.dumps({name: {"step": step, "fallback rows added": FALLBACK_KEY}}), flush=True)
        if point is not None:
            continue
        if not os.path.isdir(export):
            raise SystemExit(f"{export} is missing: train it with {recipe['command']} --train-until {step}")
        # commit: the hybrid columns depend on the decoder's rule at the time of measuring
        run["points"].append({**measure("adapter_lr10", export, step, STUDY, results["base"]), "commit": commit()})
        write_json(args.results, results)
        print(json.dumps({name: run["points"][-1]}), flush=True)
    return results


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

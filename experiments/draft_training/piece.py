"""Train the shipped adapter on by one piece: N more steps from the adapter committed in the package, shipped
back over it with its steps and training log continued (issue 55, "train it in pieces").

    python -m experiments.draft_training.piece --steps 150                      # WORKDIR runs/piece
    python -m experiments.draft_training.piece --steps 150 --workdir runs/piece # again after a kill: resumes
    python -m experiments.draft_training.piece ... --no-ship                    # export only (a decision's arm)

A piece is the decision's winning arm (`run.choose_second` over results.json; `--arm` until the decision is
recorded) as `run.arm_config` builds it (its objective, rank, learning rate, the recipe's CPU data, batch and
sequence length), changed in four places:

- `adapter.init_from`: WORKDIR/start, a copy of the shipped adapter taken when the piece first starts (the piece
  ships over that folder, so a rerun continues from the same start);
- `data.skip`: the S steps the shipped adapter has (every piece on the same data, batch and seed draws the
  batches one uninterrupted run would draw after S steps; a piece on other `--data` only starts S steps into
  that data's shuffled epochs);
- the learning rate: `wsd` with no decay (constant at the arm's peak rate after a warm-up over the first
  `WARMUP` steps, a tenth of a shorter piece), or `--decay-steps D` to decay over the last D steps of a
  final piece;
- checkpoints every `CHECKPOINT_EVERY` steps. A rerun with the same WORKDIR resumes from its own checkpoint,
  which takes precedence over `adapter.init_from`; a piece that is done only exports and ships again.

What a new piece loses against one long run: Adam's moments (they start at zero; the warm-up keeps the first
steps small while they fill) and the learning-rate schedule's position (each piece warms up again); the mask
draws and block sizes follow the piece's own step count, so they repeat the first piece's draws on other
batches. The data position is kept (`data.skip`).

It ends by exporting WORKDIR/export and shipping it (`ship.ship`, `continues` = WORKDIR/start): the folder
records S + N steps, every piece, and the joined training log. It prints the command that commits it; each
shipped rank-16 SmolLM2 adapter adds about 10 MB to the repository's history.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
from typing import Any

from experiments.draft_training import run, ship
from sbd_jax.checkpoints.adapter import CONFIG, WEIGHTS, read_adapter_config
from sbd_jax.checkpoints.load import resolve_adapter
from sbd_jax.errors import UserError

NAME = "smollm2-135m-sbd"  # the shipped adapter the pieces continue (KNOWN_ADAPTERS)
WARMUP = 10  # steps of linear warm-up from 0 at the start of every piece (fresh Adam moments)
CHECKPOINT_EVERY = 10  # a killed piece loses at most this many steps (SIGTERM and Ctrl-C lose none)
DEFAULT_DATA = os.path.relpath(run.DATA, run.ROOT)  # the recipe's kept CPU distillation, every piece before --data
PIECE = "piece.json"  # in WORKDIR: what the piece is, written when it first starts


def repository_path(path: str) -> str:
    """`path` (relative to the repository root, or absolute) relative to the root, normalised: one spelling per
    folder, as piece.json and the shipped command record it."""
    return os.path.relpath(os.path.abspath(os.path.join(run.ROOT, path)), run.ROOT)


def decided_arm(results: dict, asked: str | None) -> str:
    """The arm the pieces train: the second decision's winner, or `asked` while the decision is not recorded."""
    winner = run.choose_second(results)
    if winner is not None and asked not in (None, winner):
        raise UserError(f"the decision (experiments/draft_training/results.json) picked {winner}: drop --arm "
                        f"{asked} (a shipped adapter continues the winner)")
    arm = winner or asked
    if arm is None:
        raise UserError(f"the decision between {run.BASELINE} and {', '.join(run.SECOND_DECISION)} is not recorded "
                        "in results.json yet: give --arm NAME")
    if arm not in run.ARMS or not run.is_adapter(arm):
        adapters = [name for name in run.ARMS if run.is_adapter(name)]
        raise UserError(f"--arm {arm}: give one of the adapter arms, {', '.join(adapters)}")
    return arm


def objective_of(arm: str, results: dict) -> dict:
    """The arm's objective options: its entry in `run.ARMS`, or the one its run recorded (the adapter arms that
    took the first decision's pick)."""
    objective = run.ARMS[arm]
    if objective is None:
        objective = results["arms"].get(arm, {}).get("objective")
    if objective is None:
        raise UserError(f"arm {arm} takes its objective from the first decision, which results.json does not record")
    return dict(objective)


def take_start(workdir: str, name: str) -> str:
    """WORKDIR/start: a copy of the adapter `name` (a shipped name or a directory) taken the first time, the
    same folder on every rerun (the piece ships over the original)."""
    start = os.path.join(workdir, "start")
    if os.path.isfile(os.path.join(start, CONFIG)):
        return start
    source = resolve_adapter(name)
    partial = start + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    os.replace(partial, start)
    return start


def steps_of_start(start: str) -> int:
    shipped = read_adapter_config(start).get("shipped") or {}
    if shipped.get("steps") is None:
        raise UserError(f"{start} records no training steps (adapter.json's shipped.steps): ship the adapter with "
                        "--steps before training pieces on it")
    return int(shipped["steps"])


def piece_config(arm: str, objective: dict, sizes: dict, steps: int, start: str, done: int,
                 decay_steps: int, data: str = run.DATA) -> Any:
    """`run.arm_config`'s config for `arm` on the distilled data in `data`, continuing the adapter `start` of
    `done` steps for `steps` more (the module docstring's four changes)."""
    from sbd_jax.training.config import Schedule

    cfg = run.arm_config(arm, objective, sizes, "", steps, data)
    return dataclasses.replace(
        cfg, adapter=dataclasses.replace(cfg.adapter, init_from=start), data=dataclasses.replace(cfg.data, skip=done),
        optimizer=dataclasses.replace(cfg.optimizer, schedule=Schedule.WSD, decay_steps=decay_steps,
                                      warmup_steps=min(WARMUP, max(steps // 10, 1))),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=min(CHECKPOINT_EVERY, steps), keep=2, keep_period=0))


def recorded_piece(workdir: str, asked: dict) -> dict:
    """WORKDIR/piece.json: `asked` the first time; on a rerun the recorded piece, refused where `asked` differs
    (an unset --arm takes the recorded one)."""
    path = os.path.join(workdir, PIECE)
    if not os.path.isfile(path):
        with open(path, "w") as f:
            json.dump(asked, f, indent=1)
        return asked
    recorded = json.load(open(path))
    for key in ("steps", "arm", "name", "decay_steps", "smoke", "data"):
        if asked.get(key) is not None and asked[key] != recorded.get(key):
            raise UserError(f"{workdir} holds a piece with {key}={recorded.get(key)!r} (its {PIECE}), not "
                            f"{asked[key]!r}: rerun it as it was started, or give another --workdir")
    return recorded


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True, help="steps this piece trains")
    parser.add_argument("--workdir", default="runs/piece",
                        help="the piece's run directory (a rerun with the same one resumes; a new piece needs an "
                             "empty one)")
    parser.add_argument("--arm", default=None, help="the arm to train while results.json records no decision")
    parser.add_argument("--name", default=NAME, help="the shipped adapter to continue and ship over")
    parser.add_argument("--decay-steps", type=int, default=0,
                        help="decay the learning rate linearly over this piece's last D steps (the final piece)")
    parser.add_argument("--data", default=None,
                        help="distilled data to train on, a folder with train.jsonl, relative to the repository root "
                             "or absolute (default: the recipe's kept CPU data, recipes/smollm2_sbd/data/cpu; "
                             "`recipes.smollm2_sbd.run --cpu --train-prompts N --stop-after distill` makes more)")
    parser.add_argument("--smoke", action="store_true", help="the decision's smoke sizes (run.SMOKE)")
    parser.add_argument("--note", default=None, help="a paragraph for the shipped README.md")
    parser.add_argument("--no-ship", action="store_true",
                        help="stop after exporting WORKDIR/export (a decision between pieces ships one later: the "
                             "same command without --no-ship ships it without training again)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: give at least 1")
    from sbd_jax.evaluation.results import commit
    from sbd_jax.training.trainer import Trainer, make_workdir

    make_workdir(args.workdir)
    results = json.load(open(os.path.join(run.HERE, "results.json")))
    data = None if args.data is None else repository_path(args.data)
    if data is not None and not os.path.isfile(os.path.join(run.ROOT, data, "train.jsonl")):
        raise UserError(f"--data {args.data}: no train.jsonl there (paths are relative to the repository root)")
    asked = {"steps": args.steps, "arm": args.arm, "name": args.name, "decay_steps": args.decay_steps,
             "smoke": args.smoke, "data": data}
    if not os.path.isfile(os.path.join(args.workdir, PIECE)):
        asked["arm"] = decided_arm(results, args.arm)
        asked["data"] = data or DEFAULT_DATA
    elif args.arm is not None:
        decided_arm(results, args.arm)
    start = take_start(args.workdir, args.name)  # before piece.json: a start that fails records nothing
    done = steps_of_start(start)
    piece = recorded_piece(args.workdir, {**asked, "commit": commit()})
    sizes = run.SMOKE if piece["smoke"] else run.STUDY
    data = piece.get("data") or DEFAULT_DATA  # a piece.json written before --data: the default
    cfg = piece_config(piece["arm"], objective_of(piece["arm"], results), sizes, piece["steps"], start, done,
                       piece["decay_steps"], os.path.join(run.ROOT, data))
    print(f"piece: {piece['arm']}, steps {done + 1}-{done + piece['steps']} from {piece['name']} "
          f"({done} steps; copy in {start})", file=sys.stderr, flush=True)
    trainer = Trainer(cfg, args.workdir)
    trainer.run()
    export = os.path.join(args.workdir, "export")
    trainer.export(export)
    if args.no_ship:
        print(f"exported {export} (not shipped: --no-ship)", file=sys.stderr, flush=True)
        return export
    command = "python -m experiments.draft_training.piece " + " ".join(
        [f"--steps {piece['steps']}", f"--arm {piece['arm']}", f"--workdir {args.workdir}"] +
        (["--smoke"] if piece["smoke"] else []) +
        ([f"--decay-steps {piece['decay_steps']}"] if piece["decay_steps"] else []) +
        ([f"--data {shlex.quote(data)}"] if data != DEFAULT_DATA else []) +
        ([f"--name {piece['name']}"] if piece["name"] != NAME else []))
    out = ship.ship(export, piece["name"], steps=piece["steps"], metrics=os.path.join(args.workdir, "metrics.jsonl"),
                    trained_at_commit=piece["commit"], command=command, continues=start,
                    note=args.note or f"Last piece: {piece['steps']} steps of arm {piece['arm']} "
                                      f"(experiments/draft_training/piece.py) from the adapter's step {done}.")
    total = done + piece["steps"]
    folder = os.path.relpath(out, run.ROOT)
    print(f"shipped {out} ({total} steps; {os.path.getsize(os.path.join(out, WEIGHTS)) / 1e6:.1f} MB). Commit it:\n"
          f"  git add {folder} && git commit -m \"Issue 55: {piece['name']} trained to step {total} (a piece of "
          f"{piece['steps']} steps of {piece['arm']} from step {done})\" -- {folder}")
    return out


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

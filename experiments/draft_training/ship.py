"""Ship a trained adapter inside the package: a bfloat16 copy of an exported adapter directory, with where it came
from, written to `sbd_jax/adapters/<name>/` so that `sbd_jax.load(base, adapter=name)` finds it.

    python -m experiments.draft_training.ship --export runs/draft_training/adapter_kl_full/export_40 \
        --name smollm2-135m-sbd --note "issue 55, piece 1: adapter_kl_full's objective"

The folder gets `adapter.safetensors` (the export's tensors rounded to bfloat16: half the bytes, ~9.8 MB for
rank 16 on SmolLM2-135M; loading casts them to the model's weights dtype), `adapter.json` (the export's, plus
`dtype` and `shipped`: the source directory, its steps, the commit it was trained at when given and the commit
that shipped it), `training_log.jsonl` (one line a step up to the export's: loss, learning rate, gradient norm,
seconds; from the run's metrics.jsonl) and `README.md` (the same in words). A folder already there is replaced
file by file: each piece of a long run ships over the last. A piece that started from a shipped adapter
(`adapter.init_from`, which the export's adapter.json records) ships with `--continues FOLDER`, that adapter's
folder as the piece found it (`piece.py` keeps a copy): its steps S and this piece's N ship as S + N, its
training_log.jsonl is followed by this piece's rows (steps from S + 1), and `shipped.pieces` lists every
piece, so the shipped folder describes the whole training. A name that `KNOWN_ADAPTERS`
(sbd_jax/checkpoints/load.py) lists must come from an export of the base it names there; another name is
written, with a reminder to list it. Then `git add sbd_jax/adapters/<name>` and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import textwrap

import sbd_jax
from sbd_jax.checkpoints.adapter import CONFIG, WEIGHTS, read_adapter_config, write_copy
from sbd_jax.checkpoints.load import KNOWN_ADAPTERS, adapter_folder
from sbd_jax.cli import run_cli
from sbd_jax.errors import UserError
from sbd_jax.evaluation.results import commit

LOG, README = "training_log.jsonl", "README.md"
LOG_KEYS = ("step", "loss", "matp_loss", "ntp_loss", "lr", "grad_norm", "block_size", "tokens", "seconds")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


def steps_of(export: str, given: int | None) -> int | None:
    """The export's training steps: `given`, else the `N` of a directory named `export_N` (run.py's and the
    recipe's milestones), else unknown."""
    if given is not None:
        return given
    match = re.fullmatch(r"export_(\d+)", os.path.basename(os.path.normpath(export)))
    return int(match.group(1)) if match else None


def training_log(metrics: str, steps: int | None) -> list[dict]:
    """The run's metrics.jsonl, one row a step up to `steps` (a resumed run repeats the steps after its last
    checkpoint: the later row is the one that counts), with the fields a reader needs (`LOG_KEYS`)."""
    rows: dict[int, dict] = {}
    with open(metrics) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if "step" in row and (steps is None or row["step"] <= steps):
                rows[int(row["step"])] = {k: _rounded(row[k]) for k in LOG_KEYS if k in row}
    return [rows[s] for s in sorted(rows)]


def _rounded(value: object) -> object:
    return float(f"{value:.6g}") if isinstance(value, float) else value


def continued(export: str, meta: dict, continues: str | None) -> tuple[int, list[dict], list[dict]]:
    """(steps, training log, pieces) of the adapter `continues` that the export (its adapter.json `meta`) was
    trained on from; (0, [], []) without one. Refuses an export that records a start (`init_from`) shipped
    without it, a start of other steps, and a `continues` that is another adapter."""
    started = meta.get("init_from")
    if continues is None:
        if started:
            raise UserError(f"{export} continues the adapter {started['source']} ({started.get('steps')} steps): "
                            "give --continues with that adapter's folder, so that the shipped steps and training "
                            "log cover every piece")
        return 0, [], []
    previous = read_adapter_config(continues)
    shipped = previous.get("shipped") or {}
    if shipped.get("steps") is None:
        raise UserError(f"--continues {continues} records no training steps (adapter.json's shipped.steps): "
                        "ship it again with --steps")
    for key in ("rank", "alpha", "targets", "mask_token_id"):
        if previous[key] != meta[key]:
            raise UserError(f"--continues {continues} has {key} {previous[key]}, the export {meta[key]}: it is "
                            "another adapter than the one the export was trained from")
    if previous["base"]["fingerprint"] != meta["base"]["fingerprint"]:
        raise UserError(f"--continues {continues} was trained on another base than the export "
                        f"({previous['base']['fingerprint']} against {meta['base']['fingerprint']})")
    if started and started.get("steps") not in (None, shipped["steps"]):
        raise UserError(f"{export} was trained from an adapter of {started['steps']} steps, --continues "
                        f"{continues} has {shipped['steps']}: give the folder the piece started from")
    log_file = os.path.join(continues, LOG)
    log = [json.loads(line) for line in open(log_file) if line.strip()] if os.path.isfile(log_file) else []
    pieces = shipped.get("pieces") or [{k: shipped.get(k) for k in PIECE_KEYS}]  # shipped before pieces were listed
    return int(shipped["steps"]), log, pieces


PIECE_KEYS = ("source", "steps", "trained_at_commit", "command", "date")


def readme(name: str, meta: dict, log: list[dict], note: str | None, size: int) -> str:
    """The folder's README.md: what the adapter is, how to load it, where it came from, its training in brief."""
    shipped, base = meta["shipped"], meta["base"]
    lines = [f"# {name}", "",
             f"A gated SBD adapter for `{base['name']}`, stored in {meta['dtype']} ({size / 1e6:.1f} MB):",
             f"rank {meta['rank']}, alpha {meta['alpha']}, targets {', '.join(meta['targets'])};",
             f"mask token {meta['mask_token_id']}, base fingerprint {base['fingerprint']}.", "",
             "```bash",
             f"python sample.py --model {base['name']} --adapter {name} --prompt \"...\" --chat --mode sbd --verify "
             "--drafts tree-sbd --block-size 4",
             "```", "",
             "(the context's matches, the model's successors and the adapter's block in one tree; "
             "`docs/decoding.md` says what each `--drafts` source does)", "",
             f"or `sbd_jax.load(\"{base['name']}\", adapter=\"{name}\")`. NTP and verified decoding give the base "
             "model's own output exactly; the adapter only drafts.", "",
             "## Where it came from", "",
             f"- export: `{shipped['source']}`, {shipped['steps'] if shipped['steps'] is not None else 'unknown'} "
             "training steps" + (f" in all, in {len(shipped['pieces'])} pieces (below)"
                                 if len(shipped.get("pieces", [])) > 1 else ""),
             f"- trained at commit: {shipped['trained_at_commit'] or 'not recorded'}",
             *([f"- training command: `{shipped['command']}`"] if shipped.get("command") else []),
             f"- shipped at commit {shipped['shipped_at_commit']} on {shipped['date']} "
             f"(`python -m experiments.draft_training.ship`), float32 rounded to {meta['dtype']}"]
    if len(shipped.get("pieces", [])) > 1:
        lines += ["", "Pieces, each starting from the adapter the one before shipped (optimizer state fresh):", ""]
        lines += [f"{i}. {p.get('steps')} steps: `{p.get('source')}`, commit {p.get('trained_at_commit') or '?'}, "
                  f"{p.get('date') or '?'}" + (f":\n   `{p['command']}`" if p.get("command") else "")
                  for i, p in enumerate(shipped["pieces"], 1)]
    if note:
        lines += ["", textwrap.fill(note, 110)]
    if log:
        first, last = log[0], log[-1]
        seconds = sum(r.get("seconds", 0.0) for r in log)
        lines += ["", "## Training log", "",
                  f"`{LOG}`: {len(log)} steps ({first['step']}–{last['step']}), "
                  f"{seconds / 60:.1f} minutes of steps; loss {first.get('loss', float('nan')):.3f} at step "
                  f"{first['step']}, {_mean_loss(log[-10:]):.3f} averaged over the last {len(log[-10:])}."]
    return "\n".join(lines) + "\n"


def _mean_loss(rows: list[dict]) -> float:
    losses = [r["loss"] for r in rows if "loss" in r]
    return sum(losses) / len(losses) if losses else float("nan")


def ship(export: str, name: str, out: str | None = None, steps: int | None = None, metrics: str | None = None,
         trained_at_commit: str | None = None, command: str | None = None, note: str | None = None,
         dtype: str = "bfloat16", continues: str | None = None) -> str:
    """Writes the shippable copy of `export` (see the module docstring) and returns its folder. `steps`: the
    export's own; with `continues` (the adapter it was trained from) the copy records those plus its."""
    if not _NAME.fullmatch(name):
        raise UserError(f"adapter name {name!r}: use lower-case letters, digits, '.', '_' and '-'")
    meta = read_adapter_config(export)
    if name in KNOWN_ADAPTERS and meta["base"].get("name") != KNOWN_ADAPTERS[name][0]:
        raise UserError(f"{export} was trained on base {meta['base'].get('name')!r}; {name!r} is listed in "
                        f"KNOWN_ADAPTERS for {KNOWN_ADAPTERS[name][0]!r}")
    if out is None:
        out = adapter_folder(name) if name in KNOWN_ADAPTERS else os.path.join(
            os.path.dirname(os.path.abspath(sbd_jax.__file__)), "adapters", name)
    if metrics is None:
        beside = os.path.join(os.path.dirname(os.path.normpath(export)), "metrics.jsonl")
        metrics = beside if os.path.isfile(beside) else None
    elif not os.path.isfile(metrics):
        raise UserError(f"metrics file {metrics} does not exist")
    before, earlier_log, pieces = continued(export, meta, continues)
    steps = steps_of(export, steps)
    log = training_log(metrics, steps) if metrics else []
    if steps is None and log:
        steps = log[-1]["step"]
    if continues is not None and steps is None:
        raise UserError(f"the steps of {export} are unknown: give --steps (this piece's), so that they add to the "
                        f"{before} of --continues")
    log = earlier_log + [{**row, "step": row["step"] + before} for row in log]
    piece = {"source": os.path.normpath(export), "steps": steps, "trained_at_commit": trained_at_commit,
             "command": command, "date": datetime.date.today().isoformat()}
    note_meta = {**piece, "steps": None if steps is None else before + steps, "shipped_at_commit": commit(),
                 "metrics": metrics, "pieces": pieces + [piece]}
    meta = write_copy(export, out, dtype, note_meta)
    with open(os.path.join(out, LOG), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in log)
    with open(os.path.join(out, README), "w") as f:
        f.write(readme(name, meta, log, note, os.path.getsize(os.path.join(out, WEIGHTS))))
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", required=True,
                        help="an exported adapter directory (adapter.json + adapter.safetensors): run.py's "
                             "WORKDIR/ARM/export_N, a recipe milestone, or train.py's WORKDIR/adapter")
    parser.add_argument("--name", required=True, help="the name it loads by (a KNOWN_ADAPTERS key, e.g. "
                                                      "smollm2-135m-sbd)")
    parser.add_argument("--out", default=None, help="the folder to write (default: the package's adapters/NAME)")
    parser.add_argument("--steps", type=int, default=None,
                        help="the export's training steps (default: N of a folder named export_N, else the log's "
                             "last); with --continues, this piece's alone")
    parser.add_argument("--metrics", default=None,
                        help="the run's metrics.jsonl (default: the one beside the export, if any)")
    parser.add_argument("--commit", default=None, help="the commit the adapter was trained at (recorded as given)")
    parser.add_argument("--command", default=None, help="the command that trained it (recorded as given)")
    parser.add_argument("--note", default=None, help="a paragraph for its README.md (what run, which piece)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--continues", default=None,
                        help="the shipped adapter folder the export's training started from (adapter.init_from), as "
                             "it was then: the copy records its steps plus the export's and joins the training logs")
    args = parser.parse_args(argv)
    out = ship(args.export, args.name, args.out, args.steps, args.metrics, args.commit, args.command, args.note,
               args.dtype, args.continues)
    sizes = {f: os.path.getsize(os.path.join(out, f)) for f in (WEIGHTS, CONFIG, LOG, README)}
    print(f"wrote {out}: " + ", ".join(f"{f} {n / 1e6:.1f} MB" if n > 1e5 else f"{f} {n / 1e3:.1f} kB"
                                        for f, n in sizes.items()))
    if args.name not in KNOWN_ADAPTERS:
        print(f"{args.name!r} is not in KNOWN_ADAPTERS (sbd_jax/checkpoints/load.py): add it there to load it by "
              "name; until then load it by its folder", file=sys.stderr)
    return out


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

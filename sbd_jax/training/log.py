"""Training logs: metrics fetched in windows (one host sync per window) and timed, a status line,
metrics.jsonl kept consistent with the restored checkpoint, TensorBoard when available."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import jax

from sbd_jax.errors import UserError


class MetricsLog:
    """A run's metrics.jsonl and TensorBoard scalars, written by the primary process only (hosts share
    the workdir). On resume, the lines of steps after the restored checkpoint are dropped first: they are
    about to be recomputed."""

    def __init__(self, workdir: str, completed: int, primary: bool):
        self.file: Any = None
        self.writer: Any = None
        if primary:
            path = os.path.join(workdir, "metrics.jsonl")
            if os.path.exists(path):
                keep = [json.dumps(row) + "\n" for row in _read_rows(path) if row["step"] <= completed]
                with open(path, "w") as f:
                    f.writelines(keep)
            self.file = open(path, "a")
            self.writer = _tensorboard(workdir)

    def write(self, rows: list[dict[str, float]]) -> None:
        if self.file is None:
            return
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
            if self.writer is not None:
                for name, value in row.items():
                    self.writer.add_scalar(name, value, row["step"])
        self.file.flush()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.file is not None:
            self.file.close()


def _read_rows(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A cut last line (a kill or a full disk mid-write) is dropped with a
    note: the checkpoints hold the run, the log only mirrors them. A damaged line elsewhere is an error."""
    with open(path, "rb") as f:
        lines = [(number, line) for number, line in enumerate(f.read().split(b"\n"), 1) if line.strip()]
    rows = []
    for number, line in lines:
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("no step")
        except ValueError:  # bad JSON or UTF-8 too
            if number < lines[-1][0]:
                raise UserError(f"{path}:{number}: the record is damaged ({line[:60]!r}): remove that line, or move "
                                "the file away (the run's checkpoints do not depend on it)") from None
            print(f"note: {path}: its last record was cut off ({line[:60]!r}); dropped, the run resumes from "
                  "its checkpoint", file=sys.stderr)
            continue
        rows.append(row)
    return rows


def _tensorboard(workdir: str) -> Any:
    """A TensorBoard writer into `workdir/tensorboard`, or None without tensorboardX."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(workdir, "tensorboard"))


@dataclasses.dataclass
class Window:
    """Steps dispatched since the last fetch, their metrics still on device. `fetch` brings them to the
    host in one transfer and times the window: per step, its wall time less compiles, divided evenly
    (steps overlap, so one step's own time is not observable without a sync per step)."""

    tokens_per_step: int
    flops_per_step: float
    peak_flops: float | None
    pending: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.began = time.perf_counter()

    def add(self, step: int, block_size: int, metrics: dict[str, jax.Array], compile_seconds: float) -> None:
        self.pending.append((step, block_size, metrics, compile_seconds))

    def fetch(self) -> list[dict[str, float]]:
        fetched = jax.device_get([metrics for _, _, metrics, _ in self.pending])
        now = time.perf_counter()
        compiles = sum(c for *_, c in self.pending)
        seconds = max(now - self.began - compiles, 1e-9) / len(self.pending)
        rows = []
        for (step, k, _, compile_seconds), metrics in zip(self.pending, fetched):
            metrics = {name: float(v) for name, v in metrics.items()}
            bad = [name for name in ("loss", "grad_norm") if not math.isfinite(metrics[name])]
            if bad:
                raise UserError(f"step {step}: non-finite {' and '.join(bad)} ({', '.join(f'{n}={metrics[n]}' for n in bad)}"
                                "); stopped without saving this state, the last checkpoint stays: lower "
                                "optimizer.lr or check the data, then rerun to resume from it")
            row = {"step": step, "block_size": k, **metrics, "seconds": seconds,
                   "tokens_per_s": self.tokens_per_step / seconds, "compile_seconds": compile_seconds}
            if self.peak_flops:
                row["mfu"] = self.flops_per_step / seconds / self.peak_flops
            rows.append(row)
        self.pending, self.began = [], time.perf_counter()
        return rows


@dataclasses.dataclass
class Progress:
    """One status line per fetch: step, losses, step time, tokens/s, MFU, ETA (redrawn on a terminal)."""

    start: int
    total: int

    def __post_init__(self) -> None:
        self.began = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, row: dict[str, float]) -> None:
        done = row["step"] - self.start
        eta = (time.perf_counter() - self.began) / done * (self.total - row["step"])
        mfu = f" MFU {row['mfu']:.1%}" if "mfu" in row else ""
        line = (f"step {row['step']}/{self.total} loss {row['loss']:.4f} (ntp {row['ntp_loss']:.4f}, "
                f"matp {row['matp_loss']:.4f}) k={row['block_size']} {row['seconds']:.3f} s/step "
                f"{row['tokens_per_s']:.0f} tok/s{mfu} ETA {eta:.0f}s")
        print(("\r" if self.tty else "") + line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)

"""Evaluation entries computed once and kept in a JSON file: a recipe's evaluation resumes where it stopped.
Each entry records the commit its run began at: a file filled by several runs names each entry's code."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from sbd_jax.evaluation.results import STARTED_AT_COMMIT


class EntryCache:
    """`get(key, compute)` returns the stored entry, or computes, times, stores (with the `commit` it was
    measured at) and prints it."""

    def __init__(self, path: str):
        self.path = path
        self.entries: dict[str, Any] = json.load(open(path)) if os.path.exists(path) else {}

    def get(self, key: str, compute: Callable[[], dict], describe: Callable[[dict], str]) -> dict:
        if key not in self.entries:
            began = time.perf_counter()
            entry = compute()
            self.entries[key] = {**entry, "seconds": time.perf_counter() - began, "commit": STARTED_AT_COMMIT}
            self.save()
            print(f"{describe(self.entries[key])} ({self.entries[key]['seconds']:.0f} s)", flush=True)
        return self.entries[key]

    def save(self) -> None:
        """Rewrites the file whole (a temporary file, then a rename): a kill never leaves half of it."""
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.entries, f)
        os.replace(self.path + ".tmp", self.path)

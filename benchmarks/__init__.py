"""Benchmarks, each run as a module from the checkout's root (`python -m benchmarks.decode ...`); their
results go to benchmarks/results/<script>_<what>.json through one writer that stamps where they came from."""

from __future__ import annotations

import os

from sbd_jax.evaluation.results import write_json

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def save_result(name: str, data: dict) -> str:
    """Writes benchmarks/results/<name>.json (stamped); returns its path."""
    path = os.path.join(RESULTS, name + ".json")
    write_json(path, data)
    return path

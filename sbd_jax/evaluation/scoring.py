"""Scoring decoded outputs: intervals of accuracies, paired differences, where two outputs part, and
lookup in lists of result entries."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(centre - half), float(centre + half)


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = 1.96) -> dict:
    """Accuracy of `a` minus `b` on the same problems, with a 95% interval from the per-problem
    differences, and the discordant counts (a right where b is wrong, and the reverse)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    half = z * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else 1.0
    return {"difference": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)],
            "only_first_right": int((d > 0).sum()), "only_second_right": int((d < 0).sum())}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two outputs (the shorter's length if one extends the
    other), None if they are equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def find(entries: list[dict], **where: Any) -> list[dict]:
    """The entries whose fields equal every `where` value."""
    return [e for e in entries if all(e.get(key) == value for key, value in where.items())]


def one(entries: list[dict], **where: Any) -> dict:
    """The one entry matching `where` (an error if none or several)."""
    (entry,) = find(entries, **where)
    return entry

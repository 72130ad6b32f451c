"""The small-scale study's task: the arithmetic splits its shipped model learnt from, was tuned on and is
tested on (the task itself, problems and scoring, is `sbd_jax.evaluation.arithmetic`); the benchmarks that
measure that model draw its test problems from here."""

from __future__ import annotations

from sbd_jax.evaluation.arithmetic import Splits, splits

STUDY = dict(train_problems=40000, valid_problems=500, test_problems=2000, max_digits=5, max_new_tokens=72)


def study_splits() -> Splits:
    """The small-scale study's train / validation / test problems."""
    return splits(STUDY["train_problems"], STUDY["valid_problems"], STUDY["test_problems"], STUDY["max_digits"])

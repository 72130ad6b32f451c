"""Multi-digit addition with worked steps: a task whose answers are exactly checkable and whose
answer tokens depend on each other (each carry feeds the next step; the result is read back from
all steps).

Every digit carries a place letter (a = units, b = tens, ...), the "index hints" that let a small
transformer find digits by content instead of by counting positions:

    572+86  ->  question  c5b7a2+b8a6
                answer    a2+6+0=08,b7+8+0=15,c5+0+1=06>c6b5a8

One step per place, `place a+b+carry=two-digit sum`, then `>` and the result with its place letters.
An answer of n steps is about 12n characters long.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

PLACES = "abcdefghij"


class Problem(NamedTuple):
    question: str  # "c5b7a2+b8a6"
    answer: str  # the worked answer, as the model should write it
    result: int  # the sum
    steps: int  # digits of the longer operand: what makes an answer long


def with_places(n: int) -> str:
    digits = str(n)
    return "".join(PLACES[len(digits) - 1 - i] + d for i, d in enumerate(digits))


def worked_answer(a: int, b: int) -> str:
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[i]) if i < len(digits_a) else 0
        y = int(digits_b[i]) if i < len(digits_b) else 0
        total = x + y + carry
        steps.append(f"{PLACES[i]}{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return ",".join(steps) + ">" + with_places(a + b)


def final_result(answer: str) -> int | None:
    """The number after the last `>` of an answer (place letters dropped), or None if there is none."""
    if ">" not in answer:
        return None
    tail = answer.rsplit(">", 1)[1].strip()
    digits = tail[1::2]
    if not tail or tail[0::2] != PLACES[: len(digits)][::-1] or not digits.isdigit():
        return None
    return int(digits)


def problems(count: int, max_digits: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """`count` distinct problems (not in `exclude`); operand lengths uniform in 1..max_digits each."""
    if not 1 <= max_digits < len(PLACES):
        raise ValueError(f"max_digits={max_digits} must be in 1..{len(PLACES) - 1}")
    rng = np.random.default_rng(seed)
    found: dict[str, Problem] = {}
    while len(found) < count:
        a, b = (int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10 ** n))
                for n in rng.integers(1, max_digits + 1, size=2))
        question = f"{with_places(a)}+{with_places(b)}"
        if question not in exclude and question not in found:
            found[question] = Problem(question, worked_answer(a, b), a + b, max(len(str(a)), len(str(b))))
    return list(found.values())


class Splits(NamedTuple):
    train: list[Problem]
    valid: list[Problem]
    test: list[Problem]


def splits(train: int, valid: int, test: int, max_digits: int, seed: int = 0) -> Splits:
    """The one split rule every study uses: training problems from `seed`, test problems from `seed + 1`
    and validation problems from `seed + 2`, each excluding those drawn before it, so all are disjoint."""
    train_set = problems(train, max_digits, seed)
    seen = frozenset(p.question for p in train_set)
    test_set = problems(test, max_digits, seed + 1, exclude=seen)
    valid_set = problems(valid, max_digits, seed + 2, exclude=seen | {p.question for p in test_set})
    return Splits(train_set, valid_set, test_set)


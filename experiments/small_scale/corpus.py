"""The experiment's data, written as JSONL files the trainer reads: arithmetic chats and stdlib code.

Code is real text nobody here wrote: this interpreter's standard-library modules (top-level `.py`
files, sorted by name); every `HELDOUT_EVERY`-th file is held out for evaluation, the others are
training text up to a character budget. Arithmetic problems are generated with a fixed seed; the
held-out problems are drawn excluding every training question.
"""

from __future__ import annotations

import glob
import json
import os
from typing import NamedTuple

from sbd_jax.evaluation.arithmetic import Problem, splits

STDLIB = os.path.dirname(os.__file__)
HELDOUT_EVERY = 10


class Corpus(NamedTuple):
    train_files: tuple[str, ...]  # JSONL for the trainer
    heldout_files: tuple[str, ...]  # JSONL for held-out losses
    valid_problems: list[Problem]  # for choosing decoding settings
    test_problems: list[Problem]  # for reporting them
    heldout_code: list[str]  # the held-out modules' text


def stdlib_modules() -> tuple[list[str], list[str]]:
    """(training, held-out) paths of top-level standard-library modules."""
    files = sorted(glob.glob(os.path.join(STDLIB, "*.py")))
    if len(files) < 2 * HELDOUT_EVERY:
        raise RuntimeError(f"found only {len(files)} modules in {STDLIB}; is this a full Python install?")
    return ([f for i, f in enumerate(files) if i % HELDOUT_EVERY],
            [f for i, f in enumerate(files) if not i % HELDOUT_EVERY])


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _first_chars(paths: list[str], budget: int) -> list[str]:
    """The files' texts, in order, until `budget` characters (the last one cut)."""
    texts, size = [], 0
    for path in paths:
        if size >= budget:
            break
        texts.append(_read(path)[: budget - size])
        size += len(texts[-1])
    return texts


def _write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _chats(items: list[Problem]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]}
            for p in items]


def build_corpus(out: str, *, train_problems: int, valid_problems: int, test_problems: int, max_digits: int,
                 code_chars: int, heldout_code_chars: int, seed: int) -> Corpus:
    """Writes the JSONL files under `out`; sizes are counts of problems and characters of code.
    Training, validation and test problems are disjoint."""
    os.makedirs(out, exist_ok=True)
    train, valid, test = splits(train_problems, valid_problems, test_problems, max_digits, seed)
    train_modules, heldout_modules = stdlib_modules()
    code, heldout_code = _first_chars(train_modules, code_chars), _first_chars(heldout_modules, heldout_code_chars)
    train_files = (_write_jsonl(os.path.join(out, "arithmetic_train.jsonl"), _chats(train)),
                   _write_jsonl(os.path.join(out, "code_train.jsonl"), [{"text": t} for t in code]))
    heldout_files = (_write_jsonl(os.path.join(out, "arithmetic_heldout.jsonl"), _chats(test)),
                     _write_jsonl(os.path.join(out, "code_heldout.jsonl"), [{"text": t} for t in heldout_code]))
    return Corpus(train_files, heldout_files, valid, test, heldout_code)

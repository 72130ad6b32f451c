"""Reading JSONL files with errors that name the file and line."""

from __future__ import annotations

import json
from typing import Any, Iterator

from sbd_jax.errors import UserError


def iter_jsonl(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line; bad JSON is a UserError naming file:line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number}: not valid JSON ({e.msg})") from None

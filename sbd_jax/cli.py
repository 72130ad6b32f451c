"""Shared CLI behaviour: bad input ends in one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Callable


def run_cli(main: Callable[[list[str]], object], argv: list[str]) -> None:
    from sbd_jax.errors import UserError

    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

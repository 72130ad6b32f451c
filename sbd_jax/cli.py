"""Shared CLI behaviour: bad input ends in one line on stderr and exit code 2 (a run stopped by a signal:
75, `training.stop_request.Stopped`), never a traceback."""

from __future__ import annotations

import sys
from typing import Callable


def run_cli(main: Callable[[list[str]], object], argv: list[str]) -> None:
    from sbd_jax.errors import UserError

    try:
        main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))  # a subclass may set its own (a stopped run: 75)

"""Training config files (`configs/*.py`): ml_collections `get_config()` modules, read by path."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from sbd_jax.errors import UserError


def load_config_file(path: str) -> tuple[Any, dict | None]:
    """`get_config()` of a training config file and its module's ARCHITECTURE (8B configs), if any."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist; use one of configs/*.py")
    spec = importlib.util.spec_from_file_location("config_file", path)
    if spec is None or spec.loader is None:
        raise UserError(f"config file {path} is not a Python file; use one of configs/*.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(), getattr(module, "ARCHITECTURE", None)

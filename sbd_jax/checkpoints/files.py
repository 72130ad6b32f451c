"""Writing weight files with the permissions of the files beside them."""

from __future__ import annotations

import os
from typing import Any


def save_safetensors(arrays: dict[str, Any], file: str, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.numpy.save_file`, then the mode an ordinary `open()` gives (0644 under the usual umask 022):
    safetensors creates its files 0600, so an exported model was unreadable to the other users who could
    read its config.json and tokenizer."""
    from safetensors.numpy import save_file

    save_file(arrays, file, metadata=metadata)
    os.chmod(file, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (setting it, even back at once,
    would briefly change the mode of files other threads create)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

"""Writing weight files with the permissions of the files beside them, and a failed write as one line."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

from safetensors import SafetensorError

from sbd_jax.errors import UserError

Save = TypeVar("Save", bound=Callable[..., Any])


def reports_write_errors(save: Save) -> Save:
    """`save(path, ...)` with a failed write under `path` (a full disk, a lost mount, no permission) raised as a
    UserError naming the path and the fix, instead of a traceback from inside safetensors or json."""
    @functools.wraps(save)
    def saving(path: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return save(path, *args, **kwargs)
        except (OSError, SafetensorError) as e:
            cause = (str(e).splitlines() or [""])[0][:200]
            raise UserError(f"cannot write {path} ({type(e).__name__}: {cause}); free space or choose a directory "
                            "you can write, then run the same command again") from None
    return saving  # type: ignore[return-value]


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

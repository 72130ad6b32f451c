"""`Choice`: a closed set of names as one `str` Enum (a config field, a CLI flag's `choices`, an API keyword).

A member equals its name, hashes as it and prints as it (`str`, `repr`, f-strings), so config files, JSON and
command lines keep passing plain strings and messages read as before; `parse` turns a name into its member, or
into a one-line UserError that lists the valid names.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from sbd_jax.errors import UserError

C = TypeVar("C", bound="Choice")


class Choice(str, enum.Enum):
    """A name of a closed set; subclass it with one member per name."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return str.__repr__(self)

    @classmethod
    def parse(cls: type[C], value: object, name: str) -> C:
        """The member named `value` (a member or its name); UserError `name=value: use one of ...` otherwise."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise UserError(f"{name}={value!r}: use one of {', '.join(map(str, cls))}") from None

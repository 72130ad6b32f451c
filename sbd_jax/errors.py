"""The exception type for bad user input (PromptError: one prompt of a batch), and the config checks.

CLIs catch it and print its message on one line with exit code 2, so every message must name the
problem and the fix.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from a user: a config value, a file, a model name, a size that does not fit."""


class PromptError(UserError):
    """Bad input that is one prompt of a batch: `index` is its place in the batch (None: a prompt alone), so
    a caller that read the prompts (a file's lines, repeated flags) can name where it came from."""

    def __init__(self, problem: str, index: int | None = None):
        self.problem, self.index = problem, index
        super().__init__(problem if index is None else f"prompts[{index}]: {problem}")

    def shifted(self, offset: int) -> PromptError:
        """The same error for the batch that holds this one's batch from `offset` on."""
        return PromptError(self.problem, (self.index or 0) + offset)


def check_at_least(name: str, value: float, low: float, why: str = "") -> None:
    """`config name=value` must be at least `low` (never NaN); `why` says what the bound protects."""
    if not value >= low:  # NaN too
        raise UserError(f"config {name}={value} must be >= {low}{f' ({why})' if why else ''}")


def check_in_range(name: str, value: float, low: float, high: float, low_open: bool = False, why: str = "") -> None:
    """`value` in [low, high) ((low, high) with `low_open`); NaN and infinity are never in range."""
    if not (low < value < high if low_open else low <= value < high):
        bounds = f"{'(' if low_open else '['}{low}, {high})"
        raise UserError(f"config {name}={value} must be in {bounds}{f' ({why})' if why else ''}")

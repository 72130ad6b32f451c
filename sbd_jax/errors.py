"""The one exception type for bad user input.

CLIs catch it and print its message on one line with exit code 2, so every message must name the
problem and the fix.
"""


class UserError(ValueError):
    """Bad input from a user: a config value, a file, a model name, a size that does not fit."""

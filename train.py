"""Fine-tune a Llama/Qwen model with the SBD objective (or train a small one from scratch).

    python train.py --config configs/tiny.py --workdir /tmp/tiny [--config.train.steps=50 ...]

Resumes by itself from the latest checkpoint in --workdir. Bad input ends with a one-line error and
exit code 2; a run stopped by SIGTERM or Ctrl-C saves the step it finished and exits with 75 (EX_TEMPFAIL:
rerun the same command to continue).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "a configs/*.py file", lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and the exported HF model go here")
flags.mark_flags_as_required(["config", "workdir"])


def innermost_message(error: BaseException) -> str:
    """One line of an error that ml_collections wraps (AttributeError(KeyError("'stepz'\\nDid you mean...")))."""
    while error.args and isinstance(error.args[0], BaseException):
        error = error.args[0]
    if isinstance(error, SyntaxError):
        return f"the --config file {error.filename} has a syntax error at line {error.lineno}: {error.msg}; fix it"
    if isinstance(error, OSError) and "config file" in str(error):
        return f"cannot load the --config file ({' '.join(str(error).split()[-6:])}): give a configs/*.py file"
    text = str(error.args[0]) if error.args and isinstance(error.args[0], str) else str(error)
    return " ".join(text.replace("\\n", " ").split())


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, its errors (a misspelt --config.* key, a missing config file, a bad value) as
    one line and exit code 2 instead of a traceback or absl's exit code 1. A config file is Python: any
    error it raises is reported the same way."""
    try:
        rest = flags.FLAGS(argv)
        flags.FLAGS.config.to_dict()  # the file loads lazily: a missing or broken one fails on first use
        return rest
    except Exception as e:
        print(f"error: {innermost_message(e)}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint step at INFO
    from sbd_jax.cli import run_cli
    from sbd_jax.training.stop_request import Stopped
    from sbd_jax.training.trainer import Trainer

    try:
        run_cli(lambda _: Trainer(flags.FLAGS.config, flags.FLAGS.workdir).run(), [])
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (loading, compiling, exporting): nothing unsaved
        print("error: stopped by SIGINT (Ctrl-C) outside the training loop, with no finished step unsaved; run the "
              "same command again to continue", file=sys.stderr)
        sys.exit(Stopped.exit_code)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

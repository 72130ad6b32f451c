"""Fine-tune a Llama/Qwen model with the SBD objective (or train a small one from scratch).

    python train.py --config configs/tiny.py --workdir /tmp/tiny [--config.train.steps=50 ...]

Resumes by itself from the latest checkpoint in --workdir. Bad input ends with a one-line error and
exit code 2.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "a configs/*.py file", lock_config=True)
flags.DEFINE_string("workdir", None, "checkpoints, metrics.jsonl and the exported HF model go here")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint step at INFO
    from sbd_jax.errors import UserError
    from sbd_jax.trainer import Trainer

    try:
        Trainer(flags.FLAGS.config, flags.FLAGS.workdir).run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)

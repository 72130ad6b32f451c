"""One process of a training job for test_multiprocess.py: the quick tiny config on a (2, 2, 2) mesh.

    python -m tests.distributed_worker WORKDIR PROCESS_ID NUM_PROCESSES PORT KILL_AT

NUM_PROCESSES 1 trains alone on 8 devices; otherwise the process joins the job through
jax.distributed (coordinator on 127.0.0.1:PORT). Writes `host{PROCESS_ID}.json`: the step it resumed
from and the token ids of every host batch it read; the run ends with the HF export (`WORKDIR/hf`). KILL_AT > 0: SIGKILLs itself when asked for that
many batches, mid-run.
"""

import json
import os
import signal
import sys

from sbd_jax.training.trainer import Trainer
from tests.test_train import quick_config


class Recording:
    """The trainer's data iterator, with every batch's tokens kept (and an optional self-kill)."""

    def __init__(self, iterator, kill_at: int):
        self.iterator, self.kill_at, self.tokens = iterator, kill_at, []

    def __next__(self):
        if len(self.tokens) + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        batch = next(self.iterator)
        self.tokens.append(batch["tokens"].tolist())
        return batch

    def get_state(self):
        return self.iterator.get_state()

    def set_state(self, state):
        self.iterator.set_state(state)

    def start_prefetch(self):
        self.iterator.start_prefetch()


def main(workdir: str, process_id: int, num_processes: int, port: int, kill_at: int) -> None:
    cfg = quick_config(train__steps=6, train__log_every=1, checkpoint__every=2)
    cfg.mesh = (2, 2, 2)  # export_hf stays on: the export gathers parameters sharded across processes
    cfg.data.shards = 2  # the global batches of two hosts, also when one process reads both shards
    if num_processes > 1:
        cfg.multihost = True
        cfg.distributed.coordinator_address = f"127.0.0.1:{port}"
        cfg.distributed.num_processes, cfg.distributed.process_id = num_processes, process_id
    trainer = Trainer(cfg, workdir)
    start = trainer.checkpoint_manager().latest_step() or 0
    trainer.iterator = Recording(trainer.iterator, kill_at)
    trainer.run()
    with open(os.path.join(workdir, f"host{process_id}.json"), "w") as f:
        json.dump({"start": start, "tokens": trainer.iterator.tokens}, f)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))

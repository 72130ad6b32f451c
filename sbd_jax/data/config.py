"""The training data stream's config section (`config.data`), typed and checked when made."""

from __future__ import annotations

import dataclasses

from sbd_jax.errors import check_at_least


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The training data stream (sbd_jax/data/streaming.py): the global batch is every shard's next rows;
    shard s is read by host s % hosts. Batches depend on (files, seed, shards, workers), not on hosts."""

    files: tuple[str, ...] = ()  # JSONL (text / messages) or text files, globs allowed
    seq_len: int = 256  # tokens a training row holds (documents packed; the SBD step also runs its noisy copy)
    shards: int = 0  # 0: one shard per host
    workers: int = 2  # Grain worker processes per shard (0: read in the main process)
    mask_token: str = "new"  # 'new' (a new embedding row), an existing token's text, or its id ("198")
    # Global batches a fresh run's stream skips before its first step (a resumed run reads on from its
    # checkpoint's position instead). A run that continues S steps of training with the same files, batch
    # and seed (adapter.init_from) skips S: its batches are the ones a single longer run would draw next.
    skip: int = 0

    def __post_init__(self) -> None:
        check_at_least("data.seq_len", self.seq_len, 2)
        check_at_least("data.shards", self.shards, 0)
        check_at_least("data.workers", self.workers, 0)
        check_at_least("data.skip", self.skip, 0)

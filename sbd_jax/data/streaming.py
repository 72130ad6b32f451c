"""The training data stream: files read lazily in chunks, tokenized and packed on the fly, with Grain.

A corpus is cut into chunks: byte ranges of JSONL files (a line belongs to the chunk it starts in), about
`CORPUS_CHUNKS` of them within [MIN_CHUNK_BYTES, CHUNK_BYTES], or whole text files. Every epoch the
chunks are shuffled anew and dealt round-robin to `shards` streams (disjoint within the epoch); shard s
belongs to host s % hosts, so a host opens only its shards' chunks, and within a shard each Grain worker
process takes every W-th of the epoch's chunks. A stream reads each of its chunks once an epoch,
`OPEN_CHUNKS` of them at once, the next record always from the one that has read the fewest bytes,
tokenizes the records, and packs them a window of `WINDOW_TOKENS` (at most the corpus's bytes; never
across an epoch's end) at a time: the window's documents are shuffled, packed best-fit into rows, and
the rows shuffled, then batched. The window is what mixes a corpus whose
documents are long (a source file of 18k tokens is 145 rows of 128): it must hold many documents of
each source, or a batch drawn from it holds one source more often than independent rows would.
A global batch is every shard's next batch, in shard order: batches are a function of (files, seed,
shards, workers), not of the host count, so one process given `shards=2` sees what two hosts see
together. Host memory is bounded by the window, the open chunks' read buffers and the prefetch buffers,
whatever the corpus size.

The state (per shard: the epoch and its next chunk, the open chunks' byte offsets, where the current window began and
how many of its rows were served; per worker under multiprocessing) is saved by each host with the
train state, so a resumed run reads on from exactly where it stopped.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from typing import Any, Sequence

import grain
import numpy as np
from absl import flags

from sbd_jax.data.chunks import OPEN_CHUNKS, Chunk, Records, chunk_bytes_for, plan_chunks
from sbd_jax.data.config import DataConfig
from sbd_jax.data.packing import (
    Batch,
    Document,
    expand_paths,
    pack,
    tokenize,
)
from sbd_jax.errors import UserError

WINDOW_TOKENS = 1 << 22  # documents are shuffled and packed up to this many tokens at a time (~52 MB of rows)


def _as_arrays(document: Document) -> dict[str, np.ndarray]:
    return {"ids": np.asarray(document.ids, np.int32), "loss_mask": np.asarray(document.loss_mask, bool)}


class _Pack(grain.IterDataset):
    """Rows of `seq_len` packed from a stream of documents (`{"ids", "loss_mask"}` arrays), a window at a time."""

    def __init__(self, documents: grain.IterDataset, seq_len: int, seed: int, window_tokens: int, shard: int = 0):
        super().__init__(documents)
        self._seq_len, self._seed, self._window_tokens, self._shard = seq_len, seed, window_tokens, shard

    def __iter__(self) -> "_PackIterator":
        return _PackIterator(self._parent.__iter__(), self._seq_len, self._seed, self._window_tokens, self._shard)


class _PackIterator(grain.DatasetIterator):
    """State: the documents' iterator state where the current window began, the window's number, and
    how many of its rows were served; restoring re-reads and re-packs that window (deterministic)."""

    def __init__(self, documents: grain.DatasetIterator, seq_len: int, seed: int, window_tokens: int, shard: int):
        super().__init__(documents)
        self._seq_len, self._seed, self._window_tokens, self._shard = seq_len, seed, window_tokens, shard
        self._window, self._served, self._start = -1, 0, documents.get_state()
        self._rows: list[dict[str, np.ndarray]] = []

    def _fill(self) -> None:
        self._start = self._parent.get_state()
        self._window += 1
        self._served = 0
        documents: list[Document] = []
        tokens, empty_epoch = 0, False
        while tokens < self._window_tokens:  # a window never spans two epochs
            try:
                d = next(self._parent)
            except StopIteration:
                break
            if "epoch_end" in d:
                if documents:
                    break
                if empty_epoch:  # a whole epoch of this stream went by without a document
                    raise UserError(f"an epoch of data shard {self._shard}'s records has no token that carries "
                                    "loss: give records with text (or chats with assistant turns), or fewer "
                                    "data.shards / data.workers")
                empty_epoch = True
                continue
            documents.append(Document(d["ids"], d["loss_mask"]))
            tokens += len(d["ids"])
        if not documents:
            raise StopIteration
        rng = np.random.default_rng([self._seed, self._window])
        # Pieces without loss (a long prompt cut into row-long pieces) would be rows that train nothing,
        # and a batch of only such rows has no loss at all: every row packed here carries loss.
        packed = pack([documents[i] for i in rng.permutation(len(documents))], self._seq_len, drop_loss_free=True)
        # Best-fit packing places documents in order, so neighbouring rows hold neighbouring documents.
        self._rows = [{name: getattr(packed, name)[r] for name in Batch._fields}
                      for r in rng.permutation(len(packed.tokens))]

    def __next__(self) -> dict[str, np.ndarray]:
        if self._served == len(self._rows):
            self._fill()
        self._served += 1
        return self._rows[self._served - 1]

    def get_state(self) -> dict[str, Any]:
        return {"documents": self._start, "window": self._window, "served": self._served}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["documents"])
        # Window -1: none filled yet (a worker whose batches were all still unconsumed when the state was saved).
        self._window, self._rows, self._served = max(state["window"], 0) - 1, [], 0
        if state["window"] >= 0:
            self._fill()
            self._served = state["served"]


def _encode(record: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    return record if "epoch_end" in record else _as_arrays(tokenize(record, tokenizer))


def _kept(document: dict[str, Any]) -> bool:
    """Documents with a token that carries loss (the packer drops what carries none, so a window of only
    such documents would pack into no rows)."""
    return "epoch_end" in document or bool(document["loss_mask"].any())


def shard_stream(chunks: Sequence[Chunk], shard: int, shards: int, tokenizer: Any, seq_len: int,
                 rows: int, seed: int, workers: int, window_tokens: int) -> grain.IterDataset:
    """Endless batches of `rows` packed rows of one shard: its chunks of each epoch (`Records`), packed a
    window at a time, windows ending where epochs do."""
    documents = Records(chunks, seed, shard, shards).map(functools.partial(_encode, tokenizer=tokenizer)).filter(
        _kept)
    batches = _Pack(documents, seq_len, seed * 1_000_003 + shard, window_tokens, shard).batch(rows)
    if workers:
        if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; train.py parses them, a library user may not
            flags.FLAGS.mark_as_parsed()
        batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2),
                                      worker_init_fn=functools.partial(_exit_with_parent, parent=os.getpid()))
    return batches


def _exit_with_parent(worker_index: int, worker_count: int, parent: int) -> None:
    """In each worker: ignore Ctrl-C (the training process answers it), and exit within half a second of
    the training process `parent` dying (a SIGKILLed run would otherwise leave its workers running,
    holding memory and the run's output pipes).

    `parent` is the training process's pid, taken in that process when the stream is built. Reading it
    here with `os.getppid()` instead had a race: a worker still starting when its parent was killed read
    the pid of init (1), then waited for a change that never came. An orphan's parent pid never changes
    back, so comparing with the pid taken in the parent is exact whenever the worker starts.
    Not `prctl(PR_SET_PDEATHSIG)`: Linux sends that signal when the *thread* that started the worker
    ends, and Grain starts workers from a prefetch thread that ends once all of them are made."""
    del worker_index, worker_count
    # Ctrl-C reaches the whole process group: the training process saves and stops (StopRequest) and ends
    # its workers; a worker that died of KeyboardInterrupt instead printed a traceback and leaked its
    # shared memory.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


STREAMS = {"shards", "workers"}  # layout keys that say how many streams read the data


class HostBatches:
    """This host's part of each global batch: the next batch of each of its shards, concatenated.

    `get_state` / `set_state` speak bytes (JSON of every shard's state), as Grain's Orbax checkpoint
    handler expects of an iterator: it writes one file per host."""

    def __init__(self, streams: dict[int, grain.IterDataset], layout: dict[str, object]):
        """`layout`: what a saved position depends on besides the files' content (saved with the state)."""
        self._iterators = {shard: iter(stream) for shard, stream in streams.items()}
        self._layout = layout

    def __iter__(self) -> "HostBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(it) for it in self._iterators.values()]
        return {name: np.concatenate([p[name] for p in parts]) for name in Batch._fields}

    def close(self) -> None:
        """Stops the shards' worker processes and frees their shared memory (left behind by a process that
        exits with them running: Python then warns of leaked shared_memory objects)."""
        for it in self._iterators.values():
            it.close()

    def get_state(self) -> bytes:
        shards = {str(s): it.get_state() for s, it in self._iterators.items()}
        return json.dumps({"layout": self._layout, "shards": shards}).encode()

    def set_state(self, state: bytes) -> None:
        saved = json.loads(state)
        layout = saved.get("layout") or {}
        # The streams were recorded from 2026-12-07 on: a position saved before cannot say how many read it.
        changed = [key for key, value in self._layout.items()
                   if (key in layout or key not in STREAMS) and layout.get(key) != value]
        described = ", ".join(f"{key} {layout.get(key)} -> {self._layout[key]}" for key in changed)
        if STREAMS & set(changed):
            fixes = []
            if "shards" in changed:
                fixes.append(f"data.shards={layout['shards']} (or data.shards=0 on {layout['shards']} hosts)")
            if "workers" in changed:
                fixes.append(f"data.workers={layout['workers']}")
            raise UserError(f"the checkpoint's data position is that of other streams ({described}): resume with "
                            f"{' and '.join(fixes)}, or start a new run (another --workdir)")
        if changed and set(changed) <= {"seq_len", "rows_per_shard"}:
            raise UserError(f"the checkpoint was trained with other batch shapes ({described}): resume with its "
                            "data.seq_len and train.batch_size, or start a new run (another --workdir)")
        if changed:
            raise UserError(f"the checkpoint's data position is in a stream laid out otherwise ({described}): the "
                            "data files changed, or the version of sbd_jax that wrote it chunked or packed "
                            "differently; resume with the same files and version, or start a new run")
        states = saved["shards"]
        if sorted(states) != sorted(map(str, self._iterators)):
            raise UserError(f"the checkpoint's data state is for shards {sorted(states)}, this host reads "
                            f"{sorted(self._iterators)}: resume with the same number of hosts and data.shards")
        for shard, it in self._iterators.items():
            it.set_state(states[str(shard)])

    def start_prefetch(self) -> None:
        """Called by Grain's checkpoint handler after a restore; the streams start on the first `next`."""


class Snapshot:
    """A `HostBatches` state taken now, for Grain's checkpoint handler (one file per host) to write even
    when the save completes later, in the background, after the stream has moved on."""

    def __init__(self, state: bytes):
        self._state = state

    def get_state(self) -> bytes:
        return self._state


def host_batches(data: DataConfig, tokenizer: Any, *, global_batch: int, seed: int, host: int, hosts: int) -> HostBatches:
    """The stream of this host's share of every global batch (see the module docstring) from the config's
    `data` section (files, seq_len, shards, workers); the other sizes are keyword-only, so a swap fails."""
    files, seq_len, workers = data.files, data.seq_len, data.workers
    shards = data.shards or hosts
    if shards % hosts:
        raise UserError(f"data.shards={shards} is not a multiple of the {hosts} hosts: each host reads whole shards")
    if global_batch % shards:
        raise UserError(f"batch_size={global_batch} is not divisible by data.shards={shards} (default: the number of hosts)")
    paths = expand_paths(files)
    streams = shards * max(workers, 1)
    chunk_bytes = chunk_bytes_for(paths, streams)
    chunks = plan_chunks(paths, chunk_bytes)
    if len(chunks) < streams:
        raise UserError(f"the data files are cut into {len(chunks)} chunks, fewer than the {streams} streams that read "
                        f"them (data.shards={shards} x data.workers={workers}): every stream needs chunks of its own "
                        "each epoch; lower data.workers (0 reads in the training process) or add data")
    _check_trainable(chunks, tokenizer)
    rows = global_batch // shards
    # A window longer than the corpus (a token is seldom less than a byte of it) would mix nothing more.
    window_tokens = min(WINDOW_TOKENS, sum(os.path.getsize(path) for path in paths))
    layout = {"chunks": len(chunks), "chunk_bytes": chunk_bytes, "open_chunks": OPEN_CHUNKS,
              "window_tokens": window_tokens, "epochs": "per shard", "seq_len": seq_len, "rows_per_shard": rows,
              "shards": shards, "workers": workers}
    return HostBatches({s: shard_stream(chunks, s, shards, tokenizer, seq_len, rows, seed, workers, window_tokens)
                        for s in range(host, shards, hosts)}, layout)


def _check_trainable(chunks: Sequence[Chunk], tokenizer: Any) -> None:
    """Fails before training (where the stream would search endless epochs for a document) unless some
    record of the corpus has a token that carries loss; reads no further than the first such record."""
    files = sorted({chunk.path for chunk in chunks})
    records = 0
    for record in Records(chunks, seed=None):
        if "epoch_end" in record:
            break
        records += 1
        if any(tokenize(record, tokenizer).loss_mask):
            return
    if not records:
        raise UserError(f"the data files {files} hold no text")
    raise UserError(f"none of the {records} records of {files} has a token that carries loss (records that "
                    "tokenize to nothing, such as {\"messages\": []}, or chats without assistant turns are "
                    "skipped): give records with text, a completion or assistant turns")


def check_batch(host_batch: dict[str, np.ndarray], mask_id: int | None, step: int) -> dict[str, np.ndarray]:
    """Refuses a batch whose tokens include the mask token (the model could not tell them apart). Every
    row carries loss: the packer drops pieces without any (`pack(drop_loss_free=True)`)."""
    real = host_batch["segment_ids"] > 0
    used = 0 if mask_id is None else int((host_batch["tokens"][real] == mask_id).sum())
    if used:
        raise UserError(f"mask token id {mask_id} occurs {used} times in the training data (step {step}'s "
                        "batch); choose a token the data never uses (or data.mask_token='new' for a new "
                        "embedding row)")
    return host_batch

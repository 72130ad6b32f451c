"""The corpus cut into chunks and read as records: byte ranges of JSONL files (a line belongs to the chunk
it starts in), about `CORPUS_CHUNKS` of them within [MIN_CHUNK_BYTES, CHUNK_BYTES], or whole text files;
each epoch's chunks shuffled anew and dealt to shards, `OPEN_CHUNKS` of them read at once (`Records`,
a Grain dataset whose state is where each open chunk stands). `sbd_jax.data.streaming` packs what it reads."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, NamedTuple, Sequence

import grain
import numpy as np

from sbd_jax.data.packing import checked_record, is_jsonl, text_file_record
from sbd_jax.errors import UserError

CHUNK_BYTES = 16 << 20  # the largest unit of reading dealt to hosts and workers
MIN_CHUNK_BYTES = 4 << 10  # the smallest: a small corpus still cut below this would cost a file open per few lines
CORPUS_CHUNKS = 1024  # a corpus is cut into about this many chunks, within those bounds
OPEN_CHUNKS = 64  # chunks read at once, their records interleaved: the reach of the shuffle across the corpus
READ_BYTES = 64 << 10  # a chunk is read this much at a time, so open chunks hold no file handles


class Chunk(NamedTuple):
    """Lines of `path` that start in bytes [start, end); end -1: the whole (text) file as one record."""

    path: str
    start: int
    end: int


def chunk_bytes_for(files: Sequence[str], streams: int = 1) -> int:
    """The chunk size for a corpus: `CORPUS_CHUNKS` chunks of it, within [MIN_CHUNK_BYTES, CHUNK_BYTES],
    and small enough that each of `streams` (shards x workers) gets at least one chunk.

    Why it scales with the corpus: a file smaller than a chunk would be one chunk, read start to end,
    and a two-file corpus of a few MB would be read one file at a time (every batch from one file)."""
    total = sum(os.path.getsize(path) for path in files if is_jsonl(path))
    return int(min(np.clip(total // CORPUS_CHUNKS, MIN_CHUNK_BYTES, CHUNK_BYTES), max(total // streams, 1)))


def plan_chunks(files: Sequence[str], chunk_bytes: int | None = None) -> list[Chunk]:
    """The chunks of the files, from their sizes only (nothing is read); `chunk_bytes` None: `chunk_bytes_for`."""
    chunk_bytes = chunk_bytes or chunk_bytes_for(files)
    chunks = []
    for path in files:
        if not is_jsonl(path):
            chunks.append(Chunk(path, 0, -1))
            continue
        size = os.path.getsize(path)
        chunks += [Chunk(path, start, min(start + chunk_bytes, size)) for start in range(0, max(size, 1), chunk_bytes)]
    return chunks


def epoch_order(num_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """The chunk numbers of an epoch, shuffled anew every epoch."""
    return np.random.default_rng([seed, epoch]).permutation(num_chunks)


class Records(grain.IterDataset):
    """The records of a shard's chunks, epoch after epoch, `open_chunks` chunks read at once.

    Epoch e's chunks are `epoch_order(e)[shard::shards]`: shards are disjoint within an epoch, and a
    shard reads each of its chunks once before the next epoch opens any (so a shard of few chunks never
    reads copies of one chunk side by side). After each epoch comes a marker, `{"epoch_end": e}`, where
    the packer ends its window. Grain's worker processes divide each epoch's chunks between them by
    slicing this dataset (`set_slice`). `seed` None: the chunks in their order, for one epoch only."""

    def __init__(self, chunks: Sequence[Chunk], seed: int | None, shard: int = 0, shards: int = 1,
                 open_chunks: int = OPEN_CHUNKS):
        super().__init__()
        self._chunks, self._seed, self._shard, self._shards = list(chunks), seed, shard, shards
        self._open_chunks, self._slice = open_chunks, slice(None)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        del sequential_slice
        self._slice = sl

    def epoch_chunks(self, epoch: int) -> list[Chunk] | None:
        """This stream's chunks in `epoch`, in reading order (None: no such epoch)."""
        if self._seed is None:
            return list(self._chunks[self._slice]) if epoch == 0 else None
        order = epoch_order(len(self._chunks), self._seed, epoch)[self._shard::self._shards][self._slice]
        return [self._chunks[i] for i in order]

    def __iter__(self) -> "_RecordsIterator":
        return _RecordsIterator(self.epoch_chunks, self._open_chunks)


class _RecordsIterator(grain.DatasetIterator):
    """Records from the `open_chunks` chunks being read, each taken from the one that has read the fewest
    bytes so far, so that every part of the corpus is read at the rate of its share of the bytes; an
    exhausted chunk is replaced by the epoch's next, and once the epoch's last is exhausted the marker
    comes. Each chunk's records come in file order. (Taking a record from each chunk in turn instead
    would read a chunk of long documents ahead of the others, a bias as large as the window.)

    State: the epoch, its next chunk to open, and per open chunk its number in the epoch, the byte
    offset of its next line (-1: not started), the bytes and lines it has read (lines for error messages)."""

    def __init__(self, epoch_chunks, open_chunks: int = OPEN_CHUNKS):
        super().__init__()
        self._epoch_chunks, self._open_chunks = epoch_chunks, open_chunks
        self.set_state({"epoch": 0, "next": 0, "open": []})

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._chunks is None:
                raise StopIteration
            while len(self._open) < self._open_chunks and self._next < len(self._chunks):
                self._open.append({"chunk": self._next, "offset": -1, "read": 0, "line": 0})
                self._readers.append(None)
                self._next += 1
            if not self._open:
                ended = self._epoch
                self.set_state({"epoch": ended + 1, "next": 0, "open": []})
                return {"epoch_end": ended}
            turn = min(range(len(self._open)), key=lambda i: self._open[i]["read"])
            reader = self._readers[turn]
            if reader is None:
                cursor = self._open[turn]
                reader = self._readers[turn] = self._read(self._chunks[cursor["chunk"]], cursor)
            record = next(reader, None)
            if record is not None:
                return record
            del self._open[turn], self._readers[turn]

    @staticmethod
    def _read(chunk: Chunk, cursor: dict[str, int]) -> Iterator[dict[str, Any]]:
        """Records from the cursor's position on, advancing the cursor past each one before it is yielded."""
        if chunk.end == -1:
            if cursor["offset"] == -1:
                cursor.update(offset=0, read=_size(chunk.path))
                yield from text_file_record(chunk.path)
            return
        while True:
            with _open(chunk.path) as f:  # closed between reads: many chunks are open at once
                position = cursor["offset"]
                if position == -1:
                    position = chunk.start
                    if chunk.start > 0:  # a line running into the chunk belongs to the chunk it starts in
                        f.seek(chunk.start - 1)
                        position = chunk.start - 1 + len(f.readline())
                f.seek(position)
                lines, read = [], 0
                while position + read < chunk.end and read < READ_BYTES:
                    line = f.readline()
                    if not line:  # the file ends before the chunk planned from its size at the start
                        raise UserError(f"{chunk.path} became shorter during the run ({_size(chunk.path)} bytes, "
                                        f"at least {chunk.end} when the run started): training files must not "
                                        "change while a run reads them; restore it, or start a new run")
                    lines.append(line)
                    read += len(line)
            if not lines:
                return
            for line in lines:
                position += len(line)
                number = cursor["line"] + 1
                cursor.update(offset=position, read=cursor["read"] + len(line), line=number)
                if not line.strip():
                    continue
                try:
                    record = checked_record(parsed_line(line), "")  # a bad record's message: ": expected ..."
                except ValueError as e:  # a UserError too; the line is numbered only when one fails
                    at = number if chunk.start == 0 else _line_number(chunk.path, position - len(line))
                    message = str(e).removeprefix(": ") if isinstance(e, UserError) else f"not valid JSON ({e})"
                    raise UserError(f"{chunk.path}:{at}: {message}") from None
                yield record

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "next": self._next, "open": [dict(cursor) for cursor in self._open]}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._next = state["epoch"], state["next"]
        self._chunks = self._epoch_chunks(self._epoch)
        self._open = [dict(cursor) for cursor in state["open"]]
        self._readers: list[Iterator[dict[str, Any]] | None] = [None] * len(self._open)


def parsed_line(line: bytes) -> Any:
    """One JSON line's value; its failures as a ValueError whose message is whole (json's `msg` alone
    reads "Invalid control character at") and names the column."""
    try:
        return json.loads(line.rstrip(b"\r\n"))  # the line end would be a line 2 in json's position
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: byte {e.start} of the line") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _line_number(path: str, offset: int) -> int:
    """The number of the line that starts at byte `offset` (counted only for an error message)."""
    count = 0
    with _open(path) as f:
        while offset > 0:
            block = f.read(min(offset, READ_BYTES))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count + 1


def _open(path: str) -> Any:
    """The file opened for reading in binary, or a UserError if it went away during the run."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read training file {path} during the run ({e.strerror}): training files must "
                        "stay in place while a run reads them; restore it, or start a new run") from None


def _size(path: str) -> int:
    with _open(path) as f:
        return f.seek(0, os.SEEK_END)

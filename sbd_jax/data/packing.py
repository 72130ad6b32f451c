"""Training documents: local JSONL (`text`, chat `messages`, or `prompt` + `completion`) and plain text
files -> token ids with loss masks -> packed fixed-length rows.

Documents are tokenized (chat through the model's template, loss on assistant tokens only; a prompt
as raw text, loss on its completion only) and packed best-fit into rows with segment ids and
per-document positions. `streaming.py` runs this on the fly for training; `load_packed` does it at
once for small evaluation sets.
"""

from __future__ import annotations

import bisect
import glob
import os
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from sbd_jax.data.jsonl import iter_jsonl
from sbd_jax.errors import UserError


class Document(NamedTuple):
    """A tokenized record: lists, or 1-D arrays (the stream packs arrays; lists of Python ints take several times the memory)."""

    ids: Sequence[int]
    loss_mask: Sequence[bool]


class Batch(NamedTuple):
    """Batch rows, every field `[rows, L]`: numpy arrays on the host (`pack`), jax arrays in the train step
    (and their shapes or shardings when a step is lowered)."""

    tokens: Any  # int32
    segment_ids: Any  # int32, 0 = padding, documents numbered from 1
    positions: Any  # int32, position within each document
    loss_mask: Any  # bool, True where a token may carry loss (assistant tokens for chat data)


JSONL_SUFFIXES = (".jsonl", ".json")  # one record per line (any letter case); any other file is one text record
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")


def is_jsonl(path: str) -> bool:
    return path.lower().endswith(JSONL_SUFFIXES)


def check_data_file(path: str) -> None:
    """Refuses a compressed file: streamed chunks are byte ranges of the file as it lies on disk."""
    if path.lower().endswith(COMPRESSED_SUFFIXES):
        raise UserError(f"{path} is compressed: training reads byte ranges of plain .jsonl / text files; "
                        "decompress it first (e.g. gunzip -k)")


def expand_paths(patterns: Sequence[str]) -> list[str]:
    """Files named by paths or glob patterns, sorted; a pattern matching nothing, or a compressed file, is an
    error."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise UserError(f"data file {pattern!r} does not exist (or the pattern matches nothing)")
        files.extend(f for f in matched if os.path.isfile(f))
    if not files:
        raise UserError("no data files: set config.data.files to JSONL or text files")
    for path in files:
        check_data_file(path)
    return files


def read_records(path: str) -> Iterator[dict[str, Any]]:
    """Records of one file: each JSONL line (`text`, `messages`, or `prompt` + `completion`), or a whole
    text file as one `text`."""
    if not is_jsonl(path):
        yield from text_file_record(path)
        return
    for number, record in iter_jsonl(path):
        yield checked_record(record, f"{path}:{number}")


def text_file_record(path: str) -> Iterator[dict[str, Any]]:
    """A plain text file as one `text` record (none if it holds only whitespace); not UTF-8: an error."""
    check_data_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}): give .jsonl records or plain text files") from None
    if text.strip():
        yield {"text": text}


def checked_record(record: Any, where: str) -> dict[str, Any]:
    """The record if it has one of the accepted shapes, else a UserError naming `where` (file:line)."""
    ok_text = isinstance(record, dict) and isinstance(record.get("text"), str)
    ok_chat = isinstance(record, dict) and isinstance(record.get("messages"), list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in record["messages"])
    ok_completion = isinstance(record, dict) and all(isinstance(record.get(k), str) and record[k]
                                                     for k in ("prompt", "completion"))
    if not (ok_text or ok_chat or ok_completion):
        raise UserError(f'{where}: expected {{"text": "..."}}, {{"messages": [{{"role": ..., '
                        f'"content": ...}}, ...]}} or {{"prompt": "...", "completion": "..."}} (both non-empty)')
    if ok_text + ok_chat + ok_completion > 1:  # which one to train on would be a silent guess
        shapes = [name for name, ok in (("text", ok_text), ("messages", ok_chat), ("prompt + completion",
                                                                                  ok_completion)) if ok]
        raise UserError(f"{where}: the record has both {' and '.join(shapes)}: keep one of them")
    return record


def tokenize(record: dict[str, Any], tokenizer: Any) -> Document:
    """Token ids and loss mask: every token of plain text; only assistant turns of a chat, up to and
    including their EOS; only the completion of a prompt. Text and completions end with EOS, so models learn to stop."""
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if "text" in record:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"] + end
        return Document(ids, [True] * len(ids))
    if "prompt" in record:
        # Tokenized apart, as `sample.py --prompt` (without --chat) tokenizes a prompt at decoding time.
        prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + end
        return Document(prompt + completion, [False] * len(prompt) + [True] * len(completion))
    messages = record["messages"]
    ids = []
    loss: list[bool] = []
    for turn in range(len(messages)):
        # Render growing prefixes; the new tokens of each prefix belong to that turn.
        rendered = tokenizer.apply_chat_template(messages[: turn + 1], tokenize=True, return_dict=False)
        if rendered[: len(ids)] != ids:
            raise UserError("the chat template does not render conversations incrementally; "
                            "assistant-only loss masks cannot be derived for it")
        new = rendered[len(ids):]
        ids += new
        loss += [messages[turn]["role"] == "assistant"] * len(new)
        if messages[turn]["role"] == "assistant" and tokenizer.eos_token_id in new:
            # What a template adds after the turn's EOS (ChatML's newline) is never generated: decoding
            # stops at EOS. Without loss there, the document's end is that EOS (objective.noisy_layout).
            after = len(new) - 1 - new[::-1].index(tokenizer.eos_token_id)
            loss[len(ids) - len(new) + after + 1:] = [False] * (len(new) - after - 1)
    return Document(ids, loss)


def pack(documents: Sequence[Document], seq_len: int, drop_loss_free: bool = False) -> Batch:
    """Packs documents into rows of `seq_len`, never splitting one that fits in a row.

    A document longer than a row is cut into row-long pieces plus a remainder; with `drop_loss_free`,
    pieces without a token that carries loss are left out (a piece attends only within itself, so such
    a piece adds nothing to any loss: a chat's long prompt). Each piece goes to
    the fullest row that still has room for it (best fit), or opens a new row; the rest of a row is
    padding (segment id 0). Segment ids keep documents apart; positions count from 0 in each piece:
    a continuation piece is a window of its own, with no earlier context in its row (its true offset
    could also exceed the model's position range).
    """
    pieces = [(doc, start, min(start + seq_len, len(d.ids)))
              for doc, d in enumerate(documents) for start in range(0, len(d.ids), seq_len)
              if not drop_loss_free or np.any(d.loss_mask[start: start + seq_len])]
    rows: list[list[tuple[int, int, int]]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row), sorted
    for piece in pieces:
        size = piece[2] - piece[1]
        fit = bisect.bisect_left(open_rows, (size, -1))
        if fit < len(open_rows):
            room, row = open_rows.pop(fit)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(piece)
        if room > size:
            bisect.insort(open_rows, (room - size, row))
    tokens = np.zeros((len(rows), seq_len), np.int32)
    segments = np.zeros((len(rows), seq_len), np.int32)
    loss_mask = np.zeros((len(rows), seq_len), bool)
    for row, row_pieces in enumerate(rows):
        at = 0
        for number, (doc, start, end) in enumerate(row_pieces, start=1):
            tokens[row, at: at + end - start] = documents[doc].ids[start:end]
            loss_mask[row, at: at + end - start] = documents[doc].loss_mask[start:end]
            segments[row, at: at + end - start] = number
            at += end - start
    return Batch(tokens, segments, segment_positions(segments), loss_mask)


def padding_fraction(packed: Batch) -> float:
    """Share of the packed rows' slots that hold no token."""
    return float((packed.segment_ids == 0).mean())


def segment_positions(segments: np.ndarray) -> np.ndarray:
    """Position of each token within its run of equal segment ids in the row."""
    index = np.broadcast_to(np.arange(segments.shape[1]), segments.shape)
    starts = np.ones(segments.shape, bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)


def load_packed(files: Sequence[str], tokenizer: Any, seq_len: int) -> Batch:
    """Every document of `files`, tokenized and packed in memory (evaluation sets; training streams)."""
    documents = [tokenize(r, tokenizer) for path in expand_paths(files) for r in read_records(path)]
    documents = [d for d in documents if d.ids]
    if not documents:
        raise UserError(f"the data files {list(files)} hold no text")
    if not any(any(d.loss_mask) for d in documents):
        raise UserError("no token in the data carries loss (chat data without assistant turns?)")
    return pack(documents, seq_len)

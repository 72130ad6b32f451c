"""The streamed training data: chunked lazy reading, sharding over hosts, exact resume, workers."""

import json

import numpy as np
import pytest

from sbd_jax.data import streaming
from sbd_jax.data.chunks import (
    CHUNK_BYTES,
    CORPUS_CHUNKS,
    MIN_CHUNK_BYTES,
    OPEN_CHUNKS,
    Records,
    chunk_bytes_for,
    plan_chunks,
)
from sbd_jax.data.config import DataConfig
from sbd_jax.data.packing import Batch, read_records
from sbd_jax.errors import UserError
from tests.conftest import slow_case
from tests.test_data import char_tokenizer


def corpus(tmp_path, n=200, name="a.jsonl"):
    path = tmp_path / name
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i}: " + "xy" * (i % 37)}) + "\n")
            if i % 50 == 7:
                f.write("\n")  # blank lines are skipped, and still counted in line numbers
    return str(path)


def read(chunks, open_chunks=OPEN_CHUNKS):
    """The records of the chunks in their order, one epoch (its end marker dropped)."""
    records = list(Records(chunks, seed=None, open_chunks=open_chunks))
    assert records[-1] == {"epoch_end": 0}
    return records[:-1]


@pytest.mark.parametrize("chunk_bytes", [1, 97, 1000, 1 << 20])
def test_chunks_hold_every_record_exactly_once_in_order(tmp_path, chunk_bytes):
    path = corpus(tmp_path)
    chunks = plan_chunks([path], chunk_bytes)
    assert len(chunks) == -(-len(open(path, "rb").read()) // chunk_bytes)
    assert read(chunks, open_chunks=1) == list(read_records(path))
    # Read many at once, chunks interleave: every record still once, each chunk's in file order.
    interleaved, expected = read(chunks, open_chunks=4), list(read_records(path))
    assert sorted(map(json.dumps, interleaved)) == sorted(map(json.dumps, expected))
    if chunk_bytes == 1000:
        assert interleaved != expected
        assert interleaved[:4] == [read([c], open_chunks=1)[0] for c in chunks[:4]]


def test_a_small_corpus_is_cut_finely_and_a_large_one_in_large_chunks(tmp_path):
    small = corpus(tmp_path)
    assert chunk_bytes_for([small]) == MIN_CHUNK_BYTES
    large = tmp_path / "large.jsonl"
    with open(large, "wb") as f:  # sparse: sized, not written
        f.truncate(5 * CHUNK_BYTES * CORPUS_CHUNKS)
    assert chunk_bytes_for([str(large)]) == CHUNK_BYTES
    assert chunk_bytes_for([small, str(large)]) == CHUNK_BYTES


def test_a_bad_record_is_named_by_file_and_line_also_in_later_chunks(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n' + '{"text": "fine"}\n' * 10 + "{oops\n" + '{"text": 4}\n')
    with pytest.raises(UserError, match=f"{path}:2: expected"):
        read(plan_chunks([str(path)]))
    with pytest.raises(UserError, match=rf"{path}:13: not valid JSON"):  # counted, not "line at byte 199"
        read(plan_chunks([str(path)], 150)[1:])
    with pytest.raises(UserError, match=rf"{path}:14: expected"):
        read(plan_chunks([str(path)], 200)[1:])


def batches(files, tok, shards=2, host=0, hosts=1, workers=0):
    data = DataConfig(files=tuple(files), seq_len=64, shards=shards, workers=workers)
    return streaming.host_batches(data, tok, global_batch=4, seed=3, host=host, hosts=hosts)


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in Batch._fields:
            np.testing.assert_array_equal(x[name], y[name])


def test_one_host_reading_two_shards_sees_what_two_hosts_see_together(tmp_path):
    tok = char_tokenizer(tmp_path)
    files = [corpus(tmp_path, 150, "a.jsonl"), corpus(tmp_path, 90, "b.jsonl")]
    alone = take(batches(files, tok), 12)
    hosts = [take(batches(files, tok, host=h, hosts=2), 12) for h in range(2)]
    for whole, first, second in zip(alone, *hosts):
        assert whole["tokens"].shape == (4, 64) and first["tokens"].shape == (2, 64)
        assert_same([whole], [{name: np.concatenate([first[name], second[name]]) for name in Batch._fields}])
    # Rows are well formed: segments numbered from 1 with 0 as padding, positions restarting per document.
    rows = np.concatenate([b["segment_ids"] for b in alone])
    assert rows.max() > 1 and (rows[:, 0] == 1).all()
    assert all(np.all(np.diff(r[r > 0]) >= 0) for r in rows)


@pytest.mark.parametrize("workers,taken", [(0, 7), slow_case(2, 7), (0, 0), slow_case(2, 1)])
def test_a_restored_stream_continues_exactly(tmp_path, workers, taken):
    """Also saved before any batch, or after one with two workers: the second has served nothing yet."""
    tok = char_tokenizer(tmp_path)
    files = [corpus(tmp_path, 300)]
    stream = batches(files, tok, workers=workers)
    take(stream, taken)
    state = stream.get_state()
    expected = take(stream, 9)
    resumed = batches(files, tok, workers=workers)
    resumed.set_state(state)
    assert_same(take(resumed, 9), expected)


def test_a_restored_stream_refuses_a_changed_corpus(tmp_path):
    tok = char_tokenizer(tmp_path)
    path = corpus(tmp_path, 300)
    state = batches([path], tok).get_state()
    with open(path, "a") as f:  # a corpus that grew: the saved chunk numbers now name other bytes
        f.write((json.dumps({"text": "more"}) + "\n") * 1000)
    with pytest.raises(UserError, match="data files changed"):
        batches([path], tok).set_state(state)


def test_the_files_of_a_corpus_are_mixed_in_every_batch(tmp_path):
    """Two sources, one of many short documents and one of few long ones (as arithmetic problems and
    source files): rows of both in most batches, as if rows were drawn independently; not one file
    at a time, nor a long document's rows filling a batch."""
    tok = char_tokenizer(tmp_path)
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text("".join(json.dumps({"text": "a" * (30 + i % 10)}) + "\n" for i in range(2000)))
    long.write_text("".join(json.dumps({"text": "b" * 3000}) + "\n" for _ in range(8)))
    data = DataConfig(files=(str(short), str(long)), seq_len=64, shards=1, workers=0)
    stream = streaming.host_batches(data, tok, global_batch=8, seed=0, host=0, hosts=1)
    a, b = (tok(c)["input_ids"][0] for c in "ab")
    has = np.array([[[(row == t).any() for t in (a, b)] for row in next(stream)["tokens"]] for _ in range(300)])
    share_b = has[..., 1].mean()  # 16% of the rows of an epoch: 376 rows of "b" to 2000 of "a"
    assert 0.1 < share_b < 0.3
    both = (has[..., 0].any(1) & has[..., 1].any(1)).mean()
    assert both > 0.6, f"{both:.0%} of batches hold both files (independent rows: {1 - (1 - share_b) ** 8:.0%})"


def test_a_small_corpus_repeats_and_its_documents_are_served_whole(tmp_path):
    tok = char_tokenizer(tmp_path)
    path = corpus(tmp_path, 40)
    served = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in take(batches([path], tok, shards=1), 30)])
    ids = tok(open(path).read().replace("\n", ""))["input_ids"]
    assert len(served) > 2 * len(ids)  # several epochs of a small corpus
    starts = [tok(json.loads(line)["text"])["input_ids"] for line in open(path) if line.strip()]
    assert all(any(np.array_equal(served[i:i + len(s)], s) for i in range(len(served) - len(s) + 1))
               for s in starts[:5])


def test_bad_shard_settings_are_refused(tmp_path):
    tok = char_tokenizer(tmp_path)
    path = corpus(tmp_path, 10)
    with pytest.raises(UserError, match="data.shards=3 is not a multiple of the 2 hosts"):
        batches([path], tok, shards=3, hosts=2)
    with pytest.raises(UserError, match="batch_size=4 is not divisible by data.shards=3"):
        batches([path], tok, shards=3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="hold no text"):
        batches([str(empty)], tok)


KILLED_READER = """
import glob, os, signal, sys, threading, time
from sbd_jax.data import streaming
from sbd_jax.data.config import DataConfig
from tests.test_data import char_tokenizer
import pathlib
if __name__ == "__main__":
    tok = char_tokenizer(pathlib.Path(sys.argv[2]))
    data = DataConfig(files=(sys.argv[1],), seq_len=64, shards=1, workers=2)
    stream = streaming.host_batches(data, tok, global_batch=4, seed=0, host=0, hosts=1)
    if sys.argv[3] == "served":  # the workers are running
        next(stream)
    else:  # the workers are still starting (importing, unpickling the pipeline): kill as soon as they exist
        threading.Thread(target=next, args=(stream,), daemon=True).start()
    def workers():  # every child but Python's resource tracker
        children = [c for f in glob.glob("/proc/self/task/*/children") for c in open(f).read().split()]
        return [c for c in children if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()], children
    while len(workers()[0]) < 2:
        time.sleep(0.01)
    children = workers()[1]
    print(" ".join(children), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", [slow_case("starting"), "served"])
def test_the_workers_of_a_killed_run_exit_with_it(tmp_path, when):
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "reader.py"
    script.write_text(KILLED_READER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: orphans would hold pipes open
        code = subprocess.run([sys.executable, str(script), corpus(tmp_path, 50), str(tmp_path), when], cwd=root,
                              env={**os.environ, "PYTHONPATH": root}, stdout=stdout, stderr=stderr,
                              timeout=300).returncode
    assert code == -9, err.read_text()[-2000:]
    children = [int(pid) for pid in out.read_text().split()]
    assert len(children) >= 2  # the two workers (and Python's resource tracker)
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in children):
        time.sleep(0.2)
    left = [pid for pid in children if os.path.exists(f"/proc/{pid}")
            and "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]
    assert not left, f"workers still running after their parent was killed: {left}"


def unique_corpus(tmp_path, n, name="u.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": f"document {i:05d} " + "z" * (i % 23)}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("num_chunks", [1, 3, 8, 27, 100])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_every_shard_reads_each_of_its_documents_once_an_epoch_and_shards_are_disjoint(tmp_path, num_chunks, shards):
    """Any corpus size against the 64 chunks read at once: a shard of few chunks never reads copies of
    one chunk side by side (a 300-document corpus of 8 chunks served 43 distinct documents an epoch)."""
    path = unique_corpus(tmp_path, 400)
    chunk_bytes = -(-len(open(path, "rb").read()) // num_chunks)
    chunks = plan_chunks([path], chunk_bytes)
    assert len(chunks) == num_chunks
    everything = sorted(r["text"] for r in read(chunks))
    for epoch in range(3):
        seen = []
        for shard in range(shards):
            records = Records(chunks, seed=5, shard=shard, shards=shards)
            iterator = iter(records)
            for _ in range(epoch):  # skip earlier epochs
                while "epoch_end" not in next(iterator):
                    pass
            texts = []
            while "epoch_end" not in (record := next(iterator)):
                texts.append(record["text"])
            assert len(texts) == len(set(texts)), f"shard {shard} repeats documents within epoch {epoch}"
            seen += texts
        assert sorted(seen) == everything  # shards together: every document exactly once


def served_documents(tmp_path, n, rows, shards=1, host=0, hosts=1, workers=0):
    """The documents of the first `rows` rows a host serves, in order (each text is unique and short)."""
    tok = char_tokenizer(tmp_path)
    path = unique_corpus(tmp_path, n)
    data = DataConfig(files=(path,), seq_len=128, shards=shards, workers=workers)
    stream = streaming.host_batches(data, tok, global_batch=8, seed=1, host=host, hosts=hosts)
    texts = []
    while len(texts) < rows:
        batch = next(stream)
        for tokens, segments in zip(batch["tokens"], batch["segment_ids"]):
            texts += [tok.decode(tokens[segments == s]) for s in range(1, segments.max() + 1)]
    return texts


@pytest.mark.parametrize("n", [300, 1000])
def test_an_epoch_of_batches_serves_every_document_of_a_small_corpus_once(tmp_path, n):
    texts = served_documents(tmp_path, n, n)
    assert len(set(texts[:n])) == n  # the first epoch: every document exactly once, no other
    assert len(set(texts[n:2 * n])) == len(texts[n:2 * n])  # the next epoch begins afresh


def test_two_hosts_share_no_document_within_an_epoch(tmp_path):
    n, within = 2000, 700  # each shard holds ~1000 documents (whole chunks of ~130): 700 lie in its first epoch
    first, second = (served_documents(tmp_path, n, within, shards=2, host=h, hosts=2)[:within] for h in range(2))
    assert len(set(first)) == len(first) and len(set(second)) == len(second)
    assert not set(first) & set(second)


def test_too_few_chunks_for_the_streams_is_refused(tmp_path):
    tok = char_tokenizer(tmp_path)
    path = tmp_path / "one.txt"
    path.write_text("a single text file is one chunk")
    with pytest.raises(UserError, match="cut into 1 chunks, fewer than the 2 streams"):
        batches([str(path)], tok, shards=2)


def test_a_restored_stream_refuses_other_batch_shapes(tmp_path):
    tok = char_tokenizer(tmp_path)
    path = corpus(tmp_path, 300)
    state = batches([path], tok).get_state()
    longer = streaming.host_batches(DataConfig(files=(path,), seq_len=128, shards=2, workers=0), tok,
                                    global_batch=4, seed=3, host=0, hosts=1)
    with pytest.raises(UserError, match=r"other batch shapes \(seq_len 64 -> 128\)"):
        longer.set_state(state)
    with pytest.raises(UserError, match=r"other batch shapes \(rows_per_shard 2 -> 4\)"):
        streaming.host_batches(DataConfig(files=(path,), seq_len=64, shards=2, workers=0), tok, global_batch=8,
                               seed=3, host=0, hosts=1).set_state(state)


def test_a_restored_stream_refuses_other_workers_or_shards_naming_them(tmp_path):
    # Workers 0 and 1 both read 2 streams of the same chunks: only the recorded count tells them apart, and a
    # position restored into other workers' streams went on silently, then failed to save.
    tok = char_tokenizer(tmp_path)
    path = corpus(tmp_path, 300)
    state = batches([path], tok).get_state()
    with pytest.raises(UserError, match=r"other streams \(workers 0 -> 1\): resume with data.workers=0, or start"):
        batches([path], tok, workers=1).set_state(state)
    with pytest.raises(UserError, match=r"other streams \(.*shards 2 -> 1\): resume with data.shards=2 \(or "
                                        r"data.shards=0 on 2 hosts\), or start"):
        batches([path], tok, shards=1).set_state(state)
    # A position saved before the layout recorded the streams (an older version) still restores...
    saved = json.loads(state)
    del saved["layout"]["workers"], saved["layout"]["shards"]
    resumed = batches([path], tok)
    resumed.set_state(json.dumps(saved).encode())
    expected = batches([path], tok)
    expected.set_state(state)
    assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(take(resumed, 2), take(expected, 2)))
    # ... but one from before the stream read epochs per shard (no "epochs" key) is refused, as it was.
    del saved["layout"]["epochs"]
    with pytest.raises(UserError, match=r"laid out otherwise \(epochs None -> per shard\)"):
        batches([path], tok).set_state(json.dumps(saved).encode())


@pytest.mark.parametrize("name, content, message", [
    ("data.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "is compressed"),
    ("DATA.JSONL", json.dumps({"text": "upper-case extension"}).encode() + b"\n", None),
    ("blob.bin", b"\xff\xfe\x00\x81binary", "is not UTF-8 text"),
])
def test_compressed_binary_and_upper_case_files(tmp_path, name, content, message):
    tok = char_tokenizer(tmp_path)
    path = tmp_path / name
    path.write_bytes(content)
    if message:
        with pytest.raises(UserError, match=message):
            next(batches([str(path)], tok, shards=1))
    else:  # read as JSONL: the record's text, not its JSON
        batch = next(batches([str(path)], tok, shards=1))
        text = tok.decode(batch["tokens"][0][batch["segment_ids"][0] == 1])
        assert text.startswith("upper-case extension")


def test_records_that_tokenize_to_nothing_are_refused_before_training(tmp_path):
    tok = char_tokenizer(tmp_path)
    path = tmp_path / "empty_chats.jsonl"
    path.write_text('{"messages": []}\n' * 100)
    with pytest.raises(UserError, match="none of the 100 records .* has a token that carries loss"):
        batches([str(path)], tok, shards=1)

"""The streamed data pipeline on a large JSONL corpus: packed tokens/s and peak host memory.

    python -m benchmarks.data_pipeline [--gib 2] [--small-gib 0.25] [--windows 8] [--workers 2]

Writes corpora of `--small-gib` and `--gib` GiB of JSONL documents (made-up words of Zipf-like
frequency, 1-9 KB each; 20,000 distinct documents cycled with distinct numbers) to a temp dir, streams
global batches of the Llama-3-8B config's shape (rows of 4096 tokens) through `streaming.host_batches`
with the SmolLM2 tokenizer, as many as `--windows` packing windows per worker hold (timed from the
first batch on: the workers' first windows, packed before it, are then a small part of what is
timed), and reports, for each corpus, the peak resident memory of the process tree (this process and
its Grain workers, sampled every 50 ms) and non-padding packed tokens/s. The same batch count on both
corpora shows whether memory grows with the corpus. For scale, the tokens/s one training step of
`configs/llama3_8b.py` consumes on 8 H100s, from the roofline model: 6 x matmul weights x 2 (SBD's two
copies) FLOPs per token at an assumed 40% MFU of the dense BF16 peak.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np

from benchmarks import save_result
from sbd_jax.data import streaming
from sbd_jax.data.config import DataConfig
from sbd_jax.roofline import HARDWARE, MODELS, training_flops_per_token

ASSUMED_MFU = 0.40


def write_corpus(path: str, gib: float, seed: int = 0) -> int:
    """JSONL of random-word documents up to `gib` GiB; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    # 200k made-up words drawn Zipf-like, as word frequencies in text are: the tokenizer's word cache
    # helps as much as on real text, no more.
    words = np.array(["".join(rng.choice(letters, n)) for n in rng.integers(2, 12, 200_000)])
    rank = np.minimum(rng.zipf(1.1, 20_000_000), len(words)) - 1
    docs, at = [], 0
    for length in rng.integers(200, 1000, 20_000):
        docs.append(" ".join(words[rank[at: at + length]]))
        at += length
    target, written, number = int(gib * (1 << 30)), 0, 0
    with open(path, "w") as f:
        while written < target:
            line = '{"text": "%d %s"}\n' % (number, docs[number % len(docs)])
            f.write(line)
            written += len(line)
            number += 1
    return written


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def measure(path: str, tokenizer, batches: int, workers: int, global_batch: int, seq_len: int) -> dict:
    peak = [tree_rss(os.getpid())]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak.append(tree_rss(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    data = DataConfig(files=(path,), seq_len=seq_len, shards=1, workers=workers)
    stream = streaming.host_batches(data, tokenizer, global_batch=global_batch, seed=0, host=0, hosts=1)
    first = next(stream)  # worker start-up and the first window are not steady-state throughput
    began, tokens = time.perf_counter(), 0
    for _ in range(batches):
        batch = next(stream)
        tokens += int((batch["segment_ids"] > 0).sum())
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    del first, stream
    return {"corpus_gib": os.path.getsize(path) / (1 << 30), "batches": batches, "packed_tokens": tokens,
            "seconds": seconds, "packed_tokens_per_s": tokens / seconds, "peak_rss_mib": max(peak) / (1 << 20)}


def h100_consumption(global_batch: int, seq_len: int) -> dict:
    hw, m = HARDWARE["h100-bf16"], MODELS["llama3-8b"]
    flops = training_flops_per_token(m, sbd=True) * global_batch * seq_len
    seconds = flops / (8 * hw.peak_flops * ASSUMED_MFU)
    return {"assumption": f"llama3-8b SBD step, {global_batch} x {seq_len} tokens, 8 x H100 dense BF16 at "
                          f"{ASSUMED_MFU:.0%} MFU (roofline: 6 x matmul weights x 2 FLOPs per token)",
            "step_seconds": seconds, "tokens_per_s": global_batch * seq_len / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--small-gib", type=float, default=0.25)
    parser.add_argument("--windows", type=int, default=8, help="packing windows per worker to stream")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8, help="rows per batch (the 8B config's micro-batch)")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()

    from sbd_jax.checkpoints.load import resolve
    from sbd_jax.checkpoints.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve("smollm2-135m"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for gib in (args.small_gib, args.gib):
            path = os.path.join(tmp, f"corpus_{gib}.jsonl")
            began = time.perf_counter()
            size = write_corpus(path, gib)
            print(f"wrote {size / (1 << 30):.2f} GiB in {time.perf_counter() - began:.0f} s", flush=True)
            window_rows = streaming.WINDOW_TOKENS / args.seq_len
            batches = int(np.ceil(args.windows * max(args.workers, 1) * window_rows / args.global_batch))
            row = measure(path, tokenizer, batches, args.workers, args.global_batch, args.seq_len)
            print(row, flush=True)
            rows.append(row)
            os.remove(path)
    need = h100_consumption(args.global_batch, args.seq_len)
    result = {"workers": args.workers, "cpu_count": os.cpu_count(), "runs": rows, "llama3_8b_on_8xh100": need,
              "rss_ratio_large_to_small": rows[1]["peak_rss_mib"] / rows[0]["peak_rss_mib"],
              "pipeline_over_h100_need": rows[1]["packed_tokens_per_s"] / need["tokens_per_s"]}
    print(f"peak RSS {rows[0]['peak_rss_mib']:.0f} MiB ({rows[0]['corpus_gib']:.2f} GiB corpus) vs "
          f"{rows[1]['peak_rss_mib']:.0f} MiB ({rows[1]['corpus_gib']:.2f} GiB); "
          f"{rows[1]['packed_tokens_per_s']:.0f} packed tokens/s with {args.workers} workers on "
          f"{os.cpu_count()} cores; 8B step on 8 H100s consumes {need['tokens_per_s']:.0f} tokens/s")
    print("wrote", save_result("data_pipeline", result))


if __name__ == "__main__":
    main()

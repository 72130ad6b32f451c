"""How well the training stream mixes a corpus's files: the small-scale study's two sources, row by row.

    python -m benchmarks.data_mixing [--batches 3000]

Builds the study's training corpus (`experiments/small_scale`: 40,000 worked-step addition problems,
5.9 MB of JSONL, and 500k characters of Python's standard library, 0.5 MB in 27 long documents) in a
temp dir, streams `--batches` batches exactly as the study's NTP model trains on them (its config:
16 x 128 tokens, seed 0, 2 Grain workers), calls a row arithmetic if it holds a worked step (`+d+d=`), and reports the share of such rows
and of batches that are all arithmetic, all code or mixed, beside the all-arithmetic share that
independently drawn rows would give (share ** 16). A stream that reads one file at a time gives 100%
all-arithmetic batches for thousands of steps.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

import numpy as np

from benchmarks import save_result
from sbd_jax.data import streaming
from sbd_jax.training.config import TrainConfig

WORKED_STEP = re.compile(r"\+\d\+\d=")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=3000)
    args = parser.parse_args()

    from experiments.small_scale.config import get_config
    from experiments.small_scale.corpus import build_corpus
    from experiments.small_scale.run import study_sizes
    from sbd_jax.checkpoints.tokenizer import load_tokenizer
    from sbd_jax.evaluation.char_tokenizer import save_char_tokenizer

    sizes = study_sizes(smoke=False)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = save_char_tokenizer(os.path.join(tmp, "tokenizer"))
        tokenizer = load_tokenizer(tokenizer_dir)
        corpus = build_corpus(os.path.join(tmp, "data"), train_problems=sizes["train_problems"],
                              valid_problems=sizes["valid_problems"], test_problems=sizes["test_problems"],
                              max_digits=sizes["max_digits"], code_chars=sizes["code_chars"],
                              heldout_code_chars=sizes["heldout_code_chars"], seed=0)
        cfg = TrainConfig.from_config_dict(get_config(
            "ntp", files=corpus.train_files, tokenizer=tokenizer_dir, steps=args.batches,
            batch_size=sizes["batch_size"], seq_len=sizes["seq_len"]))
        stream = streaming.host_batches(cfg.data, tokenizer, global_batch=cfg.train.batch_size, seed=cfg.seed,
                                        host=0, hosts=1)
        shares = np.array([np.mean([bool(WORKED_STEP.search(tokenizer.decode(row.tolist())))
                                    for row in next(stream)["tokens"]]) for _ in range(args.batches)])
        file_bytes = {os.path.basename(f): os.path.getsize(f) for f in corpus.train_files}
    result = {
        "files": file_bytes, "batches": args.batches, "rows_per_batch": cfg.train.batch_size,
        "seq_len": cfg.data.seq_len, "workers": cfg.data.workers, "seed": cfg.seed, "arithmetic_row_share": float(shares.mean()),
        "all_arithmetic_batches": float((shares == 1).mean()), "all_code_batches": float((shares == 0).mean()),
        "mixed_batches": float(((shares > 0) & (shares < 1)).mean()),
        "all_arithmetic_if_rows_were_independent": float(shares.mean() ** cfg.train.batch_size),
    }
    print(f"{args.batches} batches: {result['arithmetic_row_share']:.1%} of rows arithmetic; batches "
          f"{result['all_arithmetic_batches']:.1%} all arithmetic (independent rows: "
          f"{result['all_arithmetic_if_rows_were_independent']:.1%}), {result['all_code_batches']:.1%} all code, "
          f"{result['mixed_batches']:.1%} mixed")
    print("wrote", save_result("data_mixing", result))


if __name__ == "__main__":
    main()

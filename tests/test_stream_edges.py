"""The training stream at its edges (issue 57): long prompts that would leave a batch without loss, training
files that change or go away during a run, bad records named by line, Ctrl-C reaching Grain's workers."""

import json
import os
import subprocess
import sys

import pytest

from sbd_jax.data import streaming
from sbd_jax.data.chunks import Records, plan_chunks
from sbd_jax.data.config import DataConfig
from sbd_jax.errors import UserError
from tests.test_data import char_tokenizer
from tests.test_streaming import corpus, read

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_long_prompts_never_make_a_batch_without_loss(tmp_path):
    """Issue 57 item 1: a prompt longer than a row was cut into row-long pieces without loss; at batch size 1
    such a piece was a whole batch, and `check_batch` stopped the run there, at the same step every rerun.
    The packer now leaves such pieces out (they train nothing: a piece attends only within itself)."""
    tok = char_tokenizer(tmp_path)
    path = tmp_path / "mixchat.jsonl"
    path.write_text("".join(json.dumps({"prompt": "q" * (300 if i % 10 == 0 else 5), "completion": f"a{i % 7}"}) + "\n"
                            for i in range(100)))
    data = DataConfig(files=(str(path),), seq_len=16, shards=1, workers=0)
    stream = streaming.host_batches(data, tok, global_batch=1, seed=0, host=0, hosts=1)
    served = [next(stream) for _ in range(200)]  # more than an epoch: 55 rows now, ~240 before
    assert all(batch["loss_mask"].any() for batch in served)
    # The long documents still train: the last piece of each, its prompt's end with the completion, is served.
    (q,) = tok("q", add_special_tokens=False)["input_ids"]
    assert any((batch["tokens"] == q).sum() >= 8 for batch in served)


@pytest.mark.parametrize("change, message", [
    ("shrink", r"a.jsonl became shorter during the run \(\d+ bytes, at least \d+ when the run started\)"),
    ("delete", r"cannot read training file .*a.jsonl during the run \(No such file or directory\)"),
])
def test_a_training_file_that_shrinks_or_goes_away_during_the_run_is_reported(tmp_path, change, message):
    """Items 12 and 14: cut at a line boundary, the rest of the file was silently never read (80 steps on 5
    of 25 lines); deleted, a 53-line FileNotFoundError."""
    path = corpus(tmp_path, 200)
    records = iter(Records(plan_chunks([path], 1000), seed=None, open_chunks=1))
    next(records)
    if change == "shrink":
        lines = open(path).readlines()
        open(path, "w").writelines(lines[:5])
    else:
        os.remove(path)
    with pytest.raises(UserError, match=message):
        list(records)


@pytest.mark.parametrize("line, problem", [
    ('{"text": "tab\there"}', r"Invalid control character at column 14"),  # json's msg alone ended in "at"
    ("[" * 100_000, r"nested too deeply"),  # a RecursionError inside json
    ('{"text": "fine"', r"Expecting ',' delimiter at column 16"),
])
def test_bad_records_past_the_first_chunk_are_named_by_line_with_the_whole_json_message(tmp_path, line, problem):
    """Item 16 (and 12's nested brackets): named "line at byte 4271", messages clipped."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' * 12 + "\n" + line + "\n")
    with pytest.raises(UserError, match=rf"^{path}:14: not valid JSON \({problem}\)(\n|$)"):  # then Grain's note
        read(plan_chunks([str(path)], 150)[1:2])  # the chunk where line 14 starts


WORKER = """
import os, signal, time
from sbd_jax.data.streaming import _exit_with_parent
_exit_with_parent(0, 1, parent=os.getppid())
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
print("still running")
"""


def test_grain_workers_leave_ctrl_c_to_the_training_process():
    """Item 12's Ctrl-C: it reaches every process of the group; a worker that died of KeyboardInterrupt
    printed a traceback and leaked its shared memory, while the training process saves and stops."""
    proc = subprocess.run([sys.executable, "-c", WORKER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "still running", proc.stderr[-2000:]

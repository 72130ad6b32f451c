"""train.py refuses bad input before anything loads, or at the record that is bad, in one line: config values,
the mesh, data files and the mask token."""

import os
import subprocess
import sys

import pytest

from sbd_jax.errors import UserError
from sbd_jax.training.trainer import Trainer
from tests.conftest import requires_smollm2
from tests.test_train import DATA, ROOT, quick_config


@pytest.mark.parametrize("overrides, message", [
    ({"objective__block_size_min": 0}, "block_size=0 must be >= 1"),
    ({"objective__eta_max": 1.5}, "eta range"),
    ({"objective__block_size_max": 100}, "block_size=100 is longer than seq_len=64"),
    ({"data__seq_len": 1}, "data.seq_len=1 must be >= 2"),
    ({"train__batch_size": 6, "train__grad_accum": 4}, "not divisible by train.grad_accum"),
    ({"objective__kind": "mlm"}, "objective.kind='mlm'"),
    ({"train__log_every": 0}, "train.log_every=0 must be >= 1"),
])
def test_bad_config_fails_before_anything_loads(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        Trainer(quick_config(**overrides), str(tmp_path))


def test_bad_mesh_for_the_devices(tmp_path):
    cfg = quick_config()
    cfg.mesh = (3, 1, 1)
    with pytest.raises(UserError, match="needs 3 devices, but there are 8"):
        Trainer(cfg, str(tmp_path))


@pytest.mark.slow  # several runs start; test_train_cli_reports_bad_input_in_one_line keeps the CLI path
@requires_smollm2
def test_bad_data_and_mask_token(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    cfg = quick_config()
    cfg.data.files = (str(bad),)
    with pytest.raises(UserError, match=f"{bad}:2: expected"):
        Trainer(cfg, str(tmp_path / "w1")).run()  # streamed: found when the record is read
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cfg.data.files = (str(empty),)
    with pytest.raises(UserError, match="hold no text"):
        Trainer(cfg, str(tmp_path / "w2"))
    cfg.data.files = tuple(DATA)
    cfg.data.mask_token = "1000000"
    with pytest.raises(UserError, match="mask token id 1000000 is outside the vocabulary"):
        Trainer(cfg, str(tmp_path / "w3"))
    cfg.data.mask_token = "198"  # "\n" in SmolLM2's vocabulary: Python source is full of it
    with pytest.raises(UserError, match=r"mask token id 198 occurs .* times in the training data \(step 1's batch\)"):
        Trainer(cfg, str(tmp_path / "w4")).run()


def test_train_cli_reports_bad_input_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path),
                           "--config.data.files=('/nope/*.jsonl',)"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: data file '/nope/*.jsonl' does not exist " \
                                                    "(or the pattern matches nothing)"

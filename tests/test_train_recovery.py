"""Training runs that meet trouble (issue 57): a cut metrics.jsonl, two runs on one workdir, a damaged latest
checkpoint, a full disk at a save, Ctrl-C, bad seeds and config files. Each ends in correct behaviour or
one line."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sbd_jax.errors import UserError
from sbd_jax.training.trainer import Trainer
from tests.conftest import requires_smollm2
from tests.test_train import ROOT, losses, quick_config


def small_config(**train):
    """quick_config with rows of 32 tokens (half its time a step), no export."""
    cfg = quick_config(**train)
    cfg.data.seq_len, cfg.export_hf = 32, False
    return cfg


def test_a_cut_last_metrics_record_is_dropped_and_a_damaged_earlier_one_is_named(tmp_path, capsys):
    """Item 3: a kill or a full disk mid-write left a partial last line, and every resume then ended in
    json's JSONDecodeError although the checkpoints were whole."""
    from sbd_jax.training.log import MetricsLog

    rows = [json.dumps({"step": step, "loss": 1.0}) + "\n" for step in (1, 2, 3)]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(rows) + '{"step": 4, "lo')
    with MetricsLog(str(tmp_path), 3, primary=True) as metrics:
        metrics.write([{"step": 4, "loss": 0.5}])
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]
    assert "its last record was cut off" in capsys.readouterr().err
    log.write_text(rows[0] + '{"step": 2, "lo\n' + rows[2])
    with pytest.raises(UserError, match=r"metrics.jsonl:2: the record is damaged .*remove that line"):
        MetricsLog(str(tmp_path), 3, primary=True)


HOLDER = """
import sys, time
from sbd_jax.training.workdir_lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("holding", flush=True)
time.sleep(120)
"""


@requires_smollm2
def test_a_second_run_on_a_workdir_is_refused_naming_the_first_and_a_dead_runs_lock_is_taken_over(tmp_path):
    """Item 7: two runs on one workdir both trained, every step logged twice, one taking the other's
    checkpoint. The kernel drops a dead process's lock: the lock file it leaves is no obstacle."""
    from sbd_jax.training.workdir_lock import WorkdirLock

    cfg = small_config(train__steps=1)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(UserError, match=rf"^--workdir {tmp_path} is in use by process {holder.pid} on host "
                                            r".*: wait for it to end or stop it, or choose another --workdir$"):
            Trainer(cfg, str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"process {holder.pid}" in (tmp_path / "train.lock").read_text()  # left behind by the killed run
    with WorkdirLock(str(tmp_path)):  # what Trainer.run holds
        assert f"process {os.getpid()}" in (tmp_path / "train.lock").read_text()


@requires_smollm2
def test_resume_falls_back_to_the_newest_checkpoint_that_restores_and_says_which(tmp_path, capsys):
    """Item 8: a damaged latest checkpoint blocked resuming ("use another --workdir or delete it")."""
    cfg = small_config(train__steps=2, checkpoint__every=1)
    trainer = Trainer(cfg, str(tmp_path))
    trainer.run()
    damaged = tmp_path / "checkpoints" / "2"
    for root, _, files in os.walk(damaged / "state"):
        for name in files:
            open(os.path.join(root, name), "wb").close()  # every file of its state emptied
    rows = trainer.run()  # resumes as a new run would, without compiling the step again
    assert [r["step"] for r in rows] == [2]
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert note.startswith(f"note: the checkpoint of step 2 in {tmp_path} cannot be restored (") and note.endswith(
        f"is damaged (the older one of step 1 restores): resumed from step 1; moved it to {tmp_path}/damaged_checkpoints")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]  # step 2 saved again
    assert os.listdir(tmp_path / "damaged_checkpoints") == ["2"]  # kept for a look, out of the way
    assert [step for step, *_ in losses(tmp_path)] == [1, 2]


@requires_smollm2
@pytest.mark.slow  # a run to its failing save (a second, with Orbax's error check)
@pytest.mark.parametrize("failing", ["save", "check_for_errors"])
def test_a_failed_save_stops_the_run_at_once_in_one_line(tmp_path, monkeypatch, failing):
    """Item 9: a full disk at a save gave 605 lines and 25 tracebacks, and two more steps trained past the
    failed save. `save`: the save itself fails; `check_for_errors`: an async save failed in the background
    (Orbax reports it there)."""
    import orbax.checkpoint as ocp

    from sbd_jax.training.checkpoints import SaveFailed

    saves = []
    original = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        saves.append(step)
        if failing == "save":
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, step, *args, **kwargs)

    def check_for_errors(self):
        if saves:
            raise RuntimeError("async save failed") from OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    monkeypatch.setattr(ocp.CheckpointManager, "check_for_errors", check_for_errors)
    cfg = small_config(train__steps=4, checkpoint__every=2, train__log_every=1)
    with pytest.raises(SaveFailed, match=r"^cannot save .* \(OSError: \[Errno 28\] No space left on device\); "
                                         r"training stopped: free space .* run the same command again to resume"):
        Trainer(cfg, str(tmp_path)).run()
    assert saves == [2]
    steps = [step for step, *_ in losses(tmp_path)]  # an async failure is found within a step
    assert steps == ([1, 2] if failing == "save" else [1, 2, 3][: len(steps)]) and len(steps) >= 2


def test_a_checkpoint_that_cannot_fit_is_refused_before_orbax_writes_it(tmp_path, monkeypatch):
    """A save that filled the disk failed in Orbax's background threads: about a hundred asyncio
    tracebacks (a 30 MiB tmpfs and the tiny config), and the error named the step after the failed one."""
    import collections

    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from sbd_jax.training import checkpoints

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage(8 * 2**20, 7 * 2**20, 2**20))
    manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
    state = {"w": jnp.zeros(2**20, jnp.float32)}  # 4 MiB
    with pytest.raises(checkpoints.SaveFailed, match=r"^cannot save the checkpoint of step 2 in .* \(OSError: "
                       r"\[Errno 28\] No space left on device: the checkpoint needs 4\.0 MiB, 1\.0 MiB are free\); "
                       r"training stopped: free space .* resume from the start$"):
        checkpoints.save(manager, 2, state, None, str(tmp_path))
    assert os.listdir(tmp_path / "checkpoints") == []  # nothing written


def test_ctrl_c_stops_like_sigterm_with_its_own_exit_code():
    """Item 12's Ctrl-C: a KeyboardInterrupt traceback, the finished step not saved. Now SIGINT is a stop
    request as SIGTERM is; either ends with exit code 75 (EX_TEMPFAIL: a scheduler requeues it), not 2."""
    from sbd_jax.training.stop_request import Stopped, StopRequest

    assert Stopped.exit_code == 75
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        stop.unsaved = True
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert stop.requested and stop.signal == "SIGINT (Ctrl-C)"  # the loop saves, then stops
        with pytest.raises(Stopped, match=r"^stopped by SIGINT \(Ctrl-C\) again$"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_outside_32_bits_is_refused(tmp_path, seed):
    """Item 12: an OverflowError or an 87-line ValueError."""
    cfg = quick_config()
    cfg.seed = seed
    with pytest.raises(UserError, match=rf"^config seed={seed} must be in \[0, 4294967296\) \(a 32-bit random seed\)$"):
        Trainer(cfg, str(tmp_path))


def test_a_config_file_with_a_syntax_error_is_one_line(tmp_path):
    """Item 12: a 53-line traceback."""
    bad = tmp_path / "broken.py"
    bad.write_text("def get_config():\n    return dict(a=1,\n")
    proc = subprocess.run([sys.executable, "train.py", "--config", str(bad), "--workdir", str(tmp_path / "w")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: the --config file {bad} has a syntax error at line 2: ") and line.endswith("fix it")


def test_exported_weights_are_readable_like_the_rest_of_their_folder(tmp_path):
    """Item 17: safetensors creates its files 0600, while config.json and adapter.json beside them are 0644
    under the usual umask. `save_adapter` writes through `save_safetensors`."""
    import numpy as np

    from sbd_jax.checkpoints.files import save_safetensors

    old = os.umask(0o022)
    try:
        save_safetensors({"w": np.zeros(3, np.float32)}, str(tmp_path / "adapter.safetensors"))
        open(tmp_path / "adapter.json", "w").close()
    finally:
        os.umask(old)
    assert {oct(os.stat(tmp_path / name).st_mode & 0o777) for name in ("adapter.safetensors", "adapter.json")} == {"0o644"}


def test_an_hf_export_writes_its_weights_readable_like_its_config(tmp_path):
    """Item 17 for `save_hf` (train.py's workdir/hf, `convert`): model.safetensors as readable as config.json."""
    from sbd_jax.checkpoints.hf import save_hf
    from sbd_jax.model.config import ModelConfig
    from sbd_jax.model.transformer import init_params

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32)
    old = os.umask(0o022)
    try:
        save_hf(str(tmp_path), cfg, init_params(cfg, seed=0))
    finally:
        os.umask(old)
    assert {oct(os.stat(tmp_path / name).st_mode & 0o777) for name in ("model.safetensors", "config.json")} == {"0o644"}

"""train.py end to end on CPU: tiny runs, SIGKILL + resume reproducing the same numbers, 8B compile (bad input:
test_train_bad_input.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import tiny
from sbd_jax.errors import UserError
from sbd_jax.training.trainer import Trainer
from tests.conftest import requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = [os.path.join(os.path.dirname(json.__file__), name) for name in ("decoder.py", "encoder.py")]
QUICK = [f"--config.data.files={tuple(DATA)!r}", "--config.data.seq_len=64", "--config.train.batch_size=4",
         "--config.objective.block_size_min=4", "--config.objective.block_size_max=4", "--config.mesh=(1,1,1)"]


def quick_config(**train):
    cfg = tiny.get_config()
    # 8 devices, data-parallel: half the step time of an fsdp mesh here (sharded steps: test_sharding.py)
    cfg.data.files, cfg.data.seq_len, cfg.train.batch_size, cfg.mesh = tuple(DATA), 64, 8, (-1, 1, 1)
    cfg.objective.block_size_min, cfg.objective.block_size_max = 2, 5
    cfg.data.workers = 0  # in-process reading: Grain's worker processes are tested in test_streaming.py and below
    for name, value in train.items():
        section, key = name.split("__")
        cfg[section][key] = value
    return cfg


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(row["step"], row["ntp_loss"], row["matp_loss"]) for row in map(json.loads, f)]


@requires_smollm2
def test_tiny_run_trains_checkpoints_and_exports_an_sbd_model(tmp_path):
    cfg = quick_config(train__steps=6, checkpoint__every=3)
    rows = Trainer(cfg, str(tmp_path)).run()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["loss"]) and r["ntp_tokens"] > 0 and r["matp_tokens"] > 0 for r in rows)
    assert {r["block_size"] for r in rows} <= {2, 3, 4, 5}
    assert all(0 < r["mfu"] < 1 and r["seconds"] > 0 for r in rows)  # CPU: against its measured matmul peak
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.decoding.generate import generate
    from sbd_jax.decoding.sbd import SBDDecoder

    model = load_model(str(tmp_path / "hf"))
    assert model.config.mask_token_id == model.config.vocab_size - 1  # a new embedding row
    assert model.tokenizer.convert_ids_to_tokens(model.config.mask_token_id) == "<|sbd_mask|>"
    (result,), _ = generate(SBDDecoder(model.config, max_new_tokens=8, block_size=4),
                            jax.device_put(model.params), [model.tokenizer("def f(x):")["input_ids"]], gamma=0.5)
    assert 1 <= result.nfe <= 8 and len(result.token_ids) == 8


@requires_smollm2
@pytest.mark.slow  # two training runs
def test_a_wsd_decay_branch_continues_the_long_run_it_starts_from(tmp_path):
    wsd = dict(checkpoint__every=3, optimizer__schedule="wsd", optimizer__warmup_steps=2)
    long = quick_config(train__steps=6, **wsd)
    long.export_hf = False
    long_rows = Trainer(long, str(tmp_path / "long")).run()
    assert len({r["lr"] for r in long_rows[2:]}) == 1  # stable after warmup: no decay
    branch = quick_config(train__steps=5, optimizer__decay_steps=2, **wsd)
    branch.export_hf, branch.init_from, branch.init_step = False, str(tmp_path / "long"), 3
    rows = Trainer(branch, str(tmp_path / "branch")).run()
    assert [r["step"] for r in rows] == [4, 5]
    assert losses(tmp_path / "branch")[0] == losses(tmp_path / "long")[3]  # same state, batch and lr
    assert rows[1]["lr"] < rows[0]["lr"] == pytest.approx(long_rows[3]["lr"], rel=1e-6)
    branch.init_step = 4
    with pytest.raises(UserError, match="has no checkpoint of step 4"):
        Trainer(branch, str(tmp_path / "other")).run()


@pytest.mark.slow  # compiles a step per block size
def test_one_compiled_step_for_every_block_size_equals_the_step_compiled_for_that_size():
    import dataclasses
    import functools

    import jax.numpy as jnp

    from sbd_jax.training.step import TrainState
    from tests.test_sharding import _setup

    _, params, tx, batch, per_size = _setup()
    keywords = {key: value for key, value in per_size.keywords.items() if key not in ("block_size", "spec")}
    spec = dataclasses.replace(per_size.keywords["spec"], block_sizes=(2, 16))
    one_step = jax.jit(functools.partial(per_size.func, **keywords, spec=spec))
    state = TrainState(jnp.int32(0), params, tx.init(params))
    rng = jax.random.key(5)
    for k in (2, 3, 8, 13, 16):  # the ends of the range, sizes that divide the row and sizes that do not
        expected_state, expected = jax.jit(functools.partial(per_size, block_size=k))(state, batch, rng)
        got_state, got = one_step(state, batch, rng, jnp.int32(k))
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=f"k={k} {name}")
        for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(expected_state.params)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert one_step._cache_size() == 1


@requires_smollm2
@pytest.mark.slow  # 15 steps
def test_a_run_over_every_block_size_compiles_its_step_once(tmp_path):
    """XLA compiles of the train step (counted by jax.monitoring) in a 15-step run over sizes 2..16: one."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, fun_name="", **_: compiles.append(fun_name)
        if name == "/jax/core/compile/backend_compile_duration" and "train_step" in fun_name else None)
    cfg = quick_config(train__steps=15, checkpoint__every=100)
    cfg.objective.block_size_min, cfg.objective.block_size_max = 2, 16
    cfg.export_hf = False
    rows = Trainer(cfg, str(tmp_path)).run()
    assert len({r["block_size"] for r in rows}) >= 8  # many sizes really drawn
    assert len(compiles) == 1, compiles
    assert [r["compile_seconds"] > 0 for r in rows] == [True] + [False] * 14


def run_train(workdir, steps, every):
    return [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir), *QUICK,
            f"--config.train.steps={steps}", f"--config.checkpoint.every={every}", "--config.export_hf=False"]


@requires_smollm2
@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    env = {**os.environ, "XLA_FLAGS": ""}
    straight = subprocess.run(run_train(tmp_path / "a", 8, 2), cwd=ROOT, env=env, capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr[-2000:]

    victim = subprocess.Popen(run_train(tmp_path / "b", 8, 2), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    log = tmp_path / "b" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and victim.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    assert victim.poll() is None, "the run finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = len(log.read_text().splitlines())
    assert 5 <= killed_at < 8

    resumed = subprocess.run(run_train(tmp_path / "b", 8, 2), cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(tmp_path / "b") == losses(tmp_path / "a")  # same batches, same numbers, every step


@requires_smollm2
def test_sigterm_saves_the_finished_step_and_a_rerun_continues_from_it(tmp_path):
    cfg = quick_config(train__steps=40, train__log_every=1, checkpoint__every=1000)  # no periodic save before 40
    cfg.export_hf = False
    log = tmp_path / "metrics.jsonl"

    def terminate_after_three_steps():
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_after_three_steps, daemon=True).start()
    with pytest.raises(UserError, match=r"^stopped by SIGTERM after step (\d+) of 40: .*run the same command again"):
        Trainer(cfg, str(tmp_path)).run()
    (saved,) = os.listdir(tmp_path / "checkpoints")
    assert 3 <= int(saved) < 40 and [s for s, *_ in losses(tmp_path)] == list(range(1, int(saved) + 1))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the run

    cfg.train.steps = int(saved) + 2
    resumed = Trainer(cfg, str(tmp_path)).run()
    assert [r["step"] for r in resumed] == [int(saved) + 1, int(saved) + 2]


@requires_smollm2
@pytest.mark.slow  # three runs compile
def test_a_run_spent_in_pieces_with_until_equals_the_uninterrupted_run(tmp_path):
    cfg = quick_config(train__steps=5, checkpoint__every=100, train__log_every=1)
    whole = Trainer(cfg, str(tmp_path / "whole")).run()
    first = Trainer(cfg, str(tmp_path / "pieces")).run(until=2)
    assert [r["step"] for r in first] == [1, 2] and os.listdir(tmp_path / "pieces" / "checkpoints") == ["2"]
    assert not (tmp_path / "pieces" / "hf").exists()  # exported only when the run is finished
    rest = Trainer(cfg, str(tmp_path / "pieces")).run()
    assert [r["step"] for r in rest] == [3, 4, 5] and (tmp_path / "pieces" / "hf" / "config.json").exists()
    assert losses(tmp_path / "pieces") == losses(tmp_path / "whole")  # same schedule, same batches, same numbers
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]


@requires_smollm2
@pytest.mark.slow  # Grain workers start
def test_sigterm_after_a_save_with_grain_workers_still_stops_the_run(tmp_path):
    """Orbax's (async) save and Grain's worker processes leave the SIGTERM handler in place."""
    cfg = quick_config(train__steps=40, train__log_every=1, checkpoint__every=4)
    cfg.export_hf = False
    cfg.data.workers = 2

    def terminate_after_the_first_save():
        while not (tmp_path / "checkpoints" / "4").is_dir():  # renamed into place when the save is whole
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_after_the_first_save, daemon=True).start()
    with pytest.raises(UserError, match=r"^stopped by SIGTERM after step (\d+) of 40"):
        Trainer(cfg, str(tmp_path)).run()
    saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
    assert saved[0] == 4 and 4 < saved[-1] < 40, saved


IN_FLIGHT = r"""
import sys
from tests.test_train import quick_config
from sbd_jax.training.trainer import Trainer

cfg = quick_config(train__steps=24, train__log_every=1000, checkpoint__every=1000)  # one sync: the end
cfg.mesh, cfg.export_hf = (1, 1, 1), False
trainer = Trainer(cfg, sys.argv[1])
compiled_step, losses, unfinished = trainer.compiled_step, [], []

def counting(example):
    compiled, seconds = compiled_step(example)

    def step(*args):
        unfinished.append(sum(not loss.is_ready() for loss in losses))  # earlier steps still running
        state, metrics = compiled(*args)
        losses.append(metrics["loss"])
        return state, metrics
    return step, seconds

trainer.compiled_step = counting
trainer.run()
print(max(unfinished))
"""


@requires_smollm2
@pytest.mark.slow  # 45 s of dispatch timing (CI's 30-minute budget)
def test_at_most_two_steps_are_in_flight(tmp_path):
    """Dispatch runs ahead of the device; unbounded, the loop queued every step up to the next metric
    fetch and then waited there in C, where no Python signal handler runs: the real-text study took ten
    85-second steps to answer a SIGTERM. The loop waits for step N - 1 after dispatching step N, so a
    SIGTERM is answered within two steps. One CPU device (a subprocess): there dispatch is asynchronous."""
    proc = subprocess.run([sys.executable, "-c", IN_FLIGHT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "XLA_FLAGS": ""}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) <= 1  # when step N is dispatched, at most step N - 1 still runs


@pytest.mark.slow  # a 9-step run
@requires_smollm2
def test_keep_period_keeps_milestones_beyond_the_latest_checkpoints(tmp_path):
    cfg = quick_config(train__steps=8, checkpoint__every=2, checkpoint__keep=1, checkpoint__keep_period=4)
    cfg.export_hf = False
    Trainer(cfg, str(tmp_path)).run()
    assert sorted(map(int, os.listdir(tmp_path / "checkpoints"))) == [4, 8]  # 2 and 6 rotated out


@pytest.mark.slow  # a run to the failing step
@requires_smollm2
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # Warmup makes step 1's learning rate 0; step 2's (1e30) blows the weights up, so step 3 is not finite.
    cfg = quick_config(train__steps=6, train__log_every=1, checkpoint__every=1, optimizer__lr=1e30,
                       optimizer__warmup_steps=1)
    cfg.export_hf = False
    with pytest.raises(UserError, match=r"^step 3: non-finite .*the last checkpoint stays"):
        Trainer(cfg, str(tmp_path)).run()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
    assert [step for step, *_ in losses(tmp_path)] == [1, 2]


@pytest.mark.parametrize("config", ["llama3_8b.py", "qwen3_8b.py"])
@pytest.mark.slow
def test_8b_configs_compile_on_8_devices_and_fit_80gb(config):
    from benchmarks.compile_8b import compile_report

    report = compile_report(os.path.join(ROOT, "configs", config), devices=8, micro_batch=8)
    assert 8.0 < report["params_billion"] < 8.3
    assert report["per_device_gib"] < 80, report


@pytest.mark.slow  # two runs
@requires_smollm2
def test_mismatched_checkpoint_in_workdir_is_refused(tmp_path):
    cfg = quick_config(train__steps=1)
    cfg.export_hf = False
    Trainer(cfg, str(tmp_path)).run()
    other = quick_config(train__steps=2)
    other.model.architecture = {**dict(other.model.architecture), "num_layers": 2}
    with pytest.raises(UserError, match=r"trained as another run \(model.num_layers 4 -> 2\)"):
        Trainer(other, str(tmp_path)).run()
    os.remove(tmp_path / "run_identity.json")  # a workdir from before identities: Orbax's restore refuses it
    with pytest.raises(UserError, match="cannot restore the checkpoint of step 1 .* written for another config or is damaged"):
        Trainer(other, str(tmp_path)).run()


def test_sigterm_with_no_unsaved_step_or_a_second_time_stops_at_once():
    """A run still waiting for its first batch (nothing to save) ends within seconds of SIGTERM."""
    import signal
    import time

    from sbd_jax.training.stop_request import Stopped, StopRequest

    with StopRequest() as stop:
        with pytest.raises(Stopped, match="no unsaved step"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        stop.unsaved = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.requested  # a finished step is saved first
        with pytest.raises(Stopped, match="again"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

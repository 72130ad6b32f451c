"""The GPU benchmark script runs end to end with --smoke (tiny shapes on CPU) before any GPU sees it, and
a run cut short still leaves valid JSON behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sbd_jax.decoding.settings import Mode
from sbd_jax.evaluation.recorded import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(out):
    env = {**os.environ, "XLA_FLAGS": "", "OUT": str(out)}
    command = ["bash", "benchmarks/h200.sh", "--smoke"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_h200_script_smoke(tmp_path):
    proc = smoke(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    preflight = json.load(open(tmp_path / "smoke_preflight.json"))
    assert preflight["tiny_layer"]["finite"] and preflight["versions"]["jax"] and preflight["devices"]
    forward = json.load(open(tmp_path / "smoke_forward_cost.json"))
    assert [r["k"] for r in forward["rows"]] == [1, 2] and forward["hardware"]["name"] == "cpu-measured"
    assert all(r["seconds"] > 0 and r["compile_seconds"] > 0 and r["roofline_slowdown"] >= 1 for r in forward["rows"])
    assert forward["measured_bandwidth"] > 0
    sbd = json.load(open(tmp_path / "smoke_sbd.json"))
    modes = [(describe(r), r["block_size"]) for r in sbd["accuracy"]]
    assert modes == [("NTP", 1), ("SBD", 4), ("SBD", 8), ("SBD", 16), ("verified SBD", 4), ("verified SBD", 8),
                     ("verified SBD", 16)]
    ntp = sbd["accuracy"][0]
    for row in sbd["accuracy"]:
        assert row["n"] == 4 and row["tokens_per_pass"] > 0
        if row["verify"]:  # output equal to NTP's, so the same accuracy; every pass emits a token
            assert row["accuracy"] == ntp["accuracy"] and row["tokens_per_pass"] >= 1
    assert [(r["batch"], r["mode"]) for r in sbd["speed"]][::7] == [(1, Mode.NTP), (2, Mode.NTP)] and len(sbd["speed"]) == 14
    assert all(r["decode_tokens_per_second"] > 0 for r in sbd["speed"])
    assert sbd["train"]["steps"] == 3 and sbd["train"]["median_step_seconds"] > 0
    lookup = json.load(open(tmp_path / "smoke_lookup_smollm2.json"))["smollm2_base"]
    assert [(r["batch"], r["decoder"]) for r in lookup["speed"]] == [
        (1, "ntp"), (1, "lookup k=4 min match 1"), (8, "ntp"), (8, "lookup k=4 min match 1")]
    for row in lookup["speed"]:  # verified decoding in fp32: NTP's very tokens, never more forwards than tokens
        assert row["identical_to_ntp"] == row["prompts"] and row["forwards"] <= row["tokens"]
        assert row["tokens_per_second"] > 0 and row["vs_ntp"] > 0
        assert row["narrow_share"] == 0 if row["decoder"] == "ntp" else 0 <= row["narrow_share"] <= 1
    tree = json.load(open(tmp_path / "smoke_tree_smollm2.json"))["speed"]
    decoders = ["ntp", "lookup chain k=8 min match 2", "adapter, sbd chain k=4", "adapter, tree-sbd n=16 k=4", "tree n=4",
                "tree, width rule", "tree, width rule, draft memory"]
    assert [(r["batch"], r["decoder"]) for r in tree] == [(b, d) for b in (1, 8) for d in decoders]
    assert all(r["identical_to_ntp"] == r["prompts"] and r["forwards"] <= r["tokens"] for r in tree)
    log = (tmp_path / "smoke_log.txt").read_text()
    assert all(f"stage {name}: exit 0" in log for name in ("preflight", "sbd", "lookup", "tree"))

def test_a_run_cut_short_keeps_valid_partial_results(tmp_path):
    """Killed once the preflight's result exists (a fixed time limit raced the whole run on a free CPU)."""
    env = {**os.environ, "XLA_FLAGS": "", "OUT": str(tmp_path)}
    proc = subprocess.Popen(["bash", "benchmarks/h200.sh", "--smoke"], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (tmp_path / "smoke_preflight.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0  # it was cut short, not finished
    assert json.load(open(tmp_path / "smoke_preflight.json"))["tiny_layer"]["finite"]
    for name in os.listdir(tmp_path):
        if name.endswith(".json"):
            json.load(open(tmp_path / name))  # whatever is there parses: written whole or not at all


def test_dry_run_prints_the_plan():
    proc = subprocess.run(["bash", "benchmarks/h200.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": "/tmp"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plans = {line.split(" plan:")[0]: json.loads(line.split(" plan:")[1]) for line in proc.stdout.splitlines()
             if " plan:" in line}
    assert plans["forward_cost"]["compiles"] == 42 and plans["sbd"]["compiles"] == 57
    assert all(p["estimated_minutes"] > 0 for p in plans.values())


@pytest.mark.slow  # a whole benchmark run
def test_verify_batches_table_is_consistent(tmp_path):
    out = tmp_path / "vb.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.verify_batches", "--batches", "1", "2", "--blocks", "4",
                           "--problems", "2", "--repeats", "1", "--calls", "1", "--skip-smollm2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(out))["arithmetic"]
    rows = result["rows"]
    assert [(r["batch"], r["block_size"], r["drafts"]) for r in rows] == [
        (b, k, d) for b in (1, 2) for k, d in ((1, None), (4, "sbd"), (4, "lookup"), (4, "hybrid"))]
    for r in rows:  # lookup's rows count only lookup drafts; SBD's none
        if r["drafts"] == "lookup" and r["accepted_fraction"] is not None:
            assert r["lookup_accepted_fraction"] == r["accepted_fraction"]
        if r["drafts"] in (None, "sbd"):
            assert r["lookup_accepted_fraction"] is None
        else:
            assert r["rule_choice"] is None and r["loop_rule_choice"] is None
    assert result["calibration_prompts"] == 32 and result["calibration_tokens_per_forward"]["4"] > 1
    for batch in (1, 2):  # each rule picks exactly one decoder per batch
        assert sum(bool(r["rule_choice"]) for r in rows if r["batch"] == batch) == 1
        assert sum(bool(r["loop_rule_choice"]) for r in rows if r["batch"] == batch) == 1
    for batch in (1, 2):
        group = [r for r in rows if r["batch"] == batch]
        assert group[0]["speedup"] == 1 and group[0]["tokens_per_forward"] == 1  # NTP: one token a forward
        assert sum(bool(r["rule_choice"]) for r in group) == 1
        for r in group:
            assert r["prompts"] == 2 and r["tokens_per_second"] > 0 and r["pass_overhead"] > 0
            # The bare forward runs in a cache as large as the decoder's: the prompt bucket (64) + 72 new
            # tokens, + k draft slots for verified SBD.
            assert r["cache_slots"] == 64 + 72 + (0 if r["block_size"] == 1 else r["block_size"])
            assert abs(r["efficiency"] * r["ideal_speedup"] - r["speedup"]) < 1e-9
            ntp_bare, share = group[0]["bare_forward_seconds"], r["narrow_share"]
            if r["drafts"] != "lookup":  # only lookup's passes run the exact token alone
                assert share == 0
            mean_pass = (1 - share) * r["bare_forward_seconds"] + share * ntp_bare
            assert abs(r["ideal_speedup"] - r["tokens_per_forward"] * ntp_bare / mean_pass) < 1e-9


def test_bare_forward_refuses_a_cache_too_small_for_its_context_only():
    from types import SimpleNamespace

    from sbd_jax.decoding.timing import forward_seconds
    from sbd_jax.errors import UserError
    from sbd_jax.model.transformer import init_params
    from tests.test_decoding import CFG

    model = SimpleNamespace(config=CFG, params=init_params(CFG, seed=0))
    with pytest.raises(UserError, match="capacity=9 cannot hold 10 cached tokens"):
        forward_seconds(model, 1, 4, 10, calls=1, capacity=9)
    # a pass wider than the free slots is timed: decoding attends its tokens beside the cache, never writes them
    # there (what `--block-size auto` times for `--fallback-blocks 7` at block 16: 144 tokens a pass)
    assert forward_seconds(model, 1, 4, 10, calls=1, capacity=12) > 0

"""The GPU benchmark script runs end to end with --smoke (tiny shapes on CPU) before any GPU sees it, and
a run cut short still leaves valid JSON behind."""

import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(out, limit=None):
    env = {**os.environ, "XLA_FLAGS": "", "OUT": str(out)}
    command = ["bash", "benchmarks/h200.sh", "--smoke"]
    if limit:
        command = ["timeout", "--kill-after=2", str(limit)] + command
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_h200_script_smoke(tmp_path):
    proc = smoke(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    preflight = json.load(open(tmp_path / "smoke_preflight.json"))
    assert preflight["tiny_layer"]["finite"] and preflight["versions"]["jax"] and preflight["devices"]
    forward = json.load(open(tmp_path / "smoke_forward_cost.json"))
    assert [r["k"] for r in forward["rows"]] == [1, 2] and forward["hardware"]["name"] == "cpu-measured"
    assert all(r["seconds"] > 0 and r["compile_seconds"] > 0 and r["roofline_slowdown"] >= 1 for r in forward["rows"])
    assert forward["measured_bandwidth"] > 0
    e2e = json.load(open(tmp_path / "smoke_e2e.json"))
    assert [(r["gamma"], r["verify"]) for r in e2e["rows"]] == [(0, False), (1e9, False), (0, True), (1e9, True)]
    for row in e2e["rows"]:
        assert e2e["random_weights"] and row["sbd_nfe"] >= 1 and row["ntp_tokens"] == row["sbd_tokens"] == 8
        assert row["roofline_speedup_for_observed_nfe"] > 0
        assert row.get("identical_to_ntp", True)  # the verified rows: output equal to NTP's
    log = (tmp_path / "smoke_log.txt").read_text()
    assert "stage preflight: exit 0" in log and "stage e2e: exit 0" in log


def test_a_run_cut_short_keeps_valid_partial_results(tmp_path):
    proc = smoke(tmp_path, limit=20)
    assert proc.returncode in (124, 137)  # it was cut short
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
    assert plans["forward_cost"]["compiles"] == 42 and plans["e2e"]["compiles"] == 28
    assert all(p["estimated_minutes"] > 0 for p in plans.values())

"""The GPU benchmark script runs end to end with --smoke (tiny shapes on CPU) before any GPU sees it."""

import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_h200_script_smoke():
    env = {**os.environ, "XLA_FLAGS": ""}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", "benchmarks/h200.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = os.path.join(ROOT, "benchmarks", "results")
    forward = json.load(open(os.path.join(results, "smoke_forward_cost.json")))
    assert [r["k"] for r in forward["rows"]] == [1, 2] and forward["hardware"]["name"] == "cpu-measured"
    assert all(r["seconds"] > 0 and r["roofline_slowdown"] >= 1 for r in forward["rows"])
    e2e = json.load(open(os.path.join(results, "smoke_e2e.json")))
    row = e2e["rows"][0]
    assert e2e["random_weights"] and row["sbd_nfe"] >= 1 and row["ntp_tokens"] == row["sbd_tokens"] == 8
    assert row["roofline_speedup_for_observed_nfe"] > 0

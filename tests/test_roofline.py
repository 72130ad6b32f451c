"""The roofline model reproduces the paper's headline; its terms for one case, computed by hand."""

import json
import subprocess
import sys

import pytest

from sbd_jax.errors import UserError
from sbd_jax.roofline import (
    GRID_KV,
    HARDWARE,
    MODELS,
    lookup,
    slowdown,
    speedup,
    tables,
    terms,
)

H100, LLAMA = HARDWARE["h100-fp8"], MODELS["llama3-8b"]


def test_terms_by_hand_llama3_8b_fp8_batch1_one_token_kv4096():
    t = terms(H100, LLAMA, batch=1, n=1, kv_len=4096)
    per_layer = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336  # q,o: 32 heads; k,v: 8 heads; MLP
    weights = 32 * per_layer + 128256 * 4096  # + the output head; the embedding table is not read
    assert weights == 7_504_658_432  # 32 x 218,103,808 + 525,336,576
    assert t["weight_bytes"] == weights  # FP8: one byte a weight
    assert t["kv_read_bytes"] == 4096 * 32 * 2 * 8 * 128  # 268 MB
    assert t["kv_write_bytes"] == 32 * 2 * 8 * 128
    assert t["activation_bytes"] == (32 * (4 * 4096 + 3 * 14336) + 128256) * 2
    assert t["matmul_flops"] == 2 * weights
    assert t["attention_flops"] == 4 * 4097 * 32 * 32 * 128
    assert t["time"] == t["memory_time"] == t["bytes"] / 3.35e12  # memory-bound by far
    assert t["compute_time"] < t["memory_time"] / 100


def test_paper_headline_block16_batch1_costs_1_004_to_1_015():
    for kv in GRID_KV:
        assert 1.004 <= slowdown(H100, LLAMA, 1, 16, kv) <= 1.015


def test_degradation_only_at_block_64_or_batch_16():
    for batch in (1, 4):
        for kv in GRID_KV:
            assert slowdown(H100, LLAMA, batch, 16, kv) < 1.05
    assert slowdown(H100, LLAMA, 8, 64, 1024) > 1.5
    assert slowdown(H100, LLAMA, 16, 64, 1024) > 3.0
    assert slowdown(H100, LLAMA, 16, 32, 1024) > 1.5


def test_speedup_formula():
    k, kv = 16, 4096
    t1, tk, t2k = (terms(H100, LLAMA, 1, n, kv)["time"] for n in (1, k, 2 * k))
    assert speedup(H100, LLAMA, 1, k, kv, 4) == pytest.approx(k * t1 / (t2k + 3 * tk))
    assert speedup(H100, LLAMA, 1, k, kv, k) < 1  # one token per pass: no gain, the 2k pass costs a bit
    assert 3.9 < speedup(H100, LLAMA, 1, k, kv, 4) < 4.0


def test_bad_input_lists_known_names_and_refuses_sizes():
    with pytest.raises(UserError, match="unknown hardware 'tpu-v9'.*h100-fp8, h100-bf16, h200-bf16, h200-fp8"):
        lookup("tpu-v9", "llama3-8b")
    with pytest.raises(UserError, match="unknown model 'gpt5'.*llama3-8b, qwen3-8b, smollm2-135m"):
        lookup("h100-fp8", "gpt5")
    with pytest.raises(UserError, match="batch must be >= 1"):
        terms(H100, LLAMA, 0, 1, 10)
    with pytest.raises(UserError, match="new tokens must be >= 1"):
        terms(H100, LLAMA, 1, 0, 10)
    with pytest.raises(UserError, match="KV length must be >= 0"):
        terms(H100, LLAMA, 1, 1, -5)
    with pytest.raises(UserError, match="passes=0"):
        speedup(H100, LLAMA, 1, 16, 10, 0)


def test_cli_json_and_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sbd_jax.roofline", "--hardware", "h200-bf16", "--model",
                           "qwen3-8b", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == json.loads(json.dumps(tables(HARDWARE["h200-bf16"], MODELS["qwen3-8b"])))
    assert {"batch", "k", "kv_len", "slowdown"} == set(out["slowdown"][0])
    assert {"batch", "k", "kv_len", "passes", "speedup"} == set(out["speedup"][0])
    bad = subprocess.run([sys.executable, "-m", "sbd_jax.roofline", "--model", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model 'nope'")


def test_model_from_hf_config(tmp_path):
    from tests.hf_models import tiny_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_hf_config("qwen3").to_dict()))
    _, shape = lookup("h100-bf16", str(path))
    assert shape.layers == 2 and shape.kv_heads == 2 and shape.vocab == 97

"""The paper's roofline model of one decoding forward, with every byte and flop term visible.

    python -m sbd_jax.roofline [--hardware h100-fp8] [--model llama3-8b | CONFIG.json] [--json]

time(n) = max(bytes / bandwidth, flops / peak) for a forward of n new tokens per sequence, batch B,
KV length c. Assumptions (the paper's own code is not public; these reproduce its reported range):
- weights: every matmul weight is read once per forward (all layers + the output head; the input
  embedding table is not, only B·n rows of it), at the hardware entry's weight precision;
- KV cache: B·c·layers·2·kv_heads·head_dim values read, and B·n·layers·2·kv_heads·head_dim written,
  at the KV precision (the same as the weights: FP8 KV for the FP8 setting);
- activations: per token and layer the residual stream is read and written twice (attention and MLP
  block: 4·hidden) and the MLP's gate/up/down activations once each (3·intermediate), plus the logits
  (vocab), at 2 bytes (bf16);
- flops: 2 per matmul weight per token (2·params·B·n) + attention 4·B·n·(c + n)·layers·heads·head_dim
  (QK^T and PV over the cache and the block itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import Any

from sbd_jax.errors import UserError
from sbd_jax.model.config import DType

ACTIVATION_BYTES = 2


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s
    peak_flops: float  # flop/s at the weight precision
    weight_bytes: float  # bytes per weight (and per KV value)
    note: str = ""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @property
    def matmul_params(self) -> int:
        """Weights read (and multiplied) once per forward: all layers and the output head."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + self.vocab * self.hidden


HARDWARE = {
    h.name: h for h in [
        Hardware("h100-fp8", 3.35e12, 1978e12, 1, "the paper's setting: H100 SXM, dense FP8"),
        Hardware("h100-bf16", 3.35e12, 989e12, 2, "H100 SXM, dense BF16"),
        Hardware("h200-bf16", 4.8e12, 989e12, 2, "H200, HBM3e, dense BF16"),
        Hardware("h200-fp8", 4.8e12, 1979e12, 1, "H200, HBM3e, dense FP8"),
    ]
}

MODELS = {
    m.name: m for m in [
        ModelShape("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, tied=False),
        ModelShape("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, tied=False),
        ModelShape("smollm2-135m", 49152, 576, 1536, 30, 9, 3, 64, tied=True),
    ]
}


def model_from_hf_config(path: str) -> ModelShape:
    """A ModelShape from an HF config.json (any supported architecture)."""
    from sbd_jax.checkpoints.hf_config import config_from_hf

    try:
        with open(path) as f:
            cfg = config_from_hf(json.load(f))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read model config {path}: {e}") from None
    return shape_of(cfg, os.path.basename(path))


def shape_of(cfg: Any, name: str = "model") -> ModelShape:
    """The ModelShape of a `sbd_jax.model.config.ModelConfig`."""
    return ModelShape(name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings)


def training_flops_per_token(m: ModelShape, sbd: bool, adapter: bool = False) -> float:
    """Model FLOPs of one trained token: 6 per matmul weight (forward 2, backward 4), twice for SBD (`sbd`; else
    NTP), whose step runs the clean and the noisy copy of every sequence (attention's share is left out).
    A gated adapter's step runs the clean copy forward only (2) and the noisy copy forward and back
    through frozen weights, input gradients only (2 + 2): 6 in all, as NTP (the adapter's own is left out)."""
    return 6.0 * m.matmul_params * (2 if sbd and not adapter else 1)


@functools.lru_cache(maxsize=None)
def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Achieved flop/s of an n^3 float32 matmul on the default device: the peak of a CPU (no table entry).
    Measured once per process: every later training run in it reuses the number."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    square = jax.jit(lambda x: x @ x)
    jax.block_until_ready(square(a))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(square(a))
        times.append(time.perf_counter() - began)
    return 2 * n**3 / statistics.median(times)


def device_peak_flops(device: Any, dtype: str) -> float | None:
    """Peak flop/s of a device for MFU: the table's dense BF16 entry for H100/H200 (bf16 compute), the
    measured matmul peak on a CPU, None where neither applies (MFU is then not reported)."""
    if device.platform == "cpu":
        return matmul_peak_flops()
    if device.platform == "gpu" and dtype == DType.BFLOAT16:
        for kind, name in (("H200", "h200-bf16"), ("H100", "h100-bf16")):
            if kind in device.device_kind:
                return HARDWARE[name].peak_flops
    return None


def lookup(hardware: str, model: str) -> tuple[Hardware, ModelShape]:
    if hardware not in HARDWARE:
        raise UserError(f"unknown hardware {hardware!r}: known are {', '.join(HARDWARE)}")
    if model.endswith(".json"):
        return HARDWARE[hardware], model_from_hf_config(model)
    if model not in MODELS:
        raise UserError(f"unknown model {model!r}: known are {', '.join(MODELS)}, or give a config.json path")
    return HARDWARE[hardware], MODELS[model]


def terms(hw: Hardware, m: ModelShape, batch: int, n: int, kv_len: int) -> dict[str, float]:
    """Every byte and flop term of one forward of `n` new tokens per sequence, and its time."""
    for name, value in (("batch", batch), ("new tokens", n)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if kv_len < 0:
        raise UserError(f"KV length must be >= 0, got {kv_len}")
    kv_per_token = m.layers * 2 * m.kv_heads * m.head_dim * hw.weight_bytes
    t = {
        "weight_bytes": m.matmul_params * hw.weight_bytes,
        "kv_read_bytes": batch * kv_len * kv_per_token,
        "kv_write_bytes": batch * n * kv_per_token,
        "activation_bytes": batch * n * (m.layers * (4 * m.hidden + 3 * m.intermediate) + m.vocab) * ACTIVATION_BYTES,
        "matmul_flops": 2 * m.matmul_params * batch * n,
        "attention_flops": 4 * batch * n * (kv_len + n) * m.layers * m.heads * m.head_dim,
    }
    t["bytes"] = t["weight_bytes"] + t["kv_read_bytes"] + t["kv_write_bytes"] + t["activation_bytes"]
    t["flops"] = t["matmul_flops"] + t["attention_flops"]
    t["memory_time"] = t["bytes"] / hw.bandwidth
    t["compute_time"] = t["flops"] / hw.peak_flops
    t["time"] = max(t["memory_time"], t["compute_time"])
    return t


def forward_time(hw: Hardware, m: ModelShape, batch: int, n: int, kv_len: int) -> float:
    return terms(hw, m, batch, n, kv_len)["time"]


def slowdown(hw: Hardware, m: ModelShape, batch: int, k: int, kv_len: int) -> float:
    """time(k) / time(1): what a k-token block pass costs relative to one NTP step."""
    return forward_time(hw, m, batch, k, kv_len) / forward_time(hw, m, batch, 1, kv_len)


def speedup(hw: Hardware, m: ModelShape, batch: int, k: int, kv_len: int, passes: float) -> float:
    """k·time(1) / (time(2k) + (ℓ-1)·time(k)) for a block of k tokens decoded in ℓ passes."""
    if not 1 <= passes <= k:
        raise UserError(f"passes={passes} must be between 1 and the block size {k}")
    return k * forward_time(hw, m, batch, 1, kv_len) / (
        forward_time(hw, m, batch, 2 * k, kv_len) + (passes - 1) * forward_time(hw, m, batch, k, kv_len))


GRID_K = (1, 2, 4, 8, 16, 32, 64)
GRID_BATCH = (1, 4, 8, 16)
GRID_KV = (1024, 4096, 16384, 32768)


def tables(hw: Hardware, m: ModelShape) -> dict[str, list[dict[str, Any]]]:
    slow = [{"batch": b, "k": k, "kv_len": c, "slowdown": slowdown(hw, m, b, k, c)}
            for b in GRID_BATCH for c in GRID_KV for k in GRID_K]
    fast = [{"batch": b, "k": k, "kv_len": c, "passes": p, "speedup": speedup(hw, m, b, k, c, p)}
            for b in GRID_BATCH for c in GRID_KV for k in (4, 8, 16, 32) for p in sorted({1, 2, k // 4, k // 2, k})
            if p >= 1]
    return {"slowdown": slow, "speedup": fast}


def _print_tables(hw: Hardware, m: ModelShape) -> None:
    print(f"{m.name} on {hw.name} ({hw.note}); {m.matmul_params / 1e9:.2f}B matmul weights at "
          f"{hw.weight_bytes:g} B, {hw.bandwidth / 1e12:.2f} TB/s, {hw.peak_flops / 1e12:.0f} TFLOP/s")
    one = terms(hw, m, 1, 1, 4096)
    print("terms of one 1-token forward, batch 1, KV 4096: " + ", ".join(
        f"{name} {value:.4g}" for name, value in one.items()))
    print("\nslowdown time(k)/time(1)")
    print("batch  kv_len " + "".join(f"{'k=' + str(k):>8}" for k in GRID_K))
    for b in GRID_BATCH:
        for c in GRID_KV:
            print(f"{b:5d} {c:7d} " + "".join(f"{slowdown(hw, m, b, k, c):8.3f}" for k in GRID_K))
    print("\nspeedup(passes, k) at batch 1, KV 4096")
    print("    k " + "".join(f"{'l=' + str(p):>8}" for p in (1, 2, 4, 8, 16, 32)))
    for k in (4, 8, 16, 32):
        print(f"{k:5d} " + "".join(f"{speedup(hw, m, 1, k, 4096, p):8.2f}" if p <= k else f"{'':>8}"
                                   for p in (1, 2, 4, 8, 16, 32)))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m sbd_jax.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100-fp8", help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--model", default="llama3-8b", help=f"one of {', '.join(MODELS)}, or a config.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    hw, m = lookup(args.hardware, args.model)
    if args.json:
        print(json.dumps(tables(hw, m)))
    else:
        _print_tables(hw, m)


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

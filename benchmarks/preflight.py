"""A ~10 s check that a GPU run can start: versions, devices, a tiny jitted layer, the GPU's clocks.

    python -m benchmarks.preflight --out results/preflight.json

Written first by benchmarks/h200.sh, so even a run that fails later says what it ran on.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import time

from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers", "safetensors",
            "grain", "ml-collections", "gguf", "numpy", "torch")


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_clocks() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    query = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True,
                          timeout=20)
    return done.stdout.strip() or done.stderr.strip()


def tiny_layer() -> dict:
    """Compile and run one small decoder layer's worth of work: does the device compute at all?"""
    import jax
    import jax.numpy as jnp

    from sbd_jax.model.config import ModelConfig
    from sbd_jax.model.transformer import Transformer, init_params

    config = ModelConfig(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
    params = init_params(config)
    tokens = jnp.zeros((2, 64), jnp.int32)
    forward = jax.jit(lambda p, t: Transformer(config).apply({"params": p}, t, jnp.arange(64)[None])[0])
    began = time.perf_counter()
    logits = jax.block_until_ready(forward(params, tokens))
    compiled = time.perf_counter() - began
    began = time.perf_counter()
    jax.block_until_ready(forward(params, tokens))
    return {"compile_and_run_seconds": compiled, "run_seconds": time.perf_counter() - began,
            "finite": bool(jnp.isfinite(logits).all())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import jax

    report = {"python": platform.python_version(), "versions": versions(),
              "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()], "gpu": gpu_clocks()}
    report["tiny_layer"] = tiny_layer()
    write_json(args.out, report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

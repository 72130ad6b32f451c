"""Measured time(k)/time(1) of our block forward against a KV cache, beside the roofline's prediction.

    python -m benchmarks.forward_cost [--model smollm2-135m] [--dtype float32] [--ks 1 2 4 8 16]
                                      [--batches 1 8] [--kv 1024 4096] [--max-cache-gib 4]

Random weights of the chosen shape (timing needs no trained weights). For each (batch, kv) point every
k is compiled first (compile seconds kept), then the k values are timed in --repeats interleaved rounds
(one synchronised call of each k per round, so no k is timed right after an idle compile) and the median
per k is kept: k new tokens (all-to-all, as an SBD block pass) against a cache of `kv` valid tokens,
logits out, nothing written. Points whose cache would exceed --max-cache-gib are skipped. The hardware
entry: on a GPU the roofline table's (h200-bf16 / h100-bf16 by device name), and the memory bandwidth
is also measured on the device (a 4 GiB reduction) so each time is set against both; on a CPU it is
measured once here: bandwidth from a 1 GiB matrix (its bytes / seconds of a matrix-vector product,
which streams it once as decoding streams weights), peak from a 2048^3 float32 matmul (2·n³ / seconds).
The JSON (benchmarks/results/forward_cost_<platform>_<model>.json or --out) is rewritten after every
(batch, kv) point, so a run cut short keeps what it measured. --dry-run prints the plan and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from sbd_jax.decoding.timing import median_seconds
from sbd_jax.evaluation.results import write_json
from sbd_jax.model.config import RUN_DTYPES, DType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measured_cpu(weight_bytes: float):
    """A roofline Hardware entry for this machine, from two micro-benchmarks."""
    import jax
    import jax.numpy as jnp

    from sbd_jax.roofline import Hardware, matmul_peak_flops

    # A matrix-vector product streams the matrix once, as decoding streams its weights.
    big = jnp.ones((2**14, 2**14), jnp.float32)  # 1 GiB
    vector = jnp.ones((2**14,), jnp.float32)
    bandwidth = big.nbytes / median_seconds(jax.jit(lambda m, x: m @ x), big, vector, repeats=5)
    return Hardware("cpu-measured", bandwidth, matmul_peak_flops(), weight_bytes,
                    "this CPU: bandwidth of a 1 GiB f32 matrix-vector product, peak of a 2048^3 f32 matmul")


def measured_bandwidth() -> float:
    """Bytes/s of a reduction that reads a 4 GiB array once (1 GiB on a CPU)."""
    import jax
    import jax.numpy as jnp

    size = 2**30 if jax.devices()[0].platform != "cpu" else 2**28  # float32 elements
    big = jnp.ones((size,), jnp.float32)
    return big.nbytes / median_seconds(jax.jit(jnp.sum), big, repeats=10)


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median seconds per key of `fns` (zero-argument synchronised calls), timed round-robin."""
    import statistics
    import time

    import jax

    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def hardware_for(device, dtype: str):
    from sbd_jax.roofline import HARDWARE

    weight_bytes = 4 if dtype == DType.FLOAT32 else 2
    if device.platform == "cpu":
        return measured_cpu(weight_bytes)
    name = "h200-bf16" if "H200" in device.device_kind else "h100-bf16"
    return HARDWARE[name]


def model_config(name: str, dtype: str):
    from sbd_jax.model.config import ModelConfig
    from sbd_jax.roofline import MODELS

    m = MODELS[name]
    return ModelConfig(model_type="llama", vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
                       num_layers=m.layers, num_heads=m.heads, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
                       tie_word_embeddings=m.tied, max_position_embeddings=1 << 17, dtype=dtype, param_dtype=dtype,
                       scan_layers=True), m


def plan(ks, batches, kvs, repeats: int, compile_seconds: float) -> dict:
    """What a run will do, before doing it: compiles, timed forwards and an estimate."""
    points = len(batches) * len(kvs)
    compiles, forwards = points * len(ks), points * len(ks) * (repeats + 1)
    return {"points": points, "compiles": compiles, "timed_forwards": forwards,
            "estimated_minutes": compiles * compile_seconds / 60,
            "assumption": f"{compile_seconds:g} s per compile; forwards themselves are milliseconds"}


def run(model: str, dtype: str, ks, batches, kvs, max_cache_gib: float, repeats: int, out: str) -> dict:
    import time

    import jax
    import jax.numpy as jnp

    from sbd_jax.model import masks
    from sbd_jax.model.kv_cache import KVCache
    from sbd_jax.model.transformer import Transformer, init_params
    from sbd_jax.roofline import forward_time, slowdown, terms

    config, shape = model_config(model, dtype)
    device = jax.devices()[0]
    hw = hardware_for(device, dtype)
    bandwidth = hw.bandwidth if device.platform == "cpu" else measured_bandwidth()
    hw_measured = dataclasses.replace(hw, name=hw.name + "-measured-bandwidth", bandwidth=bandwidth)
    params = jax.jit(lambda: init_params(config))()
    net = Transformer(config)

    @jax.jit
    def block_forward(params, cache, tokens):
        k = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(k)
        logits, _ = net.apply({"params": params}, tokens, positions, mask=masks.bidirectional(k), cache=cache)
        return logits

    report = {"model": model, "dtype": dtype, "platform": device.platform, "device": device.device_kind,
              "hardware": hw.__dict__, "measured_bandwidth": bandwidth,
              "roofline_terms_batch1_k1": terms(hw, shape, 1, 1, kvs[0]), "rows": []}
    for batch in batches:
        for kv in kvs:
            slots = kv + max(ks)
            cache_bytes = 2 * config.num_layers * batch * slots * config.num_kv_heads * config.head_dim * \
                jnp.dtype(config.compute_dtype).itemsize
            if cache_bytes > max_cache_gib * 2**30:
                print(f"skip batch {batch} kv {kv}: cache {cache_bytes / 2**30:.1f} GiB > {max_cache_gib} GiB")
                continue
            kv_shape = (config.num_layers, batch, slots, config.num_kv_heads, config.head_dim)
            cache = KVCache(k=jnp.full(kv_shape, 0.01, config.compute_dtype),
                            v=jnp.full(kv_shape, 0.01, config.compute_dtype),
                            lengths=jnp.full((batch,), kv, jnp.int32))
            compiled, compile_seconds = {}, {}
            for k in ks:  # every k compiled (and run once) before any is timed
                began = time.perf_counter()
                tokens = jnp.zeros((batch, k), jnp.int32)
                jax.block_until_ready(block_forward(params, cache, tokens))
                compile_seconds[k] = time.perf_counter() - began
                compiled[k] = (lambda tokens=tokens, cache=cache: block_forward(params, cache, tokens))
            times = interleaved_medians(compiled, repeats)
            for k in ks:
                rows = report["rows"]
                rows.append({"batch": batch, "kv_len": kv, "k": k, "seconds": times[k],
                             "compile_seconds": compile_seconds[k],
                             "measured_slowdown": times[k] / times[min(ks)],
                             "roofline_slowdown": slowdown(hw, shape, batch, k, kv) if min(ks) == 1 else None,
                             "roofline_seconds": forward_time(hw, shape, batch, k, kv),
                             "measured_over_roofline": times[k] / forward_time(hw, shape, batch, k, kv),
                             "measured_over_roofline_at_measured_bandwidth":
                                 times[k] / forward_time(hw_measured, shape, batch, k, kv)})
                r = rows[-1]
                print(f"batch {batch:2d} kv {kv:6d} k {k:3d}: {1e3 * times[k]:9.2f} ms | time(k)/time(1) measured "
                      f"{r['measured_slowdown']:6.3f}, roofline {r['roofline_slowdown'] or float('nan'):6.3f} | "
                      f"measured/roofline time {r['measured_over_roofline']:5.2f} (datasheet), "
                      f"{r['measured_over_roofline_at_measured_bandwidth']:5.2f} (measured bandwidth)", flush=True)
            write_json(out, report)
            del cache, compiled  # free this point's cache before the next is allocated
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=DType.FLOAT32, choices=RUN_DTYPES)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kv", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--max-cache-gib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/forward_cost_<platform>_<model>.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (compiles, forwards, minutes) only")
    parser.add_argument("--compile-seconds", type=float, default=20.0,
                        help="--dry-run's assumption per compile (an 8B bf16 forward on one H200)")
    args = parser.parse_args()
    if args.dry_run:
        print("forward_cost plan:", json.dumps(plan(args.ks, args.batches, args.kv, args.repeats, args.compile_seconds)))
        return
    import jax

    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"forward_cost_{jax.devices()[0].platform}_{args.model}.json")
    run(args.model, args.dtype, args.ks, args.batches, args.kv, args.max_cache_gib, args.repeats, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

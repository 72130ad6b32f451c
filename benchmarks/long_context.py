"""Does a decoding step cost what its forward costs, however long the cache? Per cache size, the time of
one step of the compiled decoding loop against the bare model forward of the same tokens.

    python -m benchmarks.long_context [--capacities 256 1024 4096] [--block-size 8]

A step that copies the KV cache shows here as a ratio that grows with the cache (what it measured:
benchmarks/results/long_context.md).
Rows: NTP (one token a step) and verified SBD (a 2k-token pass a step; SmolLM2's mask token is
untrained, which changes no timing). The cache is filled to `capacity - steps` tokens before the loop, so
the bare forward is timed with the cache half way through the steps. Writes
benchmarks/results/long_context_<platform>.json.
"""

from __future__ import annotations

import argparse


def step_seconds(decoder, params, cache, repeats: int) -> float:
    """Median seconds per loop iteration of `decoder.decode` from `cache` (compile excluded)."""
    import jax
    import jax.numpy as jnp

    from sbd_jax.decoding.base import TracedSettings
    from sbd_jax.decoding.timing import median_seconds

    args = (params, cache, jnp.zeros((1,), jnp.int32), jax.random.key(0), TracedSettings.create(1.0))
    iterations = int(decoder.decode(*args).nfe[0])  # batch 1: one forward per loop iteration
    return median_seconds(decoder.decode, *args, repeats=repeats) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--capacities", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="new tokens per timed decode")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from benchmarks import save_result
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.decoding.base import NTPDecoder
    from sbd_jax.decoding.timing import forward_seconds
    from sbd_jax.decoding.verified import VerifiedSBDDecoder
    from sbd_jax.model.kv_cache import init_cache

    loaded = load_model(args.model)
    config = loaded.config.replace(mask_token_id=loaded.config.mask_token_id or 0)
    model = loaded._replace(params=jax.device_put(loaded.params), config=config)
    k = args.block_size
    decoders = {  # no EOS: every decode runs exactly its steps
        "ntp": (NTPDecoder(config, max_new_tokens=args.steps, eos_ids=()), 1),
        f"verified_{k}": (VerifiedSBDDecoder(config, block_size=k, max_new_tokens=args.steps, eos_ids=()), 2 * k),
    }
    rows = []
    for capacity in args.capacities:
        filled = capacity - args.steps - 2 * k
        cache = init_cache(config, 1, capacity).replace(lengths=jnp.full((1,), filled, jnp.int32))
        for name, (decoder, tokens) in decoders.items():
            step = step_seconds(decoder, model.params, cache, args.repeats)
            bare = forward_seconds(model, 1, tokens, filled + args.steps // 2, calls=10, capacity=capacity)
            rows.append({"capacity": capacity, "decoder": name, "tokens_per_forward_pass": tokens,
                         "step_seconds": step, "bare_forward_seconds": bare, "step_over_bare": step / bare})
            print(f"capacity {capacity:>5} {name:>11}: step {step * 1e3:6.2f} ms, bare forward {bare * 1e3:6.2f} ms, "
                  f"ratio {step / bare:.2f}", flush=True)
    device = jax.devices()[0]
    command = ("python -m benchmarks.long_context --capacities " + " ".join(map(str, args.capacities))
               + f" --block-size {k} --steps {args.steps} --repeats {args.repeats}")
    result = dict(model=args.model, device=str(device), jax=jax.__version__, rows=rows, command=command)
    print(f"wrote {save_result(f'long_context_{device.platform}', result)}")


if __name__ == "__main__":
    main()

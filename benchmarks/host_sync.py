"""Does dispatch run ahead? Steps/s of the compiled train step with a metric fetch after every step
(the old loop) against a fetch every `--log-every` steps (the trainer's loop now), interleaved.

    python -m benchmarks.host_sync [--shape tiny] [--steps 60] [--log-every 10] [--rounds 3]

A small model is where a per-step host sync costs most: its step is short, so the host's wait for the
result, the transfer and the next dispatch are a larger share. Writes benchmarks/results/host_sync_<platform>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps_per_second(compiled, args, steps: int, fetch_every: int) -> float:
    import jax

    state, batch, rng = args
    jax.block_until_ready(state)
    began = time.perf_counter()
    pending = []
    for step in range(steps):
        state, metrics = compiled(state, batch, rng)
        pending.append(metrics)
        if (step + 1) % fetch_every == 0:
            jax.device_get(pending)
            pending = []
    jax.device_get(pending)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - began
    args[0] = state  # the donated state lives on in the next round
    return steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import jax

    from benchmarks import save_result
    from benchmarks.train_step import compiled_step, model_configs

    _, config = next(model_configs([args.shape]))
    compiled, example = compiled_step(config, "sbd", args.batch, args.seq_len)
    state = list(example)
    steps_per_second(compiled, state, 3, 1)  # warm-up
    rates = {"fetch_every_step": [], f"fetch_every_{args.log_every}": []}
    for _ in range(args.rounds):  # interleaved, so drift in the machine's speed hits both alike
        rates["fetch_every_step"].append(steps_per_second(compiled, state, args.steps, 1))
        rates[f"fetch_every_{args.log_every}"].append(steps_per_second(compiled, state, args.steps, args.log_every))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    ratio = medians[f"fetch_every_{args.log_every}"] / medians["fetch_every_step"]
    device = jax.devices()[0]
    result = {"device": str(device), "cpu_count": os.cpu_count(), "jax": jax.__version__, "shape": args.shape,
              "batch": args.batch, "seq_len": args.seq_len, "steps_per_round": args.steps, "rounds": rates,
              "median_steps_per_s": medians, "speedup": ratio,
              "command": f"python -m benchmarks.host_sync --shape {args.shape} --steps {args.steps} "
                         f"--log-every {args.log_every} --rounds {args.rounds}"}
    for name, value in medians.items():
        print(f"{name:>20}: {value:.1f} steps/s")
    print(f"fetching every {args.log_every} steps: {ratio:.2f}x the steps/s of fetching every step")
    print(f"wrote {save_result(f'host_sync_{device.platform}', result)}")


if __name__ == "__main__":
    main()

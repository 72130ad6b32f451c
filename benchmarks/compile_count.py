"""Compiles of the SBD train step for block sizes 2..16: one per size (a block size as a static argument)
against one step that takes the block size as a traced argument (the trainer's), counted and timed in one run.

    python -m benchmarks.compile_count [--shape tiny|smollm2] [--batch 8] [--seq-len 128]

Counts XLA backend compiles of the train step with `jax.monitoring` (not the code's own bookkeeping)
and sums their seconds. Writes benchmarks/results/compile_count_<shape>_<platform>.json.
"""

from __future__ import annotations

import argparse
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EVENT = "/jax/core/compile/backend_compile_duration"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    import jax

    from benchmarks import save_result
    from benchmarks.train_step import compiled_step, model_configs

    events: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, fun_name="", **_: events.append(seconds)
        if name == EVENT and "train_step" in fun_name else None)
    _, config = next(model_configs([args.shape]))
    result = {"shape": args.shape, "batch": args.batch, "seq_len": args.seq_len, "device": str(jax.devices()[0]),
              "jax": jax.__version__, "command": f"python -m benchmarks.compile_count --shape {args.shape} "
                                                f"--batch {args.batch} --seq-len {args.seq_len}"}
    for name, sizes in (("one_step_per_block_size", list(range(2, 17))), ("one_traced_step", [None])):
        start, began = len(events), time.perf_counter()
        for block_size in sizes:
            compiled_step(config, "sbd", args.batch, args.seq_len, block_size=block_size)
        steps = events[start:]
        result[name] = {"compiles": len(steps), "compile_seconds": sum(steps),
                        "wall_seconds": time.perf_counter() - began}
        print(f"{name}: {len(steps)} step compiles, {sum(steps):.1f} s compiling the step", flush=True)
    result["compile_seconds_ratio"] = (result["one_step_per_block_size"]["compile_seconds"]
                                       / result["one_traced_step"]["compile_seconds"])
    out = save_result(f"compile_count_{args.shape}_{jax.devices()[0].platform}", result)
    print(f"compile seconds, one per size / one traced: {result['compile_seconds_ratio']:.1f}x; wrote {out}")


if __name__ == "__main__":
    main()

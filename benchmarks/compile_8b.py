"""Lower and compile the SBD train step of the 8B configs on simulated devices; report per-device memory.

    python -m benchmarks.compile_8b [--config configs/llama3_8b.py] [--devices 8] [--micro-batch 8]
    python -m benchmarks.compile_8b --config configs/llama3_8b.py --devices 1 --micro-batch 1 --adapter-rank 16
    python -m benchmarks.compile_8b --config configs/llama3_8b.py --devices 1 --micro-batch 1 --adapter-rank 16 \
        --objective full_mask_share=1 soft_target=1 position_decay=4    # the shipped adapter's objective

No weights are loaded: parameter and optimizer shapes come from `jax.eval_shape`. The memory figures
are XLA's own accounting of the compiled executable for one device (arguments, outputs, temporaries),
the number that must fit a GPU. Writes benchmarks/results/compile_8b_<config>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_report(config_path: str, devices: int, micro_batch: int, seq_len: int | None = None,
                   adapter_rank: int = 0, objective: dict | None = None) -> dict:
    import jax

    from sbd_jax.config_files import load_config_file
    from sbd_jax.lower import model_config, train_config, train_step_inputs
    from sbd_jax.model import sharding

    cfg, architecture = load_config_file(config_path)
    if seq_len:
        cfg.data.seq_len = seq_len
    # memory is per micro-batch; accumulation only adds a grads-sized buffer
    cfg.train.batch_size, cfg.train.grad_accum = micro_batch, 1
    cfg.adapter.rank = adapter_rank
    for key, value in (objective or {}).items():
        cfg.objective[key] = value
    if devices == 1:
        cfg.mesh = (1, 1, 1)
    cfg = train_config(cfg, architecture)
    config = model_config(cfg)
    mesh = sharding.make_mesh(tuple(cfg.mesh), jax.devices()[:devices])
    step, args = train_step_inputs(cfg, config, mesh)
    params = args[0].params if not adapter_rank else args[4]  # the model's weights, trained or frozen
    began = time.perf_counter()
    lowered = step.lower(*args)
    compiled = lowered.compile()
    seconds = time.perf_counter() - began
    memory = compiled.memory_analysis()
    gib = 2**30
    per_device = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                  - memory.alias_size_in_bytes)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {"config": os.path.basename(config_path), "params_billion": n_params / 1e9, "devices": devices,
            "mesh": dict(mesh.shape), "micro_batch": micro_batch, "adapter_rank": adapter_rank,
            "objective": objective or {},
            "trained_params_million": sum(x.size for x in jax.tree.leaves(args[0].params)) / 1e6, "seq_len": cfg.data.seq_len,
            "compile_seconds": seconds, "argument_gib": memory.argument_size_in_bytes / gib,
            "output_gib": memory.output_size_in_bytes / gib, "temp_gib": memory.temp_size_in_bytes / gib,
            "alias_gib": memory.alias_size_in_bytes / gib, "per_device_gib": per_device / gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["configs/llama3_8b.py", "configs/qwen3_8b.py"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--adapter-rank", type=int, default=0,
                        help="> 0: the gated adapter's step (base frozen, an input); results get an _adapter suffix")
    parser.add_argument("--objective", nargs="*", default=[], metavar="KEY=VALUE",
                        help="objective options (objective.DraftTraining's); results get an _objective suffix")
    args = parser.parse_args()
    objective = {key: float(value) for key, value in (item.split("=", 1) for item in args.objective)}
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    for path in args.config:
        report = compile_report(os.path.join(ROOT, path) if not os.path.isabs(path) else path, args.devices,
                                args.micro_batch, args.seq_len, args.adapter_rank, objective)
        print(json.dumps(report), flush=True)
        suffix = (f"_adapter_{args.devices}dev" if args.adapter_rank else "") + ("_objective" if objective else "")
        out = os.path.join(ROOT, "benchmarks", "results", f"compile_8b_{os.path.basename(path)[:-3]}{suffix}.json")
        write_json(out, report)


if __name__ == "__main__":
    main()

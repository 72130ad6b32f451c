"""What makes an SBD training step of SmolLM2-135M fastest on this CPU, before a CPU budget is spent on it.

    python -m benchmarks.cpu_train_levers [--repeats 3] [--levers baseline remat_dots ...]

One row per lever, each against the same baseline (float32, batch 8 x L = 128, no remat, unrolled
layers, attention `auto`): remat policies, scanned layers, the batch / sequence-length split of the
same tokens, a larger batch, and XLA CPU flags (each flag set runs in a fresh process: XLA reads
them at start-up). Every row: median SBD step seconds, tokens/s (L real tokens a row), XLA's FLOPs
per step from the compiled cost analysis against 6 N tokens x 2 (the 2L layout), and achieved FLOP/s
as a fraction of this CPU's measured peak (a 2048^3 float32 matmul). The NTP step of the baseline is
timed too (SBD/NTP). Random weights: timing does not depend on them.
Writes benchmarks/results/cpu_train_levers.json; with --levers, measures only those rows and the
baseline again and stores them, with their own ratios, under "remeasured" in the existing file (e.g.
rows of a run that shared the CPU with another job): rows are only compared within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BASE = dict(batch=8, seq_len=128, remat="none", scan_layers=False, objective="sbd")
LEVERS = {
    "baseline": {},
    "ntp_step": dict(objective="ntp"),
    "remat_dots": dict(remat="dots"),
    "remat_full": dict(remat="full"),
    "scan_layers": dict(scan_layers=True),
    "batch4_len256": dict(batch=4, seq_len=256),
    "batch16_len128": dict(batch=16),
}
FLAG_SETS = {
    "xla_concurrency_scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "xla_vector_width_512": "--xla_cpu_prefer_vector_width=512",
}


def measure(lever: dict, repeats: int) -> dict:
    import jax

    from benchmarks.train_step import compiled_step, model_configs, time_compiled
    from sbd_jax.training.config import ObjectiveKind

    setting = dict(BASE, **lever)
    _, config = next(model_configs(["smollm2"]))
    config = config.replace(scan_layers=setting["scan_layers"])
    compiled, args = compiled_step(config, setting["objective"], setting["batch"], setting["seq_len"],
                                   remat=setting["remat"])
    seconds = time_compiled(compiled, args, repeats, donate=True)
    params = sum(x.size for x in jax.tree.leaves(args[0].params))
    tokens = setting["batch"] * setting["seq_len"]
    layout = 2 if setting["objective"] == ObjectiveKind.SBD else 1  # the SBD step runs the clean and the noisy copy
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {**setting, "step_s": seconds, "tokens_per_s": tokens / seconds, "xla_flops": float(cost["flops"]),
            "six_n_tokens_flops": 6.0 * params * tokens * layout, "achieved_flops_per_s": cost["flops"] / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levers", nargs="+", default=None, choices=[*LEVERS, *FLAG_SETS],
                        help="measure only these rows (and the baseline) again, kept apart in the results file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the baseline, for a flag set
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(LEVERS["baseline"], args.repeats)))
        return

    import jax

    from sbd_jax.roofline import matmul_peak_flops

    out = os.path.join(ROOT, "benchmarks", "results", "cpu_train_levers.json")
    wanted = set(args.levers or [*LEVERS, *FLAG_SETS]) | {"baseline"}
    rows = {}
    peak = matmul_peak_flops()
    for name, lever in LEVERS.items():
        if name not in wanted:
            continue
        rows[name] = measure(lever, args.repeats)
        print(name, json.dumps(rows[name]), flush=True)
    for name, flags in FLAG_SETS.items():
        if name not in wanted:
            continue
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        out = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)],
                             env=env, capture_output=True, text=True, check=True)
        rows[name] = dict(json.loads(out.stdout.strip().splitlines()[-1]), xla_flags=flags)
        print(name, json.dumps(rows[name]), flush=True)
    base = rows["baseline"]["step_s"]
    for row in rows.values():
        row["speedup_vs_baseline"] = base / row["step_s"] * (row["batch"] * row["seq_len"]) / (
            BASE["batch"] * BASE["seq_len"])  # per token, so batch/length rows compare fairly
        row["fraction_of_peak"] = row["achieved_flops_per_s"] / peak
    command = f"python -m benchmarks.cpu_train_levers --repeats {args.repeats}"
    if args.levers:
        result = json.load(open(out))
        result["remeasured"] = {"command": command + " --levers " + " ".join(args.levers),
                                "measured_peak_flops_per_s": peak, "levers": rows}
    else:
        result = {"device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "jax": jax.__version__,
                  "measured_peak_flops_per_s": peak, "sbd_over_ntp_time": base / rows["ntp_step"]["step_s"],
                  "command": command, "levers": rows}
    for name, row in rows.items():
        print(f"{name:>26}: {row['step_s']:6.2f} s/step, {row['tokens_per_s']:5.0f} tokens/s, "
              f"{row['speedup_vs_baseline']:.2f}x baseline per token, {row['fraction_of_peak']:.0%} of peak "
              f"(XLA FLOPs / 6N·tokens·layout {row['xla_flops'] / row['six_n_tokens_flops']:.2f})")
    write_json(out, result)
    print(f"peak {peak / 1e9:.0f} GFLOP/s; SBD/NTP step {result['sbd_over_ntp_time']:.2f}x; wrote {out}")


if __name__ == "__main__":
    main()

"""Training-step cost: the SBD step (2L tokens) vs an NTP-only step on the same L; blockwise vs dense attention.

    python -m benchmarks.train_step [--shapes tiny smollm2] [--batch 4] [--seq-len 256] [--attn-len 4096]

Per model shape: median step time of each objective (jitted, state donated), tokens/s counted on the
L real tokens of each sequence, their ratio (target <= 2.2: the SBD step carries 2L tokens), and XLA's
per-device memory of each compiled step; the gated adapter's step (rank 16 on every projection, base frozen,
clean half forward-only) beside them. Then one attention layer (SmolLM2's heads) forward+backward
on the SBD layout at L = --attn-len: blockwise (tile skipping) vs the dense reference, time and memory.
Random weights: timing does not depend on them. Writes benchmarks/results/train_step_<platform>.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from sbd_jax.evaluation.results import write_json
from sbd_jax.model.attention import AttentionImpl
from sbd_jax.model.transformer import Remat
from sbd_jax.training.config import ObjectiveKind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled_memory_gib(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes) / 2**30


def time_compiled(compiled, args, repeats, donate=False) -> float:
    import jax

    times = []
    state = args[0]
    for _ in range(repeats + 1):
        call_args = (state,) + tuple(args[1:])
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*call_args))
        times.append(time.perf_counter() - start)
        if donate:
            state = out[0]
    return statistics.median(times[1:])


def model_configs(names):
    from configs import tiny
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.model.config import ModelConfig

    for name in names:
        if name == "tiny":
            yield name, ModelConfig(**tiny.get_config().model.architecture, vocab_size=49153)
        elif name == "smollm2":
            yield name, load_model("smollm2-135m", with_tokenizer=False).config.replace(vocab_size=49153)


def compiled_step(config, kind: str, batch_size: int, seq_len: int, block_size: int | None = 16,
                  attention: str = AttentionImpl.AUTO, remat: str = Remat.NONE, adapter: bool = False):
    """(compiled step, its arguments) of one objective kind (`ObjectiveKind`) on random weights and tokens, state
    donated; `adapter`: the gated adapter's (rank 16, every projection) on frozen weights. `block_size=None`: the
    trainer's step, the block size a traced argument (2..16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sbd_jax.data.packing import Batch
    from sbd_jax.model.config import AdapterConfig
    from sbd_jax.model.transformer import Transformer, init_params
    from sbd_jax.training.config import OptimizerConfig
    from sbd_jax.training.step import ObjectiveSpec, TrainState, make_optimizer, train_step

    config = config.replace(mask_token_id=config.vocab_size - 1)
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-4, warmup_steps=1), 1000)
    params, frozen = init_params(config), None
    if adapter:
        from sbd_jax.model.adapter import init_adapter

        config = config.replace(adapter=AdapterConfig(rank=16))
        params, frozen = init_adapter(Transformer(config), params), params
    tokens = np.random.RandomState(0).randint(0, config.vocab_size - 1, (batch_size, seq_len)).astype(np.int32)
    batch = Batch(jnp.asarray(tokens), jnp.ones_like(tokens), jnp.asarray(np.arange(seq_len)[None].repeat(batch_size, 0)),
                  jnp.ones(tokens.shape, bool))
    spec = ObjectiveSpec(kind=kind, mask_id=config.mask_token_id, block_sizes=(2, 16) if block_size is None else None)
    step = functools.partial(train_step, model=Transformer(config, attention=attention, remat=remat), tx=tx,
                             schedule=schedule, spec=spec)

    def one_step(state, batch, rng, size, frozen):
        return step(state, batch, rng, block_size if size is None else size, frozen)

    args = (jax.random.key(0), None if block_size is not None else jnp.int32(16), frozen)
    state = TrainState(jnp.int32(0), params, tx.init(params))
    compiled = jax.jit(one_step, donate_argnums=(0,)).lower(state, batch, *args).compile()
    return compiled, (state, batch, *args)


def hlo_flops(compiled) -> float:
    """FLOPs of one call by XLA's cost analysis of the compiled step."""
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def step_report(name, config, batch_size, seq_len, repeats) -> dict:
    """SBD and NTP steps timed interleaved (NTP, SBD, NTP, SBD, ...; medians), so a slow spell of the
    machine hits both; plus the variants that say where SBD's extra cost goes: NTP on 2L tokens (the
    layout's inherent cost: 2x the tokens, 4x the attention scores) and SBD with the other attention path."""
    import jax

    from sbd_jax.model.attention import uses_blockwise
    from sbd_jax.roofline import shape_of, training_flops_per_token

    ntp, sbd, auto = ObjectiveKind.NTP, ObjectiveKind.SBD, AttentionImpl.AUTO
    chosen, other = AttentionImpl.BLOCKWISE, AttentionImpl.REFERENCE
    if not uses_blockwise(seq_len):
        chosen, other = other, chosen
    variants = {"ntp": (ntp, seq_len, auto, False), "sbd": (sbd, seq_len, auto, False),
                "ntp_2L": (ntp, 2 * seq_len, auto, False), f"sbd_{other}": (sbd, seq_len, other, False),
                "adapter": (sbd, seq_len, auto, True)}
    compiled = {key: compiled_step(config, kind, batch_size, length, attention=attention, adapter=adapter)
                for key, (kind, length, attention, adapter) in variants.items()}
    row = {"shape": name, "batch": batch_size, "seq_len": seq_len, "sbd_attention": chosen,
           "params_million": sum(x.size for x in jax.tree.leaves(compiled["ntp"][1][0].params)) / 1e6,
           "adapter_params_million": sum(x.size for x in jax.tree.leaves(compiled["adapter"][1][0].params)) / 1e6}
    states = {key: args[0] for key, (_, args) in compiled.items()}
    times: dict[str, list[float]] = {key: [] for key in compiled}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for key, (step, args) in compiled.items():
            began = time.perf_counter()
            out = jax.block_until_ready(step(states[key], *args[1:]))
            times[key].append(time.perf_counter() - began)
            states[key] = out[0]
    for key, (step, _) in compiled.items():
        row[f"{key}_step_s"] = statistics.median(times[key][1:])
        row[f"{key}_hlo_gflops"] = hlo_flops(step) / 1e9
        row[f"{key}_memory_gib"] = compiled_memory_gib(step)
    for kind in (ntp, sbd):
        row[f"{kind}_tokens_per_s"] = batch_size * seq_len / row[f"{kind}_step_s"]
        flops = training_flops_per_token(shape_of(config), kind == sbd)
        row[f"{kind}_model_gflops"] = flops * batch_size * seq_len / 1e9
    row["sbd_over_ntp_time"] = row["sbd_step_s"] / row["ntp_step_s"]
    row["sbd_over_ntp_time_pairwise_median"] = statistics.median(
        s / n for s, n in zip(times["sbd"][1:], times["ntp"][1:]))
    row["ntp_2L_over_ntp_time"] = row["ntp_2L_step_s"] / row["ntp_step_s"]
    row["adapter_over_ntp_time"] = row["adapter_step_s"] / row["ntp_step_s"]
    row["adapter_over_sbd_time"] = row["adapter_step_s"] / row["sbd_step_s"]
    row["adapter_over_sbd_memory"] = row["adapter_memory_gib"] / row["sbd_memory_gib"]
    row["sbd_over_ntp_hlo_flops"] = row["sbd_hlo_gflops"] / row["ntp_hlo_gflops"]
    return row


def attention_report(seq_len, repeats) -> dict:
    import jax
    import jax.numpy as jnp

    from sbd_jax.model.attention import blockwise_sbd_attention, reference_attention
    from sbd_jax.model.masks import SBDTrainingMask

    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2-135M
    rng = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(rng[0], (1, 2 * seq_len, heads, head_dim))
    k = jax.random.normal(rng[1], (1, 2 * seq_len, kv_heads, head_dim))
    v = jax.random.normal(rng[2], (1, 2 * seq_len, kv_heads, head_dim))
    mask = SBDTrainingMask(jnp.ones((1, 2 * seq_len), jnp.int32), seq_len=seq_len, block_size=16)
    impls = {"blockwise": lambda q, k, v: blockwise_sbd_attention(q, k, v, mask, 512),
             "dense": lambda q, k, v: reference_attention(q, [(k, v, mask.dense())])}
    row = {"seq_len": seq_len, "tokens": 2 * seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    for name, fn in impls.items():
        loss_grad = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))
        compiled = loss_grad.lower(q, k, v).compile()
        row[f"{name}_fwd_bwd_s"] = time_compiled(compiled, (q, k, v), repeats)
        row[f"{name}_memory_gib"] = compiled_memory_gib(compiled)
    row["dense_over_blockwise_time"] = row["dense_fwd_bwd_s"] / row["blockwise_fwd_bwd_s"]
    row["dense_over_blockwise_memory"] = row["dense_memory_gib"] / row["blockwise_memory_gib"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--attn-len", type=int, default=4096, help="0 skips the attention section")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    steps = []
    for name, config in model_configs(args.shapes):
        row = step_report(name, config, args.batch, args.seq_len, args.repeats)
        steps.append(row)
        print(f"{name} ({row['params_million']:.0f}M params, batch {args.batch}, L={args.seq_len}, medians of "
              f"{args.repeats} interleaved): NTP {row['ntp_tokens_per_s']:.0f} tok/s, SBD {row['sbd_tokens_per_s']:.0f} "
              f"tok/s ({row['sbd_attention']} attention) -> SBD/NTP time {row['sbd_over_ntp_time']:.2f}x; NTP on 2L "
              f"{row['ntp_2L_over_ntp_time']:.2f}x; XLA FLOPs SBD/NTP {row['sbd_over_ntp_hlo_flops']:.2f}x (SBD "
              f"{row['sbd_hlo_gflops']:.0f} GFLOP vs 6N x 2L tokens {row['sbd_model_gflops']:.0f}); memory NTP "
              f"{row['ntp_memory_gib']:.2f} GiB, SBD {row['sbd_memory_gib']:.2f} GiB; gated adapter step "
              f"{row['adapter_over_sbd_time']:.2f}x SBD's time, {row['adapter_over_sbd_memory']:.2f}x its memory", flush=True)
        print("  " + ", ".join(f"{k[:-7]} {v:.3f}s" for k, v in row.items() if k.endswith("_step_s")), flush=True)
    device = jax.devices()[0]
    out = os.path.join(ROOT, "benchmarks", "results", f"train_step_{device.platform}.json")
    result = {"platform": device.platform, "device": device.device_kind, "cpu_count": os.cpu_count(),
              "jax": jax.__version__, "steps": steps}
    write_json(out, result)  # before the attention section, which needs much more memory
    if args.attn_len:
        jax.clear_caches()
        attn = attention_report(args.attn_len, args.repeats)
        print(f"attention fwd+bwd at L={args.attn_len} (2L={2 * args.attn_len}): blockwise "
              f"{attn['blockwise_fwd_bwd_s']:.2f}s / {attn['blockwise_memory_gib']:.2f} GiB, dense "
              f"{attn['dense_fwd_bwd_s']:.2f}s / {attn['dense_memory_gib']:.2f} GiB -> dense/blockwise time "
              f"{attn['dense_over_blockwise_time']:.2f}x, memory {attn['dense_over_blockwise_memory']:.1f}x", flush=True)
        write_json(out, {**result, "attention": attn})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

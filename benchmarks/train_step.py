"""Training-step cost: the SBD step (2L tokens) vs an NTP-only step on the same L; blockwise vs dense attention.

    python benchmarks/train_step.py [--shapes tiny smollm2] [--batch 4] [--seq-len 256] [--attn-len 4096]

Per model shape: median step time of each objective (jitted, state donated), tokens/s counted on the
L real tokens of each sequence, their ratio (target <= 2.2: the SBD step carries 2L tokens), and XLA's
per-device memory of each compiled step. Then one attention layer (SmolLM2's heads) forward+backward
on the SBD layout at L = --attn-len: blockwise (tile skipping) vs the dense reference, time and memory.
Random weights: timing does not depend on them. Writes benchmarks/results/train_step_<platform>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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
    from sbd_jax.config import ModelConfig

    for name in names:
        if name == "tiny":
            yield name, ModelConfig(**tiny.get_config().model.architecture, vocab_size=49153)
        elif name == "smollm2":
            yield name, load_model("smollm2-135m", with_tokenizer=False).config.replace(vocab_size=49153)


def compiled_step(config, objective: str, batch_size: int, seq_len: int, block_size: int | None = 16):
    """(compiled step, its arguments) of one objective on random weights and tokens, state donated.
    `block_size=None`: the trainer's step, the block size a traced argument (2..16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from configs.base import get_base
    from sbd_jax.model import Transformer, init_params
    from sbd_jax.objective import Batch
    from sbd_jax.trainer import TrainState, make_optimizer, train_step

    config = config.replace(mask_token_id=config.vocab_size - 1)
    opt = get_base().optimizer
    opt.lr, opt.warmup_steps = 1e-4, 1
    tx, schedule = make_optimizer(opt, 1000)
    params = init_params(config)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size - 1, (batch_size, seq_len)).astype(np.int32)
    batch = Batch(jnp.asarray(tokens), jnp.ones_like(tokens), jnp.asarray(np.arange(seq_len)[None].repeat(batch_size, 0)),
                  jnp.ones(tokens.shape, bool))
    step = functools.partial(train_step, model=Transformer(config), tx=tx, schedule=schedule,
                             objective=objective, mask_id=config.mask_token_id, weights=(1.0, 1.0),
                             eta_range=(0.0, 1.0), grad_accum=1)
    if block_size is None:
        step = functools.partial(step, block_sizes=(2, 16))
        args = (jax.random.key(0), jnp.int32(16))
    else:
        step = functools.partial(step, block_size=block_size)
        args = (jax.random.key(0),)
    state = TrainState(jnp.int32(0), params, tx.init(params))
    compiled = jax.jit(step, donate_argnums=(0,)).lower(state, batch, *args).compile()
    return compiled, (state, batch, *args)


def step_report(name, config, batch_size, seq_len, repeats) -> dict:
    import jax

    row = {"shape": name, "batch": batch_size, "seq_len": seq_len}
    for objective in ("ntp", "sbd"):
        compiled, args = compiled_step(config, objective, batch_size, seq_len)
        row["params_million"] = sum(x.size for x in jax.tree.leaves(args[0].params)) / 1e6
        seconds = time_compiled(compiled, args, repeats, donate=True)
        row[f"{objective}_step_s"] = seconds
        row[f"{objective}_tokens_per_s"] = batch_size * seq_len / seconds
        row[f"{objective}_memory_gib"] = compiled_memory_gib(compiled)
    row["sbd_over_ntp_time"] = row["sbd_step_s"] / row["ntp_step_s"]
    return row


def attention_report(seq_len, repeats) -> dict:
    import jax
    import jax.numpy as jnp

    from sbd_jax.attention import blockwise_sbd_attention, reference_attention
    from sbd_jax.masks import SBDTrainingMask

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
    parser.add_argument("--attn-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    steps = []
    for name, config in model_configs(args.shapes):
        row = step_report(name, config, args.batch, args.seq_len, args.repeats)
        steps.append(row)
        print(f"{name} ({row['params_million']:.0f}M params, batch {args.batch}, L={args.seq_len}): NTP "
              f"{row['ntp_tokens_per_s']:.0f} tok/s, SBD {row['sbd_tokens_per_s']:.0f} tok/s -> SBD/NTP time "
              f"{row['sbd_over_ntp_time']:.2f}x; memory NTP {row['ntp_memory_gib']:.2f} GiB, SBD "
              f"{row['sbd_memory_gib']:.2f} GiB", flush=True)
    attn = attention_report(args.attn_len, args.repeats)
    print(f"attention fwd+bwd at L={args.attn_len} (2L={2 * args.attn_len}): blockwise "
          f"{attn['blockwise_fwd_bwd_s']:.2f}s / {attn['blockwise_memory_gib']:.2f} GiB, dense "
          f"{attn['dense_fwd_bwd_s']:.2f}s / {attn['dense_memory_gib']:.2f} GiB -> dense/blockwise time "
          f"{attn['dense_over_blockwise_time']:.2f}x, memory {attn['dense_over_blockwise_memory']:.1f}x", flush=True)
    device = jax.devices()[0]
    out = os.path.join(ROOT, "benchmarks", "results", f"train_step_{device.platform}.json")
    with open(out, "w") as f:
        json.dump({"platform": device.platform, "device": device.device_kind, "cpu_count": os.cpu_count(),
                   "jax": jax.__version__, "steps": steps, "attention": attn}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

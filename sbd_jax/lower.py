"""Lower the SBD train step and the decoders for TPU or CUDA on any machine, this CPU included.

    python -m sbd_jax.lower --config configs/llama3_8b.py --platform tpu [--devices 8] [--mesh 2,2,2]

What lowering proves: the computation traces with the kernels chosen for the target platform (splash
on TPU, blockwise on GPU), Pallas turns the splash kernel into Mosaic (`tpu_custom_call`) for every block
size of the range, the sharding annotations of the mesh propagate, and no `[2L, 2L]` array of the
training layout is built. What it does not prove: nothing is compiled by the target's backend (no XLA
TPU/GPU compile, no Mosaic or Triton compile), nothing runs, nothing is timed, and memory is not
checked (`benchmarks/compile_8b.py` does that for the host's own backend).

No weights are read: shapes come from the config, abstract (`jax.ShapeDtypeStruct`) throughout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any, Sequence

PLATFORMS = ("tpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One exported function: its name, the platform, and the facts read from its StableHLO text."""

    name: str
    platform: str
    mosaic_calls: int  # splash kernels lowered to Mosaic (TPU custom calls)
    dense_layout_arrays: int  # [2L, 2L] masks or score matrices (training layout; 0 = none materialised)
    text_chars: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def describe(name: str, platform: str, exported: Any, layout_len: int | None = None) -> Lowered:
    """Reads an `Exported`'s StableHLO: Mosaic calls, and (given `layout_len` = 2L) the values that are a
    dense training mask (boolean, ending in [2L, 2L]) or a score matrix over it ([B, K, G, 2L, 2L]).
    Activations `[B, 2L, heads x head_dim]` may end in [2L, 2L] too when heads x head_dim = 2L; their
    rank (3) and dtype keep them out of the count."""
    text = exported.mlir_module()
    dense = 0
    if layout_len:
        for leading, dtype in re.findall(rf"tensor<((?:[0-9]+x)*){layout_len}x{layout_len}x(\w+)>", text):
            dense += dtype == "i1" or leading.count("x") >= 2
    return Lowered(name, platform, text.count("tpu_custom_call"), dense, len(text))


def train_config(config_dict: Any, architecture: dict | None = None) -> Any:
    """The `TrainConfig` of a config file's `get_config()`; an 8B config's ARCHITECTURE (the shape of
    the model it names at run time) stands in for that model, whose weights lowering never needs."""
    from sbd_jax.training.config import TrainConfig

    if architecture:
        config_dict.model.architecture = architecture
    return TrainConfig.from_config_dict(config_dict)


def model_config(cfg: Any) -> Any:
    """The ModelConfig a `TrainConfig` trains, with a mask token id (0: shapes are all that matter): its
    `model.architecture`, else the config of `model.name` (the embedded GGUF or an HF directory)."""
    from sbd_jax.checkpoints.load import read_model_config
    from sbd_jax.training.trainer import architecture_config, run_options

    m = cfg.model
    if not m.architecture:
        return read_model_config(m.name, **run_options(m)).replace(mask_token_id=0)
    return architecture_config(m, m.architecture).replace(mask_token_id=0)


def train_step_inputs(cfg: Any, config: Any, mesh: Any) -> tuple[Any, tuple]:
    """The jitted SBD train step of `cfg` on `mesh` and abstract arguments carrying their shardings:
    state (step, params, AdamW state), one micro-batch, rng and a traced block size (and, for an adapter
    run, the frozen base weights; the state then holds the adapter alone)."""
    import jax
    import jax.numpy as jnp

    from sbd_jax.data.packing import Batch
    from sbd_jax.model import sharding
    from sbd_jax.model.transformer import Transformer, init_params
    from sbd_jax.training.step import TrainState, jitted_train_step, make_optimizer

    cfg = _one_micro_batch(cfg)
    tx, schedule = make_optimizer(cfg.optimizer, cfg.train.steps)
    params = base = jax.eval_shape(lambda: init_params(config))
    config = config.replace(adapter=cfg.adapter.model_config())
    if config.adapter:  # a gated adapter trains alone; the base is an input of the step
        from sbd_jax.model.adapter import adapter_tree

        params = jax.eval_shape(lambda key: adapter_tree(Transformer(config), key), jax.random.key(0))
    opt_state = jax.eval_shape(tx.init, params)
    # The state's pytree of shapes and of shardings (its fields are typed as arrays).
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state)  # type: ignore[arg-type]
    shardings = TrainState(sharding.replicated(mesh), sharding.param_shardings(params, mesh),  # type: ignore[arg-type]
                           sharding.param_shardings(opt_state, mesh))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    rows = (cfg.train.batch_size, cfg.data.seq_len)
    batch_sh = sharding.batch_sharding(mesh)
    batch = Batch(*[jax.ShapeDtypeStruct(rows, d, sharding=batch_sh) for d in (jnp.int32,) * 3 + (jnp.bool_,)])
    replicated = sharding.replicated(mesh)
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    block_size = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    model = Transformer(config, mesh=mesh, attention=cfg.model.attention, remat=cfg.model.remat)
    if not config.adapter:
        return jitted_train_step(cfg, model, tx, schedule, mesh, shardings), (state, batch, rng, block_size)
    frozen_shardings = sharding.param_shardings(base, mesh)
    frozen = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), base, frozen_shardings)
    step = jitted_train_step(cfg, model, tx, schedule, mesh, shardings, frozen_shardings)
    return step, (state, batch, rng, block_size, frozen)


def _one_micro_batch(cfg: Any) -> Any:
    """The step for one micro-batch: accumulation only loops it (and adds one grads-sized buffer)."""
    micro = dataclasses.replace(cfg.train, batch_size=cfg.train.batch_size // cfg.train.grad_accum, grad_accum=1)
    return dataclasses.replace(cfg, train=micro)


def lower_train_step(cfg: Any, config: Any, mesh: Any, platform: str) -> Lowered:
    """Exports the SBD train step of `cfg` (every block size of its range: one traced size) for `platform`."""
    import jax

    from sbd_jax.model.attention import compiling_for

    step, args = train_step_inputs(cfg, config, mesh)
    with compiling_for(platform):
        exported = jax.export.export(step, platforms=(platform,))(*args)
    return describe(f"train_step[{cfg.model.attention}]", platform, exported, 2 * cfg.data.seq_len)


def lower_decoders(config: Any, platform: str, batch: int, prompt_len: int, max_new_tokens: int,
                   block_size: int) -> list[Lowered]:
    """Exports prefill and the NTP, SBD and verified-SBD decode loops (greedy and sampled) for `platform`."""
    import jax
    import jax.numpy as jnp

    from sbd_jax.decoding.base import NTPDecoder, TracedSettings
    from sbd_jax.decoding.sbd import SBDDecoder
    from sbd_jax.decoding.verified import VerifiedSBDDecoder
    from sbd_jax.model.attention import compiling_for
    from sbd_jax.model.transformer import init_params

    params = jax.eval_shape(lambda: init_params(config))
    capacity = prompt_len + max_new_tokens + block_size
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    knobs = TracedSettings(gamma=jax.ShapeDtypeStruct((), jnp.float32))  # type: ignore[arg-type]  # its shape
    eos = tuple(config.eos_token_ids) or (0,)
    temperature, top_p = 0.8, 0.95
    decoders = {
        "ntp": NTPDecoder(config, max_new_tokens, eos_ids=eos),
        "ntp_sampled": NTPDecoder(config, max_new_tokens, eos_ids=eos, temperature=temperature, top_p=top_p),
        "sbd": SBDDecoder(config, max_new_tokens, eos_ids=eos, block_size=block_size),
        "verify": VerifiedSBDDecoder(config, max_new_tokens, eos_ids=eos, block_size=block_size),
        "verify_sampled": VerifiedSBDDecoder(config, max_new_tokens, eos_ids=eos, block_size=block_size,
                                             temperature=temperature, top_p=top_p),
    }
    out = []
    with compiling_for(platform):
        ntp = decoders["ntp"]
        prefill = jax.export.export(type(ntp).prefill, platforms=(platform,))(ntp, params, prompts, lengths,
                                                                              capacity=capacity)
        out.append(describe("prefill", platform, prefill))
        cache, last = jax.eval_shape(lambda p, t, n: type(ntp).prefill(ntp, p, t, n, capacity=capacity),
                                     params, prompts, lengths)
        for name, decoder in decoders.items():
            exported = jax.export.export(type(decoder).decode, platforms=(platform,))(
                decoder, params, cache, last, rng, knobs, prompts, lengths)
            out.append(describe(f"decode_{name}", platform, exported))
    return out


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a training config file (configs/*.py)")
    parser.add_argument("--platform", choices=PLATFORMS, nargs="+", default=list(PLATFORMS))
    parser.add_argument("--devices", type=int, default=8, help="simulated devices of the mesh (on a CPU host)")
    parser.add_argument("--mesh", default=None, help="data,fsdp,tensor sizes (default: the config's mesh)")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per step (default: the config's)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: the config's)")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16, help="the decoders' block size")
    parser.add_argument("--adapter-rank", type=int, default=0,
                        help="> 0: the gated adapter's train step (base frozen) at this rank")
    args = parser.parse_args(argv)
    # Simulated devices must be asked for before JAX starts its CPU backend.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax

    from sbd_jax.config_files import load_config_file
    from sbd_jax.model import sharding

    cfg, architecture = load_config_file(args.config)
    if args.mesh:
        cfg.mesh = tuple(int(s) for s in args.mesh.split(","))
    if args.micro_batch:
        cfg.train.batch_size, cfg.train.grad_accum = args.micro_batch, 1
    if args.seq_len:
        cfg.data.seq_len = args.seq_len
    cfg.adapter.rank = args.adapter_rank
    cfg = train_config(cfg, architecture)
    config = model_config(cfg)
    mesh = sharding.make_mesh(tuple(cfg.mesh), jax.devices()[: args.devices])
    results = []
    for platform in args.platform:
        for lowered in [lower_train_step(cfg, config, mesh, platform),
                        *lower_decoders(config, platform, args.decode_batch, 64, 64, args.block_size)]:
            print(json.dumps(lowered.as_dict()), flush=True)
            results.append(lowered.as_dict())
    return results


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])

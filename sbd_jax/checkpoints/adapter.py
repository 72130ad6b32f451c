"""Gated-adapter files (the adapter itself: `sbd_jax.model.adapter`): writing a trained adapter, and attaching one
to the base model it was trained on.

On disk an adapter is a directory beside the base model: `adapter.safetensors` (per-layer tensors named
by their path, e.g. `layers_3/self_attn/q_proj_lora/a`; float32 as trained, or bfloat16 in a shipped copy,
`write_copy`: loading casts them to the model's weights dtype) and `adapter.json` (rank, alpha, targets, the mask
token, and the base it was trained on: architecture and a fingerprint of its weights, checked on load). Shipped
adapters load by name (`checkpoints.load.KNOWN_ADAPTERS`). A training run may start its adapter from one
(`adapter.init_from`: `continued_adapter`), after checks that it is the same adapter on the same base.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from sbd_jax.checkpoints.files import reports_write_errors
from sbd_jax.errors import UserError
from sbd_jax.model.adapter import adapter_tree, merge
from sbd_jax.model.config import AdapterConfig, ModelConfig
from sbd_jax.model.transformer import Transformer

FORMAT = "sbd_jax.adapter/1"
WEIGHTS, CONFIG = "adapter.safetensors", "adapter.json"
# The base's architecture fields an adapter must match (its shapes and what its positions mean).
_BASE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
_KEYS = ("rank", "alpha", "targets", "mask_token_id", "base")  # adapter.json's keys that loading reads
_BASE_KEYS = (*_BASE_FIELDS, "fingerprint", "mask_token")


def fingerprint(params: dict) -> str:
    """A short hash of a parameter tree: every tensor's path and shape and up to 4,096 of its values (evenly
    spaced, rounded to bfloat16). Tells one base from another without hashing gigabytes, and is the same
    for the same weights loaded per layer or scanned, in float32 or bfloat16."""
    import ml_dtypes

    digest = hashlib.sha256()
    for path, leaf in sorted(_flat(_per_layer(params)).items()):
        array = np.asarray(leaf)
        flat = array.reshape(-1)
        sample = flat[:: max(1, flat.size // 4096)].astype(np.float32).astype(ml_dtypes.bfloat16)
        digest.update(f"{path}|{array.shape}|".encode())
        digest.update(sample.astype(np.float32).tobytes())
    return digest.hexdigest()[:16]


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = value
    return out


def _unflat(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _per_layer(tree: dict) -> dict:
    """A scanned model's stacked `layers` subtree as `layers_0 ..` (the file's layout, whatever the run's)."""
    if "layers" not in tree:
        return tree
    rest = {k: v for k, v in tree.items() if k != "layers"}
    num_layers = jax.tree.leaves(tree["layers"])[0].shape[0]
    return {**rest, **{f"layers_{i}": jax.tree.map(lambda x: np.asarray(x)[i], tree["layers"])
                       for i in range(num_layers)}}


@reports_write_errors
def save_adapter(path: str, config: ModelConfig, adapter: dict, base: dict[str, Any],
                 init_from: dict[str, Any] | None = None) -> None:
    """Writes `adapter.safetensors` and `adapter.json`. `base`: what names the base model (`name`,
    `fingerprint` of its weights before the mask token was set up, `mask_token`: the spec that set it);
    `init_from`: the adapter its training started from (`source`, its `steps`), recorded under that key."""
    from sbd_jax.checkpoints.files import save_safetensors

    assert config.adapter is not None, "save_adapter writes an adapter run's adapter"
    os.makedirs(path, exist_ok=True)
    tensors = {name: np.ascontiguousarray(np.asarray(value, np.float32))
               for name, value in _flat(_per_layer(jax.device_get(adapter))).items()}
    save_safetensors(tensors, os.path.join(path, WEIGHTS))
    meta = {"format": FORMAT, "rank": config.adapter.rank, "alpha": config.adapter.alpha,
            "targets": list(config.adapter.targets), "mask_token_id": config.mask_token_id,
            "base": {**{f: getattr(config, f) for f in _BASE_FIELDS}, **base},
            **({"init_from": init_from} if init_from else {})}
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(meta, f, indent=2)


def read_adapter_config(path: str) -> dict:
    """`adapter.json` of an adapter directory, checked to be one."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file) or not os.path.isfile(os.path.join(path, WEIGHTS)):
        raise UserError(f"{path} is not an adapter directory: it needs {CONFIG} and {WEIGHTS} "
                        "(train.py writes them with adapter.rank > 0)")
    try:
        meta = json.load(open(file))
    except json.JSONDecodeError as e:
        raise UserError(f"{file} is not valid JSON ({e}); the adapter directory is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{file} has format {found!r}, not {FORMAT!r}; re-export the adapter")
    base = meta.get("base")
    missing = [key for key in _KEYS if key not in meta] or (
        ["base"] if not isinstance(base, dict) else [f"base.{key}" for key in _BASE_KEYS if key not in base])
    if missing:
        raise UserError(f"{file} has no {missing[0]!r}; the adapter directory is damaged: re-export the adapter")
    return meta


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of the adapter directory `path`, by name, in the file's dtype (bfloat16 as `ml_dtypes`')."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.path.join(path, WEIGHTS), "np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise UserError(f"{os.path.join(path, WEIGHTS)} is not a readable safetensors file ({e}); it is "
                        "truncated or corrupt: re-export the adapter") from None


def write_copy(source: str, path: str, dtype: str = "bfloat16", note: dict[str, Any] | None = None) -> dict:
    """Writes a copy of the adapter directory `source` to `path` with its tensors in `dtype` (bfloat16 halves a
    float32 export; the values round to bfloat16, nothing else changes) and `note` (where it came from) under
    adapter.json's `shipped` key. Returns the copy's adapter.json."""
    from sbd_jax.checkpoints.files import save_safetensors
    from sbd_jax.model.config import DType

    meta = read_adapter_config(source)
    if os.path.abspath(source) == os.path.abspath(path):
        raise UserError(f"write the copy of {source} somewhere else: it would replace the adapter it reads")
    target = np.dtype(DType(dtype).jnp)
    tensors = {name: np.ascontiguousarray(value.astype(target)) for name, value in read_tensors(source).items()}
    os.makedirs(path, exist_ok=True)
    save_safetensors(tensors, os.path.join(path, WEIGHTS))
    meta = {**meta, "dtype": dtype, **({"shipped": note} if note is not None else {})}
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def shipped_steps(spec: str) -> int | None:
    """The training steps of adapter `spec` (a directory or a known name) as shipped (`adapter.json`'s
    `shipped.steps`, which result files quote to say which version ran); None for an adapter not shipped."""
    from sbd_jax.checkpoints.load import resolve_adapter

    return read_adapter_config(resolve_adapter(spec)).get("shipped", {}).get("steps")


def attach_adapter(spec: str, config: ModelConfig, params: dict, tokenizer: Any) -> tuple[ModelConfig, dict, Any]:
    """The base model (`config`, `params`, `tokenizer`, as loaded) with the adapter `spec` (a directory or a
    known name, `checkpoints.load.resolve_adapter`): the base checked against the one the adapter was trained
    on, its mask token set up as in training, the adapter's weights cast to the model's weights dtype."""
    from sbd_jax.checkpoints.load import resolve_adapter
    from sbd_jax.model.mask_token import setup_mask_token

    path = resolve_adapter(spec)
    meta = read_adapter_config(path)
    base = meta["base"]
    for field in _BASE_FIELDS:
        if base[field] != getattr(config, field):
            raise UserError(f"adapter {spec} was trained on a base with {field}={base[field]}, this model has "
                            f"{getattr(config, field)}; load the base it names ({base.get('name')})")
    if fingerprint(params) != base["fingerprint"]:
        raise UserError(f"adapter {spec} was trained on other weights (fingerprint {base['fingerprint']}, this "
                        f"base {fingerprint(params)}); load the base it names ({base.get('name')})")
    config, params, tokenizer = setup_mask_token(config, params, tokenizer, base["mask_token"])
    if config.mask_token_id != meta["mask_token_id"]:
        raise UserError(f"adapter {path} uses mask token {meta['mask_token_id']}, setting it up on this base gave "
                        f"{config.mask_token_id}; load it with the tokenizer it was trained with")
    config = config.replace(adapter=AdapterConfig(rank=meta["rank"], alpha=meta["alpha"],
                                                  targets=tuple(meta["targets"])))
    return config, merge(params, adapter_weights(path, meta, config)), tokenizer


def adapter_weights(path: str, meta: dict, config: ModelConfig) -> dict:
    """The adapter tensors of the directory `path` (its adapter.json `meta`) as the parameter tree of `config`'s
    adapter: checked against the shapes that config needs, cast to its weights dtype, stacked where it scans."""
    per_layer = config.replace(scan_layers=False)  # the file's layout
    expected = _flat(jax.eval_shape(lambda key: adapter_tree(Transformer(per_layer), key), jax.random.key(0)))
    found = read_tensors(path)
    if set(found) != set(expected):
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise UserError(f"adapter {path}: tensors do not match its {CONFIG} (missing {missing[:3]}, unexpected "
                        f"{extra[:3]}); the directory is damaged or mixed from two adapters")
    for name, want in expected.items():
        if found[name].shape != want.shape:
            raise UserError(f"adapter {path}: {name} has shape {found[name].shape}, its {CONFIG} (rank "
                            f"{meta['rank']}) needs {want.shape}; the files belong to different adapters")
    adapter = _unflat({n: v.astype(config.weights_dtype) for n, v in found.items()})
    if config.scan_layers:
        from sbd_jax.checkpoints.hf import stack_layers

        adapter = stack_layers(adapter, config.num_layers)
    return adapter


def check_continues(spec: str, meta: dict, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """Refuses, in one line naming the setting to change, to start a run's adapter (`adapter.rank`, `alpha`,
    `targets`) from the adapter `spec` (its adapter.json `meta`) when they differ."""
    where = f"config adapter.init_from={spec!r}"
    for name, theirs, ours in (("rank", meta["rank"], rank), ("alpha", float(meta["alpha"]), float(alpha)),
                               ("targets", tuple(meta["targets"]), tuple(targets))):
        if theirs != ours:
            raise UserError(f"{where} has {name} {theirs}, this run adapter.{name}={ours}: set adapter.{name}="
                            f"{theirs} to continue it, or leave adapter.init_from empty to start a new adapter")


def continued_adapter(spec: str, config: ModelConfig, base: dict[str, Any]) -> tuple[dict, dict]:
    """(weights, adapter.json) of the adapter `spec` (a directory or a known name) as the start of a training
    run whose model is `config` (its adapter and mask token set up) on the base `base` (`save_adapter`'s record:
    name, fingerprint, mask_token): every tensor it stores, its own mask embedding included, in the run's
    weights dtype. The run's adapter sizes, base weights and mask token must be the adapter's (one-line
    `UserError` naming the setting otherwise)."""
    from sbd_jax.checkpoints.load import resolve_adapter

    assert config.adapter is not None, "an adapter run starts from an adapter"
    path = resolve_adapter(spec)
    meta = read_adapter_config(path)
    check_continues(spec, meta, config.adapter.rank, config.adapter.alpha, config.adapter.targets)
    trained, where = meta["base"], f"config adapter.init_from={spec!r}"
    if trained["fingerprint"] != base["fingerprint"]:
        raise UserError(f"{where} was trained on base {trained.get('name')!r} (fingerprint {trained['fingerprint']}), "
                        f"this run's model.name={base['name']!r} has fingerprint {base['fingerprint']}: set "
                        "model.name to the base it names, or leave adapter.init_from empty")
    if trained["mask_token"] != base["mask_token"] or meta["mask_token_id"] != config.mask_token_id:
        raise UserError(f"{where} was trained with data.mask_token={trained['mask_token']!r} (id "
                        f"{meta['mask_token_id']}), this run has {base['mask_token']!r} (id {config.mask_token_id}): "
                        f"set data.mask_token={trained['mask_token']!r}")
    return adapter_weights(path, meta, config), meta

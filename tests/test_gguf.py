"""GGUF loading: llama.cpp's Q/K permutation undone, quantized types dequantized, bad files refused."""

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from sbd_jax.checkpoints import hf
from sbd_jax.checkpoints.gguf import load_gguf
from sbd_jax.checkpoints.load import read_model_config
from sbd_jax.errors import UserError
from tests.gguf_files import write_llama_gguf
from tests.hf_models import tiny_hf_model, torch_logits
from tests.test_hf_parity import TOKENS, jax_logits


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_f32_gguf_matches_transformers(tmp_path, num_kv_heads, tied):
    model = tiny_hf_model("llama", num_kv_heads=num_kv_heads, tied=tied)
    write_llama_gguf(tmp_path / "m.gguf", model)
    cfg, params = load_gguf(str(tmp_path / "m.gguf"))
    assert cfg.tie_word_embeddings == tied and cfg.num_kv_heads == num_kv_heads
    np.testing.assert_allclose(jax_logits(cfg, params), torch_logits(model, TOKENS), atol=1e-4, rtol=0)


def test_config_alone_reads_no_tensor_and_equals_the_full_loads(tmp_path, monkeypatch, tiny_hf_dir):
    write_llama_gguf(tmp_path / "m.gguf", tiny_hf_model("llama", num_kv_heads=2))
    full, _ = load_gguf(str(tmp_path / "m.gguf"), dtype="bfloat16")
    hf_dir, _ = tiny_hf_dir("qwen3")
    hf_full = hf.read_config(hf_dir)
    import gguf
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("a tensor was read"))
    monkeypatch.setattr(hf, "load_params", lambda *a: pytest.fail("weights were read"))
    assert read_model_config(str(tmp_path / "m.gguf"), dtype="bfloat16") == full
    assert read_model_config(hf_dir) == hf_full


def test_q8_0_gguf_dequantizes_exactly(tmp_path):
    model = tiny_hf_model("llama", num_kv_heads=2)
    expected = write_llama_gguf(tmp_path / "m.gguf", model, matrix_type=GGMLQuantizationType.Q8_0)
    cfg, params = load_gguf(str(tmp_path / "m.gguf"))
    saved = tmp_path / "hf"
    hf.save_hf(str(saved), cfg, params)
    loaded = hf.load_params(str(saved), cfg)  # our params, under HF names, via the exporter
    from safetensors.numpy import load_file
    tensors = load_file(str(saved / "model.safetensors"))
    for name, want in expected.items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)


def test_unsupported_architecture(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", tiny_hf_model("llama"), arch="gpt2")
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported; supported: llama"):
        load_gguf(str(tmp_path / "m.gguf"))


def test_unsupported_tensor_type(tmp_path):
    model = tiny_hf_model("llama")
    f64 = model.state_dict()["model.norm.weight"].double().numpy()
    write_llama_gguf(tmp_path / "m.gguf", model, overrides={"output_norm.weight": f64})
    with pytest.raises(UserError, match="output_norm.weight has GGUF type F64.*cannot dequantize"):
        load_gguf(str(tmp_path / "m.gguf"))


def test_unexpected_and_missing_tensors(tmp_path):
    model = tiny_hf_model("llama")
    write_llama_gguf(tmp_path / "extra.gguf", model, overrides={"blk.0.attn_sinks.weight": np.ones(4, np.float32)})
    with pytest.raises(UserError, match="unexpected tensor 'blk.0.attn_sinks.weight'"):
        load_gguf(str(tmp_path / "extra.gguf"))
    bad_shape = np.zeros((3, 64), np.float32)
    write_llama_gguf(tmp_path / "shape.gguf", model, overrides={"blk.1.ffn_up.weight": bad_shape})
    with pytest.raises(UserError, match="'model.layers.1.mlp.up_proj.weight' has shape \\(3, 64\\)"):
        load_gguf(str(tmp_path / "shape.gguf"))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"this is not gguf at all" * 10)
    with pytest.raises(UserError, match="not a readable GGUF file"):
        load_gguf(str(path))

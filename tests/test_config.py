import pytest

from sbd_jax.checkpoints.hf_config import config_from_hf, config_to_hf
from sbd_jax.errors import UserError
from tests.hf_models import tiny_hf_config


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_hf_config_round_trip(model_type):
    cfg = config_from_hf(tiny_hf_config(model_type, num_kv_heads=1, tied=True,
                                             llama3_rope=model_type == "llama").to_dict())
    assert config_from_hf(config_to_hf(cfg)) == cfg
    assert cfg.num_kv_heads == 1 and cfg.tie_word_embeddings
    assert cfg.qkv_bias == (model_type == "qwen2") and cfg.qk_norm == (model_type == "qwen3")
    assert (cfg.rope_scaling is not None) == (model_type == "llama")


def test_transformers4_style_rope_keys():
    hf = tiny_hf_config("llama").to_dict()
    hf.pop("rope_parameters", None)
    hf["rope_theta"] = 500000.0
    hf["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 8.0


def test_unsupported_model_type_lists_supported():
    hf = tiny_hf_config("llama").to_dict()
    hf["model_type"] = "gpt2"
    with pytest.raises(UserError, match="unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        config_from_hf(hf)


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "not a multiple of num_kv_heads"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn'"),
])
def test_bad_config_values(change, message):
    hf = {**tiny_hf_config("llama").to_dict(), **change}
    with pytest.raises(UserError, match=message):
        config_from_hf(hf)


def test_bad_run_options():
    hf = tiny_hf_config("llama").to_dict()
    with pytest.raises(UserError, match="dtype='int8'"):
        config_from_hf(hf, dtype="int8")

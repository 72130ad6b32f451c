"""Our Flax models against transformers' PyTorch models, fp32: logits within 1e-4, export round trip 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from sbd_jax.checkpoints import hf
from sbd_jax.model.transformer import Transformer
from tests.conftest import slow_case
from tests.hf_models import torch_logits

TOKENS = np.random.RandomState(0).randint(0, 97, (2, 48))  # 48 > 32 original positions: llama3 scaling acts


def jax_logits(cfg, params, tokens=TOKENS, remat="none"):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    logits, _ = jax.jit(Transformer(cfg, remat=remat).apply)({"params": params}, jnp.asarray(tokens),
                                                            jnp.asarray(positions))
    return np.asarray(logits)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_and_export_round_trips(tiny_hf_dir, tmp_path, model_type, num_kv_heads, tied):
    path, torch_model = tiny_hf_dir(model_type, num_kv_heads=num_kv_heads, tied=tied,
                                    llama3_rope=model_type == "llama")
    cfg = hf.read_config(path)
    params = hf.load_params(path, cfg)
    reference = torch_logits(torch_model, TOKENS)
    np.testing.assert_allclose(jax_logits(cfg, params), reference, atol=1e-4, rtol=0)

    hf.save_hf(str(tmp_path / "export"), cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert type(reloaded) is type(torch_model)
    np.testing.assert_allclose(torch_logits(reloaded.eval(), TOKENS), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan_layers, remat", [slow_case(True, "none"), (False, "full"), slow_case(True, "dots")])
def test_scan_and_remat_do_not_change_logits_or_gradients(tiny_hf_dir, scan_layers, remat):
    path, torch_model = tiny_hf_dir("qwen3")
    plain_cfg = hf.read_config(path)
    cfg = hf.read_config(path, scan_layers=scan_layers)
    plain, params = hf.load_params(path, plain_cfg), hf.load_params(path, cfg)
    if cfg.scan_layers:
        assert params["layers"]["mlp"]["up_proj"]["kernel"].shape[0] == cfg.num_layers
    np.testing.assert_allclose(jax_logits(cfg, params, remat=remat), torch_logits(torch_model, TOKENS), atol=1e-4,
                               rtol=0)

    def loss(p, model):
        logits, _ = model.apply({"params": p}, TOKENS, np.broadcast_to(np.arange(48), TOKENS.shape))
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, TOKENS[..., None], -1)[..., 0])

    g_plain = jax.grad(loss)(plain, Transformer(plain_cfg))
    g = jax.grad(loss)(params, Transformer(cfg, remat=remat))
    if cfg.scan_layers:
        g = {**{k: v for k, v in g.items() if k != "layers"},  # the scanned stack, back to one tree a layer
             **{f"layers_{i}": jax.tree.map(lambda x, i=i: x[i], g["layers"]) for i in range(cfg.num_layers)}}
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_bf16_compute_runs_in_bf16_and_stays_close(tiny_hf_dir):
    path, torch_model = tiny_hf_dir("llama")
    cfg = hf.read_config(path, dtype="bfloat16")
    params = hf.load_params(path, cfg)
    positions = np.broadcast_to(np.arange(48), TOKENS.shape)
    hidden, kv = Transformer(cfg).apply({"params": params}, TOKENS, positions, compute_logits=False)
    assert hidden.dtype == jnp.bfloat16 and kv.k.dtype == jnp.bfloat16
    reference = torch_logits(torch_model, TOKENS)
    # bf16 has an 8-bit mantissa: a few 1e-2 of error on O(1) logits is its expected rounding.
    logits = jax_logits(cfg, params)
    err = np.abs(logits - reference).max()
    assert err < 0.1 * np.abs(reference).max()
    # Logits are accumulated and returned in float32, never rounded to bf16 (which ties near-equal
    # tokens exactly): most values are not bf16 numbers.
    assert logits.dtype == np.float32
    assert (np.asarray(logits) != np.asarray(logits).astype(jnp.bfloat16).astype(np.float32)).mean() > 0.9


def test_bf16_weights_export_and_reload(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("qwen2")
    cfg = hf.read_config(path, param_dtype="bfloat16")
    params = hf.load_params(path, cfg)
    assert params["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    hf.save_hf(str(tmp_path / "bf16"), cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    again = hf.load_params(str(tmp_path / "bf16"), cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_sharded_export_loads_in_both(tiny_hf_dir, tmp_path):
    path, torch_model = tiny_hf_dir("llama")
    cfg = hf.read_config(path)
    params = hf.load_params(path, cfg)
    out = tmp_path / "sharded"
    hf.save_hf(str(out), cfg, params, max_shard_bytes=100_000)
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    np.testing.assert_allclose(jax_logits(cfg, hf.load_params(str(out), cfg)), jax_logits(cfg, params), atol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(torch_logits(reloaded, TOKENS), torch_logits(torch_model, TOKENS), atol=1e-5, rtol=0)

"""The gated adapter: every non-block position is the base model's bit for bit, its loss is SBD's MATP on a
frozen base, it learns to draft, and its files round-trip with one-line errors for the wrong base."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sbd_jax.api import SBDModel, load
from sbd_jax.checkpoints import adapter as ad
from sbd_jax.data.packing import Batch
from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.settings import Settings
from sbd_jax.errors import UserError
from sbd_jax.model.adapter import MASK_EMBEDDING, init_adapter, merge
from sbd_jax.model.config import AdapterConfig, ModelConfig
from sbd_jax.model.transformer import Transformer, init_params
from sbd_jax.training.objective import adapter_sbd_loss, sbd_loss

MASK = 63
BASE = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256, mask_token_id=MASK)
CFG = BASE.replace(adapter=AdapterConfig(rank=4, alpha=8.0))
PROMPTS = [[5, 17, 3], [9, 2, 44, 31, 7, 7, 30, 12, 1], [60], [8, 8, 8, 8, 8]]


def base_params():
    p = init_params(BASE, seed=3)
    p["embed_tokens"]["embedding"] = p["embed_tokens"]["embedding"] * 30  # sharp: greedy has margins
    return p


def random_adapter(base, scale=0.3):
    """An adapter with every value non-zero (B too), so it changes what it touches."""
    fresh = init_adapter(Transformer(CFG), base, seed=1)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: (scale * rng.standard_normal(x.shape)).astype(np.float32), fresh)


def test_positions_before_the_gate_and_ntp_decoding_are_the_base_models_bit_for_bit():
    base = base_params()
    params = merge(base, random_adapter(base))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, MASK, (3, 12))).at[:, 8:].set(MASK)
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
    plain, plain_kv = Transformer(BASE).apply({"params": base}, tokens, positions)
    gated, gated_kv = Transformer(CFG, gate_from=8).apply({"params": params}, tokens, positions)
    np.testing.assert_array_equal(np.asarray(plain[:, :8]), np.asarray(gated[:, :8]))
    np.testing.assert_array_equal(np.asarray(plain_kv.k[:, :, :8]), np.asarray(gated_kv.k[:, :, :8]))
    assert float(jnp.abs(plain[:, 8:] - gated[:, 8:]).max()) > 1e-2  # the block does change
    for temperature in (0.0, 1.0):
        decoder = NTPDecoder(CFG, max_new_tokens=12, temperature=temperature)
        ours, _ = generate(decoder, params, PROMPTS, seed=5)
        theirs, _ = generate(NTPDecoder(BASE, max_new_tokens=12, temperature=temperature), base, PROMPTS, seed=5)
        assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]


def test_verified_decoding_with_any_adapter_reproduces_the_base_models_ntp():
    base = base_params()
    params = merge(base, random_adapter(base))
    reference, _ = generate(NTPDecoder(BASE, max_new_tokens=16), base, PROMPTS)
    for drafts in ("sbd", "hybrid"):
        settings = Settings(mode="sbd", verify=True, drafts=drafts, block_size=4, max_new_tokens=16)
        results, _ = generate(settings.decoder(CFG), params, PROMPTS)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]


def batch_of(rows):
    tokens = jnp.asarray(rows, jnp.int32)
    return Batch(tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
                 jnp.ones(tokens.shape, bool))


@pytest.mark.slow  # two objective compiles
def test_an_identity_adapter_has_exactly_sbds_matp_loss():
    """B = 0 and the mask embedding copied from the base: the two-forward loss is the one-forward MATP term."""
    base = base_params()
    identity = init_adapter(Transformer(CFG), base, seed=1)
    batch = batch_of(np.random.default_rng(2).integers(0, MASK, (4, 24)))
    rng = jax.random.key(7)
    _, full = sbd_loss(base, Transformer(BASE), batch, rng, block_size=4, mask_id=MASK)
    loss, metrics = adapter_sbd_loss(identity, base, Transformer(CFG), batch, rng, block_size=4, mask_id=MASK)
    np.testing.assert_allclose(float(metrics["matp_loss"]), float(full["matp_loss"]), rtol=1e-5)
    assert int(metrics["matp_tokens"]) == int(full["matp_tokens"]) > 0
    grads = jax.grad(lambda a: adapter_sbd_loss(a, base, Transformer(CFG), batch, rng, block_size=4,
                                                mask_id=MASK)[0])(identity)
    b_norm = sum(float(jnp.abs(g).sum()) for p, g in jax.tree_util.tree_leaves_with_path(grads)
                 if p[-1].key == "b")
    assert b_norm > 0 and float(jnp.abs(grads[MASK_EMBEDDING]).sum()) > 0


def self_distilled_rows(base, count, length, seed):
    """Rows of a random prompt and the base model's own greedy continuation: what verification accepts."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, MASK, 4)) for _ in range(count)]
    outputs, _ = generate(NTPDecoder(BASE, max_new_tokens=length - 4), base, prompts)
    return prompts, [p + r.token_ids for p, r in zip(prompts, outputs)]


@pytest.mark.slow  # trains an adapter
def test_an_adapter_trained_on_the_base_models_outputs_drafts_them_and_ntp_stays_the_base():
    base = base_params()
    _, rows = self_distilled_rows(base, 64, 32, seed=0)
    batch = batch_of(rows)
    tx = optax.adam(1e-2)
    adapter = init_adapter(Transformer(CFG), base, seed=0)
    opt_state = tx.init(adapter)

    @jax.jit
    def step(adapter, opt_state, key):
        grads = jax.grad(lambda a: adapter_sbd_loss(a, base, Transformer(CFG), batch, key, block_size=4,
                                                    mask_id=MASK, eta_range=(1.0, 1.0))[0])(adapter)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(adapter, updates), opt_state

    prompts, _ = self_distilled_rows(base, 16, 32, seed=1)  # held-out prompts
    settings = Settings(mode="sbd", verify=True, block_size=4, max_new_tokens=28)
    reference, _ = generate(NTPDecoder(BASE, max_new_tokens=28), base, prompts)

    def tokens_per_forward(adapter):
        results, _ = generate(settings.decoder(CFG), merge(base, adapter), prompts)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        return sum(len(r.token_ids) for r in results) / sum(r.nfe for r in results)

    before = tokens_per_forward(adapter)
    for i in range(150):
        adapter, opt_state = step(adapter, opt_state, jax.random.key(i))
    after = tokens_per_forward(adapter)
    assert after > 1.5 and after > before + 0.3, (before, after)


def saved(tmp_path, base, adapter, config=CFG, name="tiny"):
    path = str(tmp_path / "adapter")
    ad.save_adapter(path, config, adapter, {"name": name, "fingerprint": ad.fingerprint(base), "mask_token": MASK})
    return path


class NoTokenizer:
    pass


def test_save_and_attach_round_trip_and_refuse_the_wrong_base(tmp_path):
    base = base_params()
    adapter = random_adapter(base)
    path = saved(tmp_path, base, adapter)
    config, params, _ = ad.attach_adapter(path, BASE.replace(mask_token_id=None), base, NoTokenizer())
    assert config.adapter == CFG.adapter and config.mask_token_id == MASK
    for (p, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(merge(base, adapter)),
                              jax.tree_util.tree_leaves_with_path(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    scanned, stacked, _ = ad.attach_adapter(path, BASE.replace(scan_layers=True), base, NoTokenizer())
    assert stacked["layers"]["self_attn"]["q_proj_lora"]["a"].shape == (2, 32, 4)

    other = dict(base, norm={"weight": base["norm"]["weight"] + 1})
    with pytest.raises(UserError, match="was trained on other weights .* load the base it names \\(tiny\\)"):
        ad.attach_adapter(path, BASE, other, NoTokenizer())
    with pytest.raises(UserError, match="trained on a base with num_layers=2, this model has 3"):
        ad.attach_adapter(path, BASE.replace(num_layers=3), base, NoTokenizer())
    meta = json.load(open(os.path.join(path, ad.CONFIG)))
    json.dump(dict(meta, rank=8), open(os.path.join(path, ad.CONFIG), "w"))
    with pytest.raises(UserError, match=r"down_proj_lora/a has shape \(64, 4\), its adapter.json \(rank 8\) needs \(64, 8\)"):
        ad.attach_adapter(path, BASE, base, NoTokenizer())
    os.remove(os.path.join(path, ad.WEIGHTS))
    with pytest.raises(UserError, match="is not an adapter directory: it needs adapter.json and adapter.safetensors"):
        ad.attach_adapter(path, BASE, base, NoTokenizer())


@pytest.mark.parametrize("drop", ["mask_token_id", "base.fingerprint"])
def test_adapter_json_without_a_key_is_named(tmp_path, drop):
    """Issue 57, item 12: a key missing from adapter.json is a one-line error naming the file and key."""
    base = base_params()
    path = saved(tmp_path, base, random_adapter(base))
    meta = json.load(open(os.path.join(path, ad.CONFIG)))
    del (meta["base"] if drop.startswith("base.") else meta)[drop.removeprefix("base.")]
    json.dump(meta, open(os.path.join(path, ad.CONFIG), "w"))
    with pytest.raises(UserError, match=f"{os.path.join(path, ad.CONFIG)} has no '{drop}'"):
        ad.attach_adapter(path, BASE, base, NoTokenizer())


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "adapter rank=0 must be a whole number >= 1"),
    (dict(alpha=float("nan")), "adapter alpha=nan must be a finite number > 0"),
    (dict(targets=("q_proj", "wq")), "adapter targets .* name each of q_proj"),
])
def test_bad_adapter_settings(kwargs, message):
    with pytest.raises(UserError, match=message):
        AdapterConfig(**kwargs)


def test_load_with_an_adapter_from_the_api(tmp_path):
    """`sbd_jax.load(base, adapter=DIR)`: the shipped small-scale model as a base (char tokenizer, its own mask
    token); NTP is the base's, and a mask id beside an adapter is refused."""
    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "small_scale", "models", "sbd_arith")
    plain = load(root)
    config = plain.config.replace(adapter=AdapterConfig(rank=2))
    base_fp = ad.fingerprint(plain.params)
    path = str(tmp_path / "a")
    ad.save_adapter(path, config, random_adapter_for(config, plain.params),
                    {"name": root, "fingerprint": base_fp, "mask_token": str(plain.config.mask_token_id)})
    tuned = load(root, adapter=path)
    assert isinstance(tuned, SBDModel) and tuned.config.adapter.rank == 2
    (a,) = plain.generate("c5b7a2+b8a6", chat=True, max_new_tokens=24)
    (b,) = tuned.generate("c5b7a2+b8a6", chat=True, max_new_tokens=24)
    (c,) = tuned.generate("c5b7a2+b8a6", chat=True, max_new_tokens=24, mode="sbd", verify=True, block_size=4)
    assert a.token_ids == b.token_ids == c.token_ids
    with pytest.raises(UserError, match="give mask_token_id or adapter, not both"):
        load(root, adapter=path, mask_token_id=3)


def random_adapter_for(config, base):
    fresh = init_adapter(Transformer(config), base, seed=1)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32), fresh)


def test_train_py_trains_only_the_adapter_saves_it_and_resumes(tmp_path):
    """An adapter run on the shipped small-scale model: the checkpoint holds the adapter and its optimizer
    state alone, the base weights never change, workdir/adapter loads onto the base, a rerun resumes."""
    from experiments.small_scale.task import study_splits
    from sbd_jax.training.config import default_config_dict
    from sbd_jax.training.trainer import Trainer

    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "small_scale", "models", "sbd_arith")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.question, "completion": p.answer}) + "\n"
                            for p in study_splits().train[:200]))
    cfg = default_config_dict()
    cfg.model.name, cfg.data.files, cfg.data.seq_len, cfg.data.workers = root, (str(data),), 64, 0
    cfg.train.steps, cfg.train.batch_size, cfg.checkpoint.every, cfg.mesh = 3, 8, 2, (-1, 1, 1)
    cfg.adapter.rank, cfg.adapter.targets = 2, ("q_proj", "v_proj", "down_proj")
    trainer = Trainer(cfg, str(tmp_path / "w"))
    frozen_before = jax.tree.map(np.asarray, trainer.frozen)
    rows = trainer.run(until=2)
    assert all(r["ntp_tokens"] == 0 and r["matp_tokens"] > 0 and np.isfinite(r["loss"]) for r in rows)
    assert set(trainer.state.params) == {MASK_EMBEDDING} | {f"layers_{i}" for i in range(4)}  # the adapter alone
    assert set(trainer.state.params["layers_0"]["self_attn"]) == {"q_proj_lora", "v_proj_lora"}
    jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.asarray, trainer.frozen))
    rows = Trainer(cfg, str(tmp_path / "w")).run()  # resumes at step 2
    assert [r["step"] for r in rows] == [3]
    tuned = load(root, adapter=str(tmp_path / "w" / "adapter"))
    assert tuned.config.adapter.targets == ("q_proj", "v_proj", "down_proj")
    (a,) = load(root).generate("c5b7a2+b8a6", chat=True, max_new_tokens=24)
    (b,) = tuned.generate("c5b7a2+b8a6", chat=True, max_new_tokens=24, mode="sbd", verify=True, block_size=4)
    assert a.token_ids == b.token_ids


def test_the_fingerprint_is_the_same_scanned_or_per_layer_in_float32_or_bfloat16():
    from sbd_jax.checkpoints.hf import stack_layers

    base = jax.tree.map(np.asarray, base_params())
    assert ad.fingerprint(stack_layers(base, BASE.num_layers)) == ad.fingerprint(base)
    assert ad.fingerprint(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)) == ad.fingerprint(base)
    assert ad.fingerprint(dict(base, norm={"weight": base["norm"]["weight"] * 1.5})) != ad.fingerprint(base)


@pytest.mark.slow  # the recipe's evaluation
def test_the_recipes_evaluation_loads_an_adapter_onto_its_base_scanned(tmp_path):
    from recipes.smollm2_sbd.inputs import load as load_for_eval

    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "small_scale", "models", "sbd_arith")
    plain = load(root)
    config = plain.config.replace(adapter=AdapterConfig(rank=2))
    path = str(tmp_path / "a")
    ad.save_adapter(path, config, random_adapter_for(config, plain.params),
                    {"name": root, "fingerprint": ad.fingerprint(plain.params), "mask_token": "new"})
    tuned = load_for_eval("tuned", path, True, "float32", base=root)
    assert tuned.config.adapter.rank == 2 and tuned.config.scan_layers
    assert tuned.params["layers"]["mlp"]["down_proj_lora"]["b"].shape == (config.num_layers, 2, config.hidden_size)
    with pytest.raises(UserError, match="was trained on a base with .*; load the base it names"):
        load_for_eval("tuned", path, True, "float32", base="smollm2-135m")

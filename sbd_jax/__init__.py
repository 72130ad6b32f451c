"""sbd_jax: Set Block Decoding for Llama/Qwen models in JAX/Flax.

    model = sbd_jax.load("smollm2-135m")
    outs = model.generate(["What is 2+2?"], chat=True, mode="sbd", block_size=8, verify=True, max_new_tokens=64)
"""

from sbd_jax.api import SBDModel, Settings, load
from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.model import Transformer, init_params

__all__ = ["ModelConfig", "SBDModel", "Settings", "Transformer", "UserError", "init_params", "load"]

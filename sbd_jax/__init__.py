"""sbd_jax: Set Block Decoding for Llama/Qwen models in JAX/Flax."""

from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.model import Transformer, init_params

__all__ = ["ModelConfig", "Transformer", "UserError", "init_params"]

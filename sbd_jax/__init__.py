"""sbd_jax: Set Block Decoding for Llama/Qwen models in JAX/Flax.

    model = sbd_jax.load("smollm2-135m")
    outs = model.generate(["What is 2+2?"], chat=True, mode="sbd", block_size=8, verify=True, max_new_tokens=64)
"""

import os

# transformers (tokenizers only, here) advises on import that PyTorch is missing: noise for every user of a
# JAX library that never needs it. Its own switch for advisory warnings; a user's setting wins.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from sbd_jax.api import SBDModel, Settings, load  # noqa: E402
from sbd_jax.errors import UserError  # noqa: E402
from sbd_jax.model.config import ModelConfig  # noqa: E402
from sbd_jax.model.transformer import Transformer, init_params  # noqa: E402

__all__ = ["ModelConfig", "SBDModel", "Settings", "Transformer", "UserError", "init_params", "load"]

"""The embedded SmolLM2-135M: our greedy decode equals transformers' generate on the same GGUF weights."""

import os

import jax
import pytest
import torch

from sbd_jax.checkpoints.load import load_model
from sbd_jax.checkpoints.tokenizer import encode_prompt
from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.generate import generate
from tests.conftest import requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.real_model]

CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a CPU executes an instruction, step by step.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_greedy_tokens_equal_transformers_generate(smollm2):
    from transformers import AutoModelForCausalLM

    prompts = [encode_prompt(smollm2.tokenizer, p, chat=True) for p in CHAT_PROMPTS]
    decoder = NTPDecoder(smollm2.config, max_new_tokens=64, eos_ids=smollm2.config.eos_token_ids)
    ours, _ = generate(decoder, jax.device_put(smollm2.params), prompts)  # one batch, mixed lengths

    # transformers dequantizes and un-permutes the GGUF itself: an independent path to the weights.
    folder, name = os.path.split(smollm2.source)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    full_length = 0
    for prompt, result in zip(prompts, ours):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                     eos_token_id=smollm2.config.eos_token_ids[0], pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert result.token_ids == expected
        assert result.nfe == len(expected)
        full_length += len(expected) == 64
    assert full_length >= 3  # most answers run the full 64 tokens, so the comparison is long

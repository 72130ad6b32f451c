"""The GGUF tokenizer built without torch equals transformers' own GGUF loading, text and chat."""

import os

import pytest

from sbd_jax.checkpoints.load import resolve
from sbd_jax.checkpoints.tokenizer import encode_prompt, load_tokenizer
from tests.conftest import requires_smollm2

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "def f(x):\n    return x ** 2  # café ☕ 日本語",
         "<|im_start|>user\nhi<|im_end|>", "1234567890 3.14159 -42", ""]


@requires_smollm2
def test_gguf_tokenizer_equals_transformers_from_pretrained():
    from transformers import AutoTokenizer

    path = resolve("smollm2-135m")
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids)
    for text in TEXTS[:3]:
        assert encode_prompt(ours, text, chat=True) == encode_prompt(theirs, text, chat=True)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id, len(theirs))
    assert ours.chat_template == theirs.chat_template


def test_gguf_without_vocabulary(tmp_path):
    from sbd_jax.errors import UserError
    from tests.gguf_files import write_llama_gguf
    from tests.hf_models import tiny_hf_model

    write_llama_gguf(tmp_path / "m.gguf", tiny_hf_model("llama"))
    with pytest.raises(UserError, match="holds no tokenizer vocabulary"):
        load_tokenizer(str(tmp_path / "m.gguf"))

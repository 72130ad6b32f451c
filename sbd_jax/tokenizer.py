"""Tokenizers (always Hugging Face fast tokenizers, read from local files only) and prompt encoding."""

from __future__ import annotations

import os
from typing import Any

from sbd_jax.errors import UserError

# Files any HF tokenizer is built from; without one, transformers would build an empty tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of an HF directory or a GGUF file (vocab, merges and chat template from its metadata)."""
    from transformers import AutoTokenizer

    if not path.endswith(".gguf") and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise UserError(f"{path} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); copy the tokenizer files "
                        "of the original model into it")
    try:
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path), local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt: raw text, or one user turn through the model's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat needs a chat template, and this model's tokenizer has none; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise UserError("the prompt is empty after tokenization; give at least one token of text")
    return list(ids)

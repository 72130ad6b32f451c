"""Tokenizers (always Hugging Face fast tokenizers, read from local files only) and prompt encoding."""

from __future__ import annotations

import os
from typing import Any

from sbd_jax.errors import PromptError, UserError

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
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None


def _gguf_tokenizer(path: str) -> Any:
    """A fast tokenizer from a GGUF's metadata (vocab, merges, special tokens, chat template).

    transformers' own `from_pretrained(gguf_file=...)` reads GGUF metadata with a reader that needs
    PyTorch; the metadata is read here with `gguf` instead and handed to the same converter, so
    sampling needs no torch. tests/test_tokenizer.py checks the result against `from_pretrained`.
    """
    import gguf
    from transformers import PreTrainedTokenizerFast

    try:  # transformers >= 5.18
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.56 - 5.17 (the oldest pyproject.toml admits; tests/test_dependency_floor.py)
        from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

    fields = gguf.GGUFReader(path).fields

    def value(key: str) -> Any:
        return fields[key].contents() if key in fields else None

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: value(f"tokenizer.{key}") for key, name in renames.items()
                      if f"tokenizer.{key}" in fields}
    tokens = tokenizer_dict.get("tokens")
    if not tokens:
        raise UserError(f"{path} holds no tokenizer vocabulary (tokenizer.ggml.tokens)")
    backend, _ = convert_gguf_tokenizer(value("general.architecture"), tokenizer_dict)
    special = {name: tokens[tokenizer_dict[key]] for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unk_token_id"),
                ("pad_token", "pad_token_id")) if tokenizer_dict.get(key) is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=value("tokenizer.chat_template"),
                                   **special)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt: raw text, or one user turn through the model's chat template."""
    check_prompt_text(prompt)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat needs a chat template, and this model's tokenizer has none; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise PromptError("the prompt is empty after tokenization; give at least one token of text")
    return list(ids)


def check_prompt_text(prompt: object) -> None:
    """A prompt is a str of valid Unicode (a tokenizer would fail on anything else with a traceback)."""
    if not isinstance(prompt, str):
        hint = " (decode bytes first: b.decode('utf-8'))" if isinstance(prompt, (bytes, bytearray)) else ""
        raise PromptError(f"a prompt must be a str, got {type(prompt).__name__}{hint}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: Python's stand-ins for non-UTF-8 bytes in argv
        code = ord(prompt[e.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise PromptError(f"the prompt is not valid UTF-8 text (character {e.start + 1} is {what}); "
                          "give the prompt as UTF-8") from None

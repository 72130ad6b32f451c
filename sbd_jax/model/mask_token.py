"""Choosing SBD's mask token: an existing unused token, or a new embedding row (vocabulary grows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig

NEW_TOKEN_TEXT = "<|sbd_mask|>"


def setup_mask_token(config: ModelConfig, params: dict, tokenizer: Any,
                     spec: int | str | None) -> tuple[ModelConfig, dict, Any]:
    """Returns config (with `mask_token_id`), params and tokenizer ready for SBD.

    spec: None keeps a mask token the model already has (else as 'new'); an int (or a string of
    digits) is an existing id; another string names an existing token of the tokenizer; 'new' adds `<|sbd_mask|>`, using a spare
    embedding row if the vocabulary has one, else growing embedding (and lm_head) by a row initialised
    to the mean of the others.
    """
    if spec is None and config.mask_token_id is not None:
        return config, params, tokenizer
    if isinstance(spec, str) and spec.isdigit():
        spec = int(spec)
    if isinstance(spec, int):
        if not 0 <= spec < config.vocab_size:
            raise UserError(f"mask token id {spec} is outside the vocabulary [0, {config.vocab_size})")
        return config.replace(mask_token_id=spec), params, tokenizer
    if spec not in (None, "new"):
        mask_id = tokenizer.convert_tokens_to_ids(spec)
        if mask_id is None or mask_id == tokenizer.unk_token_id:
            raise UserError(f"mask token {spec!r} is not in the tokenizer's vocabulary; name an existing "
                            "token, give its id, or use 'new'")
        return config.replace(mask_token_id=int(mask_id)), params, tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": [NEW_TOKEN_TEXT]})
    mask_id = int(tokenizer.convert_tokens_to_ids(NEW_TOKEN_TEXT))
    if mask_id < config.vocab_size:  # the embedding already has spare rows (padded vocabularies)
        return config.replace(mask_token_id=mask_id), params, tokenizer
    if mask_id != config.vocab_size:
        raise UserError(f"the tokenizer has {mask_id} tokens but the model only {config.vocab_size}; "
                        "they do not belong together")
    params = dict(params)
    embedding = np.asarray(params["embed_tokens"]["embedding"])
    params["embed_tokens"] = {"embedding": np.concatenate([embedding, embedding.mean(0, keepdims=True)])}
    if not config.tie_word_embeddings:
        head = np.asarray(params["lm_head"]["kernel"])
        params["lm_head"] = {"kernel": np.concatenate([head, head.mean(1, keepdims=True)], axis=1)}
    return config.replace(vocab_size=config.vocab_size + 1, mask_token_id=mask_id), params, tokenizer

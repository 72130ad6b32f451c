"""The Python API: load a model once, then generate text with any decoder.

    import sbd_jax

    model = sbd_jax.load("smollm2-135m")  # a known name, a Hugging Face directory or a .gguf file
    (out,) = model.generate(["What is 2+2?"], chat=True, max_new_tokens=64)  # NTP
    outs = model.generate(prompts, mode="sbd", block_size=8, verify=True, max_new_tokens=64)
    outs = model.generate(prompts, mode="sbd", block_size=8, verify=True, drafts="lookup")  # any model
    outs[0].text, outs[0].token_ids, outs[0].nfe
    choice = model.choose_block_size(prompts, batch=8)  # verified SBD's fastest k here (1: NTP)
    choice = model.choose_block_size(prompts, batch=1, drafts="lookup", max_new_tokens=256)  # as generate's

`sample.py` is a command line over this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import jax

from sbd_jax.decoding.block_choice import BLOCK_SIZES, BlockChoice, measure_block_choice
from sbd_jax.decoding.generate import BatchTiming, DraftMemory, Executables, Generation, generate
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.errors import PromptError, UserError
from sbd_jax.model.config import DType

__all__ = ["SBDModel", "Settings", "load"]


class SBDModel:
    """A loaded model (config, parameters on the default device, tokenizer) that generates text.

    Compiled decoders are kept (the `capacity` most recent shapes), so repeated calls with the same
    settings and prompt bucket do not compile again; `last_timing` holds the last call's compile,
    prefill and decode seconds. Settings with `draft_memory` carry their source's memory from call to call
    (`draft_memories`; `draft_memories.clear()` starts afresh)."""

    def __init__(self, config: Any, params: Any, tokenizer: Any, capacity: int = 16):
        self.config, self.tokenizer = config, tokenizer
        self.params = jax.device_put(params)
        self.executables = Executables(capacity)
        self.last_timing: BatchTiming | None = None
        # settings with draft_memory: one per (draft source, block size), carried from call to call; clear() resets
        self.draft_memories: dict[Any, DraftMemory] = {}

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt: raw text, or one user turn through the model's chat template."""
        from sbd_jax.checkpoints.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, prompt, chat)

    def encode_batch(self, prompts: str | Sequence[str], chat: bool = False) -> list[list[int]]:
        """Token ids of each prompt (one string: a batch of one); a bad prompt (not a str, not UTF-8, empty) is
        a PromptError naming its place. Bytes are one bad prompt, not a batch of ints."""
        batch = isinstance(prompts, Iterable) and not isinstance(prompts, (str, bytes, bytearray))
        texts: Iterable[Any] = prompts if batch else [prompts]
        ids = []
        for index, text in enumerate(texts):
            try:
                ids.append(self.encode(text, chat))
            except PromptError as e:
                raise e.shifted(index) from None
        return ids

    def generate(self, prompts: str | Sequence[str], settings: Settings | None = None, *, chat: bool = False,
                 seed: int = 0, max_cache_len: int | None = None, **options: Any) -> list[Generation]:
        """Generates for a batch of prompts (one string: a batch of one), one `Generation` each (its
        `text`, `token_ids`, `nfe`, `tokens_per_pass`; verified: `drafted`, `accepted`, `corrected`).

        Give `settings`, or their fields as keywords (`mode="sbd", block_size=8, verify=True, ...`).
        `chat` wraps each prompt as a user turn; `max_cache_len` caps the KV cache (default: the
        model's context)."""
        settings = settings_of(settings, options)
        ids = self.encode_batch(prompts, chat)
        decoder = settings.decoder(self.config)
        memory = (self.draft_memories.setdefault((settings.drafts, settings.block_size), DraftMemory())
                  if settings.draft_memory else None)
        generations, self.last_timing = generate(decoder, self.params, ids, seed=seed, max_cache_len=max_cache_len,
                                                 gamma=settings.entropy_budget, executables=self.executables,
                                                 memory=memory)
        return [g._replace(text=self.tokenizer.decode(g.token_ids, skip_special_tokens=True)) for g in generations]

    def choose_block_size(self, prompts: str | Sequence[str], batch: int, settings: Settings | None = None, *,
                          chat: bool = False, block_sizes: Sequence[int] = BLOCK_SIZES, calibration_tokens: int = 64,
                          **options: Any) -> BlockChoice:
        """The block size at which verified SBD decodes fastest at `batch` rows on this machine (1: NTP), by
        the rule of `sbd_jax.decoding.block_choice`: tokens per forward measured on the first
        `calibration_tokens` of greedy verified decoding of `prompts` (a few like those to be served), bare
        forwards timed here. The decode to price is `settings` (verified SBD: its draft source, shortest
        lookup match, fallback blocks and max_new_tokens; its block size is what is chosen) or `Settings`
        keyword options (`max_new_tokens=`, `drafts=`, ...) with mode sbd and verify implied. Its
        `describe()` says what it measured."""
        settings = settings_of(settings, options, mode=Mode.SBD, verify=True)
        return measure_block_choice(self, self.encode_batch(prompts, chat), batch, block_sizes,
                                    settings.max_new_tokens, calibration_tokens, verified=settings)

    def with_measured_widths(self, prompts: str | Sequence[str], batch: int, settings: Settings, *,
                             chat: bool = False) -> Settings:
        """`settings` (tree drafts) with the cost of each pass width timed here at `batch` rows, in the cache a
        decode of `prompts` gets: each pass then runs the width with the most expected tokens per second
        (`sbd_jax.decoding.tree_width`; what `--draft-nodes auto` does)."""
        from sbd_jax.decoding.tree_width import measure_pass_costs

        costs = measure_pass_costs(self, self.encode_batch(prompts, chat)[:batch], batch, settings.max_new_tokens,
                                   settings.draft_nodes)
        return dataclasses.replace(settings, pass_costs=costs)


def settings_of(settings: Settings | None, options: dict[str, Any], **implied: Any) -> Settings:
    """`settings`, or `Settings` made of keyword `options` over `implied` defaults; never both."""
    if settings is None:
        known = {field.name for field in dataclasses.fields(Settings)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UserError(f"unknown decoding option{'s' * (len(unknown) > 1)} {', '.join(unknown)}: give "
                            f"{', '.join(sorted(known))}")
        return Settings(**{**implied, **options})
    if options:
        raise UserError(f"give settings or keyword options, not both (got {', '.join(options)})")
    return settings


def load(model: str = "smollm2-135m", *, dtype: str = DType.FLOAT32, mask_token_id: int | None = None,
         adapter: str | None = None) -> SBDModel:
    """Loads a model by known name (`smollm2-135m`), Hugging Face directory or .gguf file.

    `mask_token_id` sets the mask token of a model whose config does not (SBD needs one); every mode
    then never emits it, so NTP and verified SBD compare exactly. `adapter`: a gated adapter, by the name of one
    shipped in the package (`smollm2-135m-sbd` for `smollm2-135m`; `checkpoints.load.KNOWN_ADAPTERS`) or its
    directory (`train.py` with `adapter.rank > 0` writes `workdir/adapter`), checked against this base; NTP
    stays the base model's exactly, and SBD's blocks use the adapter."""
    from sbd_jax.checkpoints.load import load_model

    loaded = load_model(model, dtype=dtype)
    config, params, tokenizer = loaded.config, loaded.params, loaded.tokenizer
    if adapter is not None:
        if mask_token_id is not None:
            raise UserError("give mask_token_id or adapter, not both: the adapter names its own mask token")
        from sbd_jax.checkpoints.adapter import attach_adapter

        config, params, tokenizer = attach_adapter(adapter, config, params, tokenizer)
    if mask_token_id is not None:
        config = config.replace(mask_token_id=mask_token_id)
    return SBDModel(config, params, tokenizer)

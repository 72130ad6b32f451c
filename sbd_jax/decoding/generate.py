"""Host-side decoding: pad a batch of token-id prompts, compile once per shape, run a decoder, and
return per-row generations with their pass counts and timings (compile, prefill, decode apart)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.decoding.base import DEFAULT_GAMMA, Decoder, TracedSettings
from sbd_jax.errors import PromptError, UserError
from sbd_jax.model.config import ModelConfig

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this, so few shapes compile
SEED_LIMIT = 2**63  # jax.random.key takes a signed 64-bit seed; a larger one overflows


class Generation(NamedTuple):
    token_ids: list[int]  # generated ids, up to and including the first EOS
    nfe: int
    reveal_pass: list[int]  # per token, the row's pass (1-based) that produced (verified: accepted) it
    corrected: list[bool] = []  # verified SBD: per token, NTP's correction of a rejected draft
    drafted: int = 0  # verified SBD: drafted tokens submitted for verification
    accepted: int = 0  # verified SBD: of those, accepted
    lookup_drafted: int = 0  # verified: of the drafted tokens, those prompt lookup proposed
    lookup_accepted: int = 0  # verified: of those, accepted
    narrow_passes: int = 0  # verified lookup: of the nfe passes, those that ran the exact token alone
    text: str = ""  # the decoded token ids (special tokens skipped), where a tokenizer was at hand

    @property
    def tokens_per_pass(self) -> float:
        return len(self.token_ids) / max(self.nfe, 1)

    @property
    def accepted_fraction(self) -> float:
        """Verified SBD: accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def tokens_per_pass(generations: Sequence[Generation]) -> float:
    """Generated tokens per decoding forward pass over a set of generations (1.0 for NTP)."""
    return sum(len(g.token_ids) for g in generations) / max(sum(g.nfe for g in generations), 1)


class BatchTiming(NamedTuple):
    compile_seconds: float
    prefill_seconds: float
    decode_seconds: float  # the decoding loop of the whole batch

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @classmethod
    def total(cls, timings: Sequence[BatchTiming]) -> BatchTiming:
        """The sums over batches decoded one after another."""
        return cls(*(sum(column) for column in zip(*timings)))


def pad_prompts(prompts: Sequence[Sequence[int]], new_tokens: int, new_slots: int, max_cache_len: int | None,
                config: ModelConfig, slots_label: str = "max_new_tokens",
                pad_to: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-pads prompts to a bucket (at least `pad_to` long, so batches can share one compiled
    shape); returns (tokens [B, T], lengths [B], cache capacity).

    The cache gets `new_slots` slots past the prompt (SBD: whole blocks, `slots_label` says which). The
    model's context bounds only the `new_tokens` positions that can be emitted: block positions past them
    are decoded and dropped (verified mode never emits a draft past them), so a last block may reach past
    the context where NTP's last token reaches up to it; a cache of `max_cache_len` must also hold the
    slots, and never lifts the context's bound. A bad prompt is a PromptError naming its row."""
    if not prompts:
        raise UserError("give at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise PromptError("every prompt needs at least one token", [len(p) for p in prompts].index(0))
    if max(max(p) for p in prompts) >= config.vocab_size or min(min(p) for p in prompts) < 0:
        raise UserError(f"a prompt token id is outside the vocabulary [0, {config.vocab_size})")
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    bounds = [(config.max_position_embeddings, new_tokens, "max_new_tokens", "the model's context")]
    if max_cache_len is not None:
        bounds.append((max_cache_len, new_slots, slots_label, "the cache size"))
    for limit, new, label, what in bounds:
        if longest + new > limit:
            raise PromptError(f"prompt ({longest} tokens) + {label} ({new}) = {longest + new} exceeds {what} "
                              f"({limit}); shorten the prompt or lower --max-new-tokens", int(lengths.argmax()))
    limit, new = bounds[-1][:2]  # the cache's size: max_cache_len where given, else the context
    padded_len = min(-(-max(longest, pad_to) // PROMPT_BUCKET) * PROMPT_BUCKET, limit - new)
    tokens = np.zeros((len(prompts), padded_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths, padded_len + new_slots


def check_seed(seed: object) -> None:
    """A seed is a whole number in [0, 2**63) (bools are not seeds)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < SEED_LIMIT:
        raise UserError(f"seed={seed!r} must be a whole number in [0, 2**63 - 1] (= {SEED_LIMIT - 1})")


def batch_seed(seed: int, batch: int) -> int:
    """The seed of a dataset's `batch`-th batch: `seed + batch`, wrapped to stay a valid seed."""
    return (seed + batch) % SEED_LIMIT


@dataclasses.dataclass
class DraftMemory:
    """What a draft source keeps across `generate` calls (`VerifiedSBDDecoder.draft_memory`: the model's successor
    table, earlier answers), on the device: None until a call fills it. Hold one across calls to carry it (`generate_batched`
    holds one for a dataset's batches, `SBDModel` one per draft source and block size). `generate` compiles one
    decode for a first call and later ones (a direct `decode` call without a memory traces another)."""

    state: Any = None


@functools.lru_cache(maxsize=64)
def _memory_shape(decoder: Decoder) -> Any:
    """The shapes and dtypes of `decoder`'s fresh draft memory (None: it keeps none), traced once a decoder."""
    return jax.eval_shape(decoder.fresh_memory)  # nothing allocated


def remembered_by(decoder: Decoder, memory: DraftMemory | None) -> DraftMemory | None:
    """The memory `decoder`'s draft source starts from (`memory`, filled with a fresh one where empty), or None
    where it keeps none; UserError where `memory` was kept for another model or draft source."""
    shape = _memory_shape(decoder)
    if shape is None:
        return None
    kept = DraftMemory() if memory is None else memory
    if kept.state is None:
        kept.state = decoder.fresh_memory()
    elif jax.tree.map(lambda x: (x.shape, x.dtype), kept.state) != jax.tree.map(lambda x: (x.shape, x.dtype), shape):
        raise UserError("this DraftMemory was kept for another model or draft source: give each one its own "
                        "(a fresh DraftMemory())")
    return kept


class Executables:
    """Ahead-of-time compiled prefill and decode functions by (kind, decoder, prompt shape, capacity), the
    `capacity` most recently used kept: compile time is measured apart from run time, and a repeated
    shape is not compiled again. Hold one across calls that reuse shapes (a loop over batches)."""

    def __init__(self, capacity: int = 16):
        if capacity < 1:
            raise UserError(f"Executables capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._compiled: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def get(self, key: tuple, lower: Callable[[], Any]) -> Any:
        """The executable for `key`; on first use `lower()` (a lowered function, built only then) is compiled."""
        if key in self._compiled:
            self._compiled.move_to_end(key)
        else:
            self._compiled[key] = lower().compile()
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return self._compiled[key]

    def __len__(self) -> int:
        return len(self._compiled)


def generate(decoder: Decoder, params: Any, prompts: Sequence[Sequence[int]], seed: int = 0,
             max_cache_len: int | None = None, pad_to: int = 0, gamma: float = DEFAULT_GAMMA,
             executables: Executables | None = None, memory: DraftMemory | None = None
             ) -> tuple[list[Generation], BatchTiming]:
    """Decodes a batch of token-id prompts; compile, prefill and decode times are measured apart.

    Prompts are padded to a multiple of 64 tokens, at least `pad_to`: give the longest prompt of a
    dataset to decode it in batches that all reuse one compiled shape (and pass one `executables` to
    every call, or each call compiles afresh). `gamma` is SBD's entropy budget per pass (traced: a new
    value never recompiles); the other decoders ignore it. A decoder whose draft source keeps a memory starts
    from `memory`'s and leaves its own there (a fresh one where None is given)."""
    check_seed(seed)
    knobs = TracedSettings.create(gamma)
    executables = Executables(capacity=2) if executables is None else executables  # an empty one is falsy
    tokens, lengths, capacity = pad_prompts(prompts, decoder.max_new_tokens, decoder.output_len, max_cache_len,
                                            decoder.config, decoder.output_label, pad_to)
    prefill_args = (params, jnp.asarray(tokens), jnp.asarray(lengths))
    kept = remembered_by(decoder, memory)
    remembered = () if kept is None else (kept.state,)  # one compiled decode for a first call and later ones
    start = time.perf_counter()
    prefill_fn = type(decoder).prefill
    prefill = executables.get(("prefill", decoder, tokens.shape, capacity),
                              lambda: prefill_fn.lower(decoder, *prefill_args, capacity=capacity))

    def lower_decode() -> Any:  # traced only when it must compile: the cache's shapes come from prefill
        cache_shape, last_shape = jax.eval_shape(functools.partial(prefill_fn, decoder, capacity=capacity),
                                                 *prefill_args)
        return type(decoder).decode.lower(decoder, params, cache_shape, last_shape, jax.random.key(seed), knobs,
                                          *prefill_args[1:], *remembered)

    decode = executables.get(("decode", decoder, tokens.shape, capacity), lower_decode)
    compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    cache, last = jax.block_until_ready(prefill(*prefill_args))
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(decode(params, cache, last, jax.random.key(seed), knobs, *prefill_args[1:],
                                       *remembered))
    decode_seconds = time.perf_counter() - start
    if kept is not None:  # kept on the device for the next call
        kept.state, out = out.memory, out.replace(memory=None)
    out = jax.tree.map(np.asarray, out)
    results = []
    for b in range(len(prompts)):
        n = int(out.num_tokens[b])
        results.append(Generation(token_ids=out.tokens[b, :n].tolist(), nfe=int(out.nfe[b]),
                                  reveal_pass=out.reveal_pass[b, :n].tolist(), corrected=out.corrected[b, :n].tolist(),
                                  drafted=int(out.drafted[b]), accepted=int(out.accepted[b]),
                                  lookup_drafted=int(out.lookup_drafted[b]), lookup_accepted=int(out.lookup_accepted[b]),
                                  narrow_passes=int(out.narrow_passes[b])))
    return results, BatchTiming(compile_seconds, prefill_seconds, decode_seconds)


def generate_batched(decoder: Decoder, params: Any, prompts: Sequence[Sequence[int]], batch: int, seed: int = 0,
                     pad_to: int = 0, gamma: float = DEFAULT_GAMMA, executables: Executables | None = None,
                     memory: DraftMemory | None = None) -> tuple[list[Generation], BatchTiming]:
    """Decodes a dataset `batch` prompts at a time, every batch padded to the longest prompt (at least
    `pad_to`) so that all reuse one compiled shape; the timings are the batches' sums (batch i draws
    with seed + i). A draft source's memory (`generate`) runs on from batch to batch."""
    if batch < 1 or not prompts:
        raise UserError(f"give at least one prompt and batch >= 1 (got {len(prompts)} prompts, batch={batch})")
    check_seed(seed)
    executables = Executables(capacity=2) if executables is None else executables  # an empty one is falsy
    longest = max(pad_to, *map(len, prompts))
    memory = DraftMemory() if memory is None else memory
    generations, timings = [], []
    for i, start in enumerate(range(0, len(prompts), batch)):
        try:
            results, timing = generate(decoder, params, prompts[start: start + batch], seed=batch_seed(seed, i),
                                       pad_to=longest, gamma=gamma, executables=executables, memory=memory)
        except PromptError as e:  # name the prompt by its place in the dataset, not in its batch
            raise e.shifted(start) from None
        generations += results
        timings.append(timing)
    return generations, BatchTiming.total(timings)

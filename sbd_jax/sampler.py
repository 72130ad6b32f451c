"""Decoding loops against the static KV cache: jit-compiled `lax.while_loop`, per-row lengths and EOS.

NTP (plain causal) decoding lives here; the SBD block sampler joins it. Counting convention, shared
with SBD: the prompt minus its last token is prefilled, and every generated token (EOS included)
costs one decoding forward, so NTP's `nfe == new_tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.kv_cache import KVCache, append, init_cache
from sbd_jax.model import Transformer

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this, so few shapes compile


class DecodeState(NamedTuple):
    step: jax.Array
    cache: KVCache
    last_token: jax.Array  # [B] the token to feed next
    tokens: jax.Array  # [B, max_new_tokens] generated ids (0 after a row stops)
    num_tokens: jax.Array  # [B] generated so far, EOS included
    done: jax.Array  # [B]
    rng: jax.Array


class DecodeOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens]
    num_tokens: jax.Array  # [B]
    nfe: jax.Array  # [B] decoding forward passes this row needed (prefill excluded)


def choose_tokens(logits_BV: jax.Array, rng: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Greedy (temperature 0) or temperature sampling restricted to the top-p nucleus."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        cutoff_index = jnp.sum(cumulative < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NTPDecoder:
    """Causal next-token decoding; hashable, so `decode` is jitted with `self` static."""

    config: ModelConfig
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p={self.top_p} must be in (0, 1]")

    @functools.partial(jax.jit, static_argnames=("self", "capacity"))
    def prefill(self, params: Any, prompt_BT: jax.Array, prompt_lens_B: jax.Array,
                capacity: int) -> tuple[KVCache, jax.Array]:
        """Caches right-padded prompts `[B, T]` (true lengths `[B]`) but for each row's last token.

        Returns the cache (`capacity` slots per row) and the last prompt tokens `[B]`, fed first.
        """
        batch, prompt_len = prompt_BT.shape
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
        _, kv = Transformer(self.config).apply({"params": params}, prompt_BT, positions, compute_logits=False)
        # Pad slots are written too but stay beyond each row's length: never read, later overwritten.
        cache = append(init_cache(self.config, batch, capacity), kv.k, kv.v, prompt_lens_B - 1)
        return cache, jnp.take_along_axis(prompt_BT, (prompt_lens_B - 1)[:, None], axis=1)[:, 0]

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array) -> DecodeOutput:
        """Generates up to `max_new_tokens` per row, one forward each, stopping rows at EOS."""
        model = Transformer(self.config)
        batch = last_token_B.shape[0]
        eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)

        def body(s: DecodeState) -> DecodeState:
            logits, kv = model.apply({"params": params}, s.last_token[:, None], s.cache.lengths[:, None],
                                     cache=s.cache)
            cache = append(s.cache, kv.k, kv.v, 1)
            token = choose_tokens(logits[:, -1], jax.random.fold_in(s.rng, s.step), self.temperature, self.top_p)
            token = jnp.where(s.done, 0, token)
            tokens = jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step))
            done = s.done | jnp.isin(token, eos)
            return DecodeState(s.step + 1, cache, token, tokens, s.num_tokens + (~s.done), done, s.rng)

        def cond(s: DecodeState) -> jax.Array:
            return (s.step < self.max_new_tokens) & ~jnp.all(s.done)

        state = DecodeState(
            step=jnp.int32(0), cache=cache, last_token=last_token_B,
            tokens=jnp.zeros((batch, self.max_new_tokens), jnp.int32),
            num_tokens=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool), rng=rng,
        )
        final = jax.lax.while_loop(cond, body, state)
        return DecodeOutput(final.tokens, final.num_tokens, final.num_tokens)


# Ahead-of-time compiled decoders by (decoder, prompt shape, capacity): compile time is measured
# apart from decode time, and a repeated shape is not compiled again.
_COMPILED: dict[tuple, Any] = {}


class Generation(NamedTuple):
    token_ids: list[int]  # generated ids, up to and including the first EOS
    nfe: int


class BatchTiming(NamedTuple):
    compile_seconds: float
    prefill_seconds: float
    decode_seconds: float  # the decoding loop of the whole batch; `seconds` = prefill + decode

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def pad_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_cache_len: int | None,
                config: ModelConfig) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-pads prompts to a bucket; returns (tokens [B, T], lengths [B], cache capacity)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    if max(max(p) for p in prompts) >= config.vocab_size or min(min(p) for p in prompts) < 0:
        raise UserError(f"a prompt token id is outside the vocabulary [0, {config.vocab_size})")
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    needed = longest + max_new_tokens
    limit = config.max_position_embeddings if max_cache_len is None else max_cache_len
    if needed > limit:
        what = "the model's context" if max_cache_len is None else "the cache size"
        raise UserError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds "
                        f"{what} ({limit}); shorten the prompt or lower --max-new-tokens")
    padded_len = min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, limit - max_new_tokens)
    tokens = np.zeros((len(prompts), padded_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths, padded_len + max_new_tokens


def _compiled(fn: Any, key: tuple, *args: Any, **static: Any) -> Any:
    if key not in _COMPILED:
        _COMPILED[key] = fn.lower(*args, **static).compile()
    return _COMPILED[key]


def generate(decoder: NTPDecoder, params: Any, prompts: Sequence[Sequence[int]], seed: int = 0,
             max_cache_len: int | None = None) -> tuple[list[Generation], BatchTiming]:
    """Decodes a batch of token-id prompts; compile, prefill and decode times are measured apart."""
    tokens, lengths, capacity = pad_prompts(prompts, decoder.max_new_tokens, max_cache_len, decoder.config)
    prefill_args = (params, jnp.asarray(tokens), jnp.asarray(lengths))
    start = time.perf_counter()
    prefill = _compiled(NTPDecoder.prefill, ("prefill", decoder, tokens.shape, capacity), decoder,
                        *prefill_args, capacity=capacity)
    cache_shape, last_shape = jax.eval_shape(
        functools.partial(NTPDecoder.prefill, decoder, capacity=capacity), *prefill_args)
    decode_args = (params, cache_shape, last_shape, jax.random.key(seed))
    decode = _compiled(NTPDecoder.decode, ("decode", decoder, tokens.shape, capacity), decoder, *decode_args)
    compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    cache, last = jax.block_until_ready(prefill(*prefill_args))
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(decode(params, cache, last, jax.random.key(seed)))
    decode_seconds = time.perf_counter() - start
    ids, counts, nfe = (np.asarray(x) for x in out)
    results = [Generation(ids[b, : counts[b]].tolist(), int(nfe[b])) for b in range(len(prompts))]
    return results, BatchTiming(compile_seconds, prefill_seconds, decode_seconds)

"""Decoding against the static KV cache: NTP and SBD (Entropy-Bounded) loops, jit-compiled `lax.while_loop`s.

Counting convention, shared by both modes: the prompt minus its last token is prefilled, so NTP's
first forward feeds the last prompt token and SBD's first pass commits it. Every forward after
prefill is one pass of `nfe`; NTP has `nfe == new_tokens`. Rows of a batch keep their own cache
lengths, pass counts and EOS; tokens after a row's first EOS are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax import masks
from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.kv_cache import KVCache, append, init_cache
from sbd_jax.model import Transformer

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this, so few shapes compile
PROXIES = ("entropy", "confidence", "margin")


class DecodeOutput(NamedTuple):
    tokens: jax.Array  # [B, N] generated ids; only the first num_tokens[b] are meaningful
    num_tokens: jax.Array  # [B] up to and including the first EOS, at most max_new_tokens
    nfe: jax.Array  # [B] decoding forward passes this row needed (prefill excluded)
    reveal_pass: jax.Array  # [B, N] the row's pass (1-based) that produced each token


# --------------------------------------------------------------------------- token choice
def without_token(logits: jax.Array, token_id: int | None) -> jax.Array:
    """The logits with `token_id` (the mask token, never a valid output: SPEC §4.4) made impossible."""
    if token_id is None:
        return logits
    return logits.at[..., token_id].set(-jnp.inf)


def sampling_logits(logits: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Logits of the distribution tokens are drawn from: `logits / T`, -inf outside the top-p nucleus.

    Greedy decoding (T = 0) picks the argmax of the model's own distribution, which is returned as is.
    """
    if temperature == 0.0:
        return logits
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        cutoff_index = jnp.sum(cumulative < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def choose_tokens(logits: jax.Array, rng: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Greedy (temperature 0) or temperature sampling restricted to the top-p nucleus, over the last axis."""
    return draw(sampling_logits(logits, temperature, top_p), rng, temperature)


def draw(dist_logits: jax.Array, rng: jax.Array, temperature: float) -> jax.Array:
    """A token from logits already passed through `sampling_logits`: argmax if greedy, else a sample."""
    if temperature == 0.0:
        return jnp.argmax(dist_logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, dist_logits, axis=-1).astype(jnp.int32)


def uncertainty(logits: jax.Array, proxy: str) -> jax.Array:
    """Non-negative uncertainty per position (lower = surer) of the distribution `softmax(logits)`.

    entropy: -sum p log p; confidence: 1 - max p; margin: 1 - (p_top1 - p_top2). Written as
    reductions over `exp(logits - max)` so the vocabulary is swept as few times as possible.
    """
    shifted = logits.astype(jnp.float32) - jnp.max(logits, axis=-1, keepdims=True).astype(jnp.float32)
    unnormalised = jnp.exp(shifted)
    total = jnp.sum(unnormalised, axis=-1)
    if proxy == "entropy":  # H = log Z - E[shifted]; -inf logits (outside top-p) contribute 0
        weighted = jnp.sum(jnp.where(unnormalised > 0, unnormalised * shifted, 0.0), axis=-1)
        return jnp.maximum(jnp.log(total) - weighted / total, 0.0)
    if proxy == "confidence":
        return 1.0 - 1.0 / total
    second = jax.lax.top_k(shifted, 2)[0][..., 1]
    return 1.0 - (1.0 - jnp.exp(second)) / total


def eb_reveal(scores: jax.Array, still_masked: jax.Array, gamma: jax.Array | float) -> jax.Array:
    """The Entropy-Bounded rule: which still-masked positions of `[..., k]` to reveal now.

    Sort the masked positions by score ascending and reveal the largest s >= 1 of them such that the
    sum of the s - 1 smallest scores is <= gamma (the last, most uncertain one is not counted).
    Scores must be >= 0. Rows with nothing masked reveal nothing.
    """
    keyed = jnp.where(still_masked, scores, jnp.inf)
    order = jnp.argsort(keyed, axis=-1)
    sorted_scores = jnp.take_along_axis(keyed, order, axis=-1)
    finite = jnp.where(jnp.isfinite(sorted_scores), sorted_scores, 0.0)
    before = jnp.cumsum(finite, axis=-1) - finite  # sum of the scores sorted ahead of each one
    reveal_sorted = before <= gamma
    ranks = jnp.argsort(order, axis=-1)
    return still_masked & jnp.take_along_axis(reveal_sorted, ranks, axis=-1)


# --------------------------------------------------------------------------- decoders
def check_decoding_options(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Raises UserError for settings no decoder accepts (callable before any model is loaded)."""
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise UserError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p={top_p} must be in (0, 1]")


def check_sbd_options(block_size: int, gamma: float, proxy: str) -> None:
    """Raises UserError for SBD settings that cannot work (callable before any model is loaded)."""
    if block_size < 1:
        raise UserError(f"block_size={block_size} must be >= 1")
    if gamma < 0:
        raise UserError(f"gamma={gamma} must be >= 0 (0 reveals one token per pass)")
    if proxy not in PROXIES:
        raise UserError(f"unknown proxy {proxy!r}: use one of {', '.join(PROXIES)}")


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What every decoding mode shares. Hashable: jitted methods take `self` as a static argument."""

    config: ModelConfig
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_decoding_options(self.max_new_tokens, self.temperature, self.top_p)

    @property
    def output_len(self) -> int:
        """Width of the generated-token buffer (and of cache slots needed past the prompt)."""
        return self.max_new_tokens

    @property
    def output_label(self) -> str:
        return "max_new_tokens"

    def dynamic_args(self) -> tuple:
        """Traced arguments of `decode` after the rng (values that must not trigger a recompile)."""
        return ()

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

    def _is_eos(self, tokens: jax.Array) -> jax.Array:
        return jnp.isin(tokens, jnp.asarray(self.eos_ids or (-1,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class NTPDecoder(Decoder):
    """Causal next-token decoding: one token per forward."""

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array) -> DecodeOutput:
        """Generates up to `max_new_tokens` per row, one forward each, stopping rows at EOS."""
        model = Transformer(self.config)
        batch = last_token_B.shape[0]

        def body(s):
            step, cache, last, tokens, count, done = s
            logits, kv = model.apply({"params": params}, last[:, None], cache.lengths[:, None], cache=cache)
            cache = append(cache, kv.k, kv.v, 1)
            token = choose_tokens(without_token(logits[:, -1], self.config.mask_token_id),
                                  jax.random.fold_in(rng, step), self.temperature, self.top_p)
            token = jnp.where(done, 0, token)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, step))
            return step + 1, cache, token, tokens, count + (~done), done | self._is_eos(token)

        def cond(s):
            return (s[0] < self.max_new_tokens) & ~jnp.all(s[5])

        init = (jnp.int32(0), cache, last_token_B, jnp.zeros((batch, self.max_new_tokens), jnp.int32),
                jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool))
        _, _, _, tokens, count, _ = jax.lax.while_loop(cond, body, init)
        passes = jnp.broadcast_to(jnp.arange(1, self.max_new_tokens + 1), tokens.shape)
        return DecodeOutput(tokens, count, count, passes)


@dataclasses.dataclass(frozen=True)
class SBDDecoder(Decoder):
    """Set Block Decoding: blocks of `block_size` tokens, each filled in by Entropy-Bounded passes.

    `gamma` is passed to the compiled loop as a traced value (excluded from hashing), so sweeping it
    never recompiles. With temperature > 0 the uncertainty is computed on the distribution actually
    sampled from (tempered, top-p truncated); greedy uses the model's own distribution.
    """

    block_size: int = 16
    gamma: float = dataclasses.field(default=0.35, compare=False)
    proxy: str = "entropy"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sbd_options(self.block_size, self.gamma, self.proxy)
        if self.config.mask_token_id is None:
            raise UserError("this model has no mask token configured, so it cannot decode blocks: fine-tune it "
                            "with train.py (which sets one) or pass --mask-token-id")

    @property
    def num_blocks(self) -> int:
        return -(-self.max_new_tokens // self.block_size)

    @property
    def output_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def output_label(self) -> str:
        return f"max_new_tokens in whole blocks of {self.block_size}"

    def dynamic_args(self) -> tuple:
        return (jnp.float32(self.gamma),)

    def first_pass(self, params: Any, cache: KVCache, pending_BK: jax.Array, pending_count_B: jax.Array,
                   block_BK: jax.Array) -> tuple[jax.Array, KVCache]:
        """The `2k`-token pass: commits the previous block (first `pending_count` tokens) causally to the
        cache while the new block attends to the cache, to them and bidirectionally to itself.

        Returns the new block's logits `[B, k, V]` and the cache with the pending tokens appended.
        """
        k = self.block_size
        j = jnp.arange(k)
        pending_pos = cache.lengths[:, None] + j
        block_pos = (cache.lengths + pending_count_B)[:, None] + j
        causal = jnp.broadcast_to(masks.causal(k), (pending_BK.shape[0], k, k))
        sees_pending = jnp.broadcast_to((j[None, :] < pending_count_B[:, None])[:, None, :], causal.shape)
        mask = jnp.concatenate([
            jnp.concatenate([causal, jnp.zeros_like(causal)], axis=2),  # committed tokens never see the block
            jnp.concatenate([sees_pending, jnp.ones_like(causal)], axis=2),
        ], axis=1)
        logits, kv = Transformer(self.config).apply(
            {"params": params}, jnp.concatenate([pending_BK, block_BK], axis=1),
            jnp.concatenate([pending_pos, block_pos], axis=1), mask=mask, cache=cache)
        return logits[:, k:], append(cache, kv.k[:, :, :k], kv.v[:, :, :k], pending_count_B)

    def refine_pass(self, params: Any, cache: KVCache, block_BK: jax.Array) -> jax.Array:
        """A later pass over the partly revealed block; the cache is only read."""
        k = self.block_size
        positions = cache.lengths[:, None] + jnp.arange(k)
        logits, _ = Transformer(self.config).apply({"params": params}, block_BK, positions,
                                                   mask=masks.bidirectional(k), cache=cache)
        return logits

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array,
               gamma: jax.Array) -> DecodeOutput:
        """Decodes `num_blocks` blocks per row (fewer if every row hit EOS); see the class docstring."""
        k, batch = self.block_size, last_token_B.shape[0]
        mask_id = self.config.mask_token_id
        position = jnp.arange(k)

        def undecided(block, live, offset):
            """Masked positions that still matter: not after a revealed EOS, not past max_new_tokens."""
            is_mask = block == mask_id
            eos_at = jnp.where(self._is_eos(block) & ~is_mask, position, k).min(axis=1, keepdims=True)
            return is_mask & live & (position < eos_at) & (offset + position < self.max_new_tokens)

        def reveal(block, live, nfe, passes, logits, offset, rng):
            """One EB step on every row's undecided positions; returns what is undecided after it."""
            todo = undecided(block, live, offset)
            dist = sampling_logits(without_token(logits, mask_id), self.temperature, self.top_p)  # sorts once
            chosen = draw(dist, rng, self.temperature)
            now = eb_reveal(uncertainty(dist, self.proxy), todo, gamma)
            nfe = nfe + todo.any(axis=1)
            block = jnp.where(now, chosen, block)
            return block, nfe, jnp.where(now, nfe[:, None], passes), undecided(block, live, offset)

        def block_body(s):
            index, cache, pending, pending_count, tokens, passes_out, nfe, count, done = s
            offset = index * k
            block = jnp.full((batch, k), mask_id, jnp.int32)
            live = jnp.broadcast_to(~done[:, None], (batch, k))
            logits, cache = self.first_pass(params, cache, pending, pending_count, block)
            passes = jnp.zeros((batch, k), jnp.int32)
            step_rng = jax.random.fold_in(rng, index)
            block, nfe, passes, left = reveal(block, live, nfe, passes, logits, offset,
                                              jax.random.fold_in(step_rng, 0))

            def pass_body(p):
                block, nfe, passes, left, n = p
                logits = self.refine_pass(params, cache, block)
                block, nfe, passes, left = reveal(block, live, nfe, passes, logits, offset,
                                                  jax.random.fold_in(step_rng, n))
                return block, nfe, passes, left, n + 1

            # Every pass reveals >= 1 undecided position of each row, so k passes always suffice.
            block, nfe, passes, _, _ = jax.lax.while_loop(
                lambda p: p[3].any() & (p[4] < k), pass_body, (block, nfe, passes, left, jnp.int32(1)))
            eos_at = jnp.where(self._is_eos(block), position, k).min(axis=1)
            kept = jnp.minimum(jnp.where(done, 0, jnp.minimum(eos_at + 1, k)), self.max_new_tokens - offset)
            tokens = jax.lax.dynamic_update_slice(tokens, jnp.where(done[:, None], 0, block), (0, offset))
            passes_out = jax.lax.dynamic_update_slice(passes_out, passes, (0, offset))
            done = done | (eos_at < k) | (offset + k >= self.max_new_tokens)
            return (index + 1, cache, block, jnp.where(done, 0, k).astype(jnp.int32), tokens, passes_out,
                    nfe, count + kept, done)

        pending = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(last_token_B)
        zeros = jnp.zeros((batch,), jnp.int32)
        init = (jnp.int32(0), cache, pending, jnp.ones((batch,), jnp.int32),
                jnp.zeros((batch, self.output_len), jnp.int32), jnp.zeros((batch, self.output_len), jnp.int32),
                zeros, zeros, jnp.zeros((batch,), bool))
        final = jax.lax.while_loop(lambda s: (s[0] < self.num_blocks) & ~jnp.all(s[8]), block_body, init)
        _, _, _, _, tokens, passes, nfe, count, _ = final
        return DecodeOutput(tokens, count, nfe, passes)


# --------------------------------------------------------------------------- host-side driver
class Generation(NamedTuple):
    token_ids: list[int]  # generated ids, up to and including the first EOS
    nfe: int
    reveal_pass: list[int]  # per token, the row's pass (1-based) that produced it


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


def pad_prompts(prompts: Sequence[Sequence[int]], new_slots: int, max_cache_len: int | None,
                config: ModelConfig, new_label: str = "max_new_tokens",
                pad_to: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-pads prompts to a bucket (at least `pad_to` long, so batches can share one compiled
    shape); returns (tokens [B, T], lengths [B], cache capacity)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    if max(max(p) for p in prompts) >= config.vocab_size or min(min(p) for p in prompts) < 0:
        raise UserError(f"a prompt token id is outside the vocabulary [0, {config.vocab_size})")
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    needed = longest + new_slots
    limit = config.max_position_embeddings if max_cache_len is None else max_cache_len
    if needed > limit:
        what = "the model's context" if max_cache_len is None else "the cache size"
        raise UserError(f"prompt ({longest} tokens) + {new_label} ({new_slots}) = {needed} exceeds {what} "
                        f"({limit}); shorten the prompt or lower --max-new-tokens")
    padded_len = min(-(-max(longest, pad_to) // PROMPT_BUCKET) * PROMPT_BUCKET, limit - new_slots)
    tokens = np.zeros((len(prompts), padded_len), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths, padded_len + new_slots


# Ahead-of-time compiled functions by (kind, decoder, prompt shape, capacity): compile time is
# measured apart from run time, and a repeated shape is not compiled again.
_COMPILED: dict[tuple, Any] = {}


def _compiled(fn: Any, key: tuple, *args: Any, **static: Any) -> Any:
    if key not in _COMPILED:
        _COMPILED[key] = fn.lower(*args, **static).compile()
    return _COMPILED[key]


def generate(decoder: Decoder, params: Any, prompts: Sequence[Sequence[int]], seed: int = 0,
             max_cache_len: int | None = None, pad_to: int = 0) -> tuple[list[Generation], BatchTiming]:
    """Decodes a batch of token-id prompts; compile, prefill and decode times are measured apart.

    Prompts are padded to a multiple of 64 tokens, at least `pad_to`: give the longest prompt of a
    dataset to decode it in batches that all reuse one compiled shape."""
    tokens, lengths, capacity = pad_prompts(prompts, decoder.output_len, max_cache_len, decoder.config,
                                            decoder.output_label, pad_to)
    prefill_args = (params, jnp.asarray(tokens), jnp.asarray(lengths))
    start = time.perf_counter()
    prefill = _compiled(type(decoder).prefill, ("prefill", decoder, tokens.shape, capacity), decoder,
                        *prefill_args, capacity=capacity)
    cache_shape, last_shape = jax.eval_shape(
        functools.partial(type(decoder).prefill, decoder, capacity=capacity), *prefill_args)
    decode_args = (params, cache_shape, last_shape, jax.random.key(seed), *decoder.dynamic_args())
    decode = _compiled(type(decoder).decode, ("decode", decoder, tokens.shape, capacity), decoder, *decode_args)
    compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    cache, last = jax.block_until_ready(prefill(*prefill_args))
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(decode(params, cache, last, jax.random.key(seed), *decoder.dynamic_args()))
    decode_seconds = time.perf_counter() - start
    ids, counts, nfe, passes = (np.asarray(x) for x in out)
    results = [Generation(ids[b, : counts[b]].tolist(), int(nfe[b]), passes[b, : counts[b]].tolist())
               for b in range(len(prompts))]
    return results, BatchTiming(compile_seconds, prefill_seconds, decode_seconds)

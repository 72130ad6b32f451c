"""Decoders: jit-compiled `lax.while_loop`s against the static KV cache — NTP, SBD (Entropy-Bounded
blocks) and verified SBD (self-speculative: output identical to greedy NTP).

Counting convention, shared by every mode: the prompt minus its last token is prefilled, so NTP's
first forward feeds the last prompt token and SBD's first pass commits it. Every forward after
prefill is one pass of `nfe`; NTP has `nfe == new_tokens`. Rows of a batch keep their own cache
lengths, pass counts and EOS; tokens after a row's first EOS are dropped. Knobs that may change
between calls without a recompile (γ) are arguments of `decode`, never fields of the hashed decoder.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax import masks
from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.kv_cache import KVCache, append, init_cache
from sbd_jax.model import NewKV, Transformer, output_kernel, vocab_logits
from sbd_jax.token_choice import PROXIES, choose_tokens, draw, eb_reveal, sampling_logits, uncertainty, without_token


class DecodeOutput(NamedTuple):
    tokens: jax.Array  # [B, N] generated ids; only the first num_tokens[b] are meaningful
    num_tokens: jax.Array  # [B] up to and including the first EOS, at most max_new_tokens
    nfe: jax.Array  # [B] decoding forward passes this row needed (prefill excluded)
    reveal_pass: jax.Array  # [B, N] the row's pass (1-based) that produced (verified: accepted) each token
    corrected: jax.Array  # [B, N] verified mode: the token is NTP's correction of a rejected draft
    drafted: jax.Array  # [B] verified mode: drafted tokens submitted for verification
    accepted: jax.Array  # [B] verified mode: of those, accepted


def kept_through_eos(is_eos_BK: jax.Array, limit_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Of each row's first `limit` new tokens, how many count (up to and including the first EOS among
    them), and whether that EOS ends the row. Nothing after an EOS ever counts."""
    k = is_eos_BK.shape[1]
    eos_at = jnp.where(is_eos_BK, jnp.arange(k), k).min(axis=1)
    return jnp.minimum(eos_at + 1, limit_B), eos_at < limit_B


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


@struct.dataclass
class _NTPState:
    step: jax.Array
    cache: KVCache
    last: jax.Array  # [B] the token fed next
    tokens: jax.Array  # [B, N]
    count: jax.Array  # [B]
    done: jax.Array  # [B]


@dataclasses.dataclass(frozen=True)
class NTPDecoder(Decoder):
    """Causal next-token decoding: one token per forward."""

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array) -> DecodeOutput:
        """Generates up to `max_new_tokens` per row, one forward each, stopping rows at EOS."""
        model = Transformer(self.config)
        batch = last_token_B.shape[0]

        def body(s: _NTPState) -> _NTPState:
            logits, kv = model.apply({"params": params}, s.last[:, None], s.cache.lengths[:, None], cache=s.cache)
            token = choose_tokens(without_token(logits[:, -1], self.config.mask_token_id),
                                  jax.random.fold_in(rng, s.step), self.temperature, self.top_p)
            token = jnp.where(s.done, 0, token)
            return _NTPState(s.step + 1, append(s.cache, kv.k, kv.v, 1), token,
                             jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step)),
                             s.count + ~s.done, s.done | self._is_eos(token))

        zeros = jnp.zeros((batch,), jnp.int32)
        init = _NTPState(jnp.int32(0), cache, last_token_B, jnp.zeros((batch, self.max_new_tokens), jnp.int32),
                         zeros, jnp.zeros((batch,), bool))
        final = jax.lax.while_loop(lambda s: (s.step < self.max_new_tokens) & ~jnp.all(s.done), body, init)
        passes = jnp.broadcast_to(jnp.arange(1, self.max_new_tokens + 1), final.tokens.shape)
        return DecodeOutput(final.tokens, final.count, final.count, passes, jnp.zeros(final.tokens.shape, bool),
                            zeros, zeros)


@struct.dataclass
class _FillState:
    block: jax.Array  # [B, k]
    nfe: jax.Array  # [B]
    passes: jax.Array  # [B, k] the pass that revealed each position
    n: jax.Array  # passes of this block so far


@struct.dataclass
class _BlockState:
    index: jax.Array  # blocks done
    cache: KVCache
    pending: jax.Array  # [B, k] the finished block, committed by the next first pass
    pending_count: jax.Array  # [B] how many of it to commit
    tokens: jax.Array  # [B, N]
    passes: jax.Array  # [B, N]
    nfe: jax.Array
    count: jax.Array
    done: jax.Array


@struct.dataclass
class _VerifyState:
    iteration: jax.Array
    cache: KVCache
    pending: jax.Array  # [B, k] an exact token, then the drafts it is followed by
    pending_count: jax.Array  # [B] 1 + drafts
    draft_logits: jax.Array  # [B, k, V] sampling: at j, the distribution drafts[j] was drawn from ([B, k, 0] greedy)
    tokens: jax.Array  # [B, N + k]
    passes: jax.Array  # [B, N + k]
    corrected: jax.Array  # [B, N + k]
    nfe: jax.Array
    count: jax.Array
    done: jax.Array
    drafted: jax.Array
    accepted: jax.Array


@dataclasses.dataclass(frozen=True)
class SBDDecoder(Decoder):
    """Set Block Decoding: blocks of `block_size` tokens, each filled in by Entropy-Bounded passes.

    With temperature > 0 the uncertainty is computed on the distribution actually sampled from
    (tempered, top-p truncated); greedy uses the model's own distribution. γ is an argument of
    `decode`, traced, so sweeping it never recompiles.

    verify=True makes the output follow NTP's distribution exactly (greedy: NTP's very tokens): the
    pass that commits a block runs it causally, so its logits are NTP's predictions for the block; the
    drafts are tested against them (greedy: kept while equal; sampling: the speculative ratio test) and
    the cache keeps exactly the accepted tokens. Drafts always come from one pass, so every forward
    verifies and `nfe <= new tokens`; γ (and the proxy) then play no part. See `_decode_verified`.
    A block's first token is never drafted: the causal logit of the token before it gives it exactly.
    Exact means in float32. In bf16 the verifying pass rounds differently from NTP's one-token pass (other
    shapes), so near-tied tokens can flip: measured as often as NTP flips them between batch sizes.
    """

    block_size: int = 16
    proxy: str = "entropy"
    verify: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sbd_options(self.block_size, 0.0, self.proxy)
        if self.config.mask_token_id is None:
            raise UserError("this model has no mask token configured, so it cannot decode blocks: fine-tune it "
                            "with train.py (which sets one) or pass --mask-token-id")

    @property
    def num_blocks(self) -> int:
        return -(-self.max_new_tokens // self.block_size)

    @property
    def output_len(self) -> int:
        if self.verify:  # rows advance by what they accept; a block's drafts may reach k past the limit
            return self.max_new_tokens + self.block_size
        return self.num_blocks * self.block_size

    @property
    def output_label(self) -> str:
        if self.verify:
            return f"max_new_tokens + block size {self.block_size}"
        return f"max_new_tokens in whole blocks of {self.block_size}"

    # ------------------------------------------------------------------ the two kinds of pass
    def first_pass(self, params: Any, cache: KVCache, pending_BK: jax.Array, pending_count_B: jax.Array,
                   block_BK: jax.Array, causal_logits: bool) -> tuple[jax.Array | None, jax.Array, NewKV]:
        """The `2k`-token pass: the pending tokens (the first `pending_count` of `pending_BK`) run causally
        after the cache while the new block attends to the cache, to them and bidirectionally to itself.

        Returns the pending tokens' causal logits `[B, k, V]` (position j predicts the token after it;
        None unless `causal_logits`: plain SBD never reads them, and the vocabulary projection of k
        positions is a large share of a small model's pass), the new block's logits `[B, k, V]`, and the
        pending tokens' K/V for `kv_cache.append`.
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
        hidden, kv = Transformer(self.config).apply(
            {"params": params}, jnp.concatenate([pending_BK, block_BK], axis=1),
            jnp.concatenate([pending_pos, block_pos], axis=1), mask=mask, cache=cache, compute_logits=False)
        kernel = output_kernel(params, self.config)
        pending_logits = vocab_logits(hidden[:, :k], kernel) if causal_logits else None
        return pending_logits, vocab_logits(hidden[:, k:], kernel), NewKV(kv.k[:, :, :k], kv.v[:, :, :k])

    def refine_pass(self, params: Any, cache: KVCache, block_BK: jax.Array) -> jax.Array:
        """A later pass over the partly revealed block; the cache is only read."""
        k = self.block_size
        positions = cache.lengths[:, None] + jnp.arange(k)
        logits, _ = Transformer(self.config).apply({"params": params}, block_BK, positions,
                                                   mask=masks.bidirectional(k), cache=cache)
        return logits

    # ------------------------------------------------------------------ Entropy-Bounded filling
    def fill_block(self, params: Any, cache: KVCache, block: jax.Array, logits: jax.Array, live: jax.Array,
                   budget: jax.Array, gamma: jax.Array, nfe: jax.Array, rng: jax.Array) -> _FillState:
        """EB passes until no undecided position is left: the first on `logits` (the first pass's, already
        counted in `nfe`), then refine passes, at most k in all. Undecided: still masked, in a `live` row,
        before a revealed EOS and before position `budget[b]` (the rest of max_new_tokens)."""
        k, mask_id = self.block_size, self.config.mask_token_id
        position = jnp.arange(k)

        def undecided(block):
            is_mask = block == mask_id
            eos_at = jnp.where(self._is_eos(block) & ~is_mask, position, k).min(axis=1, keepdims=True)
            return is_mask & live[:, None] & (position < eos_at) & (position < budget[:, None])

        def reveal(s: _FillState, logits: jax.Array, count: bool) -> _FillState:
            todo = undecided(s.block)
            dist = sampling_logits(without_token(logits, mask_id), self.temperature, self.top_p)  # sorts once
            chosen = draw(dist, jax.random.fold_in(rng, s.n), self.temperature)
            now = eb_reveal(uncertainty(dist, self.proxy), todo, gamma)
            nfe = s.nfe + (todo.any(axis=1) if count else 0)
            return _FillState(jnp.where(now, chosen, s.block), nfe, jnp.where(now, nfe[:, None], s.passes), s.n + 1)

        first = reveal(_FillState(block, nfe, jnp.zeros(block.shape, jnp.int32), jnp.int32(1)), logits, False)
        # Every pass reveals >= 1 undecided position of each row, so k passes always suffice.
        return jax.lax.while_loop(
            lambda s: undecided(s.block).any() & (s.n <= k),
            lambda s: reveal(s, self.refine_pass(params, cache, s.block), True), first)

    # ------------------------------------------------------------------ decoding loops
    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array,
               gamma: jax.Array) -> DecodeOutput:
        """Decodes until every row hit EOS or `max_new_tokens`; see the class docstring."""
        if self.verify:
            return self._decode_verified(params, cache, last_token_B, rng)
        k, batch = self.block_size, last_token_B.shape[0]
        mask_id = self.config.mask_token_id

        def block_body(s: _BlockState) -> _BlockState:
            offset = s.index * k
            live = ~s.done
            new_block = jnp.full((batch, k), mask_id, jnp.int32)
            _, logits, kv = self.first_pass(params, s.cache, s.pending, s.pending_count, new_block,
                                            causal_logits=False)
            cache = append(s.cache, kv.k, kv.v, s.pending_count)
            budget = jnp.full((batch,), self.max_new_tokens - offset)
            filled = self.fill_block(params, cache, new_block, logits, live, budget, gamma, s.nfe + live,
                                     jax.random.fold_in(rng, s.index))
            block = filled.block
            kept, ended = kept_through_eos(self._is_eos(block),
                                           jnp.where(live, jnp.minimum(k, self.max_new_tokens - offset), 0))
            done = s.done | ended | (offset + k >= self.max_new_tokens)
            return _BlockState(
                s.index + 1, cache, block, jnp.where(done, 0, k).astype(jnp.int32),
                jax.lax.dynamic_update_slice(s.tokens, jnp.where(live[:, None], block, 0), (0, offset)),
                jax.lax.dynamic_update_slice(s.passes, filled.passes, (0, offset)),
                filled.nfe, s.count + kept, done)

        zeros = jnp.zeros((batch,), jnp.int32)
        init = _BlockState(jnp.int32(0), cache, jnp.zeros((batch, k), jnp.int32).at[:, 0].set(last_token_B),
                           jnp.ones((batch,), jnp.int32), jnp.zeros((batch, self.output_len), jnp.int32),
                           jnp.zeros((batch, self.output_len), jnp.int32), zeros, zeros, jnp.zeros((batch,), bool))
        final = jax.lax.while_loop(lambda s: (s.index < self.num_blocks) & ~jnp.all(s.done), block_body, init)
        return DecodeOutput(final.tokens, final.count, final.nfe, final.passes,
                            jnp.zeros(final.tokens.shape, bool), zeros, zeros)

    def _decode_verified(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array) -> DecodeOutput:
        """Self-speculative decoding whose output follows NTP's distribution exactly (greedy: NTP's tokens).

        Each iteration is one first pass over `pending` (an exact token and the drafts after it) and a
        new all-masked block. The pass's causal logits at pending position j give `p_j`, NTP's
        distribution of the token after it (tempered / top-p truncated as NTP samples it). Drafts are
        tested left to right; the first rejected one is replaced, and after the last accepted one (or
        the replacement) nothing of `pending` is kept. If every draft was accepted, one more token is
        drawn from `p` after them; it starts the new block, whose other positions are drafted from this
        same pass (one pass: a forward never drafts without verifying, so `nfe <= new tokens`).

        Greedy: a draft is accepted iff it equals argmax `p_j`; the replacement is that argmax.
        Sampling: draft `d_j` was drawn from `q_j`, the masked block's distribution at its position,
        computed from the prefix alone (the whole block masked) and so independent of the other drafts.
        Accept it with probability min(1, p_j(d_j) / q_j(d_j)); on rejection draw from
        normalize(max(0, p_j - q_j)). Then P(token = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y),
        p(y))) (p(x) - q(x))^+ / sum_y (p(y) - q(y))^+ = min(q(x), p(x)) + (p(x) - q(x))^+ = p(x)
        (Leviathan et al., 2023), at every position given the tokens before it, because q_j does not
        depend on d_<j: the emitted sequence is distributed exactly as NTP sampling's. Drafts revealed
        over several passes would make q_j depend on earlier (even later) drafts and break this; here
        there are none.
        """
        k, batch = self.block_size, last_token_B.shape[0]
        mask_id = self.config.mask_token_id
        sampling = self.temperature > 0
        j = jnp.arange(k)
        rows = jnp.arange(batch)[:, None]
        width = self.output_len

        def dist(logits: jax.Array) -> jax.Array:  # logits of the distribution tokens are drawn from
            return sampling_logits(without_token(logits, mask_id), self.temperature, self.top_p)

        def body(s: _VerifyState) -> _VerifyState:
            live = ~s.done
            accept_rng, token_rng, draft_rng = jax.random.split(jax.random.fold_in(rng, s.iteration), 3)
            masked_block = jnp.full((batch, k), mask_id, jnp.int32)
            pending_logits, block_logits, kv = self.first_pass(params, s.cache, s.pending, s.pending_count,
                                                               masked_block, causal_logits=True)
            nfe = s.nfe + live
            p_logits = dist(pending_logits)  # [B, k, V]: at j, NTP's distribution of the token after j
            drafts = jnp.concatenate([s.pending[:, 1:], jnp.full((batch, 1), mask_id, jnp.int32)], axis=1)
            is_draft = j < (s.pending_count - 1)[:, None]  # drafts[j] is pending position j + 1
            if sampling:
                accepted, next_token = self.speculative_test(p_logits, s.draft_logits, drafts, is_draft, accept_rng,
                                                        token_rng)
            else:
                exact = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)
                accepted = jnp.cumprod(is_draft & (drafts == exact), axis=1).sum(axis=1)
                next_token = jnp.take_along_axis(exact, accepted[:, None], axis=1)[:, 0]
            emitted = jnp.where(j < accepted[:, None], drafts, next_token[:, None])
            kept, ended = kept_through_eos(self._is_eos(emitted) & (j <= accepted[:, None]),
                                           jnp.where(live, jnp.minimum(accepted + 1, self.max_new_tokens - s.count), 0))
            slots = s.count[:, None] + j
            tokens = s.tokens.at[rows, slots].set(emitted, mode="drop")
            passes = s.passes.at[rows, slots].set(jnp.broadcast_to(nfe[:, None], emitted.shape), mode="drop")
            was_corrected = (j == accepted[:, None]) & (accepted < s.pending_count - 1)[:, None]
            corrected = s.corrected.at[rows, slots].set(was_corrected, mode="drop")
            eos_before = (jnp.cumsum(self._is_eos(drafts), axis=1) - self._is_eos(drafts)) > 0
            drafted = s.drafted + jnp.where(live, (is_draft & (drafts != mask_id) & ~eos_before).sum(axis=1), 0)
            count = s.count + kept
            done = s.done | ended | (count >= self.max_new_tokens)
            cache = append(s.cache, kv.k, kv.v, jnp.where(live, accepted + 1, 0))  # the accepted pending tokens
            # Every draft accepted: this pass's block holds, `next_token` at its first position and drafts
            # from this pass's block logits after it, as far as max_new_tokens can still reach.
            whole = (accepted == s.pending_count - 1) & ~done
            q_logits = dist(block_logits)
            room = (j[None] >= 1) & (j[None] < (self.max_new_tokens - count + 1)[:, None])
            block = jnp.where(room, draw(q_logits, draft_rng, self.temperature), mask_id).at[:, 0].set(next_token)
            restart = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(next_token)
            # The next pass tests pending position j + 1 against q at block position j + 1.
            draft_logits = jnp.roll(q_logits, -1, axis=1) if sampling else s.draft_logits
            return _VerifyState(s.iteration + 1, cache, jnp.where(whole[:, None], block, restart),
                                jnp.where(whole, k, 1).astype(jnp.int32), draft_logits, tokens, passes, corrected,
                                nfe, count, done, drafted, s.accepted + jnp.where(live, jnp.minimum(accepted, kept), 0))

        zeros = jnp.zeros((batch,), jnp.int32)
        vocab = self.config.vocab_size if sampling else 0  # greedy tests drafts by equality: no q kept
        init = _VerifyState(jnp.int32(0), cache, jnp.zeros((batch, k), jnp.int32).at[:, 0].set(last_token_B),
                            jnp.ones((batch,), jnp.int32), jnp.zeros((batch, k, vocab), jnp.float32),
                            jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch, width), jnp.int32),
                            jnp.zeros((batch, width), bool), zeros, zeros, jnp.zeros((batch,), bool), zeros, zeros)
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
        return DecodeOutput(final.tokens, final.count, final.nfe, final.passes, final.corrected, final.drafted,
                            final.accepted)

    def speculative_test(self, p_logits: jax.Array, q_logits: jax.Array, drafts: jax.Array, is_draft: jax.Array,
                         accept_rng: jax.Array, token_rng: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Speculative sampling over `[B, k]` drafts: how many are accepted, and the token after them.

        Draft j (where `is_draft`) was drawn from softmax(q_logits[:, j]); softmax(p_logits[:, j]) is the
        target distribution at its position. Accepted with probability min(1, p/q), left to right up to the
        first rejection; the token after the accepted drafts is drawn from normalize(max(0, p - q)) at a
        rejected position, from p after the last draft.
        """
        p = jax.nn.softmax(p_logits, axis=-1)
        q = jax.nn.softmax(q_logits, axis=-1)
        p_draft = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
        q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.random.uniform(accept_rng, drafts.shape)
        accepted = jnp.cumprod(is_draft & (u * q_draft < p_draft), axis=1).sum(axis=1)  # u < p/q, q > 0 for a draft
        at = accepted[:, None, None]
        p_next, q_next = jnp.take_along_axis(p, at, axis=1)[:, 0], jnp.take_along_axis(q, at, axis=1)[:, 0]
        residual = jnp.maximum(p_next - q_next, 0.0)
        rejected = (jnp.take_along_axis(is_draft, accepted[:, None], axis=1)[:, 0]
                    & (residual.sum(axis=-1) > 0))  # p == q leaves no residual, and then never rejects
        weights = jnp.where(rejected[:, None], residual, p_next)
        return accepted, jax.random.categorical(token_rng, jnp.log(weights), axis=-1).astype(jnp.int32)

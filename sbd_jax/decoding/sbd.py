"""Set Block Decoding: `BlockDecoder` (what block decoders share: the block size and the mask token) and
`SBDDecoder` (each block predicted by the pass that commits the one before, then filled in by Entropy-Bounded
passes)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding.base import DecodeOutput, Decoder, TracedSettings, check_block_size, check_proxy, kept_through_eos
from sbd_jax.decoding.token_choice import Proxy, draw, eb_reveal, sampling_logits, uncertainty, without_token
from sbd_jax.errors import UserError
from sbd_jax.model import masks
from sbd_jax.model.kv_cache import KVCache, append
from sbd_jax.model.transformer import NewKV, Transformer, forward, output_kernel, vocab_logits


@dataclasses.dataclass(frozen=True)
class BlockDecoder(Decoder):
    """A decoder that emits blocks of `block_size` tokens using the model's mask token."""

    block_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        check_block_size(self.block_size)
        if self.config.mask_token_id is None and self.needs_mask_token:
            raise UserError(self.needs_mask_token)

    @property
    def needs_mask_token(self) -> str | None:
        """Why this decoder needs the model's mask token (the error without one), or None if it does not."""
        return ("this model has no mask token configured, so it cannot decode blocks: fine-tune it with train.py "
                "(which sets one) or pass --mask-token-id")

    def first_pass(self, params: Any, cache: KVCache, pending_BK: jax.Array, pending_count_B: jax.Array,
                   block_BK: jax.Array) -> tuple[jax.Array, NewKV]:
        """The pass that commits the pending tokens while it predicts the next block: the pending tokens
        (the first `pending_count` of `pending_BK`) run causally after the cache while the new block
        (`block_BK`, after all of them) attends to the cache, to them and bidirectionally to itself.

        Returns the block's logits `[B, k, V]` and the pending tokens' K/V for `kv_cache.append` (only the
        block's positions are projected onto the vocabulary: SBD never reads the pending tokens' logits).
        """
        k, batch = self.block_size, pending_BK.shape[0]
        j = jnp.arange(k)
        pending_pos = cache.lengths[:, None] + j
        block_pos = (cache.lengths + pending_count_B)[:, None] + j
        causal = jnp.broadcast_to(masks.causal(k), (batch, k, k))
        sees_pending = jnp.broadcast_to(j[None, None, :] < pending_count_B[:, None, None], (batch, k, k))
        mask = jnp.concatenate([
            jnp.concatenate([causal, jnp.zeros((batch, k, k), bool)], axis=2),  # never see the block
            jnp.concatenate([sees_pending, jnp.ones((batch, k, k), bool)], axis=2),
        ], axis=1)
        hidden, kv = forward(  # an adapter acts on the block alone
            Transformer(self.config, gate_from=k), params, jnp.concatenate([pending_BK, block_BK], axis=1),
            jnp.concatenate([pending_pos, block_pos], axis=1), mask=mask, cache=cache, compute_logits=False)
        logits = vocab_logits(hidden[:, k:], output_kernel(params, self.config))
        return logits, NewKV(kv.k[:, :, :k], kv.v[:, :, :k])


class _FillState(struct.PyTreeNode):
    block: jax.Array  # [B, k]
    nfe: jax.Array  # [B]
    passes: jax.Array  # [B, k] the pass that revealed each position
    n: jax.Array  # passes of this block so far


class _BlockState(struct.PyTreeNode):
    index: jax.Array  # blocks done
    cache: KVCache
    pending: jax.Array  # [B, k] the finished block, committed by the next first pass
    pending_count: jax.Array  # [B] how many of it to commit
    tokens: jax.Array  # [B, N]
    passes: jax.Array  # [B, N]
    nfe: jax.Array
    count: jax.Array
    done: jax.Array


@dataclasses.dataclass(frozen=True)
class SBDDecoder(BlockDecoder):
    """Set Block Decoding: blocks of `block_size` tokens, each filled in by Entropy-Bounded passes.

    With temperature > 0 the uncertainty is computed on the distribution actually sampled from
    (tempered, top-p truncated); greedy uses the model's own distribution. γ comes in `TracedSettings`, traced,
    so sweeping it never recompiles.
    """

    proxy: Proxy = Proxy.ENTROPY

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "proxy", check_proxy(self.proxy))  # a name given as a str

    @property
    def num_blocks(self) -> int:
        return -(-self.max_new_tokens // self.block_size)

    @property
    def output_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def output_label(self) -> str:
        return f"max_new_tokens in whole blocks of {self.block_size}"

    def refine_pass(self, params: Any, cache: KVCache, block_BK: jax.Array) -> jax.Array:
        """A later pass over the partly revealed block; the cache is only read."""
        k = self.block_size
        positions = cache.lengths[:, None] + jnp.arange(k)
        logits, _ = forward(Transformer(self.config, gate_from=0), params, block_BK, positions,
                            mask=masks.bidirectional(k), cache=cache)
        return logits

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
            return s.replace(block=jnp.where(now, chosen, s.block), nfe=nfe,
                             passes=jnp.where(now, nfe[:, None], s.passes), n=s.n + 1)

        start = _FillState(block=block, nfe=nfe, passes=jnp.zeros(block.shape, jnp.int32), n=jnp.int32(1))
        first = reveal(start, logits, False)
        # Every pass reveals >= 1 undecided position of each row, so k passes always suffice.
        return jax.lax.while_loop(
            lambda s: undecided(s.block).any() & (s.n <= k),
            lambda s: reveal(s, self.refine_pass(params, cache, s.block), True), first)

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array, knobs: TracedSettings,
               prompt_BT: jax.Array | None = None, prompt_lens_B: jax.Array | None = None) -> DecodeOutput:
        """Decodes block after block until every row hit EOS or `max_new_tokens` (the prompt is unused)."""
        k, batch = self.block_size, last_token_B.shape[0]
        mask_id = self.config.mask_token_id
        assert mask_id is not None  # __post_init__ refused a config without one

        def block_body(s: _BlockState) -> _BlockState:
            offset = s.index * k
            live = ~s.done
            new_block = jnp.full((batch, k), mask_id, jnp.int32)
            logits, kv = self.first_pass(params, s.cache, s.pending, s.pending_count, new_block)
            cache = append(s.cache, kv.k, kv.v, s.pending_count)
            budget = jnp.full((batch,), self.max_new_tokens - offset)
            filled = self.fill_block(params, cache, new_block, logits, live, budget, knobs.gamma, s.nfe + live,
                                     jax.random.fold_in(rng, s.index))
            kept, ended = kept_through_eos(self._is_eos(filled.block),
                                           jnp.where(live, jnp.minimum(k, self.max_new_tokens - offset), 0))
            done = s.done | ended | (offset + k >= self.max_new_tokens)
            return s.replace(
                index=s.index + 1, cache=cache, pending=filled.block,
                pending_count=jnp.where(done, 0, k).astype(jnp.int32),
                tokens=jax.lax.dynamic_update_slice(s.tokens, jnp.where(live[:, None], filled.block, 0), (0, offset)),
                passes=jax.lax.dynamic_update_slice(s.passes, filled.passes, (0, offset)),
                nfe=filled.nfe, count=s.count + kept, done=done)

        zeros = jnp.zeros((batch,), jnp.int32)
        init = _BlockState(index=jnp.int32(0), cache=cache,
                           pending=jnp.zeros((batch, k), jnp.int32).at[:, 0].set(last_token_B),
                           pending_count=jnp.ones((batch,), jnp.int32),
                           tokens=jnp.zeros((batch, self.output_len), jnp.int32),
                           passes=jnp.zeros((batch, self.output_len), jnp.int32), nfe=zeros, count=zeros,
                           done=jnp.zeros((batch,), bool))
        final = jax.lax.while_loop(lambda s: (s.index < self.num_blocks) & ~jnp.all(s.done), block_body, init)
        return DecodeOutput(tokens=final.tokens, num_tokens=final.count, nfe=final.nfe, reveal_pass=final.passes,
                            corrected=jnp.zeros(final.tokens.shape, bool), drafted=zeros, accepted=zeros,
                            lookup_drafted=zeros, lookup_accepted=zeros, narrow_passes=zeros)

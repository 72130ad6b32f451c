"""Verified (lossless) SBD: blocks drafted by the SBD model and kept only where NTP agrees."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoders import DecodeOutput, Knobs, kept_through_eos
from sbd_jax.kv_cache import KVCache, append
from sbd_jax.sbd_decoder import BlockDecoder
from sbd_jax.token_choice import draw, greedy_token, leading_true, sampling_logits, speculative_accept, without_token


@struct.dataclass
class _VerifyState:
    iteration: jax.Array
    cache: KVCache
    pending: jax.Array  # [B, k] an exact token, then the drafts it is followed by
    pending_count: jax.Array  # [B] 1 + drafts
    draft_logits: jax.Array  # [B, k, V] sampling: at j, the distribution drafts[j] was drawn from ([B, k, 0] greedy)
    # [B, N + k, 3]: each output slot's token, pass and whether it corrects a draft (one scatter a pass)
    record: jax.Array
    nfe: jax.Array
    count: jax.Array
    done: jax.Array
    drafted: jax.Array
    accepted: jax.Array


@dataclasses.dataclass(frozen=True)
class VerifiedSBDDecoder(BlockDecoder):
    """Self-speculative SBD whose output follows NTP's distribution exactly (greedy: NTP's very tokens).

    The pass that commits a block runs it causally, so its logits are NTP's predictions for the block;
    the drafts are tested against them (greedy: kept while equal; sampling: the speculative ratio test)
    and the cache keeps exactly the accepted tokens. Drafts always come from one pass, so every forward
    verifies and `nfe <= new tokens`; γ (in `Knobs`) plays no part. A block's first token is never
    drafted: the causal logit of the token before it gives it exactly.
    Exact means in float32. In bf16 the verifying pass rounds differently from NTP's one-token pass (other
    shapes), so near-tied tokens can flip: measured as often as NTP flips them between batch sizes.
    """

    # The sampling branch's accept / resample rule (a class attribute: tests swap in broken variants).
    speculative_test = staticmethod(speculative_accept)

    @property
    def output_len(self) -> int:
        return self.max_new_tokens + self.block_size  # rows advance by what they accept; drafts reach k past

    @property
    def output_label(self) -> str:
        return f"max_new_tokens + block size {self.block_size}"

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array,
               knobs: Knobs) -> DecodeOutput:
        """Decodes until every row hit EOS or `max_new_tokens`.

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
                exact = greedy_token(p_logits)
                accepted = leading_true(is_draft & (drafts == exact))
                next_token = jnp.take_along_axis(exact, accepted[:, None], axis=1)[:, 0]
            emitted = jnp.where(j < accepted[:, None], drafts, next_token[:, None])
            kept, ended = kept_through_eos(self._is_eos(emitted) & (j <= accepted[:, None]),
                                           jnp.where(live, jnp.minimum(accepted + 1, self.max_new_tokens - s.count), 0))
            slots = s.count[:, None] + j
            was_corrected = (j == accepted[:, None]) & (accepted < s.pending_count - 1)[:, None]
            eos_before = j > leading_true(~self._is_eos(drafts))[:, None]
            count = s.count + kept
            done = s.done | ended | (count >= self.max_new_tokens)
            # Every draft accepted: this pass's block holds, `next_token` at its first position and drafts
            # from this pass's block logits after it, as far as max_new_tokens can still reach.
            whole = (accepted == s.pending_count - 1) & ~done
            q_logits = dist(block_logits)
            room = (j[None] >= 1) & (j[None] < (self.max_new_tokens - count + 1)[:, None])
            block = jnp.where(room, draw(q_logits, draft_rng, self.temperature), mask_id).at[:, 0].set(next_token)
            restart = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(next_token)
            return s.replace(
                iteration=s.iteration + 1,
                cache=append(s.cache, kv.k, kv.v, jnp.where(live, accepted + 1, 0)),  # the accepted pending tokens
                pending=jnp.where(whole[:, None], block, restart),
                pending_count=jnp.where(whole, k, 1).astype(jnp.int32),
                # The next pass tests pending position j + 1 against q at block position j + 1.
                draft_logits=jnp.roll(q_logits, -1, axis=1) if sampling else s.draft_logits,
                record=s.record.at[rows, slots].set(
                    jnp.stack([emitted, jnp.broadcast_to(nfe[:, None], emitted.shape), was_corrected], axis=-1),
                    mode="drop"),
                nfe=nfe, count=count, done=done,
                drafted=s.drafted + jnp.where(live, (is_draft & (drafts != mask_id) & ~eos_before).sum(axis=1), 0),
                accepted=s.accepted + jnp.where(live, jnp.minimum(accepted, kept), 0))

        zeros = jnp.zeros((batch,), jnp.int32)
        vocab = self.config.vocab_size if sampling else 0  # greedy tests drafts by equality: no q kept
        width = self.output_len
        init = _VerifyState(iteration=jnp.int32(0), cache=cache,
                            pending=jnp.zeros((batch, k), jnp.int32).at[:, 0].set(last_token_B),
                            pending_count=jnp.ones((batch,), jnp.int32),
                            draft_logits=jnp.zeros((batch, k, vocab), jnp.float32),
                            record=jnp.zeros((batch, width, 3), jnp.int32), nfe=zeros, count=zeros,
                            done=jnp.zeros((batch,), bool), drafted=zeros, accepted=zeros)
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
        return DecodeOutput(tokens=final.record[..., 0], num_tokens=final.count, nfe=final.nfe,
                            reveal_pass=final.record[..., 1], corrected=final.record[..., 2] == 1,
                            drafted=final.drafted, accepted=final.accepted)

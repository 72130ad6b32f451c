"""Verified (lossless) decoding: drafted tokens kept only where NTP agrees, drafts from SBD's masked block,
from prompt lookup, or from either (hybrid)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding.base import DecodeOutput, TracedSettings, kept_through_eos
from sbd_jax.decoding.drafts import Drafts, check_fallback_blocks, check_lookup_min_match, draft_source
from sbd_jax.decoding.lookup import lookup_drafts
from sbd_jax.decoding.sbd import BlockDecoder
from sbd_jax.decoding.token_choice import (
    draw,
    greedy_token,
    leading_true,
    sampling_logits,
    speculative_accept,
    without_token,
)
from sbd_jax.errors import UserError
from sbd_jax.model.kv_cache import KVCache, append
from sbd_jax.model.transformer import NewKV, Transformer, forward

CHAIN_SOURCES = (Drafts.SBD, Drafts.LOOKUP, Drafts.HYBRID)  # the sources this decoder checks as one chain
# Names `sbd_preferred`'s rule; change it with the rule: cached hybrid results are keyed by it (greedy outputs
# do not change with the rule, the forwards they took do).
PRIOR_PASSES = 8  # chosen on validation prompts (`benchmarks/hybrid_rule.py`): 4, 8, 16 gave 1.597, 1.612, 1.618
HYBRID_RULE = f"kept per pass spent, {PRIOR_PASSES} prior passes"


def fallbacks_used(fallback_blocks: int, block_size: int) -> int:
    """The fallback blocks a pass runs: at most one for each of the k - 1 drafts that can be rejected."""
    return min(fallback_blocks, block_size - 1)


def sbd_preferred(sbd_kept: jax.Array, sbd_passes: jax.Array, lookup_kept: jax.Array,
                  lookup_passes: jax.Array) -> jax.Array:
    """Hybrid's choice, per row, where lookup has a match: SBD's block if its drafts have been kept at
    least as often per pass spent on them (`sbd_passes`) as lookup's per pass that verified them. Each mean
    starts from `PRIOR_PASSES` imagined passes that kept one draft each: a source that loses the choice is
    not tried again until the other's mean falls below it, so a mean must not rest on one or two unlucky
    passes. A tie goes to SBD, whose block would be lost if lookup's drafts were rejected."""
    return ((sbd_kept + PRIOR_PASSES) * (lookup_passes + PRIOR_PASSES)
            >= (lookup_kept + PRIOR_PASSES) * (sbd_passes + PRIOR_PASSES))


class _VerifyState(struct.PyTreeNode):
    iteration: jax.Array
    cache: KVCache
    pending: jax.Array  # [B, k] an exact token, then the drafts it is followed by
    pending_count: jax.Array  # [B] 1 + drafts
    from_lookup: jax.Array  # [B] the pending drafts came from prompt lookup (else from SBD's block)
    draft_logits: jax.Array  # [B, k, V] sampling: at j, the distribution drafts[j] was drawn from ([B, k, 0] greedy)
    history: jax.Array  # [B, T + N + k] lookup: prompt, then the emitted tokens ([B, 0] for SBD drafts)
    # [B, N + k, 3]: each output slot's token, pass and whether it corrects a draft (one scatter a pass)
    record: jax.Array
    nfe: jax.Array
    count: jax.Array
    done: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    lookup_drafted: jax.Array
    lookup_accepted: jax.Array
    sbd_uses: jax.Array  # [B] passes that verified drafts from SBD's block (hybrid's choice reads these)
    sbd_rejections: jax.Array  # [B] of those, the passes that rejected one of its drafts
    lookup_uses: jax.Array  # [B] passes that verified lookup drafts
    narrow_passes: jax.Array  # [B] passes run as the exact token alone (lookup drafts: no row had drafts)


@dataclasses.dataclass(frozen=True)
class VerifiedSBDDecoder(BlockDecoder):
    """Speculative decoding against the model's own NTP: the output follows NTP's distribution exactly
    (greedy: NTP's very tokens), whatever proposes the drafts.

    Each forward runs the pending tokens (an exact token and up to k - 1 drafts after it) causally after
    the cache, so its logits are NTP's predictions for them; drafts are tested against those (greedy:
    kept while equal; sampling: the speculative ratio test) and the cache keeps exactly the accepted
    tokens. Every forward verifies, so `nfe <= new tokens`; γ (in `TracedSettings`) plays no part. `drafts`:
    - `sbd`: the same forward also runs an all-masked block after the pending tokens; if every draft is
      accepted, its guesses are the next drafts (after a rejection they guessed past the wrong prefix, and
      the next forward drafts nothing). The pass is 2k tokens; the model needs a mask token.
      `fallback_blocks` n (at most k - 1 are used): n more masked blocks in the same forward, block a
      after the exact token and drafts 1..a, so that where draft a + 1 is rejected the next forward still
      has drafts, guessed after exactly the tokens kept (TiDAR drafts after every possible prefix the same
      way). The pass is (2 + n) k tokens: on a GPU, which reads the weights and cache once a pass whatever
      its width, nearly free; on a CPU it costs about in proportion.
    - `lookup`: the tokens that followed the latest earlier occurrence of the context's last 1-4 tokens
      (`sbd_jax.decoding.lookup`), after every forward, accepted or not. The pass is the k pending tokens alone and
      needs no mask token: any causal LM, SBD-trained or not. A pass where no row has drafts runs the one
      exact token alone (a k-token pass costs 1.6-2.1 a 1-token one on a CPU). `lookup_min_match`: the
      shortest n-gram match that proposes drafts (also hybrid's); 1 drafts wherever the last token recurs,
      2 only where the last two do: fewer passes carry drafts, more of those are kept, and at batch 1 the
      others are one-token passes, which is faster where a wide pass costs much more than a narrow one
      (`benchmarks/lookup_decode.py` measures both).
    - `hybrid`: both, per block (2k-token pass): where lookup has no match, SBD's block if it holds (every
      draft of the previous block accepted). Where it has one, each row weighs the drafts each source has
      had kept per pass spent on it (`sbd_preferred`) and takes lookup's drafts unless SBD's are kept at
      least as often. Where SBD's block holds, its passes spent are those that verified it; where it does
      not, taking SBD means a pass without drafts first (so that the next block holds), so each pass that
      rejected one of its drafts counts twice. Fixed orders each lose where the other source is better:
      SBD's block first fell to SBD's 1.09 tokens per forward on real text where its drafts are poor, lookup
      first to 1.47 at block 8 on the small-scale model, where lookup matches almost every block, its drafts
      are 5% right and SBD's ~100%; this rule matches SBD alone there and beats lookup alone on real text
      (`benchmarks/results/hybrid_rule_cpu.json`).
    Exact means in float32. In bf16 the verifying pass rounds differently from NTP's one-token pass (other
    shapes), so near-tied tokens can flip: measured as often as NTP flips them between batch sizes.
    """

    drafts: Drafts = Drafts.SBD
    lookup_min_match: int = 1
    fallback_blocks: int = 0

    # The sampling branch's accept / resample rule (a class attribute: tests swap in broken variants).
    speculative_test = staticmethod(speculative_accept)

    @staticmethod
    def pass_keys(rng: jax.Array, iteration: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This forward's keys: the accept test's, the next token's and the new drafts' (three streams;
        tests swap in a variant that reuses one)."""
        accept_rng, token_rng, draft_rng = jax.random.split(jax.random.fold_in(rng, iteration), 3)
        return accept_rng, token_rng, draft_rng

    @staticmethod
    def next_draft_logits(q_logits: jax.Array) -> jax.Array:
        """`[B, k, V]`: at j, the distribution of the next pass's draft j (pending position j + 1), drawn at
        block position j + 1 of this pass (tests swap in a variant off by one position)."""
        return jnp.roll(q_logits, -1, axis=1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafts", draft_source(self.drafts))  # a name given as a str: one hash either way
        if self.drafts not in CHAIN_SOURCES:
            raise UserError(f"drafts {self.drafts.value!r} form a tree: decode them with TreeVerifiedDecoder "
                            "(Settings picks it)")
        check_lookup_min_match(self.lookup_min_match, self.drafts)
        check_fallback_blocks(self.fallback_blocks, self.drafts)
        super().__post_init__()

    @property
    def fallbacks(self) -> int:
        """The fallback blocks this decoder's pass runs (`fallbacks_used`)."""
        return fallbacks_used(self.fallback_blocks, self.block_size)

    @property
    def needs_mask_token(self) -> str | None:
        if not self.drafts.reads_masked_block:
            return None
        return (f"drafts {self.drafts.value!r} (--drafts {self.drafts.value}) come from the masked block: this "
                "model has no mask token configured; use --drafts lookup (any model), fine-tune it with train.py (which sets "
                "one) or pass --mask-token-id")

    @property
    def output_len(self) -> int:
        return self.max_new_tokens + self.block_size  # rows advance by what they accept; drafts reach k past

    @property
    def output_label(self) -> str:
        return f"max_new_tokens + block size {self.block_size}"

    def verify_pass(self, params: Any, cache: KVCache, pending_BK: jax.Array, any_drafts: jax.Array
                    ) -> tuple[jax.Array, NewKV]:
        """The k pending tokens causally after the cache (lookup drafts: no masked block to run), or where no
        row has drafts (`any_drafts` false) the exact token alone, its logits and keys/values padded to k."""
        k = self.block_size

        def run(tokens: jax.Array) -> tuple[jax.Array, NewKV]:
            positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
            logits, kv = forward(Transformer(self.config), params, tokens, positions, cache=cache)
            short = k - tokens.shape[1]  # logits [B, T, V]; keys / values [layers, B, T, ...]
            return (jnp.pad(logits, [(0, 0), (0, short), (0, 0)]),
                    NewKV(*(jnp.pad(x, [(0, 0), (0, 0), (0, short)] + [(0, 0)] * (x.ndim - 3)) for x in kv)))

        if k == 1:
            return run(pending_BK)
        return jax.lax.cond(any_drafts, run, lambda tokens: run(tokens[:, :1]), pending_BK)

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array, knobs: TracedSettings,
               prompt_BT: jax.Array | None = None, prompt_lens_B: jax.Array | None = None) -> DecodeOutput:
        """Decodes until every row hit EOS or `max_new_tokens`.

        Each iteration is one forward over `pending` (an exact token and the drafts after it; with SBD
        drafts, and a new all-masked block). Its causal logits at pending position j give `p_j`, NTP's
        distribution of the token after it (tempered / top-p truncated as NTP samples it). Drafts are
        tested left to right; the first rejected one is replaced, and after the last accepted one (or
        the replacement) nothing of `pending` is kept. If every draft was accepted, one more token is
        drawn from `p` after them. It starts the next pending block, whose drafts come from this same
        pass's masked block (SBD) or from the context (lookup).

        Greedy: a draft is accepted iff it equals argmax `p_j`; the replacement is that argmax.
        Sampling: at every position, given everything decided before it, draft `d_j` has a known
        distribution `q_j` and is independent of the test at that position: SBD's `d_j` was drawn from
        the masked block's distribution at its position, computed from the prefix alone (the whole block
        masked), independently of the other drafts; lookup's `d_j` is a function of the prefix (q_j a point
        mass); hybrid's choice between them reads only what was decided before the block, and with fallback
        blocks which block's q applies is read from this pass's test, i.e. from tokens already decided, while
        each block's q comes from the tokens before it alone. Accept `d_j`
        with probability min(1, p_j(d_j) / q_j(d_j)); on rejection draw from normalize(max(0, p_j - q_j)).
        Then P(token = x | past) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) (p(x) - q(x))^+ /
        sum_y (p(y) - q(y))^+ = min(q(x), p(x)) + (p(x) - q(x))^+ = p(x) (Leviathan et al., 2023); for a
        point mass at d: d is kept with probability p(d), else x != d is drawn from p renormalised without
        d, so again P(x) = p(x). p_j depends on the past only through the prefix, so the emitted sequence
        is distributed exactly as NTP sampling's. Drafts revealed over several EB passes would make q_j
        depend on earlier (even later) drafts and break this; here there are none.
        `prompt_BT` / `prompt_lens_B`: the right-padded prompts, which lookup searches with the output.
        """
        k, batch = self.block_size, last_token_B.shape[0]
        mask_id = self.config.mask_token_id
        sampling = self.temperature > 0
        lookup, masked = self.drafts.reads_context, self.drafts.reads_masked_block
        if lookup and (prompt_BT is None or prompt_lens_B is None):
            raise UserError(f"drafts {self.drafts.value!r} search the prompt: pass prompt_BT and prompt_lens_B to decode")
        lens_B = jnp.zeros((batch,), jnp.int32) if prompt_lens_B is None else prompt_lens_B
        j = jnp.arange(k)
        rows = jnp.arange(batch)[:, None]
        vocab = self.config.vocab_size

        def dist(logits: jax.Array) -> jax.Array:  # logits of the distribution tokens are drawn from
            return sampling_logits(without_token(logits, mask_id), self.temperature, self.top_p)

        def lookup_block(history: jax.Array, count: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
            """[B, k]: `first` then lookup's drafts after it, and how many drafts (room left permitting)."""
            found, n = lookup_drafts(history, lens_B + count, k - 1, min_match=self.lookup_min_match)
            return jnp.concatenate([first[:, None], found], axis=1), jnp.minimum(n, self.max_new_tokens - count)

        def point_mass(tokens: jax.Array) -> jax.Array:  # [B, k, V] logits of δ at each token
            return jnp.where(jnp.arange(vocab) == tokens[..., None], 0.0, -jnp.inf)

        def body(s: _VerifyState) -> _VerifyState:
            live = ~s.done
            accept_rng, token_rng, draft_rng = self.pass_keys(rng, s.iteration)
            if masked:
                assert mask_id is not None  # __post_init__ refused a config without one
                pending_logits, block_logits, kv = self.first_pass(
                    params, s.cache, s.pending, s.pending_count, jnp.full((batch, k), mask_id, jnp.int32),
                    causal_logits=True, fallback_blocks=self.fallbacks)
                assert pending_logits is not None  # causal_logits=True returns them
                narrow = jnp.zeros((batch,), bool)
            else:
                wide = jnp.any(live & (s.pending_count > 1))
                pending_logits, kv = self.verify_pass(params, s.cache, s.pending, wide)
                narrow = live & ~wide & (k > 1)
            nfe = s.nfe + live
            p_logits = dist(pending_logits)  # [B, k, V]: at j, NTP's distribution of the token after j
            drafts = jnp.concatenate([s.pending[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
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
            room = jnp.maximum(self.max_new_tokens - count, 0)  # drafts that could still be emitted
            restart = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(next_token)
            pending, pending_count = restart, jnp.ones((batch,), jnp.int32)
            from_lookup = jnp.zeros((batch,), bool)
            draft_logits = s.draft_logits
            if masked:
                # A block holds where it was placed after exactly the tokens kept: the one after every draft
                # where all were accepted, else the fallback block after the accepted ones, if there is one.
                # `next_token` goes at its first position and drafts from its logits after it, as far as
                # max_new_tokens can still reach.
                whole = accepted == s.pending_count - 1
                holds = (whole | (accepted < self.fallbacks)) & ~done
                chosen = jnp.minimum(jnp.where(whole, 0, 1 + accepted), self.fallbacks)  # block 0: after all
                q_logits = dist(jnp.take_along_axis(block_logits, chosen[:, None, None, None], axis=1)[:, 0])
                block = draw(q_logits, draft_rng, self.temperature).at[:, 0].set(next_token)
                pending = jnp.where(holds[:, None], block, pending)
                pending_count = jnp.where(holds, 1 + jnp.minimum(k - 1, room), pending_count)
                if sampling:
                    draft_logits = self.next_draft_logits(q_logits)
            drafted_now = jnp.where(live, (is_draft & ~eos_before).sum(axis=1), 0)
            accepted_now = jnp.where(live, jnp.minimum(accepted, kept), 0)
            accepted_sum = s.accepted + accepted_now
            lookup_accepted = s.lookup_accepted + jnp.where(s.from_lookup, accepted_now, 0)
            verified_drafts = live & (s.pending_count > 1)
            sbd_uses = s.sbd_uses + (verified_drafts & ~s.from_lookup)
            sbd_rejections = s.sbd_rejections + (verified_drafts & ~s.from_lookup & (accepted < s.pending_count - 1))
            lookup_uses = s.lookup_uses + (verified_drafts & s.from_lookup)
            history = s.history
            if lookup:
                history = history.at[rows, (lens_B + s.count)[:, None] + j].set(emitted, mode="drop")
                found, n = lookup_block(history, count, next_token)
                from_lookup = (n > 0) & ~done
                if masked:
                    # Hybrid: lookup's match unless SBD's drafts have been kept more per pass spent on them. Where
                    # this pass's block holds, that is per pass that verified them; where it does not, SBD's
                    # drafts need a pass without drafts first, so each pass that rejected one counts twice.
                    sbd_passes = sbd_uses + jnp.where(holds, 0, sbd_rejections)
                    from_lookup &= ~sbd_preferred(accepted_sum - lookup_accepted, sbd_passes, lookup_accepted,
                                                  lookup_uses)
                pending = jnp.where(from_lookup[:, None], found, pending)
                pending_count = jnp.where(from_lookup, 1 + n, pending_count)
                if sampling:
                    lookup_q = point_mass(jnp.roll(found, -1, axis=1))
                    draft_logits = jnp.where(from_lookup[:, None, None], lookup_q, draft_logits)
            return s.replace(
                iteration=s.iteration + 1,
                cache=append(s.cache, kv.k, kv.v, jnp.where(live, accepted + 1, 0)),  # the accepted pending tokens
                pending=pending, pending_count=pending_count.astype(jnp.int32), from_lookup=from_lookup,
                draft_logits=draft_logits, history=history,
                record=s.record.at[rows, slots].set(
                    jnp.stack([emitted, jnp.broadcast_to(nfe[:, None], emitted.shape), was_corrected], axis=-1),
                    mode="drop"),
                nfe=nfe, count=count, done=done, drafted=s.drafted + drafted_now, accepted=accepted_sum,
                lookup_drafted=s.lookup_drafted + jnp.where(s.from_lookup, drafted_now, 0),
                lookup_accepted=lookup_accepted, sbd_uses=sbd_uses, sbd_rejections=sbd_rejections,
                lookup_uses=lookup_uses,
                narrow_passes=s.narrow_passes + narrow)

        zeros = jnp.zeros((batch,), jnp.int32)
        width = self.output_len
        pending = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(last_token_B)
        pending_count, from_lookup = jnp.ones((batch,), jnp.int32), jnp.zeros((batch,), bool)
        draft_logits = jnp.zeros((batch, k, vocab if sampling else 0), jnp.float32)  # greedy: no q kept
        history = jnp.zeros((batch, 0), jnp.int32)
        if prompt_BT is not None and lookup:  # the first forward's drafts come from the prompt
            history = jnp.concatenate([prompt_BT.astype(jnp.int32), jnp.zeros((batch, width), jnp.int32)], axis=1)
            found, n = lookup_block(history, zeros, last_token_B)
            from_lookup = n > 0
            pending, pending_count = jnp.where(from_lookup[:, None], found, pending), 1 + n
            if sampling:
                draft_logits = point_mass(jnp.roll(found, -1, axis=1))
        init = _VerifyState(iteration=jnp.int32(0), cache=cache, pending=pending,
                            pending_count=pending_count.astype(jnp.int32), from_lookup=from_lookup,
                            draft_logits=draft_logits, history=history,
                            record=jnp.zeros((batch, width, 3), jnp.int32), nfe=zeros, count=zeros,
                            done=jnp.zeros((batch,), bool), drafted=zeros, accepted=zeros, lookup_drafted=zeros,
                            lookup_accepted=zeros, sbd_uses=zeros, sbd_rejections=zeros, lookup_uses=zeros,
                            narrow_passes=zeros)
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
        return DecodeOutput(tokens=final.record[..., 0], num_tokens=final.count, nfe=final.nfe,
                            reveal_pass=final.record[..., 1], corrected=final.record[..., 2] == 1,
                            drafted=final.drafted, accepted=final.accepted, lookup_drafted=final.lookup_drafted,
                            lookup_accepted=final.lookup_accepted, narrow_passes=final.narrow_passes)

"""Verified (lossless) decoding: each pass checks the candidates a draft source proposes (a chain or a tree,
`sbd_jax.decoding.drafts`) and keeps what NTP agrees with, so the output is NTP's (greedy: its very tokens;
sampling: its distribution)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding import tree as trees
from sbd_jax.decoding.base import DecodeOutput, TracedSettings, check_whole_number, kept_through_eos
from sbd_jax.decoding.drafts import (
    Drafts,
    check_draft_memory,
    check_fallback_blocks,
    check_lookup_min_match,
    draft_source,
)
from sbd_jax.decoding.sbd import BlockDecoder
from sbd_jax.decoding.token_choice import draw, point_mass, sampling_logits, speculative_accept, without_token
from sbd_jax.errors import UserError
from sbd_jax.model.kv_cache import KVCache, append
from sbd_jax.model.transformer import NewKV, Transformer, forward

DEFAULT_DRAFT_NODES = 16
# Kept tokens the width rule's calibration starts with, as if the scores had predicted them exactly: until passes
# have kept a few tokens the scores are trusted as they are.
CALIBRATION_PRIOR = 4.0


def check_pass_widths(widths: tuple[int, ...], draft_nodes: int) -> None:
    """Raises UserError unless the pass widths are distinct, increasing and from 1 to 1 + `draft_nodes`."""
    if list(widths) != sorted(set(widths)) or not all(1 <= w <= 1 + draft_nodes for w in widths):
        raise UserError(f"pass widths {tuple(widths)} must be distinct, increasing and from 1 to 1 + draft_nodes "
                        f"({1 + draft_nodes})")


class _Pass(struct.PyTreeNode):
    """What one pass kept (`VerifiedSBDDecoder.pass_at`)."""

    walk: trees.Walk
    kept: jax.Array  # [B] tokens the row keeps (through an EOS, within max_new_tokens)
    done: jax.Array  # [B] the row is finished after this pass
    accepted: jax.Array  # [B] nodes kept
    path_k: jax.Array  # the kept path's keys / values, for the cache
    path_v: jax.Array
    source: Any  # the source's state after it observed the pass


class _State(struct.PyTreeNode):
    iteration: jax.Array
    cache: KVCache
    history: jax.Array  # [B, T + W] prompt then emitted tokens; its last valid token is the next pass's root
    source: Any  # the draft source's own state
    record: jax.Array  # [B, W, 3] each output slot's token, pass and whether it corrects a candidate
    nfe: jax.Array
    count: jax.Array
    done: jax.Array
    drafted: jax.Array  # [B] candidate nodes run
    accepted: jax.Array  # [B] of those, kept
    lookup_drafted: jax.Array  # [B] of the drafted, those the context proposed
    lookup_accepted: jax.Array  # [B] of those, kept
    narrow_passes: jax.Array  # [B] passes run as the root alone (no row had a candidate worth a node)
    expected: jax.Array  # () the scores of the nodes run in live rows: what the width rule expected them to keep


@dataclasses.dataclass(frozen=True)
class VerifiedSBDDecoder(BlockDecoder):
    """Speculative decoding against the model's own NTP: the output follows NTP's distribution exactly
    (greedy: NTP's very tokens), whatever proposes the drafts.

    Each pass runs the root (the token the last pass emitted) and the candidate nodes after the cache, each node
    seeing its ancestors only, so a node's logits are NTP's prediction after its path (`sbd_jax.decoding.tree`:
    the walk, and why it is exact); with SBD drafts the same pass runs masked blocks for the next candidates.
    The cache keeps exactly the accepted path. Every pass verifies, so `nfe <= new tokens`; γ plays no part.
    `drafts`: a `Drafts` name, whose source is built for `block_size` (nodes at most `block_size - 1` deep), or a
    draft-source object. Chains (sbd, lookup, hybrid) have `block_size - 1` nodes, trees `draft_nodes`.
    `draft_memory`: the source keeps what it learnt (the model's successors, earlier answers) across calls: `decode`
    takes the last call's `DecodeOutput.memory` and returns this call's (`generate`'s `DraftMemory` carries it), so
    a call's forwards depend on what was decoded before; its output never does.
    `widths` are the pass widths compiled (root included; the candidates' best first so many), `costs` the seconds
    of a forward at each (measured once per model and machine: `sbd_jax.decoding.tree_width`): each pass takes the
    width with the most expected tokens per second over the live rows, a node's score being its estimated chance
    to be kept times the call's calibration so far: nodes kept over the scores of the nodes run (scores learnt in
    other contexts over-predict: 18-27% of the nodes the rule ran were kept). Without costs a pass runs every
    node, or the root alone where no row has one (a wider pass costs more on a CPU:
    `benchmarks/forward_cost.py`). A source with masked blocks runs every pass at full width.
    Exact means in float32. In bf16 the verifying pass rounds differently from NTP's one-token pass (other
    shapes), so near-tied tokens can flip: measured as often as NTP flips them between batch sizes.
    """

    drafts: Any = Drafts.SBD
    lookup_min_match: int = 1
    fallback_blocks: int = 0
    draft_nodes: int = DEFAULT_DRAFT_NODES
    widths: tuple[int, ...] = ()
    costs: tuple[float, ...] = ()
    draft_memory: bool = False

    # The verdict's rules as class attributes: tests swap in broken variants the exactness checks must catch.
    speculative_test = staticmethod(speculative_accept)
    walk = staticmethod(trees.walk)
    attention_mask = staticmethod(trees.ancestor_mask)
    path_kv = staticmethod(trees.kept_kv)

    @staticmethod
    def pass_keys(rng: jax.Array, iteration: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This pass's keys: the accept test's, the target's tokens' and the new drafts' (three streams;
        tests swap in a variant that reuses one)."""
        accept_rng, token_rng, draft_rng = jax.random.split(jax.random.fold_in(rng, iteration), 3)
        return accept_rng, token_rng, draft_rng

    def __post_init__(self) -> None:
        if isinstance(self.drafts, str):  # a name given as a str: one hash either way
            drafts = draft_source(self.drafts)
            object.__setattr__(self, "drafts", drafts)
            check_lookup_min_match(self.lookup_min_match, drafts)
            check_fallback_blocks(self.fallback_blocks, drafts)
        elif (self.lookup_min_match, self.fallback_blocks) != (1, 0):
            raise UserError("lookup_min_match and fallback_blocks configure the named sources: set them on the draft "
                            "source object instead")
        super().__post_init__()
        if isinstance(self.drafts, Drafts) and self.drafts.is_tree and self.block_size < 2:
            raise UserError(f"drafts {self.drafts.value!r} form trees block_size - 1 deep: give block_size >= 2")
        check_whole_number("draft_nodes", self.draft_nodes, 1)
        check_pass_widths(self.widths, self.nodes)
        if self.widths and self.source.blocks:
            raise UserError("a source with masked blocks runs every pass at full width: give it no pass widths")
        if len(self.costs) != len(self.widths):
            raise UserError(f"give one cost per pass width (widths {self.widths}, costs {self.costs})")
        check_draft_memory(self.draft_memory, self.source.keeps_memory, self.temperature)

    @property
    def source(self) -> Any:
        """The draft source (`drafts` itself, or the one its name builds)."""
        if isinstance(self.drafts, Drafts):
            return self.drafts.source(self.block_size, self.lookup_min_match, self.fallback_blocks, self.draft_memory)
        return self.drafts

    @property
    def nodes(self) -> int:
        """Candidate nodes a pass: a chain's depth, or `draft_nodes`."""
        return self.source.depth if self.source.chain else self.draft_nodes

    @property
    def pass_widths(self) -> tuple[int, ...]:
        """The widths compiled (root and nodes; masked blocks come on top)."""
        if self.widths:
            return self.widths
        return (1 + self.nodes,) if self.source.blocks or not self.nodes else (1, 1 + self.nodes)

    @property
    def needs_mask_token(self) -> str | None:
        if not self.source.blocks:
            return None
        name = self.drafts.value if isinstance(self.drafts, Drafts) else type(self.drafts).__name__
        return (f"drafts {name!r} (--drafts {name}) come from the masked block: this model has no mask token "
                "configured; use --drafts lookup (any model), fine-tune it with train.py (which sets one) or pass "
                "--mask-token-id")

    @property
    def output_len(self) -> int:
        return self.max_new_tokens + self.source.depth + 1  # a pass may emit its depth + 1 tokens

    @property
    def output_label(self) -> str:
        return f"max_new_tokens + draft depth {self.source.depth} + 1"

    def fresh_memory(self) -> Any:
        if not self.draft_memory:
            return None
        return self.source.remember(self.source.init(1, self.config.vocab_size, self.temperature > 0),
                                    jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32))  # no answers yet

    def width_choice(self, tree: trees.Tree, live_B: jax.Array, calibration: jax.Array) -> jax.Array:
        """The index in `pass_widths` this pass runs (class docstring); `calibration` scales the scores."""
        widths = self.pass_widths
        if len(widths) == 1:
            return jnp.int32(0)
        if not self.costs:
            return jnp.where(jnp.any(tree.present & live_B[:, None]), len(widths) - 1, 0).astype(jnp.int32)
        kept = calibration * jnp.cumsum(tree.scores, axis=1).sum(axis=0)  # [N]: first n + 1 nodes (none if done)
        expected = jnp.stack([live_B.sum() + (kept[w - 2] if w > 1 else 0.0) for w in widths])
        return jnp.argmax(expected / jnp.asarray(self.costs)).astype(jnp.int32)

    def run_pass(self, params: Any, cache: KVCache, root_B: jax.Array, part: trees.Tree, anchors_BM: jax.Array
                 ) -> tuple[jax.Array, jax.Array | None, NewKV]:
        """The root, `part`'s nodes (a pass of width `1 + nodes`) and the source's masked blocks after the cache.
        Returns the root's and the nodes' logits `[B, width, V]` (the mask token excluded), the blocks' logits
        `[B, M, k, V]` (None without blocks), and the root's and nodes' keys / values."""
        width, k = 1 + part.tokens.shape[1], (self.source.block_size if self.source.blocks else 0)
        mask = self.attention_mask(part, self.source.depth)
        positions = trees.positions(part, cache.lengths)
        tokens = jnp.concatenate([root_B[:, None], part.tokens], axis=1)
        if self.source.blocks:
            positions, mask = trees.with_blocks(mask, part, anchors_BM, k, cache.lengths)
            assert self.config.mask_token_id is not None  # __post_init__ refused a config without one
            blocks = jnp.full((tokens.shape[0], self.source.blocks * k), self.config.mask_token_id, jnp.int32)
            tokens = jnp.concatenate([tokens, blocks], axis=1)
        logits, kv = forward(Transformer(self.config, gate_from=width if self.source.blocks else None),
                             params, tokens, positions, mask=mask, cache=cache)  # an adapter: blocks alone
        logits = without_token(logits, self.config.mask_token_id)
        blocks_out = logits[:, width:].reshape(logits.shape[0], -1, k, logits.shape[-1]) if self.source.blocks else None
        return logits[:, :width], blocks_out, NewKV(kv.k[:, :, :width], kv.v[:, :, :width])

    def pass_at(self, width: int, params: Any, s: _State, root_B: jax.Array, tree: trees.Tree, anchors_BM: jax.Array,
                candidates: trees.Candidates, keys: tuple[jax.Array, jax.Array, jax.Array]) -> _Pass:
        """One pass at `width` (the root and the first `width - 1` nodes): run it, walk it, tell the source. Every
        per-position step (the target's tokens, a source's harvest) sweeps these positions only, not the widest
        pass's, except for a sampled chain: it is tested at full length (its candidates' distributions are), the
        nodes past the width absent, their logits zero. The target's draws take their noise by the positions'
        shape, so a sampled tree's tokens at one seed depend on the width its passes ran (their distribution
        never does)."""
        accept_rng, token_rng, draft_rng = keys
        live = ~s.done
        part = tree.first(width - 1)
        logits, block_logits, kv = self.run_pass(params, s.cache, root_B, part, anchors_BM)
        if self.source.chain and self.temperature > 0:
            part, logits = tree, _pad(logits, 1, 1 + tree.tokens.shape[1])
        w = self.verdict(part, sampling_logits(logits, self.temperature, self.top_p), candidates, accept_rng,
                         token_rng)
        j = jnp.arange(self.source.depth + 1)
        kept, ended = kept_through_eos(self._is_eos(w.emitted) & (j <= w.accepted[:, None]),
                                       jnp.where(live, jnp.minimum(w.accepted + 1, self.max_new_tokens - s.count), 0))
        done = s.done | ended | (s.count + kept >= self.max_new_tokens)
        accepted = jnp.where(live, jnp.minimum(w.accepted, kept), 0)
        result = trees.PassResult(root=root_B, tree=part, walk=w, logits=logits, block_logits=block_logits,
                                  anchors=anchors_BM, accepted=accepted, live=live, done=done, rng=draft_rng,
                                  temperature=self.temperature, top_p=self.top_p)
        return _Pass(walk=w, kept=kept, done=done, accepted=accepted, path_k=self.path_kv(kv.k, w.path),
                     path_v=self.path_kv(kv.v, w.path), source=self.source.observe(s.source, result))

    def verdict(self, tree: trees.Tree, p_logits: jax.Array, candidates: trees.Candidates, accept_rng: jax.Array,
                token_rng: jax.Array) -> trees.Walk:
        """What the pass keeps: a sampled chain by the speculative ratio test against the distributions its
        candidates were drawn from (point masses where none are given), anything else by the walk (the target's
        argmax or draw at each node, descending while it is a child)."""
        if self.temperature == 0 or not self.source.chain:
            return self.walk(tree, draw(p_logits, token_rng, self.temperature), self.source.depth)
        q = candidates.dists if candidates.dists is not None else point_mass(tree.tokens, p_logits.shape[-1])
        drafts = jnp.pad(tree.tokens, ((0, 0), (0, 1)))
        accepted, next_token = self.speculative_test(p_logits, jnp.pad(q, ((0, 0), (0, 1), (0, 0))), drafts,
                                                     jnp.pad(tree.present, ((0, 0), (0, 1))), accept_rng, token_rng)
        return trees.chain_walk(tree, accepted, next_token)

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array, knobs: TracedSettings,
               prompt_BT: jax.Array | None = None, prompt_lens_B: jax.Array | None = None,
               memory: Any = None) -> DecodeOutput:
        """Decodes until every row hit EOS or `max_new_tokens`: propose, run, walk, keep, tell the source.
        `prompt_BT` / `prompt_lens_B`: the right-padded prompts, which context sources search with the output;
        `memory`: the last call's `DecodeOutput.memory` (with `draft_memory`; None: `fresh_memory()`)."""
        source, batch, depth = self.source, last_token_B.shape[0], self.source.depth
        if prompt_BT is None or prompt_lens_B is None:  # the context sources then search the output alone
            prompt_BT, prompt_lens_B = last_token_B[:, None], jnp.ones((batch,), jnp.int32)
        rows, j = jnp.arange(batch)[:, None], jnp.arange(depth + 1)

        def body(s: _State) -> _State:
            live = ~s.done
            length = prompt_lens_B + s.count
            keys = self.pass_keys(rng, s.iteration)
            # chains as they always were; a tree node that can only be emitted in place of the pass's own token is
            # left out (it would take the slot of one that adds a token)
            room = jnp.where(live, self.max_new_tokens - s.count - (0 if source.chain else 1), 0)
            candidates = source.candidates(s.source, s.history, length, room)
            tree = trees.before_eos(trees.build_tree(candidates, self.nodes), self._is_eos)
            choice = self.width_choice(tree, live, (s.accepted.sum() + CALIBRATION_PRIOR) /
                                       (s.expected + CALIBRATION_PRIOR))
            kept_nodes = jnp.asarray(self.pass_widths)[choice] - 1
            tree = tree.replace(scores=jnp.where(jnp.arange(self.nodes) < kept_nodes, tree.scores, 0.0))
            tree = tree.replace(from_context=tree.from_context & tree.present)
            root = jnp.take_along_axis(s.history, (length - 1)[:, None], axis=1)[:, 0]
            anchors = source.anchors(tree, s.source) if source.blocks else jnp.zeros((batch, 0), jnp.int32)
            step = [functools.partial(self.pass_at, width, params, s, root, tree, anchors, candidates, keys)
                    for width in self.pass_widths]
            p = step[0]() if len(step) == 1 else jax.lax.switch(choice, step)
            w, accepted, nfe, count = p.walk, p.accepted, s.nfe + live, s.count + p.kept
            on_path = jnp.take_along_axis(jnp.pad(tree.from_context, ((0, 0), (1, 0))), w.path[:, 1:], axis=1)
            return s.replace(
                iteration=s.iteration + 1,
                cache=append(s.cache, p.path_k, p.path_v, jnp.where(live, w.accepted + 1, 0)),
                history=s.history.at[rows, length[:, None] + j].set(w.emitted, mode="drop"),
                source=p.source,
                record=s.record.at[rows, s.count[:, None] + j].set(
                    jnp.stack([w.emitted, jnp.broadcast_to(nfe[:, None], w.emitted.shape),
                               (j == w.accepted[:, None]) & w.corrected[:, None]], axis=-1), mode="drop"),
                nfe=nfe, count=count, done=p.done, drafted=s.drafted + tree.present.sum(axis=1),
                accepted=s.accepted + accepted,
                lookup_drafted=s.lookup_drafted + tree.from_context.sum(axis=1),
                lookup_accepted=s.lookup_accepted + (on_path & (j[:-1] < accepted[:, None])).sum(axis=1),
                narrow_passes=s.narrow_passes + (live & (kept_nodes == 0) & (self.nodes > 0)),
                expected=s.expected + jnp.where(live[:, None], tree.scores, 0.0).sum())

        zeros = jnp.zeros((batch,), jnp.int32)
        source_state = source.init(batch, self.config.vocab_size, self.temperature > 0)
        if self.draft_memory:
            source_state = source.recall(source_state, self.fresh_memory() if memory is None else memory)
        history = jnp.concatenate([prompt_BT.astype(jnp.int32),
                                   jnp.zeros((batch, self.output_len), jnp.int32)], axis=1)
        init = _State(iteration=jnp.int32(0), cache=cache, history=history,
                      source=source_state,
                      record=jnp.zeros((batch, self.output_len, 3), jnp.int32), nfe=zeros, count=zeros,
                      done=jnp.zeros((batch,), bool), drafted=zeros, accepted=zeros, lookup_drafted=zeros,
                      lookup_accepted=zeros, narrow_passes=zeros, expected=jnp.float32(0.0))
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
        return DecodeOutput(tokens=final.record[..., 0], num_tokens=final.count, nfe=final.nfe,
                            reveal_pass=final.record[..., 1], corrected=final.record[..., 2] == 1,
                            drafted=final.drafted, accepted=final.accepted, lookup_drafted=final.lookup_drafted,
                            lookup_accepted=final.lookup_accepted, narrow_passes=final.narrow_passes,
                            memory=source.remember(final.source, final.record[..., 0], final.count)
                            if self.draft_memory else None)


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    """`x` zero-padded along `axis` to `size`."""
    return jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])

"""Draft sources that propose one chain a pass: SBD's masked block, prompt lookup, and hybrid (either, per row).

- `SBDBlock`: the pass also runs an all-masked block after the deepest node; where the walk keeps every node, its
  guesses (drawn from its per-position distributions q) are the next pass's chain (after a rejection they guessed
  past the wrong prefix: no chain). The pass is 2k tokens; the model needs a mask token. `fallback_blocks` n (at
  most k - 1 are used): n more masked blocks in the same pass, block a after the root and nodes 1..a - 1, so that
  where node a is rejected the next pass still has a chain, guessed after exactly the tokens kept (TiDAR drafts
  after every possible prefix the same way). The pass is (2 + n) k tokens: on a GPU, which reads the weights and
  cache once a pass whatever its width, nearly free; on a CPU it costs about in proportion.
- `Lookup`: the tokens that followed the latest earlier occurrence of the context's last 1-4 tokens
  (`sbd_jax.decoding.lookup`). The pass is the chain alone and needs no mask token: any causal LM.
- `Hybrid`: both, per row (2k-token pass): where lookup has no match, SBD's block if it holds. Where it has one,
  each row weighs the drafts each source has had kept per pass spent on it (`sbd_preferred`) and takes lookup's
  unless SBD's are kept at least as often. Where SBD's block holds, its passes spent are those that verified it;
  where it does not, taking SBD means a pass without drafts first (so that the next block holds), so each pass
  that rejected one of its drafts counts twice. Fixed orders each lose where the other source is better (SBD
  first where its drafts are poor, lookup first where they are nearly all right); the measured comparison is
  `benchmarks/results/hybrid_rule_cpu.json`.

Sampling: SBD's drafts are draws from q and are tested by the speculative ratio test against that q; lookup's are
point masses. Exact because at every position, given everything decided before it, a draft's q is known and the
draft is independent of the test there: SBD's guess was drawn from the masked block's distribution at its position,
computed from the prefix alone (the whole block masked), independently of the other guesses; lookup's is a function
of the prefix; hybrid's choice between them reads only what earlier passes decided, and with fallback blocks which
block's q applies is read from the test of the pass before (decided tokens), each block's q from the tokens before
it alone. Every source follows the protocol `sbd_jax.decoding.drafts` states.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding.context_drafts import CONTEXT_KEEP
from sbd_jax.decoding.lookup import lookup_drafts
from sbd_jax.decoding.token_choice import draw, point_mass
from sbd_jax.decoding.tree import Candidates, PassResult, Tree, best_first, likeliest

CHAIN_KEEP = 0.5  # an SBD chain draft's chance to be kept per token (the order of a chain's nodes only)
# Names `sbd_preferred`'s rule; change it with the rule: cached hybrid results are keyed by it (greedy outputs
# do not change with the rule, the forwards they took do).
PRIOR_PASSES = 8  # chosen on validation prompts (`benchmarks/hybrid_rule.py`; the figures in its result file)
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


@dataclasses.dataclass(frozen=True)
class Lookup:
    """Prompt lookup's chain: the continuation of the latest earlier match of the longest recurring suffix
    (`min_match`..4 tokens), `depth` tokens."""

    depth: int
    min_match: int = 1
    chain = True
    blocks = 0
    reads_context = True
    keeps_memory = False

    def init(self, batch: int, vocab: int, sampling: bool) -> Any:
        return ()

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        found, n = lookup_drafts(history_BW, length_B, self.depth, min_match=self.min_match)
        d = jnp.arange(self.depth)
        scores = jnp.where(d < jnp.minimum(n, room_B)[:, None], CONTEXT_KEEP ** (d + 1.0), 0.0)
        return Candidates.chain(found, scores, from_context=True)

    def observe(self, state: Any, result: PassResult) -> Any:
        return state


class BlockDrafts(struct.PyTreeNode):
    """What a masked block guessed, for the next pass."""

    tokens: jax.Array  # [B, k - 1, K] block positions 1..k - 1 (0 is the pass's own token): the guess, or top K
    chances: jax.Array  # [B, k - 1, K] a tree's: their probabilities under the block's distribution (chain: unused)
    holds: jax.Array  # [B] the block was placed after exactly the tokens kept
    dists: jax.Array  # [B, k - 1, V] a sampled chain: the logits each guess was drawn from ([B, k - 1, 0] else)


@dataclasses.dataclass(frozen=True)
class SBDBlock:
    """SBD's masked block of `block_size` (and `fallback_blocks` copies): the module docstring says where each
    goes and when its guesses are the next candidates. `top_k` 1: one chain, guesses drawn from the block's
    distributions (argmax when greedy); more: each position's `top_k` most likely tokens, grown best-first into a
    tree on the product of their probabilities (DDTree, arXiv 2604.12989), `beam` paths kept per depth (the
    decoder keeps the best `draft_nodes`, so deep nodes of the likeliest path can give way to likelier
    alternatives); the blocks then go after the likeliest path's last node in the tree and along it."""

    block_size: int
    fallback_blocks: int = 0
    top_k: int = 1
    beam: int = 16
    reads_context = False
    keeps_memory = False

    @property
    def chain(self) -> bool:
        return self.top_k == 1

    @property
    def depth(self) -> int:
        return self.block_size - 1

    @property
    def blocks(self) -> int:
        return 1 + fallbacks_used(self.fallback_blocks, self.block_size)

    def init(self, batch: int, vocab: int, sampling: bool) -> BlockDrafts:
        zeros = jnp.zeros((batch, self.depth, self.top_k))
        return BlockDrafts(tokens=zeros.astype(jnp.int32), chances=zeros, holds=jnp.zeros((batch,), bool),
                           dists=jnp.zeros((batch, self.depth, vocab if sampling and self.chain else 0)))

    def candidates(self, state: BlockDrafts, history_BW: jax.Array, length_B: jax.Array,
                   room_B: jax.Array) -> Candidates:
        room = jnp.where(state.holds, room_B, 0)
        if not self.chain:
            root = jnp.take_along_axis(history_BW, (length_B - 1)[:, None], axis=1)
            return best_first(root, self.depth, self.beam, room, lambda d, last: tuple(
                jnp.broadcast_to(x[:, d][:, None], last.shape + (self.top_k,)) for x in (state.tokens, state.chances)))
        d = jnp.arange(self.depth)
        return Candidates.chain(state.tokens[..., 0], jnp.where(d < room[:, None], CHAIN_KEEP ** (d + 1.0), 0.0),
                                from_context=False, dists=state.dists if state.dists.shape[-1] else None)

    def anchors(self, tree: Tree, state: BlockDrafts) -> jax.Array:
        """`[B, blocks]`: the first block after the pass's likeliest path (`tree.likeliest`: a chain's last node,
        whatever proposed it (hybrid's may be lookup's); a tree's highest-scored child at each node, whichever
        source proposed it), fallback block a after that path's node a - 1."""
        path = likeliest(tree, self.depth)
        along = jnp.minimum(jnp.arange(self.blocks) - 1, path.accepted[:, None]).at[:, 0].set(path.accepted)
        return jnp.take_along_axis(path.path, along, axis=1).astype(jnp.int32)

    def observe(self, state: BlockDrafts, result: PassResult) -> BlockDrafts:
        """The block placed after the walk's last kept node holds; its guesses after the pass's own token are
        the next candidates."""
        assert result.block_logits is not None  # the pass ran this source's blocks
        end = jnp.take_along_axis(result.walk.path, result.walk.accepted[:, None], axis=1)
        placed = result.anchors == end
        chosen = jnp.argmax(placed, axis=1)
        q = result.dist(jnp.take_along_axis(result.block_logits, chosen[:, None, None, None], axis=1)[:, 0])
        if self.chain:  # [B, k, V] above; the guesses are drawn from it (argmax when greedy)
            tokens, chances = draw(q, result.rng, result.temperature)[:, 1:, None], state.chances
        else:
            chances, tokens = jax.lax.top_k(jax.nn.softmax(q[:, 1:], axis=-1), self.top_k)
        return BlockDrafts(tokens=tokens.astype(jnp.int32), chances=chances, holds=placed.any(axis=1) & ~result.done,
                           dists=self.guess_dists(q) if state.dists.shape[-1] else state.dists)

    @staticmethod
    def guess_dists(q_BKV: jax.Array) -> jax.Array:
        """`[B, k - 1, V]`: the distributions the guesses were drawn from, block positions 1..k - 1 (tests swap in
        a variant off by one position)."""
        return q_BKV[:, 1:]


class HybridState(struct.PyTreeNode):
    block: BlockDrafts
    started: jax.Array  # a pass has run (the first pass takes lookup's match wherever there is one)
    sbd_kept: jax.Array  # [B] SBD drafts kept
    sbd_uses: jax.Array  # [B] passes that verified SBD's drafts
    sbd_rejections: jax.Array  # [B] of those, the passes that rejected one
    lookup_kept: jax.Array  # [B] lookup drafts kept
    lookup_uses: jax.Array  # [B] passes that verified lookup's drafts


@dataclasses.dataclass(frozen=True)
class Hybrid:
    """Lookup's chain or SBD's block's, per row (module docstring)."""

    lookup: Lookup
    block: SBDBlock
    chain = True
    reads_context = True
    keeps_memory = False

    @property
    def depth(self) -> int:
        return self.block.depth

    @property
    def block_size(self) -> int:
        return self.block.block_size

    @property
    def blocks(self) -> int:
        return self.block.blocks

    def init(self, batch: int, vocab: int, sampling: bool) -> HybridState:
        zeros = jnp.zeros((batch,), jnp.int32)
        return HybridState(block=self.block.init(batch, vocab, sampling), started=jnp.bool_(False), sbd_kept=zeros,
                           sbd_uses=zeros, sbd_rejections=zeros, lookup_kept=zeros, lookup_uses=zeros)

    def candidates(self, state: HybridState, history_BW: jax.Array, length_B: jax.Array,
                   room_B: jax.Array) -> Candidates:
        lookup = self.lookup.candidates((), history_BW, length_B, room_B)
        block = self.block.candidates(state.block, history_BW, length_B, room_B)
        sbd_passes = state.sbd_uses + jnp.where(state.block.holds, 0, state.sbd_rejections)
        prefer_sbd = state.started & sbd_preferred(state.sbd_kept, sbd_passes, state.lookup_kept, state.lookup_uses)
        from_lookup = (lookup.scores > 0).any(axis=1) & ~prefer_sbd
        if block.dists is not None:  # sampling: lookup's drafts as point masses
            lookup = lookup.replace(dists=point_mass(jnp.diagonal(lookup.paths, axis1=1, axis2=2),
                                                     block.dists.shape[-1]))
        return jax.tree.map(lambda a, b: jnp.where(from_lookup.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                            lookup, block)

    def anchors(self, tree: Tree, state: HybridState) -> jax.Array:
        return self.block.anchors(tree, state.block)

    def observe(self, state: HybridState, result: PassResult) -> HybridState:
        verified = result.live & result.tree.present.any(axis=1)
        from_lookup = result.tree.from_context.any(axis=1)
        return HybridState(
            block=self.block.observe(state.block, result), started=jnp.bool_(True),
            sbd_kept=state.sbd_kept + jnp.where(from_lookup, 0, result.accepted),
            sbd_uses=state.sbd_uses + (verified & ~from_lookup),
            sbd_rejections=state.sbd_rejections + (verified & ~from_lookup & result.walk.corrected),
            lookup_kept=state.lookup_kept + jnp.where(from_lookup, result.accepted, 0),
            lookup_uses=state.lookup_uses + (verified & from_lookup))

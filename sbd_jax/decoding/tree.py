"""Token trees for verification: candidates merged into one tree, the tree's attention, the walk that keeps
what the target agrees with, and the kept path's keys / values.

A pass runs the root (the exact token just emitted, not yet cached) and N nodes after it. Node i has a token,
a parent (0 = the root, p + 1 = node p) and a depth (the root's is 0); it runs at position cache length +
depth and attends to the cache and to its ancestors only (itself included), so its logits are NTP's
distribution after the root-to-node path, whatever else the pass holds. Nodes are ordered best first and
every node's ancestors come before it, so the first w nodes are a tree too: one candidate set serves every
pass width.

Why the walk is exact (any tree whose tokens and shape are fixed before the pass's draws): at the node u it
has reached, the emitted token y is the argmax (greedy) or a draw (sampling) of p_u, NTP's distribution
given exactly the tokens emitted so far; the walk moves to u's child holding y if there is one (siblings hold
distinct tokens, so at most one does) and stops after emitting y otherwise. Every emitted token is therefore
NTP's choice given the emitted prefix, drawn with a fresh coin that nothing before it looked at; the tree
decides only how many of those tokens one forward reveals, never which.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding.token_choice import sampling_logits


class Tree(struct.PyTreeNode):
    """`[B, N]` candidate nodes after the root, best first; a node with score 0 is absent."""

    tokens: jax.Array
    parents: jax.Array  # pass index of the parent: 0 the root, p + 1 node p
    depths: jax.Array  # 1 .. max depth (an absent node: 1)
    scores: jax.Array  # the estimated chance the walk keeps the node (ordering and the width rule)
    from_context: jax.Array  # the context proposed the node (the counters a decode reports)

    @property
    def present(self) -> jax.Array:
        return self.scores > 0

    def first(self, n: int) -> "Tree":
        """The first `n` nodes: a tree of their own (ancestors come first)."""
        return jax.tree.map(lambda x: x[:, :n], self)


class Candidates(struct.PyTreeNode):
    """`[B, M]` proposed nodes, each as its whole path from the root (`paths [B, M, D]`, the node's token at
    depth - 1) with a score; a node's ancestors must be proposed too, none scored below it. Score 0: none."""

    paths: jax.Array
    depths: jax.Array
    scores: jax.Array
    from_context: jax.Array  # [B, M] proposed by a match in the context (else by the model)
    # [B, D, V] sampling, a chain's sources only: the logits each depth's candidate was drawn from
    # (None: every candidate is a function of the past, a point mass)
    dists: jax.Array | None = None

    @staticmethod
    def concatenate(parts: list["Candidates"]) -> "Candidates":
        return jax.tree.map(lambda *x: jnp.concatenate(x, axis=1), *parts)

    @staticmethod
    def chain(tokens_BD: jax.Array, scores_BD: jax.Array, from_context: bool | jax.Array,
              dists: jax.Array | None = None) -> "Candidates":
        """One candidate per depth: node d is `tokens[:, :d + 1]` (score 0: absent, and so is all below it)."""
        batch, depth = tokens_BD.shape
        d = jnp.arange(depth)
        paths = jnp.where(d[None, None, :] <= d[None, :, None], tokens_BD[:, None, :], 0)
        present = jnp.cumprod(scores_BD > 0, axis=1).astype(bool)
        return Candidates(paths=paths, depths=jnp.broadcast_to(d + 1, (batch, depth)),
                          scores=jnp.where(present, scores_BD, 0.0),
                          from_context=jnp.broadcast_to(jnp.asarray(from_context)[..., None], (batch, depth)),
                          dists=dists)


def best_first(root_B1: jax.Array, depth: int, beam: int, room_B: jax.Array, children: Any) -> Candidates:
    """Paths grown from the root a level at a time, the `beam` best kept at each depth (none deeper than `room`):
    `children(d, last_BP)` gives the kept paths' children at depth d + 1 from their last tokens, as tokens and
    chances `[B, P, K]`; a path scores the product of its chances. The model proposes them (not the context)."""
    batch = root_B1.shape[0]
    paths = jnp.zeros((batch, 1, depth), jnp.int32)
    scores, last = jnp.ones((batch, 1)), root_B1
    levels = []
    for d in range(depth):
        tokens, chances = children(d, last)
        child_scores = (scores[:, :, None] * chances * (d < room_B)[:, None, None]).reshape(batch, -1)
        child_paths = jnp.broadcast_to(paths[:, :, None, :], tokens.shape + (depth,)).at[..., d].set(tokens)
        scores, best = jax.lax.top_k(child_scores, min(beam, child_scores.shape[1]))
        paths = jnp.take_along_axis(child_paths.reshape(batch, -1, depth), best[..., None], axis=1)
        last = paths[:, :, d]
        levels.append(Candidates(paths=paths, depths=jnp.full(scores.shape, d + 1, jnp.int32), scores=scores,
                                 from_context=jnp.zeros(scores.shape, bool)))
    return Candidates.concatenate(levels)


def build_tree(candidates: Candidates, num_nodes: int) -> Tree:
    """The `num_nodes` best distinct nodes of `candidates` as a tree.

    A node proposed more than once (by two sources, or two matches) counts once, with its best score. Nodes
    are ranked by score, a shallower one first on equal scores, so a parent (never scored below its child)
    always ranks before it and every prefix of the ranking is a tree."""
    if num_nodes == 0:  # blocks of one token: the root alone
        none = jnp.zeros((candidates.scores.shape[0], 0), jnp.int32)
        return Tree(tokens=none, parents=none, depths=none, scores=none.astype(jnp.float32), from_context=none > 0)
    short = max(num_nodes - candidates.scores.shape[1], 0)  # fewer candidates than nodes: absent ones fill up
    paths = jnp.pad(candidates.paths, ((0, 0), (0, short), (0, 0)))
    depths, scores, from_context = (jnp.pad(x, ((0, 0), (0, short)))
                                    for x in (candidates.depths, candidates.scores, candidates.from_context))
    max_depth = paths.shape[-1]
    d = jnp.arange(max_depth)
    prefix = jnp.where(d < depths[..., None], paths, -1)  # [B, M, D]: the path, -1 past the node
    same = jnp.all(prefix[:, :, None] == prefix[:, None, :], axis=-1) & (depths[:, :, None] == depths[:, None, :])
    best = jnp.max(jnp.where(same, scores[:, None, :], 0.0), axis=-1)
    unique = jnp.argmax(same, axis=-1) == jnp.arange(paths.shape[1])  # the first copy of each node
    key = jnp.where(unique & (depths > 0), best, 0.0)
    order = jax.vmap(lambda k, dep: jnp.lexsort((dep, -k)))(key, depths)[:, :num_nodes]
    def pick(x: jax.Array) -> jax.Array:  # [B, M] or [B, M, D] in ranking order
        return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)

    chosen_prefix, chosen_depth, chosen_score = pick(prefix), pick(depths), pick(key)
    parent_prefix = jnp.where(d < (chosen_depth - 1)[..., None], chosen_prefix, -1)
    is_parent = (jnp.all(parent_prefix[:, :, None] == chosen_prefix[:, None, :], axis=-1)
                 & (chosen_depth[:, None, :] == chosen_depth[:, :, None] - 1) & (chosen_score[:, None, :] > 0))
    found = jnp.any(is_parent, axis=-1) | (chosen_depth == 1)
    token = jnp.take_along_axis(chosen_prefix, jnp.maximum(chosen_depth - 1, 0)[..., None], axis=-1)[..., 0]
    parent = jnp.where(chosen_depth > 1, jnp.argmax(is_parent, axis=-1) + 1, 0)
    present = (chosen_score > 0) & found
    for _ in range(max_depth - 1):  # a node whose parent is absent (a caller that broke the score rule) is too
        present = present & jnp.take_along_axis(jnp.pad(present, ((0, 0), (1, 0)), constant_values=True), parent, 1)
    return Tree(tokens=jnp.where(present, token, 0).astype(jnp.int32),
                parents=jnp.where(present, parent, 0).astype(jnp.int32),
                depths=jnp.where(present, chosen_depth, 1).astype(jnp.int32),
                scores=jnp.where(present, chosen_score, 0.0), from_context=present & pick(from_context))


def ancestor_mask(tree: Tree, max_depth: int) -> jax.Array:
    """`[B, 1 + N, 1 + N]`: pass token q may attend to pass token kv iff kv is q or one of its ancestors
    (the root is everyone's); nodes are at most `max_depth` deep."""
    batch, n = tree.tokens.shape
    parent_of = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.parents], axis=1)  # the root's: itself
    index = jnp.arange(n + 1)
    current = jnp.broadcast_to(index, (batch, n + 1))
    mask = current[:, :, None] == index
    for _ in range(min(max_depth, n)):  # enough hops to reach the root from any node
        current = jnp.take_along_axis(parent_of, current, axis=1)
        mask = mask | (current[:, :, None] == index)
    return mask


def positions(tree: Tree, cache_lengths: jax.Array) -> jax.Array:
    """`[B, 1 + N]`: the root at the cache's length, a node that many past it as its depth."""
    return cache_lengths[:, None] + pass_depths(tree)


def pass_depths(tree: Tree) -> jax.Array:
    """`[B, 1 + N]`: each pass token's depth (the root's 0)."""
    return jnp.concatenate([jnp.zeros((tree.depths.shape[0], 1), tree.depths.dtype), tree.depths], axis=1)


def before_eos(tree: Tree, is_eos: Any) -> Tree:
    """`tree` without the nodes below an end-of-sequence node (nothing is emitted after one)."""
    n = tree.tokens.shape[1]
    ends = jnp.concatenate([jnp.zeros((tree.tokens.shape[0], 1), bool), tree.present & is_eos(tree.tokens)], axis=1)
    parent_of = jnp.concatenate([jnp.zeros_like(tree.parents[:, :1]), tree.parents], axis=1)  # the root's: itself
    reach = ends  # reach[p]: pass token p or one of its ancestors is an EOS node
    for _ in range(n):  # an EOS ancestor is at most n hops up
        reach = jnp.take_along_axis(reach, parent_of, axis=1) | ends
    present = tree.present & ~jnp.take_along_axis(reach, tree.parents, axis=1)
    return tree.replace(scores=jnp.where(present, tree.scores, 0.0), from_context=tree.from_context & present)


def with_blocks(tree_mask: jax.Array, tree: Tree, anchors_BM: jax.Array, block_size: int,
                cache_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The positions `[B, T]` and attention `[B, T, T]` of a pass of the root, the nodes, then one all-masked block
    of `block_size` after each anchor (a pass index): a block's tokens see the anchor's path and their own block
    (bidirectionally), never the other nodes; no node sees a block. T = 1 + N + M k."""
    batch, width = tree_mask.shape[:2]
    k, blocks = block_size, anchors_BM.shape[1]
    anchor_rows = jnp.take_along_axis(tree_mask, anchors_BM[:, :, None], axis=1)  # [B, M, 1 + N]
    anchor_depth = jnp.take_along_axis(pass_depths(tree), anchors_BM, axis=1)  # [B, M]
    block_positions = (cache_lengths[:, None, None] + anchor_depth[:, :, None] + 1 + jnp.arange(k)).reshape(batch, -1)
    block_of = jnp.repeat(jnp.arange(blocks), k)
    mask = jnp.concatenate([
        jnp.concatenate([tree_mask, jnp.zeros((batch, width, blocks * k), bool)], axis=2),
        jnp.concatenate([jnp.repeat(anchor_rows, k, axis=1),
                         jnp.broadcast_to(block_of[:, None] == block_of, (batch, blocks * k, blocks * k))], axis=2),
    ], axis=1)
    return jnp.concatenate([positions(tree, cache_lengths), block_positions], axis=1), mask


class Walk(struct.PyTreeNode):
    """What one pass keeps: the path's pass indices `[B, 1 + D]` (the root, then the accepted nodes; 0 after
    them), how many nodes were accepted, the tokens emitted `[B, 1 + D]` (the accepted nodes' tokens, then the
    target's own token after them), and whether the last of them replaced a rejected candidate."""

    path: jax.Array
    accepted: jax.Array
    emitted: jax.Array
    corrected: jax.Array


def walk(tree: Tree, chosen_BT: jax.Array, max_depth: int) -> Walk:
    """Descends from the root while the target's token at the current node (`chosen_BT`: argmax or draw at
    every pass position) is one of its children (module docstring: why this is exact)."""
    batch = chosen_BT.shape[0]
    if tree.tokens.shape[1] == 0:  # the root alone: one absent node keeps the shapes
        tree = jax.tree.map(lambda x: jnp.zeros((batch, 1), x.dtype), tree)
    current = jnp.zeros((batch,), jnp.int32)
    moving = jnp.ones((batch,), bool)
    accepted = jnp.zeros((batch,), jnp.int32)
    steps = [current]
    for _ in range(max_depth):
        target = jnp.take_along_axis(chosen_BT, current[:, None], axis=1)[:, 0]
        child = tree.present & (tree.parents == current[:, None]) & (tree.tokens == target[:, None])
        moves = moving & child.any(axis=1)
        current = jnp.where(moves, jnp.argmax(child, axis=1) + 1, current).astype(jnp.int32)
        accepted = accepted + moves
        moving = moves
        steps.append(jnp.where(moves, current, 0))
    path = jnp.stack(steps, axis=1)
    last = jnp.take_along_axis(chosen_BT, current[:, None], axis=1)[:, 0]
    node_tokens = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.tokens], axis=1)
    j = jnp.arange(max_depth + 1)
    kept_tokens = jnp.take_along_axis(node_tokens, jnp.roll(path, -1, axis=1), axis=1)
    emitted = jnp.where(j < accepted[:, None], kept_tokens, last[:, None])
    had_children = jnp.any(tree.present & (tree.parents == current[:, None]), axis=1)
    return Walk(path=path, accepted=accepted, emitted=emitted, corrected=had_children)


def likeliest(tree: Tree, max_depth: int) -> Walk:
    """The walk that descends from the root to each node's highest-scored child, greedily by score: where a
    source places its masked blocks (after its end, fallback blocks along it). A chain's is all of it."""
    n = tree.tokens.shape[1]
    if n == 0:  # blocks of one token: the root alone
        return walk(tree, jnp.full((tree.tokens.shape[0], 1), -1, jnp.int32), max_depth)
    child = tree.present[:, None, :] & (tree.parents[:, None, :] == jnp.arange(n + 1)[None, :, None])  # [B, 1+N, N]
    best = jnp.argmax(jnp.where(child, tree.scores[:, None, :], -1.0), axis=-1)
    return walk(tree, jnp.where(child.any(axis=-1), jnp.take_along_axis(tree.tokens, best, axis=1), -1), max_depth)


def chain_walk(tree: Tree, accepted_B: jax.Array, next_token_B: jax.Array) -> Walk:
    """The walk of a chain (node i at depth i + 1) whose first `accepted` nodes were kept, then `next_token`."""
    depth = tree.tokens.shape[1]
    j = jnp.arange(depth + 1)
    kept = j <= accepted_B[:, None]
    tokens = jnp.concatenate([tree.tokens, jnp.zeros_like(tree.tokens[:, :1])], axis=1)
    return Walk(path=jnp.where(kept, j, 0), accepted=accepted_B,
                emitted=jnp.where(j < accepted_B[:, None], tokens, next_token_B[:, None]),
                corrected=accepted_B < tree.present.sum(axis=1))


class PassResult(struct.PyTreeNode):
    """What a verifying pass computed and decided, for a draft source's `observe`."""

    root: jax.Array  # [B] the pass's first token (emitted by the pass before)
    tree: Tree  # the nodes run after it (a sampled chain: all its nodes, those past the pass's width absent)
    walk: Walk
    logits: jax.Array  # [B, 1 + N, V] the root's and `tree`'s nodes' next-token logits (the mask token excluded;
    # an absent node's past the width: zeros)
    block_logits: jax.Array | None  # [B, M, k, V] the masked blocks' logits, as `logits` (None: no blocks)
    anchors: jax.Array  # [B, M] each block's anchor (pass index)
    accepted: jax.Array  # [B] nodes kept (0 in a finished row)
    live: jax.Array  # [B] the row was still decoding
    done: jax.Array  # [B] the row is finished after this pass
    rng: jax.Array  # the key for drafts drawn from this pass
    temperature: float = struct.field(pytree_node=False)
    top_p: float = struct.field(pytree_node=False)

    def dist(self, logits: jax.Array) -> jax.Array:
        """`logits` as the decoder samples from them (tempered, top-p truncated)."""
        return sampling_logits(logits, self.temperature, self.top_p)


def kept_kv(kv_LBT: jax.Array, path_BP: jax.Array) -> jax.Array:
    """A pass's keys or values `[layers, B, 1 + N, ...]` along the kept path `[B, P]`, for `kv_cache.append`."""
    index = path_BP[None, :, :].reshape((1,) + path_BP.shape + (1,) * (kv_LBT.ndim - 3))
    return jnp.take_along_axis(kv_LBT, index, axis=2)

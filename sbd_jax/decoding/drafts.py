"""Draft sources for tree verification: small frozen objects that propose candidate nodes before each pass
and learn from what the pass computed. Each owns a pytree state; the decoder holds the prompt and the emitted
tokens (`history`) and hands them to every source.

- `ContextTrie`: every recent earlier occurrence of the context's longest matching suffix (not only the latest,
  as chain lookup takes), their continuations merged into a trie; a node's score is the share of occurrences
  that continue through it times `CONTEXT_KEEP` per token.
- `Successors`: the model's own top-k next tokens after every token it has run, harvested from every pass's
  logits (accepted nodes or not) and kept per token id, shared by the batch (Token Recycling, arXiv
  2408.08696); expanded from the root best-first, a node scored by the product of the kept probabilities.
  Drafts exist where the context holds no match.
- `Mixed`: the union of sources (a node proposed twice counts once, with its best score).

Exactness needs only that a pass's tree is fixed before its draws: every source reads what earlier passes
produced, never the pass it proposes for (`sbd_jax.decoding.tree`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

from sbd_jax.decoding.lookup import MAX_NGRAM, continuation, match_ends
from sbd_jax.decoding.tree import Candidates
from sbd_jax.errors import UserError


class Drafts(str, enum.Enum):
    """What proposes the drafts verification checks (the CLI's `--drafts`). The first three check one chain a
    pass (`sbd_jax.decoding.verified`), the others a tree (`sbd_jax.decoding.tree_verified`)."""

    SBD = "sbd"  # SBD's masked block (needs an SBD fine-tune: a mask token)
    LOOKUP = "lookup"  # the continuation of the latest earlier match of the context's last 1-4 tokens
    HYBRID = "hybrid"  # per row, whichever of the two has had more drafts kept per pass
    CONTEXT_TREE = "context-tree"  # every recent earlier match, merged into a trie (`ContextTrie`)
    SUCCESSORS = "successors"  # the model's own top-k successors of each token (`Successors`)
    TREE = "tree"  # both, best first (`Mixed`)

    @property
    def is_tree(self) -> bool:
        return self in (Drafts.CONTEXT_TREE, Drafts.SUCCESSORS, Drafts.TREE)

    @property
    def reads_masked_block(self) -> bool:
        return self in (Drafts.SBD, Drafts.HYBRID)

    @property
    def reads_context(self) -> bool:
        return self in (Drafts.LOOKUP, Drafts.HYBRID, Drafts.CONTEXT_TREE, Drafts.TREE)

    def tree_source(self, depth: int, min_match: int = 1) -> Any:
        """The tree source of this name, nodes at most `depth` deep."""
        context = ContextTrie(depth=depth, min_match=min_match)
        return {Drafts.CONTEXT_TREE: context, Drafts.SUCCESSORS: Successors(depth=depth),
                Drafts.TREE: Mixed((context, Successors(depth=depth)))}[self]


def draft_source(drafts: str) -> Drafts:
    """The draft source named `drafts`; UserError for an unknown name (callable before any model is loaded)."""
    try:
        return Drafts(drafts)
    except ValueError:
        raise UserError(f"unknown draft source {drafts!r}: use one of {', '.join(d.value for d in Drafts)}") from None


def check_lookup_min_match(min_match: int, drafts: Drafts) -> None:
    """Raises UserError unless `min_match` is a match length lookup can find (1..MAX_NGRAM) and the drafts
    search the context."""
    if not isinstance(min_match, int) or isinstance(min_match, bool) or not 1 <= min_match <= MAX_NGRAM:
        raise UserError(f"lookup_min_match={min_match!r} must be a whole number from 1 to {MAX_NGRAM} (the longest "
                        "n-gram lookup searches)")
    if min_match != 1 and not drafts.reads_context:
        raise UserError("lookup_min_match (--lookup-min-match) sets when context matches draft: use it with drafts "
                        f"that search the context ({', '.join(d.value for d in Drafts if d.reads_context)}; --drafts)")


def check_fallback_blocks(fallback_blocks: int, drafts: Drafts) -> None:
    """Raises UserError unless `fallback_blocks` is a whole number >= 0, and 0 unless the drafts come from SBD's
    masked block."""
    if not isinstance(fallback_blocks, int) or isinstance(fallback_blocks, bool) or fallback_blocks < 0:
        raise UserError(f"fallback_blocks={fallback_blocks!r} must be a whole number >= 0 (masked blocks after "
                        "each of the first N places a draft can be rejected)")
    if fallback_blocks and not drafts.reads_masked_block:
        raise UserError("fallback_blocks (--fallback-blocks) are masked blocks of SBD's drafts: use them with drafts "
                        "'sbd' or 'hybrid' (--drafts), or drop them")


SUCCESSORS_KEPT = 8  # successors harvested per pass token (Token Recycling keeps 8)
# A context match's chance to be kept per token, before the share of matches that agree (one constant for
# every depth; chosen by hand, to be fitted on validation prompts: `benchmarks/tree_decode.py`).
CONTEXT_KEEP = 0.5


@dataclasses.dataclass(frozen=True)
class ContextTrie:
    """Continuations of the `occurrences` latest earlier matches of the longest suffix (`min_match` ..
    `MAX_NGRAM` tokens) that recurs, `depth` tokens each (a match that runs into the end repeats with its
    period, as chain lookup's); a node scores its share of the matches times `keep` per token."""

    depth: int
    occurrences: int = 8
    min_match: int = 1
    keep: float = CONTEXT_KEEP

    def init(self, batch: int, vocab: int) -> Any:
        return ()

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        batch, width = history_BW.shape
        ends = match_ends(history_BW, length_B, min_match=self.min_match)
        end, _ = jax.lax.top_k(jnp.where(ends, jnp.arange(width), -1), self.occurrences)  # [B, O] latest first
        found = end >= 0
        d = jnp.arange(self.depth)
        cont = continuation(history_BW, end, length_B, self.depth)  # [B, O, D]
        # share[o, d]: occurrences whose first d + 1 tokens equal occurrence o's
        same = jnp.cumprod(cont[:, :, None, :] == cont[:, None, :, :], axis=-1) & found[:, None, :, None]
        share = same.sum(axis=2) / jnp.maximum(found.sum(axis=1), 1)[:, None, None]
        scores = jnp.where(found[:, :, None] & (d < room_B[:, None, None]), share * self.keep ** (d + 1), 0.0)
        occurrences = cont.shape[1]
        paths = jnp.broadcast_to(cont[:, :, None, :], (batch, occurrences, self.depth, self.depth))
        return Candidates(paths=paths.reshape(batch, -1, self.depth),
                          depths=jnp.broadcast_to(d + 1, (batch, occurrences, self.depth)).reshape(batch, -1),
                          scores=scores.reshape(batch, -1))

    def observe(self, state: Any, pass_tokens_BT: jax.Array, present_BT: jax.Array, top_tokens_BTK: jax.Array,
                top_probs_BTK: jax.Array) -> Any:
        return state


@dataclasses.dataclass(frozen=True)
class Successors:
    """The model's `SUCCESSORS_KEPT` most likely successors of every token id it has run (a table shared by the
    batch), expanded from the root `depth` deep keeping the `beam` best nodes per depth."""

    depth: int
    beam: int = 16

    def init(self, batch: int, vocab: int) -> Any:
        return (jnp.zeros((vocab, SUCCESSORS_KEPT), jnp.int32), jnp.zeros((vocab, SUCCESSORS_KEPT), jnp.float32))

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        table_tokens, table_probs = state
        batch = history_BW.shape[0]
        root = jnp.take_along_axis(history_BW, (length_B - 1)[:, None], axis=1)  # [B, 1]
        paths = jnp.zeros((batch, 1, self.depth), jnp.int32)
        scores = jnp.ones((batch, 1))
        last = root
        levels = []
        for d in range(self.depth):
            tokens = table_tokens[last]  # [B, P, K]
            child_scores = scores[:, :, None] * table_probs[last] * (d < room_B)[:, None, None]
            child_paths = jnp.broadcast_to(paths[:, :, None, :], tokens.shape + (self.depth,))
            child_paths = child_paths.at[..., d].set(tokens)
            flat_scores = child_scores.reshape(batch, -1)
            scores, best = jax.lax.top_k(flat_scores, min(self.beam, flat_scores.shape[1]))
            paths = jnp.take_along_axis(child_paths.reshape(batch, -1, self.depth), best[..., None], axis=1)
            last = paths[:, :, d]
            levels.append(Candidates(paths=paths, depths=jnp.full(scores.shape, d + 1, jnp.int32), scores=scores))
        return Candidates.concatenate(levels)

    def observe(self, state: Any, pass_tokens_BT: jax.Array, present_BT: jax.Array, top_tokens_BTK: jax.Array,
                top_probs_BTK: jax.Array) -> Any:
        """Every present pass token's successors become its row of the table (the latest pass wins; where one
        pass runs a token id twice, which of its rows is kept is up to the scatter, so on a GPU the drafts, never
        the output, may differ between runs)."""
        table_tokens, table_probs = state
        ids = jnp.where(present_BT, pass_tokens_BT, table_tokens.shape[0]).reshape(-1)  # absent: dropped
        return (table_tokens.at[ids].set(top_tokens_BTK.reshape(ids.shape[0], -1), mode="drop"),
                table_probs.at[ids].set(top_probs_BTK.reshape(ids.shape[0], -1), mode="drop"))


@dataclasses.dataclass(frozen=True)
class Mixed:
    """Several sources' candidates, one tree (`sbd_jax.decoding.tree.build_tree` merges the duplicates)."""

    sources: tuple[Any, ...]

    @property
    def depth(self) -> int:
        return max(source.depth for source in self.sources)

    def init(self, batch: int, vocab: int) -> Any:
        return tuple(source.init(batch, vocab) for source in self.sources)

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        parts = [source.candidates(s, history_BW, length_B, room_B) for source, s in zip(self.sources, state)]
        depth = self.depth
        return Candidates.concatenate([
            part.replace(paths=jnp.pad(part.paths, ((0, 0), (0, 0), (0, depth - part.paths.shape[-1]))))
            for part in parts])

    def observe(self, state: Any, *pass_results: jax.Array) -> Any:
        return tuple(source.observe(s, *pass_results) for source, s in zip(self.sources, state))

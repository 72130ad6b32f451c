"""Draft sources that propose trees from what the model and the context already hold.

- `ContextTrie`: every recent earlier occurrence of the context's longest matching suffix (not only the latest,
  as chain lookup takes), their continuations merged into a trie; a node's score is the share of occurrences
  that continue through it times `CONTEXT_KEEP` per token. With `draft_memory` it also searches the last
  `ANSWER_MEMORY` tokens of earlier calls' answers (SuffixDecoding's tree of earlier outputs, arXiv 2411.04975,
  bounded) with the context: the longest recurring suffix wins wherever it recurs.
- `Successors`: the model's own top-k next tokens after every token it has run, harvested from every pass's
  logits (accepted nodes or not) and kept per token id, shared by the batch (Token Recycling, arXiv
  2408.08696); expanded from the root best-first, a node scored by the product of the kept probabilities.
  Drafts exist where the context holds no match. With `draft_memory` the table outlives the call: the next
  call of the same model starts from it (Token Recycling's hot start) instead of from an empty table.
- `Mixed`: the union of tree sources (a node proposed twice counts once, with its best score); one of them may
  be SBD's block as a tree (the model then needs a mask token).

Every source follows the protocol `sbd_jax.decoding.drafts` states.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sbd_jax.decoding.lookup import continuation, match_ends
from sbd_jax.decoding.tree import Candidates, PassResult, Tree, best_first
from sbd_jax.errors import UserError

SUCCESSORS_KEPT = 8  # successors harvested per pass token (Token Recycling keeps 8)
# A context match's chance to be kept per token, before the share of matches that agree (one constant for
# every depth; chosen by hand, to be fitted on validation prompts: `benchmarks/tree_decode.py`).
CONTEXT_KEEP = 0.5
ANSWER_MEMORY = 4096  # tokens of earlier answers a context trie with draft memory searches (16 KB as int32)
SEPARATOR = -1  # ends each remembered answer: never a token, so no match or draft crosses it


@dataclasses.dataclass(frozen=True)
class ContextTrie:
    """Continuations of the `occurrences` latest earlier matches of the longest suffix (`min_match` ..
    `MAX_NGRAM` tokens) that recurs, `depth` tokens each (a match that runs into the end repeats with its
    period, as chain lookup's); a node scores its share of the matches times `keep` per token. `answers` > 0:
    the state is the last `answers` tokens of earlier calls' answers, each ended by `SEPARATOR`, kept across
    calls (`remember`) and searched as if they came before the prompt: the longest suffix that recurs in either
    is matched, and among the `occurrences` latest of its matches the context's come first."""

    depth: int
    occurrences: int = 8
    min_match: int = 1
    keep: float = CONTEXT_KEEP
    answers: int = 0
    chain = False
    blocks = 0
    reads_context = True

    @property
    def keeps_memory(self) -> bool:
        return self.answers > 0

    def init(self, batch: int, vocab: int, sampling: bool) -> Any:
        return jnp.full((self.answers,), SEPARATOR, jnp.int32)

    def remember(self, state: Any, outputs_BT: jax.Array, count_B: jax.Array) -> Any:
        """The last `answers` tokens of the memory followed by each row's answer (its first `count` tokens) and a
        separator."""
        batch, width = outputs_BT.shape
        j = jnp.arange(width + 1)
        keep = (j < count_B[:, None]) | (j == width)  # the answer, then its separator
        tokens = jnp.where(j < count_B[:, None], jnp.pad(outputs_BT, ((0, 0), (0, 1))), SEPARATOR).reshape(-1)
        slots = jnp.where(keep.reshape(-1), jnp.cumsum(keep.reshape(-1)) - 1, tokens.shape[0])  # dropped: past the end
        packed = jnp.zeros_like(tokens).at[slots].set(tokens, mode="drop")  # kept tokens first, in order
        return jax.lax.dynamic_slice(jnp.concatenate([state, packed]), (keep.sum(),), (self.answers,))

    def recall(self, state: Any, memory: Any) -> Any:
        return memory

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        if self.answers:  # the remembered answers before each row's context; they end with a separator
            history_BW = jnp.concatenate([jnp.broadcast_to(state, (history_BW.shape[0], self.answers)), history_BW], 1)
            length_B = length_B + self.answers
        batch, width = history_BW.shape
        ends = match_ends(history_BW, length_B, min_match=self.min_match, start=self.answers)  # suffixes: the row's own
        # [B, O] latest first (a history shorter than `occurrences` has fewer places)
        end, _ = jax.lax.top_k(jnp.where(ends, jnp.arange(width), -1), min(self.occurrences, width))
        found = end >= 0
        d = jnp.arange(self.depth)
        cont = continuation(history_BW, end, length_B, self.depth)  # [B, O, D]
        # share[o, d]: occurrences whose first d + 1 tokens equal occurrence o's
        same = jnp.cumprod(cont[:, :, None, :] == cont[:, None, :, :], axis=-1) & found[:, None, :, None]
        share = same.sum(axis=2) / jnp.maximum(found.sum(axis=1), 1)[:, None, None]
        real = jnp.cumprod(cont != SEPARATOR, axis=-1).astype(bool)  # a remembered answer's continuation stops at its end
        scores = jnp.where(found[:, :, None] & real & (d < room_B[:, None, None]), share * self.keep ** (d + 1), 0.0)
        occurrences = cont.shape[1]
        paths = jnp.broadcast_to(cont[:, :, None, :], (batch, occurrences, self.depth, self.depth))
        return Candidates(paths=paths.reshape(batch, -1, self.depth),
                          depths=jnp.broadcast_to(d + 1, (batch, occurrences, self.depth)).reshape(batch, -1),
                          scores=scores.reshape(batch, -1), from_context=jnp.ones((batch, occurrences * self.depth), bool))

    def observe(self, state: Any, result: PassResult) -> Any:
        return state


@dataclasses.dataclass(frozen=True)
class Successors:
    """The model's `SUCCESSORS_KEPT` most likely successors of every token id it has run (a table shared by the
    batch), expanded from the root `depth` deep keeping the `beam` best nodes per depth."""

    depth: int
    beam: int = 16
    chain = False
    blocks = 0
    reads_context = False
    keeps_memory = True  # the table, across calls when asked (Token Recycling keeps it across queries)

    def init(self, batch: int, vocab: int, sampling: bool) -> Any:
        return (jnp.zeros((vocab, SUCCESSORS_KEPT), jnp.int32), jnp.zeros((vocab, SUCCESSORS_KEPT), jnp.float32))

    def remember(self, state: Any, outputs_BT: jax.Array, count_B: jax.Array) -> Any:
        return state

    def recall(self, state: Any, memory: Any) -> Any:
        return memory

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        table_tokens, table_probs = state
        root = jnp.take_along_axis(history_BW, (length_B - 1)[:, None], axis=1)  # [B, 1]
        return best_first(root, self.depth, self.beam, room_B, lambda d, last: (table_tokens[last], table_probs[last]))

    def observe(self, state: Any, result: PassResult) -> Any:
        top_logits, top_tokens = jax.lax.top_k(result.logits, SUCCESSORS_KEPT)
        top_probs = jnp.exp(top_logits - jax.nn.logsumexp(result.logits, axis=-1, keepdims=True))
        return self.harvest(state, jnp.concatenate([result.root[:, None], result.tree.tokens], axis=1),
                            jnp.concatenate([result.live[:, None], result.tree.present], axis=1),
                            top_tokens.astype(jnp.int32), top_probs)

    def harvest(self, state: Any, pass_tokens_BT: jax.Array, present_BT: jax.Array, top_tokens_BTK: jax.Array,
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
    """Several sources' candidates, one tree (`sbd_jax.decoding.tree.build_tree` merges the duplicates). At most
    one of them runs masked blocks (SBD's block as a tree): its blocks go after the whole tree's likeliest path,
    and where the walk keeps another path its guesses are not the next pass's candidates (the block was guessed
    after other tokens), the other sources' are."""

    sources: tuple[Any, ...]
    chain = False

    def __post_init__(self) -> None:
        if any(source.chain for source in self.sources):  # a sampled chain's drafts are tested against their q
            raise UserError("a Mixed tree merges tree sources: give it ContextTrie, Successors or SBDBlock with "
                            "top_k > 1, not a chain source")
        if sum(1 for source in self.sources if source.blocks) > 1:
            raise UserError("a Mixed tree runs the masked blocks of at most one of its sources: give it one SBDBlock")

    @property
    def depth(self) -> int:
        return max(source.depth for source in self.sources)

    @property
    def reads_context(self) -> bool:
        return any(source.reads_context for source in self.sources)

    @property
    def keeps_memory(self) -> bool:
        return any(source.keeps_memory for source in self.sources)

    def remember(self, state: Any, outputs_BT: jax.Array, count_B: jax.Array) -> Any:
        return tuple(source.remember(s, outputs_BT, count_B) if source.keeps_memory else ()
                     for source, s in zip(self.sources, state))

    def recall(self, state: Any, memory: Any) -> Any:
        return tuple(source.recall(s, m) if source.keeps_memory else s
                     for source, s, m in zip(self.sources, state, memory))

    @property
    def _with_blocks(self) -> int | None:
        """The index of the source that runs masked blocks (None: none does)."""
        return next((i for i, source in enumerate(self.sources) if source.blocks), None)

    @property
    def blocks(self) -> int:
        return 0 if self._with_blocks is None else self.sources[self._with_blocks].blocks

    @property
    def block_size(self) -> int:
        assert self._with_blocks is not None, "a Mixed tree without masked blocks has no block size"
        return self.sources[self._with_blocks].block_size

    def init(self, batch: int, vocab: int, sampling: bool) -> Any:
        return tuple(source.init(batch, vocab, sampling) for source in self.sources)

    def candidates(self, state: Any, history_BW: jax.Array, length_B: jax.Array, room_B: jax.Array) -> Candidates:
        parts = [source.candidates(s, history_BW, length_B, room_B) for source, s in zip(self.sources, state)]
        depth = self.depth
        return Candidates.concatenate([
            part.replace(paths=jnp.pad(part.paths, ((0, 0), (0, 0), (0, depth - part.paths.shape[-1]))))
            for part in parts])

    def anchors(self, tree: Tree, state: Any) -> jax.Array:
        i = self._with_blocks
        assert i is not None, "a Mixed tree without masked blocks places none"
        return self.sources[i].anchors(tree, state[i])

    def observe(self, state: Any, result: PassResult) -> Any:
        return tuple(source.observe(s, result) for source, s in zip(self.sources, state))

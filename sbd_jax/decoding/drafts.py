"""Draft sources: what proposes the candidates a verifying pass checks, named by `Drafts` (the CLI's `--drafts`).

A source is a small frozen, hashable dataclass with a pytree state; the decoder (`sbd_jax.decoding.verified`)
holds the prompt and the emitted tokens (`history`) and asks the source, around each pass:
- `depth` (deepest node), `chain` (one candidate per depth, scores never rising with depth, so that pass index
  = depth: sampled chains are tested by the speculative ratio test against the distributions they were drawn
  from, `Candidates.dists`), `reads_context` (it searches the prompt and output: `lookup_min_match` applies),
  `blocks` (all-masked blocks of `block_size` the pass runs for the source, and
  `anchors(tree, state)`: the pass index each goes after; a source with blocks needs a mask token);
- `init(batch, vocab, sampling)`: its state before the first pass;
- `candidates(state, history, length, room)`: `sbd_jax.decoding.tree.Candidates`, none deeper than `room`;
- `observe(state, result)`: its state after a pass (`sbd_jax.decoding.tree.PassResult`);
- `keeps_memory`: it can keep what it learnt across `generate` calls (`draft_memory`): `remember(state, outputs,
  count)`, the batch-independent part kept after a call (the call's answers given), and `recall(state, memory)`,
  the next call's state before its first pass.
Exactness needs only that a pass's candidates are fixed before its draws: a source reads what earlier passes
produced, never the pass it proposes for (`sbd_jax.decoding.tree`). Sources: `sbd_jax.decoding.chain_drafts`
(SBD's block, lookup, hybrid) and `sbd_jax.decoding.context_drafts` (trees of context matches and of the model's
own successors).
"""

from __future__ import annotations

from typing import Any

from sbd_jax.choice import Choice
from sbd_jax.decoding.base import GREEDY_BELOW, check_flag
from sbd_jax.decoding.chain_drafts import Hybrid, Lookup, SBDBlock
from sbd_jax.decoding.context_drafts import ANSWER_MEMORY, ContextTrie, Mixed, Successors
from sbd_jax.decoding.lookup import MAX_NGRAM
from sbd_jax.errors import UserError

SBD_TREE_TOP_K = 4  # tokens a masked-block position offers the tree (DDTree's per-position top-k)


class Drafts(Choice):
    """What proposes the drafts verification checks (the CLI's `--drafts`): sbd, lookup and hybrid one chain a pass,
    the others a tree (SBD's block: `sbd_jax.decoding.chain_drafts`; the context and the model's successors:
    `sbd_jax.decoding.context_drafts`)."""

    SBD = "sbd"  # SBD's masked block (needs an SBD fine-tune: a mask token)
    LOOKUP = "lookup"  # the continuation of the latest earlier match of the context's last 1-4 tokens
    HYBRID = "hybrid"  # per row, whichever of the two has had more drafts kept per pass
    CONTEXT_TREE = "context-tree"  # every recent earlier match, merged into a trie (`ContextTrie`)
    SUCCESSORS = "successors"  # the model's own top-k successors of each token (`Successors`)
    TREE = "tree"  # both, best first (`Mixed`)
    SBD_TREE = "sbd-tree"  # SBD's masked block as a tree of each position's top tokens (`SBDBlock`, top_k > 1)
    TREE_SBD = "tree-sbd"  # tree's and sbd-tree's nodes, best first, as one tree (`Mixed`; needs a mask token)

    @property
    def is_tree(self) -> bool:
        return not self.source(2).chain  # read from the source itself: one place per source

    @property
    def reads_masked_block(self) -> bool:
        return self.source(2).blocks > 0

    @property
    def reads_context(self) -> bool:
        return self.source(2).reads_context

    @property
    def keeps_memory(self) -> bool:
        return self.source(2, memory=True).keeps_memory

    def source(self, block_size: int, min_match: int = 1, fallback_blocks: int = 0, memory: bool = False) -> Any:
        """The draft source of this name for blocks of `block_size` (nodes at most `block_size - 1` deep);
        `memory`: built to keep what it learns across calls (`draft_memory`: context trees then search earlier
        answers too)."""
        depth = block_size - 1
        lookup, block = Lookup(depth, min_match), SBDBlock(block_size, fallback_blocks)
        context = ContextTrie(depth=depth, min_match=min_match, answers=ANSWER_MEMORY if memory else 0)
        successors = Successors(depth=depth)
        block_tree = SBDBlock(block_size, fallback_blocks, top_k=SBD_TREE_TOP_K)
        return {Drafts.SBD: block, Drafts.LOOKUP: lookup, Drafts.HYBRID: Hybrid(lookup, block),
                Drafts.CONTEXT_TREE: context, Drafts.SUCCESSORS: successors, Drafts.TREE: Mixed((context, successors)),
                Drafts.SBD_TREE: block_tree, Drafts.TREE_SBD: Mixed((context, successors, block_tree))}[self]


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
                        f"{', '.join(repr(d.value) for d in Drafts if d.reads_masked_block)} (--drafts), or drop them")


def check_draft_memory(draft_memory: bool, keeps_memory: bool, temperature: float) -> None:
    """Raises UserError unless `draft_memory` is a bool, and False unless the drafts keep what they learn across
    calls (`keeps_memory`, verified decoding) and decoding is greedy."""
    check_flag("draft_memory", draft_memory)
    if draft_memory and not keeps_memory:
        raise UserError("draft_memory (--draft-memory) keeps the model's successors and earlier answers across calls "
                        "for the tree sources: use it with "
                        f"--mode sbd --verify and drafts {', '.join(d.value for d in Drafts if d.keeps_memory)} "
                        "(--drafts)")
    if draft_memory and temperature >= GREEDY_BELOW:  # calls at one seed draw with the same keys
        raise UserError("draft_memory (--draft-memory) is for greedy decoding: a table kept from an earlier sampled "
                        "call can depend on the very draws of this one (same seed), which sampled verification "
                        "must not; drop --temperature or --draft-memory")

"""Tree-verified decoding: each pass checks a tree of candidates from a draft source (`sbd_jax.decoding.drafts`)
and keeps the path the model agrees with, so the output is NTP's (greedy: its very tokens; sampling: its
distribution; `sbd_jax.decoding.tree` says why)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding import tree as trees
from sbd_jax.decoding.base import DecodeOutput, Decoder, TracedSettings, check_whole_number, kept_through_eos
from sbd_jax.decoding.drafts import SUCCESSORS_KEPT
from sbd_jax.decoding.token_choice import draw, sampling_logits, without_token
from sbd_jax.errors import UserError
from sbd_jax.model.kv_cache import KVCache, append
from sbd_jax.model.transformer import NewKV, Transformer, forward

DEFAULT_DRAFT_NODES = 16


def check_pass_widths(widths: tuple[int, ...], draft_nodes: int) -> None:
    """Raises UserError unless the pass widths are distinct, increasing and from 1 to 1 + `draft_nodes`."""
    if list(widths) != sorted(set(widths)) or not all(1 <= w <= 1 + draft_nodes for w in widths):
        raise UserError(f"pass widths {tuple(widths)} must be distinct, increasing and from 1 to 1 + draft_nodes "
                        f"({1 + draft_nodes})")


class _TreeState(struct.PyTreeNode):
    iteration: jax.Array
    cache: KVCache
    history: jax.Array  # [B, T + W] prompt then emitted tokens; its last valid token is the root
    source: Any  # the draft source's own state
    record: jax.Array  # [B, W, 3] each output slot's token, pass and whether it corrects a candidate
    nfe: jax.Array
    count: jax.Array
    done: jax.Array
    drafted: jax.Array  # candidate nodes run
    accepted: jax.Array  # of those, kept
    narrow_passes: jax.Array  # passes run as the root alone (no candidate worth a node)


@dataclasses.dataclass(frozen=True)
class TreeVerifiedDecoder(Decoder):
    """Verified decoding over a tree of up to `draft_nodes` candidates a pass from `source` (a frozen draft
    source, `sbd_jax.decoding.drafts`), nodes at most `source.depth` deep.

    `widths` are the pass widths compiled (root included; the candidates' best first so many), `costs` the
    seconds of a forward at each (measured once per model and machine: `sbd_jax.decoding.tree_width`). Each
    pass takes the width with the most expected tokens per second over the live rows, a node's score being
    its estimated chance to be kept; without costs every pass runs the widest. A pass whose best width is 1
    runs the root alone, as NTP's step."""

    source: Any = None
    draft_nodes: int = DEFAULT_DRAFT_NODES
    widths: tuple[int, ...] = ()
    costs: tuple[float, ...] = ()

    # The tree's rules as class attributes: tests swap in broken variants that the exactness checks must catch.
    walk = staticmethod(trees.walk)
    attention_mask = staticmethod(trees.ancestor_mask)
    path_kv = staticmethod(trees.kept_kv)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source is None:
            raise UserError("tree verification needs a draft source (sbd_jax.decoding.drafts)")
        check_whole_number("draft_nodes", self.draft_nodes, 1)
        check_pass_widths(self.widths, self.draft_nodes)
        if len(self.costs) != len(self.widths):
            raise UserError(f"give one cost per pass width (widths {self.widths}, costs {self.costs})")

    @property
    def pass_widths(self) -> tuple[int, ...]:
        """The widths compiled: the given ones, or 1 + draft_nodes alone."""
        return self.widths or (1 + self.draft_nodes,)

    @property
    def output_len(self) -> int:
        return self.max_new_tokens + self.source.depth + 1  # a pass may emit its depth + 1 tokens

    @property
    def output_label(self) -> str:
        return f"max_new_tokens + tree depth {self.source.depth} + 1"

    def tree_pass(self, params: Any, cache: KVCache, root_B: jax.Array, tree: trees.Tree, rng: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, NewKV]:
        """The root and `tree`'s nodes after the cache, each seeing its ancestors only. Returns per pass token
        the target's choice (argmax or a draw of NTP's distribution there), its top successors and their
        probabilities (untempered), and the keys / values."""
        tokens = jnp.concatenate([root_B[:, None], tree.tokens], axis=1)
        logits, kv = forward(Transformer(self.config), params, tokens, trees.positions(tree, cache.lengths),
                             mask=self.attention_mask(tree, self.source.depth), cache=cache)
        logits = without_token(logits, self.config.mask_token_id)
        chosen = draw(sampling_logits(logits, self.temperature, self.top_p), rng, self.temperature)
        top_logits, top_tokens = jax.lax.top_k(logits, SUCCESSORS_KEPT)
        top_probs = jnp.exp(top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
        return chosen, top_tokens.astype(jnp.int32), top_probs, kv

    def widest_worth(self, tree: trees.Tree, live_B: jax.Array) -> jax.Array:
        """The index in `pass_widths` with the most expected tokens per second (class docstring)."""
        widths = self.pass_widths
        if not self.costs:
            return jnp.int32(len(widths) - 1)
        kept = jnp.cumsum(tree.scores, axis=1).sum(axis=0)  # [N]: first n + 1 nodes (a finished row has none)
        expected = jnp.stack([live_B.sum() + (kept[w - 2] if w > 1 else 0.0) for w in widths])
        return jnp.argmax(expected / jnp.asarray(self.costs)).astype(jnp.int32)

    def run_pass(self, params: Any, cache: KVCache, root_B: jax.Array, tree: trees.Tree, choice: jax.Array,
                 rng: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, NewKV]:
        """`tree_pass` at the width `choice` picks, padded to the widest (the nodes past the width are absent)."""
        full = 1 + tree.tokens.shape[1]

        def at_width(width: int) -> Any:
            def run(_: None) -> tuple[jax.Array, jax.Array, jax.Array, NewKV]:
                chosen, top_tokens, top_probs, kv = self.tree_pass(params, cache, root_B, tree.first(width - 1), rng)
                return (_pad(chosen, 1, full), _pad(top_tokens, 1, full), _pad(top_probs, 1, full),
                        NewKV(_pad(kv.k, 2, full), _pad(kv.v, 2, full)))
            return run

        return jax.lax.switch(choice, [at_width(w) for w in self.pass_widths], None)

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array, knobs: TracedSettings,
               prompt_BT: jax.Array | None = None, prompt_lens_B: jax.Array | None = None) -> DecodeOutput:
        """Decodes until every row hit EOS or `max_new_tokens`: propose a tree, run it, walk it, keep the path."""
        if prompt_BT is None or prompt_lens_B is None:
            raise UserError("tree verification searches the prompt: pass prompt_BT and prompt_lens_B to decode")
        batch, depth, nodes = last_token_B.shape[0], self.source.depth, self.draft_nodes
        rows, j = jnp.arange(batch)[:, None], jnp.arange(depth + 1)

        def body(s: _TreeState) -> _TreeState:
            live = ~s.done
            length = prompt_lens_B + s.count
            room = jnp.where(live, self.max_new_tokens - s.count - 1, 0)  # candidates that could still be emitted
            tree = trees.build_tree(self.source.candidates(s.source, s.history, length, room), nodes)  # none when done
            choice = self.widest_worth(tree, live)
            kept_nodes = jnp.asarray(self.pass_widths)[choice] - 1
            tree = tree.replace(scores=jnp.where(jnp.arange(nodes) < kept_nodes, tree.scores, 0.0))
            root = jnp.take_along_axis(s.history, (length - 1)[:, None], axis=1)[:, 0]
            chosen, top_tokens, top_probs, kv = self.run_pass(params, s.cache, root, tree, choice,
                                                              jax.random.fold_in(rng, s.iteration))
            w = self.walk(tree, chosen, depth)
            kept, ended = kept_through_eos(self._is_eos(w.emitted) & (j <= w.accepted[:, None]),
                                           jnp.where(live, jnp.minimum(w.accepted + 1, self.max_new_tokens - s.count),
                                                     0))
            nfe = s.nfe + live
            count = s.count + kept
            pass_tokens = jnp.concatenate([root[:, None], tree.tokens], axis=1)
            present = jnp.concatenate([live[:, None], tree.present], axis=1)
            corrected = (j == w.accepted[:, None]) & w.corrected[:, None]
            return s.replace(
                iteration=s.iteration + 1,
                cache=append(s.cache, self.path_kv(kv.k, w.path), self.path_kv(kv.v, w.path),
                             jnp.where(live, w.accepted + 1, 0)),
                history=s.history.at[rows, length[:, None] + j].set(w.emitted, mode="drop"),
                source=self.source.observe(s.source, pass_tokens, present, top_tokens, top_probs),
                record=s.record.at[rows, s.count[:, None] + j].set(
                    jnp.stack([w.emitted, jnp.broadcast_to(nfe[:, None], w.emitted.shape), corrected], axis=-1),
                    mode="drop"),
                nfe=nfe, count=count, done=s.done | ended | (count >= self.max_new_tokens),
                drafted=s.drafted + tree.present.sum(axis=1),
                accepted=s.accepted + jnp.where(live, jnp.minimum(w.accepted, kept), 0),
                narrow_passes=s.narrow_passes + (live & (kept_nodes == 0)))

        zeros = jnp.zeros((batch,), jnp.int32)
        history = jnp.concatenate([prompt_BT.astype(jnp.int32),
                                   jnp.zeros((batch, self.output_len), jnp.int32)], axis=1)
        init = _TreeState(iteration=jnp.int32(0), cache=cache, history=history,
                          source=self.source.init(batch, self.config.vocab_size),
                          record=jnp.zeros((batch, self.output_len, 3), jnp.int32), nfe=zeros, count=zeros,
                          done=jnp.zeros((batch,), bool), drafted=zeros, accepted=zeros, narrow_passes=zeros)
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, init)
        return DecodeOutput(tokens=final.record[..., 0], num_tokens=final.count, nfe=final.nfe,
                            reveal_pass=final.record[..., 1], corrected=final.record[..., 2] == 1,
                            drafted=final.drafted, accepted=final.accepted, lookup_drafted=zeros,
                            lookup_accepted=zeros, narrow_passes=final.narrow_passes)


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    """`x` zero-padded along `axis` to `size`."""
    return jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])

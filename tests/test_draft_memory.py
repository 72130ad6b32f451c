"""A draft source's memory across calls (`draft_memory`: the model's successor table, Token Recycling's hot start,
and the context trie's earlier answers, SuffixDecoding's): the next call starts from the last call's, outputs stay
NTP's, and only sources that keep one accept it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbd_jax
from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.context_drafts import SEPARATOR, ContextTrie
from sbd_jax.decoding.generate import DraftMemory, generate, generate_batched
from sbd_jax.decoding.settings import Settings
from sbd_jax.decoding.verified import VerifiedSBDDecoder
from sbd_jax.errors import UserError
from sbd_jax.evaluation.recorded import has, record
from sbd_jax.model.transformer import init_params
from tests.test_api import SHIPPED
from tests.test_tree import CFG, PROMPTS, SOURCES, params

NEW = 24


def ntp_outputs(prompts):
    return [g.token_ids for g in generate(NTPDecoder(CFG, NEW, eos_ids=CFG.eos_token_ids), params(), prompts)[0]]


def rows_run(memory):
    """The token ids whose successors the table holds."""
    tokens, probs = memory
    return set(np.flatnonzero(np.asarray(probs).sum(axis=1) > 0).tolist())


@pytest.mark.parametrize("name", ["successors", "mixed"])
def test_the_next_call_starts_from_the_last_calls_successor_table(name):
    decoder = VerifiedSBDDecoder(CFG, NEW, eos_ids=CFG.eos_token_ids, block_size=5, drafts=SOURCES[name],
                                 draft_nodes=6, draft_memory=True)
    table = (lambda state: state) if name == "successors" else (lambda state: state[1])
    kept, fresh = DraftMemory(), DraftMemory()
    first = generate(decoder, params(), PROMPTS[:2], memory=kept)[0]
    after_first = jax.tree.map(np.asarray, table(kept.state))
    second = generate(decoder, params(), PROMPTS[2:], memory=kept)[0]
    alone = generate(decoder, params(), PROMPTS[2:], memory=fresh)[0]
    assert [g.token_ids for g in first + second + alone] == ntp_outputs(PROMPTS) + ntp_outputs(PROMPTS[2:])
    # rows are never cleared: the first call's rows that the second call alone does not run are still there
    assert rows_run(after_first) - rows_run(table(fresh.state))
    assert rows_run(table(kept.state)) >= rows_run(after_first)


def test_a_kept_table_gives_the_first_passes_candidates_that_an_empty_one_lacks():
    def decoder(new):
        return VerifiedSBDDecoder(CFG, new, eos_ids=CFG.eos_token_ids, block_size=5, drafts=SOURCES["successors"],
                                  draft_nodes=6, draft_memory=True)

    warm = DraftMemory()
    generate(decoder(NEW), params(), PROMPTS, memory=warm)
    cold_run = generate(decoder(2), params(), PROMPTS, memory=DraftMemory())[0]
    warm_run = generate(decoder(2), params(), PROMPTS, memory=warm)[0]
    assert [g.token_ids for g in warm_run] == [g.token_ids for g in cold_run] == [o[:2] for o in ntp_outputs(PROMPTS)]
    assert sum(g.drafted for g in warm_run) > sum(g.drafted for g in cold_run)


def test_a_memory_kept_for_another_source_or_model_is_refused():
    memory = DraftMemory()
    generate(VerifiedSBDDecoder(CFG, 4, block_size=5, drafts=SOURCES["successors"], draft_memory=True), params(),
             PROMPTS[:1], memory=memory)
    with pytest.raises(UserError, match="another model or draft source"):
        generate(VerifiedSBDDecoder(CFG, 4, block_size=5, drafts=SOURCES["mixed"], draft_memory=True), params(),
                 PROMPTS[:1], memory=memory)
    wider = dataclasses.replace(CFG, vocab_size=96)
    with pytest.raises(UserError, match="another model or draft source"):
        generate(VerifiedSBDDecoder(wider, 4, block_size=5, drafts=SOURCES["successors"], draft_memory=True),
                 init_params(wider, seed=0), PROMPTS[:1], memory=memory)


def test_a_dataset_carries_the_memory_from_batch_to_batch_and_a_decoder_without_it_starts_empty():
    def decoder(draft_memory):
        return VerifiedSBDDecoder(CFG, NEW, eos_ids=CFG.eos_token_ids, block_size=5, drafts=SOURCES["successors"],
                                  draft_nodes=6, draft_memory=draft_memory)

    memory, first_alone, second_alone = DraftMemory(), DraftMemory(), DraftMemory()
    batched = generate_batched(decoder(True), params(), PROMPTS, batch=2, memory=memory)[0]
    generate(decoder(True), params(), PROMPTS[:2], memory=first_alone)
    generate(decoder(True), params(), PROMPTS[2:], memory=second_alone)
    assert [g.token_ids for g in batched] == ntp_outputs(PROMPTS)
    assert rows_run(first_alone.state) - rows_run(second_alone.state)  # the first batch's own rows ...
    assert rows_run(memory.state) >= rows_run(first_alone.state)  # ... are still there after the second
    untouched = DraftMemory()
    generate_batched(decoder(False), params(), PROMPTS, batch=2, memory=untouched)
    assert untouched.state is None and decoder(False).fresh_memory() is None


def test_only_sources_that_keep_a_memory_take_draft_memory_and_results_record_it():
    for options in (dict(drafts="lookup"), dict(drafts="sbd-tree"), dict(drafts="hybrid")):
        with pytest.raises(UserError, match="draft_memory"):
            Settings.verified(5, draft_memory=True, **options)
    with pytest.raises(UserError, match="draft_memory"):
        Settings.ntp(draft_memory=True)
    with pytest.raises(UserError, match="greedy"):  # calls at one seed would draw with the same keys
        Settings.verified(5, "tree", draft_memory=True, temperature=0.7)
    with pytest.raises(UserError, match="draft_memory"):
        Settings.verified(5, "tree", draft_memory="no")
    with pytest.raises(UserError, match="draft_memory"):
        VerifiedSBDDecoder(CFG, NEW, block_size=5, drafts=SOURCES["context"], draft_memory=True)
    assert Settings.verified(5, "context-tree", draft_memory=True).draft_memory  # its earlier answers
    kept = Settings.verified(5, "tree", draft_memory=True)
    assert record(kept)["draft_memory"] is True and "draft_memory" not in record(Settings.verified(5, "tree"))
    assert has(record(Settings.verified(5, "tree")), draft_memory=False) and has(record(kept), draft_memory=True)


def test_the_api_carries_the_memory_from_call_to_call_until_it_is_cleared():
    model = sbd_jax.load(SHIPPED)
    prompt, short = "c5b7a2+b8a6", Settings.verified(8, "tree", draft_memory=True, max_new_tokens=2)
    (ntp,) = model.generate(prompt, chat=True, max_new_tokens=32)
    model.generate(prompt, dataclasses.replace(short, max_new_tokens=32), chat=True)  # fills the table
    (warm,) = model.generate(prompt, short, chat=True)
    assert list(model.draft_memories) == [(short.drafts, short.block_size)]
    model.draft_memories.clear()  # the reset
    (cold,) = model.generate(prompt, short, chat=True)
    assert warm.token_ids == cold.token_ids == ntp.token_ids[:2] and warm.drafted > cold.drafted
    model.generate(prompt, Settings.verified(8, "tree", max_new_tokens=2), chat=True)
    assert len(model.draft_memories) == 1  # without draft_memory nothing is kept


def test_a_context_trie_remembers_the_latest_answers_each_ended_by_a_separator():
    trie, S = ContextTrie(depth=3, answers=8), SEPARATOR
    memory = trie.remember(trie.init(2, 64, False), jnp.asarray([[1, 2, 3, 0], [4, 5, 0, 0]]), jnp.asarray([3, 2]))
    assert memory.tolist() == [S, 1, 2, 3, S, 4, 5, S]  # each row's first `count` tokens, then a separator
    memory = trie.remember(memory, jnp.asarray([[7, 8, 9]]), jnp.asarray([2]))
    assert memory.tolist() == [3, S, 4, 5, S, 7, 8, S]  # the oldest tokens leave
    assert trie.remember(memory, jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32)).tolist() == \
        [S, 4, 5, S, 7, 8, S, S]  # an empty answer leaves its separator


def test_a_context_trie_drafts_an_earlier_answers_continuation_up_to_its_end_after_the_contexts_matches():
    trie, S = ContextTrie(depth=4, answers=8), SEPARATOR
    memory = jnp.asarray([S, S, 5, 6, 7, 8, S, S], jnp.int32)
    history, length, room = jnp.asarray([[9, 5, 0, 0]]), jnp.asarray([2]), jnp.asarray([4])
    found = trie.candidates(memory, history, length, room)
    kept = [(p[:d].tolist(), float(c)) for p, d, c in zip(found.paths[0], found.depths[0], found.scores[0]) if c > 0]
    assert sorted(p for p, _ in kept) == [[6], [6, 7], [6, 7, 8]]  # not past the answer's separator
    assert not any(c > 0 for c in ContextTrie(depth=4).candidates((), history, length, room).scores[0])  # no memory
    # the context's own match (5 -> 1) is later, so it comes first; both are drafted
    both = trie.candidates(memory, jnp.asarray([[5, 1, 9, 5, 0]]), jnp.asarray([4]), room)
    firsts = {int(p[0]) for p, d, c in zip(both.paths[0], both.depths[0], both.scores[0]) if c > 0 and d == 1}
    assert firsts == {1, 6}
    # a suffix never reaches back into the memory: a one-token row's match is its token alone, not the separator
    # before it too (which would keep only the match after a separator)
    lone = trie.candidates(jnp.asarray([4, 6, 7, S, 6, 1, S, S], jnp.int32), jnp.asarray([[6, 0]]), jnp.asarray([1]), room)
    assert {tuple(p[:d].tolist()) for p, d, c in zip(lone.paths[0], lone.depths[0], lone.scores[0]) if c > 0} == \
        {(7,), (1,)}


def test_a_repeated_prompt_is_drafted_from_the_remembered_answer_and_still_gives_ntps_output():
    def decoder(draft_memory):
        return VerifiedSBDDecoder(CFG, NEW, eos_ids=CFG.eos_token_ids, block_size=5, drafts="context-tree",
                                  draft_nodes=6, draft_memory=draft_memory)

    memory = DraftMemory()
    first = generate(decoder(True), params(), PROMPTS, memory=memory)[0]
    again = generate(decoder(True), params(), PROMPTS, memory=memory)[0]
    cold = generate(decoder(False), params(), PROMPTS)[0]
    assert [g.token_ids for g in first] == [g.token_ids for g in again] == [g.token_ids for g in cold] == \
        ntp_outputs(PROMPTS)
    assert [g.nfe for g in first] == [g.nfe for g in cold]  # the first call's memory is empty
    # every answer is in the memory now: the repeated prompts take fewer forwards
    assert sum(g.nfe for g in again) < sum(g.nfe for g in cold)

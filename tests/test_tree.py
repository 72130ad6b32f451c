"""Tree verification: the candidates' tree, its attention, the kept path's cache, and decoding that keeps NTP's
output exactly for every draft source and pass width (greedy: token for token; sampling: its distribution),
with must-fail variants (a walk that descends without the target's token, a sibling's keys / values kept, a
node that sees a non-ancestor) that the same checks catch."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.decoding import tree as trees
from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.chain_drafts import SBDBlock
from sbd_jax.decoding.context_drafts import ContextTrie, Mixed, Successors
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.verified import VerifiedSBDDecoder
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.kv_cache import append
from sbd_jax.model.transformer import Transformer, forward, init_params
from tests import test_verify_sampling as sampling
from tests.conftest import slow_case

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_ids=(7,))
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 10, 8, 9, 10, 8, 9], [2, 7 + 13, 11, 12, 13, 14, 2, 20, 11, 12],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 40, 41, 42, 60, 61]]
SOURCES = {
    "context": ContextTrie(depth=4),
    "successors": Successors(depth=4, beam=4),
    "mixed": Mixed((ContextTrie(depth=4), Successors(depth=4, beam=4))),
}


@functools.lru_cache(maxsize=None)
def params():
    return init_params(CFG, seed=3)


def candidates(paths, scores):
    """One row's candidates from paths (tokens after the root) and their scores."""
    depth = max(map(len, paths))
    padded = [list(p) + [0] * (depth - len(p)) for p in paths]
    return trees.Candidates(paths=jnp.asarray([padded], jnp.int32), depths=jnp.asarray([[len(p) for p in paths]]),
                            scores=jnp.asarray([scores], jnp.float32), from_context=jnp.zeros((1, len(paths)), bool))


def test_build_tree_merges_duplicates_and_ranks_parents_before_children():
    c = candidates([[5], [5, 6], [5], [5, 7], [9], [5, 6, 1], [9, 2]], [0.5, 0.25, 0.6, 0.1, 0.3, 0.2, 0.05])
    t = trees.build_tree(c, 6)
    tokens, parents, scores = (np.asarray(x)[0].tolist() for x in (t.tokens, t.parents, t.scores))
    assert tokens == [5, 9, 6, 1, 7, 2]  # by score; [5] once, with its best score
    assert scores[0] == pytest.approx(0.6)
    assert parents == [0, 0, 1, 3, 1, 2]  # pass indices: 0 the root, i + 1 node i


def test_the_tree_keeps_the_best_nodes_and_leaves_absent_ones_out():
    t = trees.build_tree(candidates([[5], [5, 6], [4], [0]], [0.5, 0.4, 0.45, 0.0]), 2)
    assert np.asarray(t.tokens)[0].tolist() == [5, 4]
    t = trees.build_tree(candidates([[5], [5, 6], [0]], [0.5, 0.4, 0.0]), 4)
    assert np.asarray(t.present)[0].tolist() == [True, True, False, False]


def test_ancestor_mask_lets_a_node_see_only_its_path():
    t = trees.build_tree(candidates([[5], [9], [5, 6], [9, 2], [5, 6, 1]], [0.9, 0.8, 0.7, 0.6, 0.5]), 5)
    mask = np.asarray(trees.ancestor_mask(t, 3))[0].astype(int)
    # pass order: root, 5, 9, 6 (under 5), 2 (under 9), 1 (under 6)
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                             [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]


def ntp_outputs(prompts, max_new):
    return [g.token_ids for g in generate(NTPDecoder(CFG, max_new_tokens=max_new, eos_ids=CFG.eos_token_ids),
                                          params(), prompts)[0]]


def tree_decoder(source, nodes=6, widths=(), costs=(), max_new=24, cls=VerifiedSBDDecoder, **kw):
    return cls(CFG, max_new_tokens=max_new, eos_ids=CFG.eos_token_ids, drafts=source, draft_nodes=nodes,
               widths=widths, costs=costs, **kw)


@pytest.mark.parametrize("name, nodes, widths, costs", [
    (name, *case) if (name, case[0]) in (("context", 6), ("mixed", 12)) else slow_case(name, *case)
    for case in ((1, (), ()), (6, (), ()), (12, (1, 4, 13), (1.0, 1.3, 2.0))) for name in SOURCES])
def test_greedy_tree_decoding_is_ntp_alone_and_in_a_batch(name, nodes, widths, costs):
    expected = ntp_outputs(PROMPTS, 24)
    decoder = tree_decoder(SOURCES[name], nodes, widths, costs)
    batched = generate(decoder, params(), PROMPTS)[0]
    assert [g.token_ids for g in batched] == expected
    if nodes == 6:  # alone too (one width setting: each call compiles)
        assert [generate(decoder, params(), [p])[0][0].token_ids for p in PROMPTS[:2]] == expected[:2]
    assert all(g.nfe <= len(g.token_ids) for g in batched)
    if nodes > 1 and not costs:  # with costs the rule may rightly run the root alone (these drafts are poor)
        assert sum(g.accepted for g in batched) > 0  # the trees were used, not only the root


def test_eos_inside_a_tree_ends_the_row_there():
    eos_cfg = dataclasses.replace(CFG, eos_token_ids=(int(ntp_outputs(PROMPTS[:1], 6)[0][3]),))
    ntp = generate(NTPDecoder(eos_cfg, max_new_tokens=24, eos_ids=eos_cfg.eos_token_ids), params(), PROMPTS)[0]
    decoder = VerifiedSBDDecoder(eos_cfg, max_new_tokens=24, eos_ids=eos_cfg.eos_token_ids,
                                  drafts=SOURCES["mixed"], draft_nodes=8)
    assert [g.token_ids for g in generate(decoder, params(), PROMPTS)[0]] == [g.token_ids for g in ntp]


def test_the_cache_after_a_tree_pass_holds_the_kept_path_as_a_plain_forward_would():
    prompt = PROMPTS[0]
    a, b, c = ntp_outputs([prompt], 3)[0]
    wrong = [t for t in range(20, 30) if t not in (a, b, c)]
    decoder = tree_decoder(ContextTrie(depth=3), nodes=5)
    cache, root = decoder.prefill(params(), jnp.asarray([prompt]), jnp.asarray([len(prompt)]), capacity=32)
    tree = trees.build_tree(candidates([[wrong[0]], [a], [a, wrong[1]], [a, b], [a, b, wrong[2]]],
                                       [0.9, 0.8, 0.7, 0.6, 0.5]), 5)
    logits, _, kv = decoder.run_pass(params(), cache, root, tree, jnp.zeros((1, 0), jnp.int32))
    chosen = jnp.argmax(logits, axis=-1)
    w = decoder.walk(tree, chosen, 3)
    assert int(w.accepted[0]) == 2 and np.asarray(w.emitted)[0, :3].tolist() == [a, b, c]
    kept = append(cache, decoder.path_kv(kv.k, w.path), decoder.path_kv(kv.v, w.path), w.accepted + 1)
    full = jnp.asarray([prompt + [a, b]])
    _, ref = forward(Transformer(CFG), params(), full, jnp.arange(full.shape[1])[None])
    n = full.shape[1]
    assert int(kept.lengths[0]) == n
    np.testing.assert_allclose(np.asarray(kept.k[:, :, :n]), np.asarray(ref.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kept.v[:, :, :n]), np.asarray(ref.v), atol=1e-5)


def test_each_masked_block_of_a_pass_sees_its_anchors_path_and_itself_as_an_uncached_forward_would():
    """SBD's blocks in a tree pass (`tree.with_blocks`): the block after pass index a sees the cache, the path from
    the root to a, and itself bidirectionally; never the other nodes. Each block's logits equal an uncached forward
    of the prompt, that path and the block, at fp32."""
    k, mask_id = 4, CFG.vocab_size - 1
    cfg = CFG.replace(mask_token_id=mask_id)
    decoder = VerifiedSBDDecoder(cfg, max_new_tokens=8, eos_ids=cfg.eos_token_ids, block_size=k,
                                 drafts=SBDBlock(k, fallback_blocks=2, top_k=2), draft_nodes=5)
    prompt = PROMPTS[0]
    cache, root = decoder.prefill(params(), jnp.asarray([prompt]), jnp.asarray([len(prompt)]), capacity=48)
    tree = trees.build_tree(candidates([[20], [21], [21, 22], [21, 23], [21, 23, 24]], [0.9, 0.8, 0.7, 0.6, 0.5]), 5)
    # pass order: the root, then the ranked nodes: 20, 21, 22 (under 21), 23 (under 21), 24 (under 23)
    anchors = [5, 0, 3]  # the deepest node, the root, a node off the deepest path
    _, blocks, _ = decoder.run_pass(params(), cache, root, tree, jnp.asarray([anchors]))
    tokens, parents = np.asarray(tree.tokens)[0].tolist(), np.asarray(tree.parents)[0].tolist()

    def path_to(index):  # the tokens after the root down to pass index `index`
        return [] if index == 0 else path_to(parents[index - 1]) + [tokens[index - 1]]

    assert [path_to(a) for a in anchors] == [[21, 23, 24], [], [21, 22]]
    for m, a in enumerate(anchors):
        context = prompt + path_to(a) + [mask_id] * k
        n = len(context)
        attend = np.tril(np.ones((n, n), bool))
        attend[n - k:, n - k:] = True
        logits, _ = forward(Transformer(cfg), params(), jnp.asarray([context]), jnp.arange(n)[None],
                            mask=jnp.asarray(attend)[None])
        expected = np.asarray(logits)[0, -k:, :mask_id]
        np.testing.assert_allclose(np.asarray(blocks)[0, m, :, :mask_id], expected, atol=1e-5, rtol=0)


class DescendsWithoutTheTarget(VerifiedSBDDecoder):
    @staticmethod
    def walk(tree, chosen, max_depth):  # takes the first child as if the target had chosen it
        first_child = jnp.where(tree.present & (tree.parents == 0), tree.tokens, -1).max(axis=1, initial=-1)
        return trees.walk(tree, chosen.at[:, 0].set(jnp.where(first_child >= 0, first_child, chosen[:, 0])),
                          max_depth)


class KeepsASibling(VerifiedSBDDecoder):
    @staticmethod
    def path_kv(kv, path):  # the node after each kept one in pass order instead
        return trees.kept_kv(kv, jnp.where(path > 0, jnp.minimum(path + 1, kv.shape[2] - 1), 0))


class SeesEveryEarlierNode(VerifiedSBDDecoder):
    @staticmethod
    def attention_mask(tree, max_depth):
        n = tree.tokens.shape[1] + 1
        return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (tree.tokens.shape[0], n, n))


@pytest.mark.parametrize("broken", [DescendsWithoutTheTarget, KeepsASibling, SeesEveryEarlierNode])
def test_the_greedy_check_rejects_an_inexact_tree_verifier(broken):
    expected = ntp_outputs(PROMPTS, 24)
    outputs = [g.token_ids for g in generate(tree_decoder(SOURCES["mixed"], 8, cls=broken), params(), PROMPTS)[0]]
    assert outputs != expected


@pytest.mark.parametrize("name,temperature,top_p", [slow_case("successors", 1.0, 1.0), ("mixed", 0.7, 0.9),
                                                    slow_case("sbd-tree", 1.0, 1.0), slow_case("tree-sbd", 0.7, 0.9)])
def test_tree_sampling_draws_from_ntp_distribution(name, temperature, top_p):
    source = {"successors": Successors(depth=2, beam=3), "mixed": Mixed((ContextTrie(depth=2), Successors(depth=2))),
              "sbd-tree": SBDBlock(3, fallback_blocks=1, top_k=2),
              "tree-sbd": Mixed((ContextTrie(depth=2), Successors(depth=2, beam=3), SBDBlock(3, 1, top_k=2)))}
    decoder = VerifiedSBDDecoder(sampling.CFG, max_new_tokens=sampling.NEW, temperature=temperature, top_p=top_p,
                                  drafts=source[name], draft_nodes=4)
    counts, results = sampling.sampled_joint(decoder, seed=5)
    probs = sampling.ntp_joint(temperature, top_p)
    assert sum(r.accepted for r in results) > 0.02 * sampling.ROWS  # the trees kept candidates
    assert sampling.chi_square_p(counts, probs) > 1e-3
    assert sampling.total_variation(counts, probs) < 3 * sampling.sampling_noise(probs, sampling.ROWS)


def test_the_distribution_test_rejects_a_walk_without_the_target():
    decoder = DescendsWithoutTheTarget(sampling.CFG, max_new_tokens=sampling.NEW, temperature=1.0,
                                       drafts=Successors(depth=2, beam=3), draft_nodes=4)
    counts, _ = sampling.sampled_joint(decoder, seed=5)
    assert sampling.chi_square_p(counts, sampling.ntp_joint(1.0, 1.0)) < 1e-6


def test_context_trie_scores_each_node_by_the_share_of_matches_through_it():
    # the suffix [1] recurs at 0, 2 and 4 ([5, 1] does not): continuations 2 1, 3 1, 2 5
    history = jnp.asarray([[1, 2, 1, 3, 1, 2, 5, 1, 0]])
    c = ContextTrie(depth=2, occurrences=4, keep=1.0).candidates((), history, jnp.asarray([8]), jnp.asarray([9]))
    got = {tuple(np.asarray(c.paths)[0, i, :d].tolist()): float(np.asarray(c.scores)[0, i])
           for i, d in enumerate(np.asarray(c.depths)[0]) if np.asarray(c.scores)[0, i] > 0}
    third = pytest.approx(1 / 3)
    assert got == {(2,): pytest.approx(2 / 3), (3,): third, (2, 1): third, (3, 1): third, (2, 5): third}


def test_successors_keep_the_latest_top_tokens_of_present_pass_tokens_only():
    source = Successors(depth=2)
    state = source.init(1, 16, False)
    top = jnp.arange(2 * 8).reshape(1, 2, 8) % 16
    state = source.harvest(state, jnp.asarray([[3, 5]]), jnp.asarray([[True, False]]), top,
                           jnp.full((1, 2, 8), 0.1))
    assert np.asarray(state[0])[3].tolist() == list(range(8)) and not np.asarray(state[0])[5].any()


def test_a_node_whose_parent_is_absent_is_absent_too():
    # a caller that scores a child above its parent: [5, 6] ranks first with its parent [5] cut off
    t = trees.build_tree(candidates([[5], [5, 6]], [0.4, 0.5]), 1)
    assert not np.asarray(t.present).any()


@pytest.mark.parametrize("k, fallback", [slow_case(8, 0), (8, 3)])
def test_sbd_block_tree_is_ntp_and_keeps_more_than_the_chain_on_the_trained_model(k, fallback):
    """DDTree's tree from the masked block's per-position top tokens (SBD's own model: the arithmetic study's),
    blocks after the most likely path and along it: NTP's output, and here (drafts mostly right) no more forwards
    than the chain."""
    from tests.test_verify import trained_arithmetic_model

    cfg, weights, prompts = trained_arithmetic_model()
    common = dict(max_new_tokens=40, eos_ids=cfg.eos_token_ids, block_size=k, fallback_blocks=fallback)
    expected = generate(NTPDecoder(cfg, max_new_tokens=40, eos_ids=cfg.eos_token_ids), weights, prompts)[0]
    chain = generate(VerifiedSBDDecoder(cfg, drafts="sbd", **common), weights, prompts)[0]
    tree = generate(VerifiedSBDDecoder(cfg, drafts="sbd-tree", draft_nodes=16, **common), weights, prompts)[0]
    mixed = generate(VerifiedSBDDecoder(cfg, drafts="tree-sbd", draft_nodes=16, **common), weights, prompts)[0]
    assert [g.token_ids for g in tree] == [g.token_ids for g in chain] == [g.token_ids for g in expected]
    assert [g.token_ids for g in mixed] == [g.token_ids for g in expected]
    # the block's drafts count: the same tree without it (the context and the successors) takes more forwards
    no_block = generate(VerifiedSBDDecoder(cfg, drafts="tree", draft_nodes=16, **dict(common, fallback_blocks=0)),
                        weights, prompts)[0]
    assert sum(g.nfe for g in mixed) < sum(g.nfe for g in no_block)
    assert sum(g.accepted for g in tree) > 0.5 * sum(len(g.token_ids) for g in tree)
    assert sum(g.nfe for g in tree) <= sum(g.nfe for g in chain)


def test_blocks_go_after_the_highest_scored_path_and_along_it():
    from sbd_jax.decoding.chain_drafts import BlockDrafts

    source = SBDBlock(4, fallback_blocks=2, top_k=2)  # depth 3, 3 blocks
    state = BlockDrafts(tokens=jnp.zeros((1, 3, 2), jnp.int32), chances=jnp.ones((1, 3, 2)),
                        holds=jnp.asarray([True]), dists=jnp.zeros((1, 3, 0)))
    t = trees.build_tree(candidates([[4], [5], [5, 2], [5, 6], [5, 6, 1]], [0.7, 0.8, 0.3, 0.6, 0.5]), 5)
    # pass order: root, 5, 4, 6 (under 5), 1 (under 6), 2 (under 5): the likeliest path 5, 6, 1 ends at pass index 4
    assert np.asarray(source.anchors(t, state))[0].tolist() == [4, 0, 1]
    # a node of any source counts: here another source's 4 outranks 5 and the path is 4 alone
    t = trees.build_tree(candidates([[4], [5], [5, 6]], [0.9, 0.8, 0.6]), 3)
    assert np.asarray(Mixed((ContextTrie(depth=3), source)).anchors(t, ((), state)))[0].tolist() == [1, 0, 1]


def test_a_mixed_tree_runs_the_blocks_of_one_source_at_most():
    from sbd_jax.errors import UserError

    assert Mixed((ContextTrie(depth=3), SBDBlock(4, top_k=2))).blocks == 1
    with pytest.raises(UserError, match="at most one"):
        Mixed((SBDBlock(4, top_k=2), SBDBlock(4, top_k=3)))
    with pytest.raises(UserError, match="not a chain source"):
        Mixed((ContextTrie(depth=3), SBDBlock(4)))


@pytest.mark.parametrize("drafts", ["sbd", "hybrid"])
def test_blocks_of_one_token_run_the_root_alone(drafts):
    ntp = generate(NTPDecoder(sampling.CFG, max_new_tokens=6), sampling.params(), [sampling.PROMPT])[0]
    one = generate(VerifiedSBDDecoder(sampling.CFG, max_new_tokens=6, block_size=1, drafts=drafts), sampling.params(),
                   [sampling.PROMPT])[0]
    assert one[0].token_ids == ntp[0].token_ids and one[0].nfe == 6


def test_the_width_rule_runs_every_candidate_on_a_gpus_modeled_costs_and_the_root_alone_on_a_steep_curve():
    from sbd_jax import roofline
    from sbd_jax.decoding.tree_width import modeled_pass_costs

    modeled = modeled_pass_costs("h100-bf16", "smollm2-135m", 1, 16, 512)
    hw, shape = roofline.lookup("h100-bf16", "smollm2-135m")
    assert [w for w, _ in modeled] == [1, 2, 4, 8, 16, 17]
    assert [s for _, s in modeled] == [roofline.forward_time(hw, shape, 1, w, 512) for w, _ in modeled]
    tree = trees.build_tree(candidates([[5], [5, 6], [5, 6, 7], [9]], [0.3, 0.2, 0.1, 0.1]), 16)  # 0.7 expected
    steep = tuple((w, 0.01 * w) for w, _ in modeled)  # a pass of w tokens costs w one-token passes
    for costs, width in ((modeled, 8), (steep, 1)):  # 8: the narrowest that holds the root and all 4 nodes
        decoder = VerifiedSBDDecoder(CFG, 8, block_size=5, drafts=SOURCES["mixed"], draft_nodes=16,
                                     widths=tuple(w for w, _ in costs), costs=tuple(s for _, s in costs))
        assert decoder.pass_widths[int(decoder.width_choice(tree, jnp.ones((1,), bool), 1.0))] == width
        overconfident = 0.05  # calibrated: the scores predicted 20 times the tokens kept
        assert decoder.pass_widths[int(decoder.width_choice(tree, jnp.ones((1,), bool), overconfident))] == (
            1 if costs is steep else 4)

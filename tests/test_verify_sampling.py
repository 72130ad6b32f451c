"""Verified SBD at temperature > 0 samples exactly NTP's distribution: a test of the distribution itself.

A tiny model with a 9-token vocabulary (one of them the mask token); 20,000 seeded rows of the same
prompt decoded with verification; the joint distribution of the first three generated tokens (the
first exact, the next two through the draft test) is compared with NTP's, computed exactly from the
model's logits, by a χ² test and a total-variation bound, for every draft source (SBD's block, lookup,
hybrid). The same test rejects a variant that accepts drafts without the ratio test, one that replaces a
rejected draft from p instead of the residual, and (with hand-made logits whose q differs by block
position) one that tests a draft against the q of the wrong block position.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from sbd_jax.decoding.chain_drafts import SBDBlock
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.token_choice import sampling_logits, without_token
from sbd_jax.decoding.verified import VerifiedSBDDecoder
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.transformer import Transformer, init_params
from tests.conftest import slow_case

VOCAB, MASK = 9, 8
CFG = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, mask_token_id=MASK)
PROMPT = [3, 1, 4, 1, 5]
ROWS, NEW = 20_000, 3


@functools.lru_cache(maxsize=None)
def params():
    """Weights sharpened so that each token's distribution depends strongly on the tokens before it,
    and the masked block's guesses (q) differ from the causal distributions (p)."""
    p = init_params(CFG, seed=11)
    p["embed_tokens"]["embedding"] = p["embed_tokens"]["embedding"] * 20
    p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 5
    return p


def ntp_joint(temperature, top_p):
    """P(t1, t2, t3) of NTP sampling, from one forward over every 2-token continuation."""
    pairs = np.array([(a, b) for a in range(VOCAB) for b in range(VOCAB)])
    tokens = jnp.asarray(np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1))
    logits, _ = Transformer(CFG).apply({"params": params()}, tokens, jnp.arange(tokens.shape[1])[None])
    probs = np.asarray(jax.nn.softmax(sampling_logits(without_token(logits[:, -3:], MASK), temperature, top_p), -1),
                       np.float64)
    first, second, third = probs[0, 0], probs[:, 1].reshape(VOCAB, VOCAB, VOCAB)[:, 0], probs[:, 2]
    joint = first[:, None, None] * second[:, :, None] * third.reshape(VOCAB, VOCAB, VOCAB)
    return joint / joint.sum()


def sampled_joint(decoder, seed):
    results, _ = generate(decoder, params(), [PROMPT] * ROWS, seed=seed)
    counts = np.zeros((VOCAB,) * NEW)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    return counts, results


def chi_square_p(counts, expected_probs):
    """p-value of counts against expected probabilities, cells with expected count < 5 pooled."""
    expected = expected_probs.ravel() * counts.sum()
    observed = counts.ravel()
    small = expected < 5
    e = np.append(expected[~small], expected[small].sum())
    o = np.append(observed[~small], observed[small].sum())
    statistic = ((o - e) ** 2 / np.maximum(e, 1e-12)).sum()
    return stats.chi2.sf(statistic, len(e) - 1)


def total_variation(counts, probs):
    return 0.5 * np.abs(counts / counts.sum() - probs).sum()


def sampling_noise(probs, n):
    """The total variation a sample of n exact draws shows on average (normal approximation per cell)."""
    return 0.5 * np.sqrt(2 * probs * (1 - probs) / (np.pi * n)).sum()


@dataclasses.dataclass(frozen=True)
class AcceptsEveryDraft(VerifiedSBDDecoder):
    """Broken on purpose: drafts are kept without the ratio test."""
    def speculative_test(self, p_logits, q_logits, drafts, is_draft, accept_rng, token_rng):
        accepted = is_draft.sum(axis=1)
        after = jnp.take_along_axis(p_logits, accepted[:, None, None], axis=1)[:, 0]
        return accepted, jax.random.categorical(token_rng, after, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ReplacesFromP(VerifiedSBDDecoder):
    """Broken on purpose: a rejected draft is replaced by a draw from p, not from the residual."""

    def speculative_test(self, p_logits, q_logits, drafts, is_draft, accept_rng, token_rng):
        accepted, _ = super().speculative_test(p_logits, q_logits, drafts, is_draft, accept_rng, token_rng)
        after = jnp.take_along_axis(p_logits, accepted[:, None, None], axis=1)[:, 0]
        return accepted, jax.random.categorical(token_rng, after, axis=-1).astype(jnp.int32)


def decoder(kind, temperature, top_p, block_size=3, **kw):
    return kind(CFG, max_new_tokens=NEW, block_size=block_size, temperature=temperature, top_p=top_p, **kw)


@pytest.mark.parametrize("temperature, top_p", [slow_case(1.0, 1.0), (0.7, 0.8)])
def test_verified_sampling_draws_from_ntp_distribution(temperature, top_p):
    expected = ntp_joint(temperature, top_p)
    counts, results = sampled_joint(decoder(VerifiedSBDDecoder, temperature, top_p), seed=0)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    assert 0.2 < accepted / drafted < 0.95  # both branches (accept, reject + residual) are exercised
    assert sum(r.nfe for r in results) < NEW * ROWS  # fewer forwards than NTP
    assert chi_square_p(counts, expected) > 1e-3
    assert total_variation(counts, expected) < 1.5 * sampling_noise(expected, ROWS)


@pytest.mark.parametrize("broken", [slow_case(AcceptsEveryDraft), ReplacesFromP])
def test_the_distribution_test_rejects_an_inexact_verifier(broken):
    expected = ntp_joint(1.0, 1.0)
    counts, _ = sampled_joint(decoder(broken, 1.0, 1.0), seed=0)
    assert chi_square_p(counts, expected) < 1e-6
    assert total_variation(counts, expected) > 1.5 * sampling_noise(expected, ROWS)


# --- Hand-made logits whose masked-block guesses q differ strongly by block position (the tiny model's
# differ by < 1e-5, so a verifier testing draft j against the q of the wrong position looked exact).
_tables = np.random.default_rng(7)
P_TABLE = _tables.normal(size=(VOCAB, 16, VOCAB)) * 1.5  # p(next | last token, its position)
Q_TABLE = _tables.normal(size=(VOCAB, 8, VOCAB)) * 2.5  # q(token | last pending token, block position)


@dataclasses.dataclass(frozen=True)
class HandMadeLogits(VerifiedSBDDecoder):
    """The real pass (its K/V fill the cache) with its logits replaced: p from the last token and its
    position (a Markov chain NTP samples exactly from), q from the last chain token and the block position."""

    def run_pass(self, params, cache, root_B, part, anchors_BM):
        assert anchors_BM.shape[1] == 1  # q here is the block's after the whole chain
        _, _, kv = super().run_pass(params, cache, root_B, part, anchors_BM)
        tokens = jnp.concatenate([root_B[:, None], part.tokens], axis=1)
        p = jnp.asarray(P_TABLE, jnp.float32)[tokens, cache.lengths[:, None] + jnp.arange(tokens.shape[1])]
        last = jnp.take_along_axis(tokens, anchors_BM, axis=1)
        q = jnp.asarray(Q_TABLE, jnp.float32)[last, jnp.arange(self.block_size)[None]][:, None]
        return without_token(p, MASK), without_token(q, MASK), kv


@dataclasses.dataclass(frozen=True)
class WrongPositionBlock(SBDBlock):
    """Broken on purpose: guess j (drawn at block position j + 1) is tested against q at block position j."""

    @staticmethod
    def guess_dists(q_BKV):
        return q_BKV[:, :-1]


def hand_made_joint(temperature, top_p):
    """NTP's P(t1, t2, t3) under the hand-made p: the chain from the prompt's last token at its position."""
    def probs(last, position):
        logits = jnp.asarray(P_TABLE[last, position], jnp.float32)
        return np.asarray(jax.nn.softmax(sampling_logits(without_token(logits, MASK), temperature, top_p)), np.float64)

    start = len(PROMPT) - 1
    joint = np.zeros((VOCAB,) * NEW)
    first = probs(PROMPT[-1], start)
    for a in range(VOCAB):
        second = probs(a, start + 1)
        for b in range(VOCAB):
            joint[a, b] = first[a] * second[b] * probs(b, start + 2)
    return joint / joint.sum()


@pytest.mark.slow  # the same ratio test as above, with a position-dependent q
def test_verified_sampling_is_exact_when_q_differs_by_block_position():
    expected = hand_made_joint(1.0, 1.0)
    counts, results = sampled_joint(decoder(HandMadeLogits, 1.0, 1.0), seed=0)
    drafted, accepted = sum(r.drafted for r in results), sum(r.accepted for r in results)
    assert 0.1 < accepted / drafted < 0.95
    assert chi_square_p(counts, expected) > 1e-3
    assert total_variation(counts, expected) < 1.5 * sampling_noise(expected, ROWS)


@pytest.mark.slow  # a second mutant of the ratio test; ReplacesFromP stays in the default group
def test_the_distribution_test_rejects_a_verifier_testing_drafts_against_the_wrong_position():
    expected = hand_made_joint(1.0, 1.0)
    counts, _ = sampled_joint(decoder(HandMadeLogits, 1.0, 1.0, drafts=WrongPositionBlock(3)), seed=0)
    assert chi_square_p(counts, expected) < 1e-6
    assert total_variation(counts, expected) > 1.5 * sampling_noise(expected, ROWS)


@pytest.mark.parametrize("drafts, temperature, top_p", [slow_case("lookup", 1.0, 1.0), ("hybrid", 0.7, 0.8)])
def test_lookup_and_hybrid_drafts_sample_exactly_ntp_distribution(drafts, temperature, top_p):
    """Lookup's drafts are point masses (accepted with probability p(d), else a draw from p without d);
    hybrid chooses its source from what was decided before the block, so each draft's q is known."""
    expected = ntp_joint(temperature, top_p)
    kind = functools.partial(VerifiedSBDDecoder, drafts=drafts)
    counts, results = sampled_joint(decoder(kind, temperature, top_p), seed=1)
    lookup_drafted = sum(r.lookup_drafted for r in results)
    # Both sources must be exercised thousands of times.
    assert lookup_drafted > (ROWS // 4 if drafts == "lookup" else ROWS // 10)
    assert 0 < sum(r.lookup_accepted for r in results) < lookup_drafted
    if drafts == "hybrid":
        assert sum(r.drafted for r in results) > lookup_drafted  # SBD's block drafted too
    assert chi_square_p(counts, expected) > 1e-3
    assert total_variation(counts, expected) < 1.5 * sampling_noise(expected, ROWS)


@pytest.mark.parametrize("drafts, temperature, top_p", [("sbd", 1.0, 1.0), slow_case("hybrid", 0.7, 0.8)])
def test_fallback_block_drafts_sample_exactly_ntp_distribution(drafts, temperature, top_p):
    """After a rejected draft the next drafts come from the fallback block placed after the tokens kept: which
    block is read from this pass's test (decided tokens), and each block's q from the tokens before it alone."""
    expected = ntp_joint(temperature, top_p)
    kind = functools.partial(VerifiedSBDDecoder, drafts=drafts, fallback_blocks=2)
    counts, results = sampled_joint(decoder(kind, temperature, top_p), seed=2)
    # Without a fallback block a row drafts at most the 2 drafts of its second pass (block 3, 3 new tokens);
    # a third draft is one a fallback block proposed after the second pass rejected its first draft.
    assert sum(r.drafted - r.lookup_drafted == 3 for r in results) > ROWS // 10
    assert chi_square_p(counts, expected) > 1e-3
    assert total_variation(counts, expected) < 1.5 * sampling_noise(expected, ROWS)

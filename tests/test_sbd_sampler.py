"""The Entropy-Bounded rule and the SBD block decoder against an uncached reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.sbd import SBDDecoder
from sbd_jax.decoding.token_choice import TWO_REDUCTIONS_FROM_VOCAB, eb_reveal, greedy_token, uncertainty
from sbd_jax.errors import UserError
from sbd_jax.model.kv_cache import append, init_cache
from sbd_jax.model.transformer import Transformer, init_params
from tests.conftest import slow_case
from tests.test_decoding import CFG as BASE_CFG
from tests.test_decoding import PROMPTS

MASK = 100
CFG = BASE_CFG.replace(mask_token_id=MASK)


@pytest.fixture(scope="module")
def params():
    """A random model whose block predictions vary in token and in entropy, so γ matters.

    Untrained weights give near-uniform distributions: embeddings and the output head are scaled up,
    and the mask token's embedding is zeroed so masked positions are driven by their context.
    """
    p = init_params(CFG, seed=1)
    p["embed_tokens"]["embedding"] = (p["embed_tokens"]["embedding"] * 50).at[MASK].set(0.0)
    p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 20
    return p


def test_worked_example_reveals_two():
    scores = jnp.asarray([0.85, 0.05, 1.40, 0.12])  # sorted: 0.05, 0.12, 0.85, 1.40
    reveal = eb_reveal(scores, jnp.ones(4, bool), 0.15)
    assert reveal.tolist() == [False, True, False, True]  # 0.05 <= 0.15; 0.05 + 0.12 > 0.15


def test_gamma_zero_reveals_one_and_nothing_masked_reveals_nothing():
    scores = jnp.asarray([[0.3, 0.2, 0.9], [0.1, 0.1, 0.1]])
    masked = jnp.asarray([[True, True, True], [False, False, False]])
    assert eb_reveal(scores, masked, 0.0).tolist() == [[False, True, False], [False, False, False]]
    only_unmasked_is_sure = jnp.asarray([[5.0, 0.0, 7.0]])
    assert eb_reveal(only_unmasked_is_sure, jnp.asarray([[True, False, True]]), 0.0).tolist() == [[True, False, False]]


def test_larger_gamma_never_reveals_fewer():
    rng = np.random.RandomState(0)
    scores = jnp.asarray(rng.exponential(0.3, (200, 16)))
    masked = jnp.asarray(rng.rand(200, 16) < 0.7)
    counts = [np.asarray(eb_reveal(scores, masked, g)).sum(-1) for g in (0.0, 0.1, 0.35, 1.0, 5.0, 1e9)]
    for fewer, more in zip(counts, counts[1:]):
        assert (more >= fewer).all()
    assert (counts[0] == np.minimum(1, np.asarray(masked).sum(-1))).all()
    assert (counts[-1] == np.asarray(masked).sum(-1)).all()


def test_greedy_token_is_argmax():
    """The CPU's two-reduction argmax picks what jnp.argmax picks: the first maximum among ties (logits
    drawn from 4 values tie often), index 0 in an all -inf row; a NaN or the maximum where a row holds
    NaN; other platforms lower jnp.argmax itself."""
    logits = jax.random.randint(jax.random.key(0), (64, 3, TWO_REDUCTIONS_FROM_VOCAB), 0, 4).astype(jnp.float32).at[1].set(-jnp.inf)
    np.testing.assert_array_equal(jax.jit(greedy_token)(logits), jnp.argmax(logits, axis=-1))
    broken = logits.at[0, 0, 7].set(jnp.nan).at[0, 0, 300].set(jnp.nan)
    assert int(jax.jit(greedy_token)(broken)[0, 0]) in (7, int(jnp.argmax(logits[0, 0])))
    for platform in ("cuda", "tpu"):
        text = jax.export.export(jax.jit(greedy_token), platforms=[platform])(logits).mlir_module()
        assert "argmax" in text or "reduce" in text


def test_uncertainty_proxies():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]]))
    np.testing.assert_allclose(uncertainty(logits, "entropy"),
                               [-(0.7 * np.log(0.7) + 0.2 * np.log(0.2) + 0.1 * np.log(0.1)), np.log(3)], rtol=1e-6)
    np.testing.assert_allclose(uncertainty(logits, "confidence"), [0.3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(uncertainty(logits, "margin"), [0.5, 1.0], rtol=1e-6)
    assert float(uncertainty(jnp.asarray([[0.0, -jnp.inf]]), "entropy")[0]) == 0.0  # top-p truncated
    left_to_right = uncertainty(jnp.zeros((2, 4, 5)), "left_to_right")
    masked = jnp.asarray([[True] * 4, [False, True, True, True]])
    assert eb_reveal(left_to_right, masked, 0.0).tolist() == [[True, False, False, False], [False, True, False, False]]


@functools.lru_cache(maxsize=None)
def _full_forward():
    return jax.jit(Transformer(CFG).apply)


def reference_sbd(params, prompt, max_new, k, gamma, eos=()):
    """EB decoding with an uncached forward of the whole sequence for every pass (greedy)."""
    out, passes, nfe = [], [], 0
    while len(out) < max_new:
        block = [MASK] * k
        block_pass = [0] * k
        limit = min(k, max_new - len(out))
        while True:
            eos_at = min([i for i, t in enumerate(block) if t in eos and t != MASK] + [k])
            todo = [i for i in range(k) if block[i] == MASK and i < eos_at and i < limit]
            if not todo:
                break
            context = prompt + out
            n = len(context) + k
            mask = np.tril(np.ones((n, n), bool))
            mask[len(context):, len(context):] = True  # the SBD inference mask: block all-to-all
            logits, _ = _full_forward()({"params": params}, jnp.asarray([context + block]),
                                        jnp.arange(n)[None], mask=jnp.asarray(mask))
            block_logits = logits[0, len(context):].at[:, MASK].set(-jnp.inf)  # never a valid output
            masked = jnp.asarray([i in todo for i in range(k)])
            now = np.asarray(eb_reveal(uncertainty(block_logits, "entropy"), masked, gamma))
            nfe += 1
            for i in np.flatnonzero(now):
                block[i] = int(jnp.argmax(block_logits[i]))
                block_pass[i] = nfe
        eos_at = min([i for i, t in enumerate(block) if t in eos] + [k])
        keep = min(eos_at + 1, limit)
        out += block[:keep]
        passes += block_pass[:keep]
        if eos_at < k:
            break
    return out, nfe, passes


@pytest.mark.parametrize("gamma, k, max_new", [(0.0, 4, 12), slow_case(0.5, 4, 12), slow_case(3.0, 4, 12),
                                                slow_case(0.0, 3, 10), (0.5, 3, 10), slow_case(3.0, 3, 10)])
def test_block_decoding_equals_uncached_reference(params, gamma, k, max_new):
    decoder = SBDDecoder(CFG, max_new_tokens=max_new, block_size=k)
    results, _ = generate(decoder, params, PROMPTS, gamma=gamma)
    if gamma == 3.0:
        assert min(r.nfe for r in results) < max_new  # the model is uncertain enough for γ to matter
    for prompt, result in zip(PROMPTS, results):
        tokens, nfe, passes = reference_sbd(params, prompt, max_new, k, gamma)
        assert result.token_ids == tokens and result.nfe == nfe and result.reveal_pass == passes
        if gamma == 0.0:
            assert nfe == len(tokens) == max_new  # one token per pass
            assert sorted(passes) == list(range(1, max_new + 1))
        assert nfe <= max_new


def test_pass_logits_equal_uncached_forward(params):
    """A block's first pass (committing 1 or k pending tokens) and a refine pass equal an uncached forward at fp32
    1e-5, and the committed K/V a causal forward's. (Verified decoding's blocks: `tests/test_tree.py`.)"""
    k = 4
    decoder = SBDDecoder(CFG, max_new_tokens=8, block_size=k)
    seq = np.random.RandomState(3).randint(0, 100, (2, 30))

    def uncached(context):  # causal, with the last k tokens a block that sees itself
        n = context.shape[1]
        mask = np.tril(np.ones((n, n), bool))
        mask[n - k:, n - k:] = True
        return Transformer(CFG).apply({"params": params}, context, jnp.arange(n)[None].repeat(2, 0),
                                      mask=jnp.asarray(mask))[0]

    for prefix, pending_count in [(10, 1), (13, k)]:
        _, kv = Transformer(CFG).apply({"params": params}, seq[:, :prefix], jnp.arange(prefix)[None].repeat(2, 0))
        cache = append(init_cache(CFG, 2, 64), kv.k, kv.v, prefix)
        pending = np.zeros((2, k), np.int32)
        pending[:, :pending_count] = seq[:, prefix:prefix + pending_count]
        block = np.full((2, k), MASK, np.int32)
        block[:, 1] = seq[:, 0]  # a partly revealed block
        logits, kv = decoder.first_pass(params, cache, jnp.asarray(pending), jnp.full((2,), pending_count, jnp.int32),
                                        jnp.asarray(block))
        cache_after = append(cache, kv.k, kv.v, pending_count)
        full = uncached(np.concatenate([seq[:, :prefix + pending_count], block], axis=1))
        np.testing.assert_allclose(logits, full[:, -k:], atol=1e-5, rtol=0)
        assert cache_after.lengths.tolist() == [prefix + pending_count] * 2
        refined = decoder.refine_pass(params, cache_after, jnp.asarray(block))
        np.testing.assert_allclose(refined, full[:, -k:], atol=1e-5, rtol=0)
        # The committed K/V equal a causal forward's: the cache after the pass serves NTP exactly.
        _, causal_kv = Transformer(CFG).apply({"params": params}, seq[:, :prefix + pending_count],
                                              jnp.arange(prefix + pending_count)[None].repeat(2, 0))
        np.testing.assert_allclose(cache_after.k[:, :, :prefix + pending_count], causal_kv.k, atol=1e-5, rtol=0)


def test_mask_token_is_never_emitted_and_a_block_takes_at_most_k_passes(params):
    """A model that prefers the mask token: its output row is a scaled copy of its favourite token's."""
    ntp, _ = generate(NTPDecoder(CFG, max_new_tokens=12), params, PROMPTS)
    favourite = int(np.bincount(sum((r.token_ids for r in ntp), [])).argmax())
    kernel = params["lm_head"]["kernel"]
    fond = {**params, "lm_head": {"kernel": kernel.at[:, MASK].set(kernel[:, favourite] * 3)}}
    context = PROMPTS[0] + ntp[0].token_ids
    raw, _ = _full_forward()({"params": fond}, jnp.asarray([context]), jnp.arange(len(context))[None])
    assert (np.asarray(raw[0, len(PROMPTS[0]) - 1:]).argmax(-1) == MASK).any()  # it would emit it
    results, _ = generate(NTPDecoder(CFG, max_new_tokens=12), fond, PROMPTS)
    assert all(MASK not in r.token_ids and len(r.token_ids) == 12 for r in results)
    k = 4
    for gamma in (0.0, 0.5, 1e9):
        results, _ = generate(SBDDecoder(CFG, max_new_tokens=12, block_size=k), fond, PROMPTS, gamma=gamma)
        for prompt, result in zip(PROMPTS, results):
            assert MASK not in result.token_ids and len(result.token_ids) == 12
            assert (result.token_ids, result.nfe) == reference_sbd(fond, prompt, 12, k, gamma)[:2]
            for block in range(3):  # passes of one block: at most k, numbered consecutively
                passes = result.reveal_pass[block * k: (block + 1) * k]
                assert max(passes) - min(passes) < k


def test_batch_equals_rows_alone_and_eos_stops_a_row(params):
    decoder = SBDDecoder(CFG, max_new_tokens=12, block_size=4)
    batch, _ = generate(decoder, params, PROMPTS, gamma=0.5)
    for prompt, result in zip(PROMPTS, batch):
        (alone,), _ = generate(decoder, params, [prompt], gamma=0.5)
        assert result == alone
    # An EOS id that first appears inside a later block of some row.
    row, at = next((r, i) for r, res in enumerate(batch) for i in range(4, 12)
                   if res.token_ids[i] not in res.token_ids[:i])
    eos = batch[row].token_ids[at]
    stopped, _ = generate(SBDDecoder(CFG, max_new_tokens=12, block_size=4, eos_ids=(eos,)),
                          params, PROMPTS, gamma=0.5)
    ref_tokens, ref_nfe, _ = reference_sbd(params, PROMPTS[row], 12, 4, 0.5, eos=(eos,))
    assert stopped[row].token_ids == ref_tokens and stopped[row].nfe == ref_nfe
    assert stopped[row].token_ids[-1] == eos and len(stopped[row].token_ids) <= at + 1


@pytest.mark.parametrize("gamma", [-0.1, float("nan"), "0.5", True])
def test_gamma_that_is_not_a_number_at_least_0_is_refused(params, gamma):
    with pytest.raises(UserError, match=f"gamma={gamma!r} must be a number >= 0"):
        generate(SBDDecoder(CFG, max_new_tokens=8), params, PROMPTS, gamma=gamma)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size=0 must be >= 1"),
    ({"proxy": "vibes"}, "proxy='vibes': use one of entropy, confidence, margin, left_to_right"),
    ({"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(UserError, match=message):
        SBDDecoder(CFG, max_new_tokens=8, **kwargs)


def test_model_without_mask_token():
    with pytest.raises(UserError, match="no mask token configured"):
        SBDDecoder(BASE_CFG, max_new_tokens=8)


def test_block_larger_than_the_cache_allows(params):
    with pytest.raises(UserError, match="whole blocks of 64 \\(64\\) = 73 exceeds the cache size \\(64\\)"):
        generate(SBDDecoder(CFG, max_new_tokens=8, block_size=64), params, PROMPTS, max_cache_len=64)

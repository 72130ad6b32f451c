"""Verified SBD (`VerifiedSBDDecoder`): output identical to greedy NTP, and its accounting against a Python
reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.block_choice import choose_block_size
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.sbd import SBDDecoder
from sbd_jax.decoding.verified import VerifiedSBDDecoder
from sbd_jax.errors import UserError
from sbd_jax.model.transformer import Transformer, init_params
from tests.conftest import requires_smollm2, slow_case
from tests.test_decoding import CFG as QWEN2

MASK = 37  # an ordinary vocabulary id: the models were never trained to fill blocks
CONFIGS = {
    "llama": QWEN2.replace(model_type="llama", qkv_bias=False, mask_token_id=MASK),
    "qwen2": QWEN2.replace(mask_token_id=MASK),
    "qwen3": QWEN2.replace(model_type="qwen3", qkv_bias=False, qk_norm=True, mask_token_id=MASK),
}
PROMPTS = [[5, 17, 3], [9, 2, 44, 81, 7, 7, 30, 12, 1], [60], [8, 8, 8, 8, 8]]


@functools.lru_cache(maxsize=None)
def model(name):
    """Sharpened random weights, so greedy choices have margins and some drafts are right."""
    cfg = CONFIGS[name]
    p = init_params(cfg, seed=3)
    p["embed_tokens"]["embedding"] = p["embed_tokens"]["embedding"] * 50
    p["lm_head"]["kernel"] = p["lm_head"]["kernel"] * 10
    return cfg, p


@functools.lru_cache(maxsize=None)
def ntp(name, max_new, eos=()):
    cfg, params = model(name)
    return generate(NTPDecoder(cfg, max_new_tokens=max_new, eos_ids=eos), params, PROMPTS)[0]


@pytest.mark.parametrize("name, k", [(n, k) if (n, k) in (("llama", 4), ("qwen3", 16)) else slow_case(n, k)
                                     for k in (1, 3, 4, 16) for n in CONFIGS])
def test_verified_output_equals_greedy_ntp(name, k):
    cfg, params = model(name)
    free = ntp(name, 20)
    # EOS ids that first appear mid-answer (inside blocks), differently in each row.
    eos = tuple(sorted({free[0].token_ids[5], free[1].token_ids[9]}))
    for stop in ((), eos):
        reference = ntp(name, 20, stop)
        assert stop == () or any(len(r.token_ids) < 20 for r in reference)
        results, _ = generate(VerifiedSBDDecoder(cfg, max_new_tokens=20, block_size=k, eos_ids=stop),
                              params, PROMPTS)
        for ours, expected in zip(results, reference):
            assert ours.token_ids == expected.token_ids
            assert 1 <= ours.nfe <= len(ours.token_ids)  # one-pass drafts: never more forwards than NTP
            assert ours.accepted <= ours.drafted


@functools.lru_cache(maxsize=None)
def _apply(cfg):
    return jax.jit(Transformer(cfg).apply)


def _forward(cfg, params, tokens, block):
    """Uncached logits of `tokens` (causal) followed by `block` positions that see all of it and each other.
    Right-padded to a multiple of 128 (nothing real attends to padding): calls share one compiled forward."""
    n = len(tokens)
    width = -(-n // 128) * 128
    mask = np.tril(np.ones((width, width), bool))
    mask[n - block: n, n - block: n] = True
    padded = np.zeros((1, width), np.int32)
    padded[0, :n] = tokens
    logits, _ = _apply(cfg)({"params": params}, jnp.asarray(padded), jnp.arange(width)[None], mask=jnp.asarray(mask))
    return logits[0, :n].at[:, cfg.mask_token_id].set(-jnp.inf)  # the mask token is never an output


def reference_verified(cfg, params, prompt, max_new, k, eos=(), fallback=0):
    """Verified SBD written plainly with uncached forwards: (tokens, nfe, drafted, accepted, corrected).
    `fallback`: where draft m + 1 (m < fallback) is rejected, the next drafts come from a block after the
    tokens kept, computed here by a forward of its own (the decoder's pass computes it beside the others)."""
    mask = cfg.mask_token_id
    committed, pending = list(prompt[:-1]), [prompt[-1]]  # pending: an exact token, then its drafts
    out, corrected = [], []
    nfe = drafted = accepted = 0
    while True:
        logits = _forward(cfg, params, committed + pending + [mask] * k, k)
        nfe += 1
        exact = [int(jnp.argmax(logits[len(committed) + j])) for j in range(len(pending))]
        drafts = pending[1:]
        for d in drafts:  # drafts up to and including the first drafted EOS were submitted
            if d == mask:
                break
            drafted += 1
            if d in eos:
                break
        m = 0
        while m < len(drafts) and drafts[m] == exact[m]:
            m += 1
        emitted = drafts[:m] + [exact[m]]
        for i, token in enumerate(emitted):
            if len(out) == max_new:
                return out, nfe, drafted, accepted, corrected
            out.append(token)
            corrected.append(i == m and m < len(drafts))
            accepted += i < m
            if token in eos:
                return out, nfe, drafted, accepted, corrected
        if len(out) == max_new:
            return out, nfe, drafted, accepted, corrected
        committed += pending[: m + 1]
        if m < len(drafts) and m >= min(fallback, k - 1):
            pending = [exact[m]]
            continue
        if m < len(drafts):  # a fallback block: after the tokens kept, not after the rejected draft
            logits = _forward(cfg, params, committed + [mask] * k, k)
        # The next block is drafted from this same pass, as far as max_new_tokens reaches.
        budget = max_new - len(out) + 1
        block = [exact[m]] + [int(jnp.argmax(logits[i - k])) if i < budget else mask for i in range(1, k)]
        pending = block


@functools.lru_cache(maxsize=None)
def trained_arithmetic_model(questions=("c5b7a2+b8a6", "a9+a9", "e1d2c3b4a5+d9c9b9a9", "b4a0+c1b1a1")):
    """The small-scale study's shipped SBD model, whose drafts are mostly right, and chat prompts."""
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.evaluation.measure import chat_prompt

    loaded = load_model("experiments/small_scale/models/sbd_arith")
    prompts = [chat_prompt(loaded.tokenizer, q) for q in questions]
    return loaded.config, jax.device_put(loaded.params), prompts


@pytest.mark.parametrize("which, k", [slow_case("random", 4), ("trained", 4), slow_case("random", 8),
                                      slow_case("trained", 8)])
def test_accounting_equals_the_python_reference(which, k):
    if which == "random":
        cfg, params = model("llama")
        prompts, eos = PROMPTS[:3], ()
    else:
        cfg, params, prompts = trained_arithmetic_model()
        eos = cfg.eos_token_ids
    results, _ = generate(VerifiedSBDDecoder(cfg, max_new_tokens=40, block_size=k, eos_ids=eos), params,
                          prompts)
    expected, _ = generate(NTPDecoder(cfg, max_new_tokens=40, eos_ids=eos), params, prompts)
    for prompt, ours, ntp_result in zip(prompts, results, expected):
        tokens, nfe, drafted, accepted, corrected = reference_verified(cfg, params, prompt, 40, k, eos)
        assert ours.token_ids == tokens == ntp_result.token_ids
        assert (ours.nfe, ours.drafted, ours.accepted, ours.corrected) == (nfe, drafted, accepted, corrected)
    if which == "trained":  # right drafts: well over one token per pass, identical output
        assert sum(len(r.token_ids) for r in results) / sum(r.nfe for r in results) > 2


@pytest.mark.parametrize("which, k, fallback", [slow_case("random", 4, 1), ("random", 4, 3),
                                                slow_case("trained", 16, 15), slow_case("random", 3, 5)])
def test_fallback_blocks_keep_ntp_output_and_draft_after_a_rejection(which, k, fallback):
    """Fallback blocks (one per place a draft can be rejected, at most k - 1 used) run in the verifying pass
    itself: their drafts equal those of a block computed after exactly the tokens kept, and the output is NTP's."""
    if which == "random":
        cfg, params = model("qwen3")
        prompts, eos = PROMPTS, ()
    else:
        cfg, params, prompts = trained_arithmetic_model()
        eos = cfg.eos_token_ids
    results, _ = generate(VerifiedSBDDecoder(cfg, max_new_tokens=40, block_size=k, eos_ids=eos,
                                             fallback_blocks=fallback), params, prompts)
    plain, _ = generate(VerifiedSBDDecoder(cfg, max_new_tokens=40, block_size=k, eos_ids=eos), params, prompts)
    expected, _ = generate(NTPDecoder(cfg, max_new_tokens=40, eos_ids=eos), params, prompts)
    for prompt, ours, ntp_result in zip(prompts, results, expected):
        tokens, nfe, drafted, accepted, corrected = reference_verified(cfg, params, prompt, 40, k, eos, fallback)
        assert ours.token_ids == tokens == ntp_result.token_ids
        assert (ours.nfe, ours.drafted, ours.accepted, ours.corrected) == (nfe, drafted, accepted, corrected)
    # after a rejection the next pass still drafts: more drafts, and never more forwards in all
    assert sum(r.drafted for r in results) > sum(r.drafted for r in plain)
    assert sum(r.nfe for r in results) <= sum(r.nfe for r in plain)


@requires_smollm2
@pytest.mark.real_model
@pytest.mark.slow  # real SmolLM2, 3 decoders
def test_verified_smollm2_with_an_untrained_mask_token_equals_ntp():
    """Drafts of a model never trained to fill blocks are mostly wrong: rejections everywhere, same text."""
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.checkpoints.tokenizer import encode_prompt
    from tests.test_real_smollm2 import CHAT_PROMPTS

    loaded = load_model("smollm2-135m")
    cfg = loaded.config.replace(mask_token_id=4)
    params = jax.device_put(loaded.params)
    prompts = [encode_prompt(loaded.tokenizer, p, chat=True) for p in CHAT_PROMPTS[:3]]
    common = dict(max_new_tokens=40, eos_ids=cfg.eos_token_ids)
    expected, _ = generate(NTPDecoder(cfg, **common), params, prompts)
    results, _ = generate(VerifiedSBDDecoder(cfg, block_size=8, **common), params, prompts)
    for ours, reference in zip(results, expected):
        assert ours.token_ids == reference.token_ids
    assert sum(r.drafted - r.accepted for r in results) > 0  # rejections happened


@pytest.mark.parametrize("k", [slow_case(2), 5, slow_case(16)])
def test_verified_output_equals_ntp_where_drafts_are_accepted(k):
    """The trained model accepts most drafts, so this matrix runs the acceptance paths: limits at and
    around the block size, rows batched together or alone, EOS wherever the answers end."""
    from sbd_jax.evaluation.arithmetic import problems

    cfg, params, prompts = trained_arithmetic_model(tuple(p.question for p in problems(6, 5, seed=7)))
    eos = cfg.eos_token_ids
    for max_new in sorted({1, max(k - 1, 1), k, k + 1, 72}):
        reference, _ = generate(NTPDecoder(cfg, max_new_tokens=max_new, eos_ids=eos), params, prompts)
        decoder = VerifiedSBDDecoder(cfg, max_new_tokens=max_new, block_size=k, eos_ids=eos)
        results, _ = generate(decoder, params, prompts)
        if max_new == 72:  # whole answers (EOS inside a block), and a row alone as well as batched
            results.append(generate(decoder, params, prompts[:1])[0][0])
            assert sum(r.accepted for r in results) > 0.5 * sum(r.drafted for r in results) > 0
        for ours, expected in zip(results, reference + reference[:1]):
            assert ours.token_ids == expected.token_ids
            assert 1 <= ours.nfe <= len(ours.token_ids) and ours.accepted <= ours.drafted


def test_verified_and_plain_sbd_run_wherever_ntp_fits_the_context():
    """prompt + max_new_tokens filling the context exactly: NTP runs, and so do the block decoders (their
    last block's extra positions are decoded and dropped, never emitted); verified = NTP."""
    cfg, params = model("llama")
    cfg = cfg.replace(max_position_embeddings=9 + 23)  # the longest prompt has 9 tokens
    reference, _ = generate(NTPDecoder(cfg, max_new_tokens=23), params, PROMPTS)
    verified, _ = generate(VerifiedSBDDecoder(cfg, max_new_tokens=23, block_size=16), params, PROMPTS)
    plain, _ = generate(SBDDecoder(cfg, max_new_tokens=23, block_size=16), params, PROMPTS, gamma=1.0)
    assert [r.token_ids for r in verified] == [r.token_ids for r in reference]
    assert all(len(r.token_ids) == 23 for r in reference + plain)
    with pytest.raises(UserError, match="exceeds the model's context"):
        generate(NTPDecoder(cfg, max_new_tokens=24), params, PROMPTS)


def test_the_block_size_rule_picks_the_best_predicted_speedup_or_ntp():
    tokens = {4: 3.6, 8: 6.0, 16: 9.0}
    # batch 1: a pass costs little more than a step, so the longest block wins (9.0 / 1.5 = 6.0)
    assert choose_block_size(tokens, {4: 1.1, 8: 1.2, 16: 1.5}, 1.0) == 16
    # a larger batch: time grows with the tokens of a pass; 8 wins (6.0 / 2.0 = 3.0 > 3.6 / 1.3, 9.0 / 4.0)
    assert choose_block_size(tokens, {4: 1.3, 8: 2.0, 16: 4.0}, 1.0) == 8
    # no block is predicted to beat one token per step: NTP
    assert choose_block_size({4: 1.0, 8: 1.1}, {4: 1.5, 8: 3.0}, 1.0) == 1
    # lookup: passes where no row drafts run one token; 80% such passes: 1.5 / (0.2 * 2.0 + 0.8 * 1.0) = 1.25
    assert choose_block_size({4: 1.5}, {4: 2.0}, 1.0) == 1
    assert choose_block_size({4: 1.5}, {4: 2.0}, 1.0, {4: 0.8}) == 4
    with pytest.raises(UserError, match="same block sizes"):
        choose_block_size({4: 2.0}, {8: 1.0}, 1.0)


@pytest.mark.slow  # four decoders compiled
def test_measured_settings_decode_with_the_decoder_they_name():
    """`evaluation.measure.decode` (what studies and recipes record rows of) runs each setting's own decoder."""
    from sbd_jax.decoding.settings import Mode, Settings
    from sbd_jax.decoding.token_choice import Proxy
    from sbd_jax.evaluation.measure import EvaluatedModel, decode

    cfg, params, prompts = trained_arithmetic_model()
    model = EvaluatedModel("sbd_arith", cfg, params, None)
    ntp, _ = decode(model, Settings(), prompts, 40)
    out, _ = decode(model, Settings(mode=Mode.SBD, block_size=8, verify=True), prompts, 40, 3)
    assert [g.token_ids for g in out] == [g.token_ids for g in ntp] and sum(g.drafted for g in out) > 0
    assert sum(g.nfe for g in out) < sum(g.nfe for g in ntp)  # verified SBD: NTP's output in fewer forwards
    order, _ = decode(model, Settings(mode=Mode.SBD, block_size=8, gamma=0.0, proxy=Proxy.LEFT_TO_RIGHT), prompts, 40)
    assert all(g.reveal_pass == list(range(1, len(g.token_ids) + 1)) for g in order)  # one token a pass, in order
    plain, _ = decode(model, Settings(mode=Mode.SBD, block_size=8, gamma=1.0), prompts, 40)
    assert sum(g.nfe for g in plain) < sum(len(g.token_ids) for g in plain) and not any(g.drafted for g in plain)

"""Prompt-lookup drafts (`sbd_jax.decoding.lookup`) and the verified decoder's draft sources: lookup on device
equals the host rule, greedy output equals NTP for every source, forwards equal the replay, and a
model without a mask token decodes with lookup drafts only."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.chain_drafts import sbd_preferred
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.lookup import lookup_drafts, lookup_once, replay_lookup
from sbd_jax.decoding.settings import Settings
from sbd_jax.decoding.verified import VerifiedSBDDecoder
from sbd_jax.errors import UserError
from tests.conftest import slow_case
from tests.test_verify import PROMPTS, model


@pytest.mark.parametrize("max_ngram, latest, extend, min_match",
                         [*itertools.product((1, 4), (True, False), (True, False), (1,)), (4, True, True, 3)])
def test_lookup_on_device_equals_the_host_rule(max_ngram, latest, extend, min_match):
    rng = np.random.default_rng(max_ngram)
    width, drafts = 40, 6
    histories = rng.integers(0, 4, (64, width))  # a small alphabet: many n-grams recur
    lengths = rng.integers(1, width + 1, 64)
    found, count = lookup_drafts(histories, lengths, drafts, max_ngram, latest, extend, min_match)
    for row, n in enumerate(lengths):
        expected = lookup_once(histories[row, :n], drafts, max_ngram, latest, extend, min_match)
        assert found[row, :count[row]].tolist() == expected
    assert (np.asarray(count) > 0).mean() > (0.8 if min_match == 1 else 0.1)


def test_lookup_proposes_what_followed_the_latest_longest_match():
    #              0  1  2  3  4  5  6  7  8
    context = [7, 1, 2, 9, 1, 2, 5, 3, 1, 2]
    assert lookup_once(context, 3, max_ngram=2, latest=True, extend=False) == [5, 3, 1]
    assert lookup_once(context, 3, max_ngram=2, latest=False, extend=False) == [9, 1, 2]
    assert lookup_once([4, 4, 4], 5, max_ngram=1, latest=True, extend=True) == [4] * 5  # a repeat of period 1
    assert lookup_once([4, 4, 4], 5, max_ngram=1, latest=True, extend=False) == [4]
    assert lookup_once([1, 2, 3], 4) == []


@pytest.mark.parametrize("name, drafts, k, min_match", [
    slow_case("llama", "lookup", 1, 1), ("llama", "lookup", 4, 1), slow_case("qwen3", "lookup", 8, 1),
    slow_case("llama", "hybrid", 1, 1), slow_case("llama", "hybrid", 4, 1), slow_case("qwen3", "hybrid", 8, 1),
    slow_case("llama", "lookup", 4, 2), ("qwen3", "hybrid", 8, 2)])  # passes without drafts: one-token passes
def test_lookup_and_hybrid_output_equals_greedy_ntp(name, drafts, k, min_match):
    cfg, params = model(name)
    free = generate(NTPDecoder(cfg, max_new_tokens=24), params, PROMPTS)[0]
    eos = (free[1].token_ids[9],)
    for stop in ((), eos):
        reference = generate(NTPDecoder(cfg, max_new_tokens=24, eos_ids=stop), params, PROMPTS)[0]
        results, _ = generate(VerifiedSBDDecoder(cfg, max_new_tokens=24, block_size=k, eos_ids=stop, drafts=drafts,
                                                 lookup_min_match=min_match), params, PROMPTS)
        for prompt, ours, expected in zip(PROMPTS, results, reference):
            assert ours.token_ids == expected.token_ids
            assert 1 <= ours.nfe <= len(ours.token_ids)
            assert ours.lookup_accepted <= ours.lookup_drafted <= ours.drafted
            if drafts == "lookup":  # the replay of the same rule on the output takes the same forwards
                replay = replay_lookup(prompt, expected.token_ids, k - 1, 24, min_match=min_match)
                assert (ours.nfe, ours.accepted) == (replay.forwards, replay.accepted)
                assert ours.drafted == ours.lookup_drafted
    assert sum(r.lookup_accepted for r in results) > 0 or k == 1


class AlwaysWide(VerifiedSBDDecoder):
    """Runs every pass k tokens wide, drafts or not."""

    def width_choice(self, tree, live_B, calibration):
        return jnp.int32(len(self.pass_widths) - 1)


@pytest.mark.parametrize("temperature", [slow_case(0.0), 1.0])
def test_a_pass_without_drafts_runs_one_token_and_decodes_as_the_wide_pass(temperature):
    cfg, params = model("llama")
    options = dict(max_new_tokens=24, block_size=8, drafts="lookup", lookup_min_match=3, temperature=temperature)
    narrow_passes = []
    for prompt in PROMPTS:  # batch 1: a pass is narrow where this row has no drafts
        (narrow,), _ = generate(VerifiedSBDDecoder(cfg, **options), params, [prompt], seed=5)
        (wide,), _ = generate(AlwaysWide(cfg, **options), params, [prompt], seed=5)
        assert (narrow.token_ids, narrow.nfe, narrow.accepted) == (wide.token_ids, wide.nfe, wide.accepted)
        # A lookup draft is kept iff it is the emitted token (sampling too: a rejected point mass is never
        # drawn again), so replaying the output counts the passes that had drafts.
        replay = replay_lookup(prompt, narrow.token_ids, 7, 24, min_match=3)
        assert narrow.nfe == replay.forwards
        assert narrow.narrow_passes == replay.forwards - replay.drafting_passes
        narrow_passes.append(narrow.narrow_passes)
    assert max(narrow_passes) > 2  # so some passes ran narrow


def test_lookup_needs_no_mask_token_and_the_block_sources_say_so():
    cfg, params = model("llama")
    plain = cfg.replace(mask_token_id=None)
    reference = generate(NTPDecoder(plain, max_new_tokens=16), params, PROMPTS)[0]
    results, _ = generate(Settings(mode="sbd", verify=True, drafts="lookup", block_size=4,
                                   max_new_tokens=16).decoder(plain), params, PROMPTS)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert sum(r.nfe for r in results) < sum(len(r.token_ids) for r in results)
    for drafts in ("sbd", "hybrid"):
        with pytest.raises(UserError, match=f"drafts '{drafts}' .* no mask token .* use --drafts lookup"):
            Settings(mode="sbd", verify=True, drafts=drafts).decoder(plain)


@pytest.mark.parametrize("options, message", [
    (dict(drafts="ngram", verify=True, mode="sbd"), "unknown draft source 'ngram'"),
    (dict(drafts="lookup"), "proposals for verification: add verify"),
    (dict(temperature=float("inf")), "temperature=inf must be >= 0 and finite"),
    (dict(temperature=float("nan")), "temperature=nan must be >= 0 and finite"),
    (dict(temperature="0.5"), "temperature='0.5' must be >= 0 and finite"),
    (dict(top_p=float("nan")), "top_p=nan must be a number in"),
    (dict(max_new_tokens=2.5), r"max_new_tokens=2.5 must be >= 1 \(a whole number\)"),
    (dict(mode="sbd", block_size=2.5), r"block_size=2.5 must be >= 1 \(a whole number\)"),
    (dict(mode="sbd", verify="no"), "verify='no' must be True or False"),
    (dict(mode="sbd", verify=True, drafts="lookup", lookup_min_match=5), "lookup_min_match=5 must be a whole number"),
    (dict(mode="sbd", verify=True, lookup_min_match=2), r"drafts that search the context \(lookup, hybrid, "),
    (dict(mode="sbd", verify=True, fallback_blocks=-1), "fallback_blocks=-1 must be a whole number >= 0"),
    (dict(mode="sbd", verify=True, fallback_blocks=True), "fallback_blocks=True must be a whole number >= 0"),
    (dict(mode="sbd", verify=True, drafts="lookup", fallback_blocks=2), "use them with drafts 'sbd', 'hybrid', 'sbd-tree'"),
    (dict(mode="sbd", fallback_blocks=2), r"add verify \(--mode sbd --verify\)"),
    (dict(mode="sbd", verify=True, drafts="tree", block_size=1), "form trees block_size - 1 deep"),
    (dict(mode="sbd", verify=True, drafts="successors", draft_nodes=0), r"draft_nodes=0 must be >= 1"),
    (dict(mode="sbd", verify=True, drafts="successors", fallback_blocks=1), "use them with drafts 'sbd', 'hybrid', 'sbd-tree'"),
    (dict(mode="sbd", verify=True, drafts="lookup", draft_nodes=8), "sizes the trees of tree drafts"),
    (dict(mode="sbd", verify=True, drafts="tree", draft_nodes=4, pass_costs=((1, 0.1), (8, 0.2))),
     r"pass widths \(1, 8\) must be distinct, increasing and from 1 to 1 \+ draft_nodes"),
])
def test_settings_refuse_bad_values_when_made(options, message):
    with pytest.raises(UserError, match=message):
        Settings(**options)


@pytest.mark.parametrize("drafts", ["sbd", "lookup", "hybrid", "tree"])
def test_settings_as_ntp_keep_length_and_sampling_and_drop_every_draft_option(drafts):
    # --block-size auto that picks NTP decodes these (it kept the draft options, which NTP refuses: issue 57)
    verified = Settings(mode="sbd", verify=True, drafts=drafts, block_size=8, max_new_tokens=40, temperature=0.5,
                        top_p=0.9, lookup_min_match=1 if drafts == "sbd" else 2,
                        fallback_blocks=3 if drafts in ("sbd", "hybrid") else 0,
                        draft_nodes=4 if drafts == "tree" else 16)
    assert verified.as_ntp() == Settings(max_new_tokens=40, temperature=0.5, top_p=0.9)


@pytest.mark.parametrize("options", [
    slow_case(dict()), slow_case(dict(mode="sbd", block_size=4)), dict(mode="sbd", block_size=4, gamma=100.0),
    *(slow_case(dict(mode="sbd", verify=True, drafts=d, block_size=4)) for d in ("sbd", "lookup")),
    dict(mode="sbd", verify=True, drafts="hybrid", block_size=4)])
def test_no_decoder_emits_the_mask_token_even_where_the_model_prefers_it(options):
    cfg, params = model("llama")
    favoured = dict(params, lm_head={"kernel": params["lm_head"]["kernel"].at[:, cfg.mask_token_id].set(50.0)})
    for temperature, top_p in ((0.0, 1.0), (3.0, 0.5)):
        settings = Settings(max_new_tokens=12, temperature=temperature, top_p=top_p, **options)
        results, _ = generate(settings.decoder(cfg), favoured, PROMPTS, seed=3)
        assert all(cfg.mask_token_id not in r.token_ids for r in results), (options, temperature)


def test_the_block_size_rule_refuses_impossible_measurements():
    from sbd_jax.decoding.block_choice import choose_block_size, measure_block_choice

    with pytest.raises(UserError, match="forward times must be > 0"):
        choose_block_size({4: 2.0}, {4: 0.0}, 1.0)
    cfg, params = model("llama")
    holder = type("Model", (), {"config": cfg, "params": params})()
    with pytest.raises(UserError, match=r"batch=0 must be >= 1"):
        measure_block_choice(holder, PROMPTS, batch=0)
    with pytest.raises(UserError, match=r"calibration_tokens=0 must be >= 1"):
        measure_block_choice(holder, PROMPTS, batch=1, calibration_tokens=0)


def test_the_block_size_rule_prices_and_calibrates_the_decode_it_is_given():
    from sbd_jax.decoding.block_choice import at_block_size, pass_tokens

    hybrid = Settings(mode="sbd", verify=True, drafts="hybrid", fallback_blocks=7, temperature=0.7, max_new_tokens=9)
    assert pass_tokens(1, hybrid) == 1  # NTP's step
    assert pass_tokens(4, hybrid) == (2 + 3) * 4  # pending, block, at most k - 1 fallback blocks
    assert pass_tokens(8, hybrid) == (2 + 7) * 8
    assert pass_tokens(8, Settings(mode="sbd", verify=True, drafts="lookup")) == 8
    calibrated = at_block_size(hybrid, 4, 32)  # the draft options kept, greedy, the calibration's length
    assert (calibrated.block_size, calibrated.max_new_tokens, calibrated.temperature, calibrated.drafts,
            calibrated.fallback_blocks) == (4, 32, 0.0, "hybrid", 7)
    assert at_block_size(hybrid, 1, 32) == Settings(max_new_tokens=32)
    with pytest.raises(UserError, match="the block-size rule measures verified SBD"):
        at_block_size(Settings(mode="sbd"), 4, 32)


def test_the_calibration_counts_one_token_passes_for_lookup_only():
    from sbd_jax.decoding.block_choice import calibrate

    cfg, params = model("llama")
    holder = type("Model", (), {"config": cfg, "params": params})()
    lookup = Settings(mode="sbd", verify=True, drafts="lookup", lookup_min_match=3)
    one_by_one = calibrate(holder, PROMPTS, (8,), 24, batch=1, verified=lookup)
    expected = []
    for prompt in PROMPTS:  # at batch 1 a pass runs narrow exactly where the replay drafts nothing
        (ntp,), _ = generate(NTPDecoder(cfg, max_new_tokens=24), params, [prompt])
        replay = replay_lookup(prompt, ntp.token_ids, 7, 24, min_match=3)
        expected.append((replay.forwards - replay.drafting_passes, replay.forwards))
    assert one_by_one.narrow_share[8] == sum(n for n, _ in expected) / sum(f for _, f in expected) > 0
    together = calibrate(holder, PROMPTS, (8,), 24, batch=len(PROMPTS), verified=lookup)
    assert together.tokens_per_forward == one_by_one.tokens_per_forward  # the same outputs, the same drafts
    assert together.narrow_share[8] < one_by_one.narrow_share[8]  # a pass is narrow only if no row drafts
    assert calibrate(holder, PROMPTS, (8,), 24, batch=1).narrow_share == {8: 0.0}  # SBD's drafts


def test_hybrid_prefers_the_source_whose_drafts_were_kept_more_per_pass_spent():
    # (sbd kept, sbd passes spent, lookup kept, lookup passes) -> SBD's block preferred? (8 prior passes each)
    cases = {(0, 0, 0, 0): True,  # neither tried: SBD's block (lookup's rejected drafts would lose it)
             (0, 5, 5, 5): False, (1, 9, 3, 4): False,  # poor SBD drafts (real text): lookup
             (35, 5, 1, 10): True, (7, 1, 0, 0): True,  # SBD drafts kept whole (the small-scale model)
             (2, 2, 2, 2): True, (2, 3, 2, 2): False,
             # 30 SBD drafts kept over 40 passes, 30 of which rejected one, against lookup's 25 over 40: SBD
             # where its block holds (0.75 a pass against 0.62); where it does not, it needs a draftless pass
             # after each rejection first (30 over 70): lookup
             (30, 40, 25, 40): True, (30, 40 + 30, 25, 40): False,
             # lookup unlucky on its first two passes (0 kept) is tried again against SBD's 17 over 37: the
             # prior keeps one or two passes from settling the choice for the rest of the answer
             (17, 37, 0, 2): False}
    for (sk, su, lk, lu), expected in cases.items():
        assert bool(sbd_preferred(jnp.array(sk), jnp.array(su), jnp.array(lk), jnp.array(lu))) == expected

"""The Python API (`sbd_jax.load`, `SBDModel.generate`, `Settings`) on the shipped small-scale SBD model."""

import os

import jax
import pytest

import sbd_jax
from sbd_jax.api import SBDModel, Settings
from sbd_jax.decoding.generate import tokens_per_pass
from sbd_jax.decoding.sbd import SBDDecoder
from sbd_jax.decoding.verified import VerifiedSBDDecoder
from sbd_jax.errors import UserError

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "experiments", "small_scale", "models", "sbd_arith")
PROMPTS = ["c5b7a2+b8a6", "d1c0b9a9+a1"]


@pytest.fixture(scope="module")
def model():
    return sbd_jax.load(SHIPPED)


def test_verified_sbd_returns_ntps_completions_in_fewer_passes(model):
    ntp = model.generate(PROMPTS, chat=True, max_new_tokens=72)
    verified = model.generate(PROMPTS, chat=True, max_new_tokens=72, mode="sbd", block_size=8, verify=True)
    for v, n in zip(verified, ntp):
        assert v.token_ids == n.token_ids and v.text == n.text and n.text.strip()
        assert n.nfe == len(n.token_ids) and v.nfe < n.nfe and v.tokens_per_pass > 1
        assert 0 < v.accepted <= v.drafted and len(v.corrected) == len(v.reveal_pass) == len(v.token_ids)


def test_compiled_decoders_are_reused_and_bounded(model):
    settings = Settings(mode="sbd", block_size=4, gamma=0.5, max_new_tokens=16)
    model.generate(PROMPTS[0], settings)  # a string: a batch of one
    held = len(model.executables)
    assert held >= 2  # this shape's prefill and decode, kept
    (out,) = model.generate(PROMPTS[1], settings)
    assert len(model.executables) == held and model.last_timing.compile_seconds < 0.05
    assert out.token_ids and out.text == model.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert held <= model.executables.capacity


def test_settings_build_one_decoder_class_per_algorithm(model):
    assert type(Settings(mode="sbd").decoder(model.config)) is SBDDecoder
    assert type(Settings(mode="sbd", verify=True).decoder(model.config)) is VerifiedSBDDecoder
    assert Settings(mode="sbd").entropy_budget == 0.35 and Settings(mode="sbd", gamma=0.0).entropy_budget == 0.0


@pytest.mark.parametrize("options, message", [
    ({"mode": "fast"}, "mode='fast': use one of ntp, sbd"),
    ({"verify": True}, "verify .* checks SBD's drafts: use it with mode 'sbd'"),
    ({"mode": "sbd", "verify": True, "gamma": 0.5}, "gamma .* has no effect with verify"),
    ({"mode": "sbd", "gamma": float("nan")}, "gamma=nan must be a number >= 0"),
    ({"mode": "sbd", "block_size": 0}, "block_size=0 must be >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be >= 1"),
    ({"gamma": 0.5}, r"^gamma \(--gamma\): SBD's, not NTP's: add mode 'sbd' \(--mode sbd\), or drop them$"),
    ({"block_size": 8, "proxy": "margin"}, r"^proxy \(--proxy\), block_size \(--block-size\): SBD's, not NTP's"),
    ({"mode": "sbd", "verify": True, "proxy": "margin"}, "proxy .* orders plain SBD's reveals; with verify"),
])
def test_bad_settings_are_refused_before_any_model_is_loaded(options, message):
    with pytest.raises(UserError, match=message):
        Settings(**options)


def test_a_misspelt_option_is_refused_naming_the_options(model):
    with pytest.raises(UserError, match=r"^unknown decoding option max_tokens: give block_size, .*max_new_tokens"):
        model.generate("x", max_tokens=4)
    with pytest.raises(UserError, match=r"^unknown decoding options top_k, tree: give "):
        model.generate("x", tree=True, top_k=50)


def test_settings_and_keywords_together_are_refused(model):
    with pytest.raises(UserError, match="give settings or keyword options, not both"):
        model.generate("x", Settings(), max_new_tokens=4)
    with pytest.raises(UserError, match="give settings or keyword options, not both"):
        model.choose_block_size("x", 1, Settings(mode="sbd", verify=True), drafts="lookup")


@pytest.mark.slow  # times every block size
def test_choose_block_size_measures_the_drafts_and_picks_a_block_or_ntp(model):
    choice = model.choose_block_size(PROMPTS, batch=1, chat=True, block_sizes=(4, 8), max_new_tokens=96,
                                     calibration_tokens=72)
    for k in (4, 8):
        verified = model.generate(PROMPTS, chat=True, max_new_tokens=72, mode="sbd", block_size=k, verify=True)
        assert choice.tokens_per_forward[k] == pytest.approx(tokens_per_pass(verified))
    assert set(choice.bare_seconds) == {1, 4, 8} and min(choice.bare_seconds.values()) > 0
    # trained drafts (> 3 tokens per forward) beat one token per step at batch 1 by far
    assert choice.block_size in (4, 8) and choice.describe().startswith(f"picked block size {choice.block_size}")
    # the same architecture with random weights: drafts are never right, so NTP
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    noise = jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    untrained = SBDModel(model.config, noise, model.tokenizer)
    assert untrained.choose_block_size(PROMPTS, batch=1, chat=True, block_sizes=(4,), max_new_tokens=16).block_size == 1
    with pytest.raises(UserError, match="block sizes to choose from must be >= 2"):
        model.choose_block_size(PROMPTS, batch=1, block_sizes=(1, 4))


def test_prompts_are_strings_of_utf8_text_and_the_seed_is_in_range(model):
    """Issue 57, items 12 and 13: bytes, non-strings and undecodable text are refused, naming the prompt."""
    with pytest.raises(UserError, match=r"a prompt must be a str, got bytes \(decode bytes first"):
        model.generate(b"c5b7a2+b8a6")
    with pytest.raises(UserError, match=r"prompts\[1\]: a prompt must be a str, got int"):
        model.generate(["c5b7a2+b8a6", 5, None])
    with pytest.raises(UserError, match=r"prompts\[0\]: the prompt is not valid UTF-8 text \(character 2 is the "
                                        r"byte 0xff\)"):
        model.generate("c\udcff5")  # how Python hands over a non-UTF-8 byte of argv
    with pytest.raises(UserError, match=r"seed=18446744073709551616 must be a whole number in \[0, 2\*\*63 - 1\]"):
        model.generate(PROMPTS[0], seed=2**64)


def test_an_end_of_sequence_id_is_refused_as_the_mask_token():
    """Issue 57, item 11: with the mask token an EOS id, no decoder could ever stop."""
    with pytest.raises(UserError, match=r"mask_token_id=1 is an end-of-sequence id of this model \(eos ids \[1\]\)"):
        sbd_jax.load(SHIPPED, mask_token_id=1)

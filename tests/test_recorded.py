"""How result files record a decoding setting (`sbd_jax.evaluation.recorded`): the fields that build the decoder,
a cache key that tells every decoder apart, and one label a setting."""

import pytest

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.evaluation.recorded import FIELDS, cache_key, describe, has, key_of, record

NTP = Settings()
PLAIN = Settings(mode=Mode.SBD, block_size=4, gamma=0.35)
VERIFIED = Settings(mode=Mode.SBD, block_size=4, verify=True)


def test_the_named_constructors_build_the_settings_they_name():
    assert Settings.ntp() == NTP
    assert Settings.plain_sbd(4, 0.35) == PLAIN
    assert Settings.verified(4) == VERIFIED
    assert Settings.verified(8, Drafts.HYBRID, fallback_blocks=3) == Settings(
        mode=Mode.SBD, block_size=8, verify=True, drafts=Drafts.HYBRID, fallback_blocks=3)


def test_rows_are_selected_by_their_fields():
    rows = [record(s) for s in (NTP, PLAIN, VERIFIED, Settings.verified(4, Drafts.LOOKUP))]
    assert [has(r, verify=True, drafts=Drafts.SBD) for r in rows] == [False, False, True, False]
    assert [has(r, mode=Mode.SBD, verify=False) for r in rows] == [False, True, False, False]
    with pytest.raises(ValueError, match="not a recorded field: split"):
        has(rows[0], split="test")


def test_a_row_holds_only_what_its_decoder_uses():
    assert record(NTP) == dict(mode=Mode.NTP, block_size=1, gamma=None, proxy=None, verify=False, drafts=None,
                               fallback_blocks=0)
    assert record(PLAIN) == dict(mode=Mode.SBD, block_size=4, gamma=0.35, proxy=Proxy.ENTROPY, verify=False,
                                 drafts=None, fallback_blocks=0)
    assert record(VERIFIED) == dict(mode=Mode.SBD, block_size=4, gamma=None, proxy=None, verify=True,
                                    drafts=Drafts.SBD, fallback_blocks=0)
    # The run's length and sampling are the file's, not the setting's.
    assert record(Settings(max_new_tokens=7, temperature=0.5)) == record(NTP)
    hybrid = record(Settings(mode=Mode.SBD, block_size=4, verify=True, drafts=Drafts.HYBRID, fallback_blocks=3))
    assert list(hybrid)[: len(FIELDS)] == list(FIELDS) and hybrid["hybrid_rule"]


def test_a_row_records_the_fallback_blocks_a_pass_runs_not_the_number_asked_for():
    # At block 4 at most 3 drafts can be rejected, so a fourth fallback block is never run.
    asked_for_more = Settings.verified(4, Drafts.SBD, fallback_blocks=7)
    assert record(asked_for_more)["fallback_blocks"] == 3
    assert cache_key(asked_for_more) == cache_key(Settings.verified(4, Drafts.SBD, fallback_blocks=3))
    assert describe(record(asked_for_more)) == "verified SBD, 3 fallback blocks"
    assert record(Settings.verified(8, Drafts.SBD, fallback_blocks=7))["fallback_blocks"] == 7


def test_every_decoder_has_its_own_key_and_the_key_of_a_row_is_its_settings():
    settings = [NTP, PLAIN, VERIFIED, Settings(mode=Mode.SBD, block_size=4, gamma=0.6),
                Settings(mode=Mode.SBD, block_size=4, gamma=0.35, proxy=Proxy.LEFT_TO_RIGHT),
                Settings(mode=Mode.SBD, block_size=8, verify=True),
                Settings(mode=Mode.SBD, block_size=4, verify=True, fallback_blocks=3),
                Settings(mode=Mode.SBD, block_size=4, verify=True, drafts=Drafts.LOOKUP),
                Settings(mode=Mode.SBD, block_size=4, verify=True, drafts=Drafts.LOOKUP, lookup_min_match=2),
                Settings(mode=Mode.SBD, block_size=8, verify=True, drafts=Drafts.TREE),
                Settings(mode=Mode.SBD, block_size=8, verify=True, drafts=Drafts.TREE, draft_nodes=32)]
    keys = [cache_key(s) for s in settings]
    assert len(set(keys)) == len(keys)
    assert all(key_of(record(s)) == k for s, k in zip(settings, keys))


@pytest.mark.parametrize("settings, words", [
    (NTP, "NTP"), (PLAIN, "SBD"), (VERIFIED, "verified SBD"),
    (Settings(mode=Mode.SBD, block_size=4, gamma=0.0, proxy=Proxy.LEFT_TO_RIGHT), "SBD, left_to_right order"),
    (Settings(mode=Mode.SBD, block_size=4, verify=True, drafts=Drafts.LOOKUP), "verified, lookup drafts"),
    (Settings(mode=Mode.SBD, block_size=4, verify=True, drafts=Drafts.HYBRID, fallback_blocks=3),
     "verified, hybrid drafts, 3 fallback blocks"),
])
def test_a_recorded_setting_reads_as_words(settings, words):
    assert describe(record(settings)) == words

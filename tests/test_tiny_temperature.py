"""A temperature far below any logit gap samples the greedy output, for every decoder and draft source (at
T = 1e-9 verification's accept test once formed softmax(logits / T), which overflowed into NaN: the shipped
arithmetic model then wrote garbage where NTP at the same temperature wrote the greedy text)."""

import functools
import os

import pytest

import sbd_jax

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "experiments", "small_scale", "models", "sbd_arith")
KINDS = [dict(mode="ntp"), dict(mode="sbd", block_size=8)] + [
    dict(mode="sbd", verify=True, block_size=8, drafts=d) for d in ("sbd", "lookup", "hybrid", "context-tree",
                                                                    "successors", "tree")]


@functools.lru_cache(maxsize=None)
def model():
    return sbd_jax.load(SHIPPED)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k['mode']}-{k.get('drafts', 'plain')}")
def test_a_tiny_temperature_decodes_as_greedy(kind):
    greedy = model().generate(["c5b7a2+b8a6"], chat=True, max_new_tokens=40, **kind)
    tiny = model().generate(["c5b7a2+b8a6"], chat=True, max_new_tokens=40, temperature=1e-9, seed=3, **kind)
    assert tiny[0].token_ids == greedy[0].token_ids

"""KV-cached forwards equal uncached ones; the jit NTP decoder handles batches, EOS, sampling, limits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.generate import Executables, generate, generate_batched
from sbd_jax.decoding.token_choice import choose_tokens
from sbd_jax.errors import PromptError, UserError
from sbd_jax.model import masks
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.kv_cache import append, init_cache
from sbd_jax.model.transformer import Transformer, init_params
from tests.conftest import slow_case

CFG = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, seed=1)
    # Random 0.02-scale weights give nearly flat logits; sharpen them so greedy choices have margins.
    p["embed_tokens"]["embedding"] = p["embed_tokens"]["embedding"] * 50
    return p


def forward(params, tokens, positions=None, mask=None, cache=None):
    tokens = jnp.asarray(tokens)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return Transformer(CFG).apply({"params": params}, tokens, positions, mask=mask, cache=cache)


SEQ = np.random.RandomState(0).randint(0, 101, (2, 20))


def test_cached_token_by_token_equals_full_forward(params):
    full, _ = forward(params, SEQ)
    _, kv = forward(params, SEQ[:, :12])
    cache = append(init_cache(CFG, 2, 32), kv.k, kv.v, 12)
    for t in range(12, 20):
        logits, kv = forward(params, SEQ[:, t:t + 1], np.full((2, 1), t), cache=cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=0)
        cache = append(cache, kv.k, kv.v, 1)
    assert cache.lengths.tolist() == [20, 20]


def _full_mask(prefix: int, block_mask: np.ndarray) -> np.ndarray:
    """Uncached equivalent: causal prefix; the new tokens see the whole prefix plus `block_mask`."""
    n = prefix + block_mask.shape[0]
    mask = np.tril(np.ones((n, n), bool))
    mask[prefix:, prefix:] = block_mask
    return mask


@pytest.mark.parametrize("block_ids", [
    [0, 0, 0, 0],  # an SBD block being decoded: all-to-all
    [0, 1, 2, 3],  # causal new tokens
    [0, 1, 2, 3, 4, 4, 4, 4],  # SBD's 2k pass: commit a finished block causally + a fresh block
])
def test_new_tokens_against_cache_equal_uncached_forward(params, block_ids):
    prefix, n = 12, len(block_ids)
    ids = np.asarray(block_ids)
    block_mask = ids[None, :] <= ids[:, None]  # token i sees j iff block_ids[j] <= block_ids[i]
    seq = SEQ[:, :prefix + n]
    full, full_kv = forward(params, seq, mask=jnp.asarray(_full_mask(prefix, block_mask)))
    _, kv = forward(params, seq[:, :prefix])
    cache = append(init_cache(CFG, 2, 64), kv.k, kv.v, prefix)
    positions = np.broadcast_to(np.arange(prefix, prefix + n), (2, n))
    logits, new_kv = forward(params, seq[:, prefix:], positions, mask=block_mask, cache=cache)
    np.testing.assert_allclose(logits, full[:, prefix:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(new_kv.k, full_kv.k[:, :, prefix:], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [prefix, prefix]  # the forward never writes the cache itself


def test_rows_with_different_cache_lengths_equal_rows_alone(params):
    lengths = [5, 11]
    _, kv = forward(params, SEQ[:, :11])
    cache = append(init_cache(CFG, 2, 32), kv.k, kv.v, np.asarray(lengths))
    new = np.stack([SEQ[0, 5:9], SEQ[1, 11:15]])
    positions = np.stack([np.arange(5, 9), np.arange(11, 15)])
    logits, _ = forward(params, new, positions, mask=masks.bidirectional(4), cache=cache)
    for row, length in enumerate(lengths):
        alone, _ = forward(params, SEQ[row:row + 1, :length + 4],
                           mask=jnp.asarray(_full_mask(length, np.ones((4, 4), bool))))
        np.testing.assert_allclose(logits[row], alone[0, length:], atol=1e-5, rtol=0)


PROMPTS = [[5, 17, 3], [9, 2, 44, 81, 7, 7, 30, 12, 1], [60]]


def test_greedy_decode_is_the_argmax_of_a_full_forward(params):
    (result,), _ = generate(NTPDecoder(CFG, max_new_tokens=12), params, PROMPTS[1:2])
    assert len(result.token_ids) == 12 and result.nfe == 12
    full, _ = forward(params, np.asarray([PROMPTS[1] + result.token_ids]))
    expected = np.asarray(jnp.argmax(full[0], -1))[len(PROMPTS[1]) - 1:-1]
    assert result.token_ids == expected.tolist()


def test_batch_of_mixed_lengths_equals_each_prompt_alone(params):
    decoder = NTPDecoder(CFG, max_new_tokens=10)
    batch, _ = generate(decoder, params, PROMPTS)
    for prompt, result in zip(PROMPTS, batch):
        (alone,), _ = generate(decoder, params, [prompt])
        assert result.token_ids == alone.token_ids


def test_a_dataset_in_batches_equals_one_batch_and_compiles_one_shape(params):
    decoder, prompts = NTPDecoder(CFG, max_new_tokens=8), [*PROMPTS, [8, 8]]
    whole, _ = generate(decoder, params, prompts)
    executables = Executables(capacity=4)
    batched, timing = generate_batched(decoder, params, prompts, batch=2, executables=executables)
    assert [g.token_ids for g in batched] == [g.token_ids for g in whole]
    assert len(executables) == 2 and timing.decode_seconds > 0  # one prefill and one decode: every batch padded alike
    with pytest.raises(UserError, match="at least one prompt and batch >= 1"):
        generate_batched(decoder, params, PROMPTS, batch=0)


def test_eos_stops_only_its_row(params):
    (free, other), _ = generate(NTPDecoder(CFG, max_new_tokens=10), params, PROMPTS[:2])
    eos = free.token_ids[3]
    assert eos not in free.token_ids[:3]
    stopped, continued = generate(NTPDecoder(CFG, max_new_tokens=10, eos_ids=(eos,)), params, PROMPTS[:2])[0]
    assert stopped.token_ids == free.token_ids[:4] and stopped.nfe == 4
    cut = other.token_ids.index(eos) + 1 if eos in other.token_ids else 10
    assert continued.token_ids == other.token_ids[:cut] and continued.nfe == cut


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(params):
    greedy, _ = generate(NTPDecoder(CFG, max_new_tokens=16), params, PROMPTS)
    nucleus, _ = generate(NTPDecoder(CFG, max_new_tokens=16, temperature=1.0, top_p=1e-6), params, PROMPTS)
    assert [r.token_ids for r in nucleus] == [r.token_ids for r in greedy]
    hot = NTPDecoder(CFG, max_new_tokens=16, temperature=5.0)
    a, _ = generate(hot, params, PROMPTS, seed=1)
    b, _ = generate(hot, params, PROMPTS, seed=1)
    c, _ = generate(hot, params, PROMPTS, seed=2)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_choose_tokens_follows_temperature_and_top_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray(np.tile(probs, (20000, 1))))
    draws = np.asarray(choose_tokens(logits, jax.random.key(0), 1.0, 1.0))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), probs, atol=0.015)
    nucleus = np.asarray(choose_tokens(logits, jax.random.key(1), 1.0, 0.85))  # mass 0.8 < 0.85: 3 kept
    freq = np.bincount(nucleus, minlength=4) / len(nucleus)
    assert freq[3] == 0 and freq[2] > 0.1
    np.testing.assert_allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.015)
    assert set(np.asarray(choose_tokens(logits, jax.random.key(2), 1.0, 0.7)).tolist()) == {0, 1}


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be >= 1"),
    ({"max_new_tokens": 4, "temperature": -1.0}, "temperature=-1.0 must be >= 0"),
    ({"max_new_tokens": 4, "top_p": 0.0}, r"top_p=0.0 must be a number in \(0, 1\]"),
])
def test_bad_decoder_settings(kwargs, message):
    with pytest.raises(UserError, match=message):
        NTPDecoder(CFG, **kwargs)


def test_prompt_that_does_not_fit_the_cache(params):
    with pytest.raises(UserError, match=r"prompt \(9 tokens\) \+ max_new_tokens \(30\) = 39 exceeds the cache size \(32\)"):
        generate(NTPDecoder(CFG, max_new_tokens=30), params, PROMPTS, max_cache_len=32)
    with pytest.raises(UserError, match="exceeds the model's context \\(512\\)"):
        generate(NTPDecoder(CFG, max_new_tokens=510), params, PROMPTS)


def test_max_cache_len_never_lifts_the_models_context(params):
    """Issue 57, item 10: a cache larger than the context does not let decoding run past the context."""
    with pytest.raises(UserError, match="exceeds the model's context \\(512\\)"):
        generate(NTPDecoder(CFG, max_new_tokens=510), params, PROMPTS, max_cache_len=1000)


@pytest.mark.parametrize("seed", [2**63, 2**64, -1, True, 1.5])
def test_a_seed_outside_the_valid_range_is_refused(params, seed):
    with pytest.raises(UserError, match=r"must be a whole number in \[0, 2\*\*63 - 1\]"):
        generate(NTPDecoder(CFG, max_new_tokens=4), params, PROMPTS, seed=seed)


def test_bad_prompts(params):
    decoder = NTPDecoder(CFG, max_new_tokens=4)
    with pytest.raises(PromptError, match="at least one token") as refused:
        generate(decoder, params, [[1, 2], []])
    assert refused.value.index == 1  # the row, so a caller can name the prompt's source
    with pytest.raises(UserError, match="outside the vocabulary \\[0, 101\\)"):
        generate(decoder, params, [[1, 101]])


@pytest.mark.parametrize("scan_layers", [slow_case(False), True])
def test_decoding_loops_write_the_cache_in_place(params, scan_layers):
    """No decoding step copies the KV cache: the only whole-cache copies are the two (K and V) of the
    cache handed to `decode`, made once before its loop. A step that copies it costs time in proportion
    to the cache (1.4x NTP's step on SmolLM2 at 4,096 cached tokens before the fix)."""
    from sbd_jax.decoding.base import TracedSettings
    from sbd_jax.decoding.sbd import SBDDecoder
    from sbd_jax.decoding.verified import VerifiedSBDDecoder

    config = CFG.replace(mask_token_id=100, scan_layers=scan_layers)
    layer_params = params
    if scan_layers:  # the stacked parameter tree of the same weights
        layer_params = init_params(config, seed=1)
    capacity = 77  # a size nothing else in the model has
    cache = init_cache(config, 1, capacity)
    cache_shape = f"f32[{config.num_layers},1,{capacity},{config.num_kv_heads},{config.head_dim}]"
    common = dict(max_new_tokens=12, eos_ids=(1,))
    for decoder in (NTPDecoder(config, **common), SBDDecoder(config, block_size=4, **common),
                    VerifiedSBDDecoder(config, block_size=4, **common)):
        hlo = decoder.decode.lower(decoder, layer_params, cache, jnp.zeros((1,), jnp.int32), jax.random.key(0),
                                   TracedSettings.create(0.5)).compile().as_text()
        copies = [line for line in hlo.splitlines() if f"{cache_shape}{{4,3,2,1,0}} copy(" in line]
        assert len(copies) <= 2, (type(decoder).__name__, copies)

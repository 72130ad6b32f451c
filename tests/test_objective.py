"""The joint NTP + MATP loss against a per-token reference written from SPEC §2-3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.config import ModelConfig
from sbd_jax.errors import UserError
from sbd_jax.model import Transformer, init_params
from sbd_jax.objective import Batch, check_objective, noise, ntp_loss, sbd_loss
from tests.test_masks_attention import spec_mask

CFG = ModelConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, mask_token_id=49)
L, K, MASK = 11, 4, 49  # 11 = two full blocks of 4 + a partial block of 3


def make_batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 49, (2, L)).astype(np.int32)
    seg = np.ones((2, L), np.int32)
    seg[1, 6:] = 2  # row 1 packs two documents
    seg[1, 10:] = 0  # and a padding token
    positions = np.stack([np.arange(L), np.r_[np.arange(6), np.arange(5)]]).astype(np.int32)
    loss_mask = np.ones((2, L), bool)
    loss_mask[0, :3] = False  # a prompt: no loss on its tokens
    return Batch(*map(jnp.asarray, (tokens, seg, positions, loss_mask)))


def reference_loss(params, batch, masked):
    """Per-token loops: the clean|noisy input, the SPEC mask with segments, CE term by term."""
    tokens, seg, pos, loss_mask = (np.asarray(x) for x in batch)
    ntp_terms, matp_terms = [], []
    for b in range(2):
        noisy = np.where(masked[b], MASK, tokens[b])
        inputs = np.concatenate([tokens[b], noisy])[None]
        positions = np.concatenate([pos[b], pos[b]])[None]
        segs = np.concatenate([seg[b], seg[b]])
        mask = spec_mask(L, K) & (segs[:, None] == segs[None, :])
        logits, _ = Transformer(CFG).apply({"params": params}, inputs, positions, mask=mask[None])
        logp = np.asarray(jax.nn.log_softmax(logits[0]))
        for t in range(1, L):  # NTP: clean position t-1 predicts token t, same document, with loss
            if loss_mask[b, t] and seg[b, t] == seg[b, t - 1] and seg[b, t] > 0:
                ntp_terms.append(-logp[t - 1, tokens[b, t]])
        for i in range(L):  # MATP: masked noisy position i predicts token i, full blocks only
            if masked[b, i] and loss_mask[b, i] and i < (L // K) * K:
                matp_terms.append(-logp[L + i, tokens[b, i]])
    return np.mean(ntp_terms), np.mean(matp_terms), len(ntp_terms), len(matp_terms)


def test_loss_equals_per_token_reference():
    cfg = CFG
    params = init_params(cfg, seed=3)
    batch = make_batch()
    rng = jax.random.key(7)
    masked = np.asarray(noise(batch, rng, MASK))
    assert masked.any() and not masked[1, 10]  # padding is never noised
    loss, metrics = sbd_loss(params, Transformer(cfg), batch, rng, block_size=K, mask_id=MASK,
                             w_ntp=0.7, w_matp=1.3)
    ntp, matp, n_ntp, n_matp = reference_loss(params, batch, masked)
    np.testing.assert_allclose(metrics["ntp_loss"], ntp, rtol=1e-5)
    np.testing.assert_allclose(metrics["matp_loss"], matp, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.7 * ntp + 1.3 * matp, rtol=1e-5)
    assert int(metrics["ntp_tokens"]) == n_ntp and int(metrics["matp_tokens"]) == n_matp


def test_blockwise_attention_gives_the_same_loss_and_gradients():
    seq_len = 128
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(0, 49, (2, seq_len)), jnp.int32)
    seg = jnp.asarray(np.where(np.arange(seq_len) < 70, 1, 2)[None].repeat(2, 0), jnp.int32)
    batch = Batch(tokens, seg, jnp.asarray(np.arange(seq_len)[None].repeat(2, 0), jnp.int32),
                  jnp.ones((2, seq_len), bool))
    params = init_params(CFG, seed=3)
    results = []
    for attention in ("reference", "blockwise"):
        model = Transformer(CFG.replace(attention=attention))
        results.append(jax.value_and_grad(lambda p: sbd_loss(p, model, batch, jax.random.key(2), block_size=16,
                                                             mask_id=MASK)[0])(params))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_ntp_only_loss_equals_sbd_ntp_term():
    params = init_params(CFG, seed=3)
    batch = make_batch()
    plain, _ = ntp_loss(params, Transformer(CFG), batch)
    _, metrics = sbd_loss(params, Transformer(CFG), batch, jax.random.key(0), block_size=K, mask_id=MASK)
    # The clean half never sees the noisy half, so its NTP loss is the plain causal one.
    np.testing.assert_allclose(plain, metrics["ntp_loss"], rtol=1e-5)


def test_noise_rate_follows_eta():
    tokens = jnp.zeros((4000, 32), jnp.int32)
    batch = Batch(tokens, jnp.ones_like(tokens), jnp.zeros_like(tokens), jnp.ones(tokens.shape, bool))
    rates = np.asarray(noise(batch, jax.random.key(0), MASK)).mean(axis=1)
    assert abs(rates.mean() - 0.5) < 0.02  # η ~ U(0, 1)
    np.testing.assert_allclose(np.histogram(rates, bins=4, range=(0, 1))[0] / 4000, 0.25, atol=0.03)
    fixed = np.asarray(noise(batch, jax.random.key(1), MASK, eta_range=(0.3, 0.3))).mean()
    assert abs(fixed - 0.3) < 0.01


@pytest.mark.parametrize("k, eta, seq_len, message", [
    (0, (0, 1), 16, "block_size=0 must be >= 1"),
    (4, (-0.1, 1), 16, "eta range"),
    (4, (0.2, 1.5), 16, "eta range"),
    (32, (0, 1), 16, "longer than seq_len=16"),
])
def test_bad_objective_settings(k, eta, seq_len, message):
    with pytest.raises(UserError, match=message):
        check_objective(k, eta, seq_len)

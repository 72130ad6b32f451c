"""The joint NTP + MATP loss against a per-token reference written from the method's definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.data.packing import Batch
from sbd_jax.decoding.sbd import SBDDecoder
from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.kv_cache import append, init_cache
from sbd_jax.model.transformer import Transformer, init_params
from sbd_jax.training.objective import (
    check_objective,
    noise,
    noisy_layout,
    ntp_loss,
    sbd_loss,
    training_inputs,
)
from tests.conftest import slow_case
from tests.test_masks_attention import spec_mask

CFG = ModelConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, mask_token_id=49)
L, K, MASK, EOS = 11, 4, 49, 48  # 11 = two full blocks of 4 + a partial block of 3


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


def reference_layout(batch, k):
    """Document ends, by loops: after a document's last token (the next position holds another
    segment), the rest of that block joins it in the noisy half, EOS as target, positions continued."""
    tokens, seg, pos, loss_mask = (np.array(x) for x in batch)
    length = seg.shape[1]
    for b in range(seg.shape[0]):
        for start in range(0, length, k):
            ends = [i for i in range(start, min(start + k, length) - 1 + (start + k < length))
                    if i + 1 < length and seg[b, i] > 0 and seg[b, i + 1] != seg[b, i]]
            if ends:
                e = ends[0]
                for j in range(e + 1, min(start + k, length)):
                    seg[b, j], pos[b, j], tokens[b, j], loss_mask[b, j] = seg[b, e], pos[b, e] + j - e, EOS, loss_mask[b, e]
    return tokens, seg, pos, loss_mask


def reference_logits(params, batch, masked, b):
    """Row b's `[2L, V]` logits: its clean|noisy input under the training mask with segments, by hand."""
    tokens, seg, pos, _ = (np.asarray(x) for x in batch)
    noisy_tokens, noisy_seg, noisy_pos, _ = reference_layout(batch, K)
    noisy = np.where(masked[b], MASK, noisy_tokens[b])
    inputs = np.concatenate([tokens[b], noisy])[None]
    positions = np.concatenate([pos[b], noisy_pos[b]])[None]
    segs = np.concatenate([seg[b], noisy_seg[b]])
    mask = spec_mask(L, K) & (segs[:, None] == segs[None, :])
    return Transformer(CFG).apply({"params": params}, inputs, positions, mask=mask[None])[0][0]


def reference_loss(params, batch, masked):
    """Per-token loops: the clean|noisy input, the training mask with segments, CE term by term."""
    tokens, seg, pos, loss_mask = (np.asarray(x) for x in batch)
    noisy_tokens, noisy_seg, noisy_pos, noisy_loss = reference_layout(batch, K)
    ntp_terms, matp_terms = [], []
    for b in range(2):
        logp = np.asarray(jax.nn.log_softmax(reference_logits(params, batch, masked, b)))
        for t in range(1, L):  # NTP: clean position t-1 predicts token t, same document, with loss
            if loss_mask[b, t] and seg[b, t] == seg[b, t - 1] and seg[b, t] > 0:
                ntp_terms.append(-logp[t - 1, tokens[b, t]])
        for i in range(L):  # MATP: masked noisy position i predicts its target, full blocks only
            if masked[b, i] and noisy_loss[b, i] and i < (L // K) * K:
                matp_terms.append(-logp[L + i, noisy_tokens[b, i]])
    return np.mean(ntp_terms), np.mean(matp_terms), len(ntp_terms), len(matp_terms)


def test_loss_equals_per_token_reference():
    cfg = CFG
    params = init_params(cfg, seed=3)
    batch = make_batch()
    rng = jax.random.key(7)
    layout = noisy_layout(batch, K, (EOS,))
    masked = np.asarray(noise(layout.segment_ids, rng))
    # Document 1 of row 1 ends inside block 1 (position 5): 6 and 7 join it; document 2 ends at 9, so
    # the padding at 10 joins document 2.
    assert layout.segment_ids[1].tolist() == [1] * 8 + [2, 2, 2]
    assert masked[1, 6:8].any() and masked.any()
    loss, metrics = sbd_loss(params, Transformer(cfg), batch, rng, block_size=K, mask_id=MASK,
                             w_ntp=0.7, w_matp=1.3, end_ids=(EOS,))
    ntp, matp, n_ntp, n_matp = reference_loss(params, batch, masked)
    np.testing.assert_allclose(metrics["ntp_loss"], ntp, rtol=1e-5)
    np.testing.assert_allclose(metrics["matp_loss"], matp, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.7 * ntp + 1.3 * matp, rtol=1e-5)
    assert int(metrics["ntp_tokens"]) == n_ntp and int(metrics["matp_tokens"]) == n_matp


@pytest.mark.slow  # gradients through both attentions; test_masks_attention checks the kernels
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
        model = Transformer(CFG, attention=attention)
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


def test_noise_rate_follows_eta_and_spares_padding():
    seg = jnp.ones((4000, 32), jnp.int32).at[:, 30:].set(0)
    noised = np.asarray(noise(seg, jax.random.key(0)))
    assert not noised[:, 30:].any()
    rates = noised[:, :30].mean(axis=1)
    assert abs(rates.mean() - 0.5) < 0.02  # η ~ U(0, 1)
    np.testing.assert_allclose(np.histogram(rates, bins=4, range=(0, 1))[0] / 4000, 0.25, atol=0.03)
    fixed = np.asarray(noise(seg, jax.random.key(1), eta_range=(0.3, 0.3)))[:, :30].mean()
    assert abs(fixed - 0.3) < 0.01


def test_document_ends_extend_to_the_end_of_their_block():
    """Written out by hand: L = 12, k = 4, row = document 1 (0..5), document 2 (6..8), padding (9..11)."""
    seg = np.array([[1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 0, 0]], np.int32)
    tokens = np.array([[5, 6, 7, 8, 9, EOS, 10, 11, EOS, 0, 0, 0]], np.int32)
    loss = np.array([[0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0]], bool)
    layout = noisy_layout(Batch(*map(jnp.asarray, (tokens, seg, pos, loss))), 4, (EOS,))
    # Block 1 (4..7) holds document 1's end at 5: 6 and 7 join document 1 (document 2's start is
    # taken); document 2 ends at 8, the first position of block 2: 9..11 (padding) join it.
    assert layout.segment_ids.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5]]
    assert layout.tokens.tolist() == [[5, 6, 7, 8, 9, EOS, EOS, EOS, EOS, EOS, EOS, EOS]]
    assert layout.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]]
    # A document ending on its block's last position, or a row's last piece, gets nothing more.
    for k in (3, 6):
        assert noisy_layout(Batch(*map(jnp.asarray, (tokens, seg, pos, loss))), k, (EOS,)).segment_ids[0, 6:9].tolist() == [2, 2, 2]
    # A piece cut at the row's end (its last loss-carrying token is no EOS; an earlier turn's EOS at 5
    # is not its end) gets nothing either.
    cut_tokens = np.where(np.arange(12) == 8, 12, tokens)
    cut = noisy_layout(Batch(*map(jnp.asarray, (cut_tokens, np.ones_like(seg), np.arange(12)[None], loss))), 5,
                       (EOS,))
    assert cut.segment_ids.tolist() == [[1] * 12] and cut.tokens.tolist() == cut_tokens.tolist()
    # Without end ids the layout is the clean half's.
    plain = noisy_layout(Batch(*map(jnp.asarray, (tokens, seg, pos, loss))), 4, ())
    assert plain.segment_ids.tolist() == seg.tolist()


def test_a_chat_document_ends_at_its_eos_and_its_tail_repeats_that_eos():
    """Written out by hand: L = 12, k = 4; a chat answer ends in EOS2 (the second of two EOS ids) and a
    loss-free template newline (NL), then the next document; the newline is not part of the answer."""
    EOS2, NL = 47, 40
    seg = np.array([[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]], np.int32)
    tokens = np.array([[5, 6, 7, 8, 9, EOS2, NL, 10, 11, 12, EOS2, NL]], np.int32)
    loss = np.array([[0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0]], bool)
    layout = noisy_layout(Batch(*map(jnp.asarray, (tokens, seg, pos, loss))), 4, (EOS, EOS2))
    # Document 1 ends at 5 (not at its newline, 6): 6 and 7 are its tail, target EOS2 (not EOS).
    # Document 2 ends at 10, its newline at 11 is its tail; the row's end is no obstacle.
    assert layout.segment_ids.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]
    assert layout.tokens.tolist() == [[5, 6, 7, 8, 9, EOS2, EOS2, EOS2, 11, 12, EOS2, EOS2]]
    assert layout.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1]]
    # EOS on a block's last position (k = 3: 3..5): the next block starts with the loss-free newline,
    # never trained as [newline, EOS, ...]; nothing after the EOS joins the answer.
    on_edge = noisy_layout(Batch(*map(jnp.asarray, (tokens, seg, pos, loss))), 3, (EOS, EOS2))
    assert on_edge.tokens[0, :9].tolist() == tokens[0, :9].tolist()
    assert on_edge.loss_mask[0, 6] == 0


@pytest.mark.parametrize("revealed", [slow_case(()), (2,), slow_case((0, 3))])
def test_training_layout_equals_block_decoding_when_the_answer_ends_inside_a_block(revealed):
    """The noisy logits of a block where the answer ends (EOS at its 1st position) equal the decoding
    pass over the cached prefix with that block: masks after EOS, some positions already revealed."""
    params = init_params(CFG, seed=5)
    rng = np.random.RandomState(2)
    seq_len, k = 16, 4
    doc = list(rng.randint(0, 40, 8)) + [EOS]  # document ends at 8, the first position of block 2
    tokens = np.array([doc + list(rng.randint(0, 40, 7))], np.int32)
    seg = np.array([[1] * 9 + [2] * 7], np.int32)
    pos = np.array([list(range(9)) + list(range(7))], np.int32)
    batch = Batch(*map(jnp.asarray, (tokens, seg, pos, np.ones((1, seq_len), bool))))
    layout = noisy_layout(batch, k, (EOS,))
    masked = np.zeros((1, seq_len), bool)
    masked[0, 8:12] = [i not in revealed for i in range(k)]
    inputs, positions, attn = training_inputs(batch, layout, jnp.asarray(masked), MASK, k)
    train_logits, _ = Transformer(CFG).apply({"params": params}, inputs, positions, mask=attn)
    # Decoding: doc[:8] is in the cache (the clean prefix before the block), the block is being refined.
    _, kv = Transformer(CFG).apply({"params": params}, tokens[:, :8], jnp.arange(8)[None])
    cache = append(init_cache(CFG, 1, 32), kv.k, kv.v, 8)
    block = np.full((1, k), MASK, np.int32)
    for i in revealed:  # revealed positions hold what the answer has there: EOS at 0, EOS after it
        block[0, i] = EOS
    decoder = SBDDecoder(CFG, max_new_tokens=8, block_size=k)
    decode_logits = decoder.refine_pass(params, cache, jnp.asarray(block))
    np.testing.assert_allclose(train_logits[0, seq_len + 8: seq_len + 12], decode_logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("k, eta, seq_len, message", [
    (0, (0, 1), 16, "block_size=0 must be >= 1"),
    (4, (-0.1, 1), 16, "eta range"),
    (4, (0.2, 1.5), 16, "eta range"),
    (32, (0, 1), 16, "longer than seq_len=16"),
])
def test_bad_objective_settings(k, eta, seq_len, message):
    with pytest.raises(UserError, match=message):
        check_objective(k, eta, seq_len)


def reference_draft_matp(params, batch, masked, decay, soft):
    """The MATP term with position decay and soft targets, by loops: position i of a block (j = i mod k)
    weighs exp(-j / decay); its target mixes the data token (1 - soft) and, where clean position i - 1
    of the same document predicts token i, that position's distribution without the mask token (soft)."""
    tokens, seg, pos, _ = (np.asarray(x) for x in batch)
    noisy_tokens, noisy_seg, noisy_pos, noisy_loss = reference_layout(batch, K)
    total, weights = 0.0, 0.0
    for b in range(2):
        logits = np.asarray(reference_logits(params, batch, masked, b), np.float64)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        for i in range(L):
            if not (masked[b, i] and noisy_loss[b, i] and i < (L // K) * K):
                continue
            term = -logp[L + i, noisy_tokens[b, i]]
            if i > 0 and seg[b, i] == seg[b, i - 1] > 0 and noisy_seg[b, i] == seg[b, i] and noisy_pos[b, i] == pos[b, i]:
                teacher = np.exp(logits[i - 1] - logits[i - 1].max())
                teacher[MASK] = 0
                teacher /= teacher.sum()
                term = (1 - soft) * term + soft * -(teacher * logp[L + i]).sum()
            w = np.exp(-(i % K) / decay) if decay else 1.0
            total, weights = total + w * term, weights + w
    return total / weights


@pytest.mark.parametrize("decay, soft", [(2.0, 0.0), (0.0, 0.6), (1.5, 1.0)])
def test_position_decay_and_soft_targets_equal_the_per_token_reference(decay, soft):
    from sbd_jax.training.objective import DraftTraining

    params = init_params(CFG, seed=3)
    batch = make_batch()
    rng = jax.random.key(7)
    masked = np.asarray(noise(noisy_layout(batch, K, (EOS,)).segment_ids, rng))
    _, plain = sbd_loss(params, Transformer(CFG), batch, rng, block_size=K, mask_id=MASK, end_ids=(EOS,))
    _, metrics = sbd_loss(params, Transformer(CFG), batch, rng, block_size=K, mask_id=MASK, end_ids=(EOS,),
                          drafts=DraftTraining(position_decay=decay, soft_target=soft))
    expected = reference_draft_matp(params, batch, masked, decay, soft)
    np.testing.assert_allclose(float(metrics["matp_loss"]), expected, rtol=1e-5)
    assert abs(float(metrics["matp_loss"]) - float(plain["matp_loss"])) > 1e-3  # the option changes the loss
    np.testing.assert_allclose(metrics["ntp_loss"], plain["ntp_loss"], rtol=1e-6)  # and only the MATP term


def test_soft_targets_do_not_train_the_teacher():
    """The clean half's distribution is a target, not a prediction: the MATP term's gradient with respect to
    the clean hidden states (the teacher) is zero, with respect to the noisy ones (the student) it is not."""
    from sbd_jax.training.objective import DraftTraining, _matp

    batch = make_batch()
    layout = noisy_layout(batch, K)
    masked = jnp.ones((2, L), bool)
    rng = np.random.RandomState(0)
    noisy, clean = (jnp.asarray(rng.randn(2, L, 32), jnp.float32) for _ in range(2))
    kernel = jnp.asarray(rng.randn(32, 50), jnp.float32)

    def matp(noisy, clean):
        ce = jnp.zeros((2, L))
        return _matp(ce, noisy, clean, kernel, batch, layout, masked, K, MASK, DraftTraining(soft_target=1.0))[0]

    to_student, to_teacher = jax.grad(matp, argnums=(0, 1))(noisy, clean)
    assert float(jnp.abs(to_student).max()) > 1e-4 and float(jnp.abs(to_teacher).max()) == 0.0


def test_full_mask_share_masks_whole_rows():
    seg = jnp.ones((4000, 16), jnp.int32)
    noised = np.asarray(noise(seg, jax.random.key(0), full_mask_share=0.5))
    whole = noised.all(axis=1).mean()
    assert abs(whole - (0.5 + 0.5 / 17)) < 0.03  # half by the share, 1 in 17 of the rest by η ~ U(0, 1)
    assert np.asarray(noise(seg, jax.random.key(0), full_mask_share=1.0)).all()

"""The SBD training mask and the attention implementations that use it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.errors import UserError
from sbd_jax.model.attention import attention, blockwise_sbd_attention, reference_attention
from sbd_jax.model.masks import SBDTrainingMask, sbd_allowed, tile_visits
from sbd_jax.model.sharding import make_mesh
from sbd_jax.model.splash import SBDSplashMask, splash_sbd_attention
from tests.conftest import slow_case


def spec_mask(seq_len, k):
    """The mask's four rules written out literally, one (q, kv) pair at a time."""
    n = 2 * seq_len
    out = np.zeros((n, n), bool)
    for q in range(n):
        for kv in range(n):
            if q < seq_len and kv < seq_len:
                out[q, kv] = kv <= q
            elif q >= seq_len and kv >= seq_len:
                out[q, kv] = (q - seq_len) // k == (kv - seq_len) // k
            elif q >= seq_len:
                out[q, kv] = (q - seq_len) // k > kv // k
    return out


def sbd_training_mask(seq_len, block_size):
    """The dense bool `[2L, 2L]` mask the package builds only symbolically (no packing)."""
    idx = np.arange(2 * seq_len)
    return sbd_allowed(idx[:, None], idx[None, :], seq_len, block_size)


@pytest.mark.parametrize("seed", range(6))
def test_training_mask_equals_spec(seed):
    rng = np.random.RandomState(seed)
    seq_len, k = rng.randint(1, 40), rng.randint(1, 17)
    np.testing.assert_array_equal(sbd_training_mask(seq_len, k), spec_mask(seq_len, k))


def test_first_noisy_block_sees_no_clean_context_and_most_tiles_are_masked():
    m = sbd_training_mask(64, 16)
    assert not m[64:80, :64].any() and m[80:96, :16].all() and not m[80:96, 16:64].any()
    assert not m[:64, 64:].any()
    assert 0.7 < 1 - m.mean() < 0.8  # about 3/4 of the dense score matrix is masked


def test_segments_keep_documents_apart():
    seg = np.array([[1, 1, 1, 2, 2, 0]])
    mask = SBDTrainingMask(jnp.asarray(np.concatenate([seg, seg], 1)), seq_len=6, block_size=2)
    dense = np.asarray(mask.dense())[0]
    expected = sbd_training_mask(6, 2) & (np.tile(seg[0], 2)[:, None] == np.tile(seg[0], 2)[None, :])
    np.testing.assert_array_equal(dense, expected)
    assert dense.any(axis=1).all()  # every query (padding too) sees at least itself


def assert_kernel_matches_reference(kernel, seg, k, n_kv, g, h, seed, traced_range=None):
    """Values (1e-5) and gradients (1e-4) of `kernel(q, k, v, mask)` against the dense reference; with
    `traced_range` (min, max), the kernel's block size is a traced value of one jitted function."""
    b, seq_len = seg.shape
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(b, 2 * seq_len, n_kv * g, h), jnp.float32)
    kk = jnp.asarray(rng.randn(b, 2 * seq_len, n_kv, h), jnp.float32)
    v = jnp.asarray(rng.randn(b, 2 * seq_len, n_kv, h), jnp.float32)
    mask = SBDTrainingMask(jnp.asarray(np.concatenate([seg, seg], 1)), seq_len=seq_len, block_size=k)

    def ref(q, kk, v):
        return reference_attention(q, [(kk, v, mask.dense())])

    def fast(q, kk, v):
        return kernel(q, kk, v, mask)

    if traced_range is not None:
        traced = jax.jit(lambda q, kk, v, size: kernel(q, kk, v, mask.replace(block_size=size, block_sizes=traced_range)))
        fast = lambda q, kk, v: traced(q, kk, v, jnp.int32(k))  # noqa: E731

    np.testing.assert_allclose(fast(q, kk, v), ref(q, kk, v), atol=1e-5, rtol=0)
    w = jnp.asarray(rng.randn(*q.shape), jnp.float32)
    g_ref = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2))(q, kk, v)
    g_fast = jax.grad(lambda *a: jnp.sum(fast(*a) * w), argnums=(0, 1, 2))(q, kk, v)
    for a, r in zip(g_fast, g_ref):
        np.testing.assert_allclose(a, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seq_len, k, tile", [slow_case(256, 16, 128), (256, 5, 128), slow_case(512, 2, 256)])
def test_blockwise_equals_reference_values_and_gradients(seq_len, k, tile):
    seg = np.ones((2, seq_len), np.int32)
    seg[1, seq_len // 3:] = 2  # packed second document in row 1
    seg[1, -7:] = 0  # padding
    kernel = lambda q, kk, v, mask: blockwise_sbd_attention(q, kk, v, mask, tile)  # noqa: E731
    assert_kernel_matches_reference(kernel, seg, k, n_kv=2, g=2, h=16, seed=0)


@pytest.mark.parametrize("seq_len, tile", [(64, 16), (256, 128), (96, 32)])
def test_tile_visits_are_exactly_the_tiles_the_mask_allows_for_one_size_and_their_union_for_a_range(seq_len, tile):
    tiles = 2 * seq_len // tile

    def dense_visits(k):
        return sbd_training_mask(seq_len, k).reshape(tiles, tile, tiles, tile).any(axis=(1, 3))

    for k in (1, 2, 3, 5, 16, 17):
        np.testing.assert_array_equal(tile_visits(seq_len, tile, (k, k)), dense_visits(k))
    union = np.logical_or.reduce([dense_visits(k) for k in range(2, 17)])
    np.testing.assert_array_equal(tile_visits(seq_len, tile, (2, 16)), union)
    assert not union.all()  # clean queries never see noisy keys, whatever the size


@pytest.mark.parametrize("k", [slow_case(2), 5, slow_case(16)])
def test_blockwise_with_a_traced_block_size_equals_reference(k):
    """One compiled kernel for sizes 2..16 (the union tile schedule), exact for each size."""
    seg = np.ones((2, 256), np.int32)
    seg[1, 80:] = 2
    kernel = lambda q, kk, v, mask: blockwise_sbd_attention(q, kk, v, mask, 128)  # noqa: E731
    assert_kernel_matches_reference(kernel, seg, k, n_kv=2, g=2, h=16, seed=2, traced_range=(2, 16))


@pytest.mark.parametrize("seq_len, blockwise", [(512, True), (256, True), (128, False), (200, False)])
def test_auto_picks_blockwise_when_a_tile_cuts_each_half_in_two(seq_len, blockwise):
    mask = SBDTrainingMask(jnp.ones((1, 2 * seq_len), jnp.int32), seq_len=seq_len, block_size=16)
    q = jnp.zeros((1, 2 * seq_len, 2, 8))
    kv = jnp.zeros((1, 2 * seq_len, 1, 8))
    hlo_auto = jax.jit(lambda q: attention(q, [(kv, kv, mask)], "auto")).lower(q).as_text()
    # The reference builds a [2L, 2L] score matrix per head; the blockwise path never does.
    assert (f"{2 * seq_len}x{2 * seq_len}" not in hlo_auto) == blockwise


def test_splash_kernel_in_interpret_mode_equals_reference():
    """TPU's splash kernel, run by Pallas's interpreter on CPU: values and gradients, GQA and packing."""
    seg = np.ones((2, 128), np.int32)
    seg[1, 50:] = 2
    kernel = lambda q, kk, v, mask: splash_sbd_attention(q, kk, v, mask, 128, interpret=True)  # noqa: E731
    assert_kernel_matches_reference(kernel, seg, 16, n_kv=2, g=2, h=128, seed=1)


def test_splash_with_a_traced_block_size_switches_to_that_sizes_kernel():
    seg = np.ones((1, 128), np.int32)
    kernel = lambda q, kk, v, mask: splash_sbd_attention(q, kk, v, mask, 128, interpret=True)  # noqa: E731
    assert_kernel_matches_reference(kernel, seg, 7, n_kv=1, g=2, h=128, seed=3, traced_range=(6, 8))


def test_splash_mask_is_computed_from_indices_and_equals_the_spec():
    mask = SBDSplashMask(64, 5)
    np.testing.assert_array_equal(mask[:, :], spec_mask(64, 5))
    np.testing.assert_array_equal(mask[64:96, 0:32], spec_mask(64, 5)[64:96, 0:32])
    assert mask == SBDSplashMask(64, 5) and hash(mask) == hash(SBDSplashMask(64, 5)) and mask != SBDSplashMask(64, 6)


@pytest.mark.parametrize("k, n_kv, g", [(3, 2, 2), slow_case(3, 2, 1), slow_case(16, 2, 2), slow_case(16, 2, 1)],
                         ids=["3-gqa", "3-mha", "16-gqa", "16-mha"])
def test_splash_under_a_2x2x2_mesh_equals_reference(n_kv, g, k):
    """shard_map over (data, fsdp, tensor): batch 4 over data x fsdp, kv heads over tensor; packed rows."""
    mesh = make_mesh((2, 2, 2))
    seg = np.ones((4, 128), np.int32)
    seg[1, 50:] = 2
    seg[2, 90:] = 2
    seg[3, -9:] = 0
    kernel = lambda q, kk, v, mask: attention(q, [(kk, v, mask)], "splash", mesh)  # noqa: E731
    assert_kernel_matches_reference(kernel, seg, k, n_kv=n_kv, g=g, h=128, seed=k)


def test_explicit_splash_that_cannot_run_is_refused():
    mask = SBDTrainingMask(jnp.ones((1, 256), jnp.int32), seq_len=128, block_size=4)
    q = jnp.zeros((1, 256, 2, 64))
    with pytest.raises(UserError, match="head_dim % 128"):
        attention(q, [(q, q, mask)], "splash")
    short = SBDTrainingMask(jnp.ones((1, 200), jnp.int32), seq_len=100, block_size=4)
    q = jnp.zeros((1, 200, 2, 128))
    with pytest.raises(UserError, match="seq_len=100"):
        attention(q, [(q, q, short)], "splash")

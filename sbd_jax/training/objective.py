"""SBD training objective: noise the sequence, one forward on [clean | noisy], joint loss."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sbd_jax.data.packing import Batch
from sbd_jax.errors import UserError
from sbd_jax.model import masks
from sbd_jax.model.adapter import merge
from sbd_jax.model.masks import SBDTrainingMask
from sbd_jax.model.transformer import Transformer, forward, output_kernel, vocab_logits


class DraftTraining(NamedTuple):
    """What the MATP term aims at, beyond the paper's (all off by default: the paper's objective).

    `full_mask_share`: the share of rows whose noisy half is masked entirely (η = 1), as every block
    starts at inference and as verified decoding drafts. `position_decay`: weight the MATP loss of block
    position j (0-based) by exp(-j / position_decay), so early positions, which verification reaches far
    more often, count more (0: equal weights). `soft_target`: the MATP target is (1 - λ) the data token +
    λ the clean half's own next-token distribution at the predicting position (cross-entropy against it,
    the teacher under stop-gradient, its mask-token probability removed), where that position is in the
    same document; λ = 0: the data token alone."""

    full_mask_share: float = 0.0
    position_decay: float = 0.0
    soft_target: float = 0.0


def check_objective(block_size: int, eta_range: tuple[float, float], seq_len: int) -> None:
    """One-line errors for settings that cannot train, before anything compiles."""
    if block_size < 1:
        raise UserError(f"block_size={block_size} must be >= 1")
    if block_size > seq_len:
        raise UserError(f"block_size={block_size} is longer than seq_len={seq_len}: no full block, no MATP loss")
    low, high = eta_range
    if not 0.0 <= low <= high <= 1.0:
        raise UserError(f"eta range ({low}, {high}) must satisfy 0 <= min <= max <= 1")


def noise(segment_ids: jax.Array, rng: jax.Array, eta_range: tuple[float, float] = (0.0, 1.0),
          full_mask_share: float = 0.0) -> jax.Array:
    """bool `[B, L]`: which positions the noisy copy replaces by the mask token.

    Per sequence η ~ U(eta_range), or η = 1 with probability `full_mask_share`; each position of a
    document (segment id > 0) is masked with probability η.
    """
    eta_rng, token_rng = jax.random.split(rng)
    eta = jax.random.uniform(eta_rng, (segment_ids.shape[0], 1), minval=eta_range[0], maxval=eta_range[1])
    if full_mask_share:
        full = jax.random.uniform(jax.random.fold_in(eta_rng, 1), eta.shape) < full_mask_share
        eta = jnp.where(full, 1.0, eta)
    return (jax.random.uniform(token_rng, segment_ids.shape) < eta) & (segment_ids > 0)


class NoisyLayout(NamedTuple):
    """The noisy half's documents, `[B, L]` each: the clean half's, with document ends extended."""

    segment_ids: jax.Array
    positions: jax.Array
    tokens: jax.Array  # clean tokens, EOS on the extended positions (the MATP targets)
    loss_mask: jax.Array


def noisy_layout(batch: Batch, block_size: Any, end_ids: tuple[int, ...] = ()) -> NoisyLayout:
    """Gives every document that ends inside a block the rest of that block in the noisy half.

    At inference a block is always `block_size` positions, so an answer that ends inside it leaves
    positions after its EOS; here they join the ending document (taking them from the next document,
    from padding, or from the document's own tokens after its EOS, such as a chat template's newline),
    continue its positions, and have the document's EOS as their target and, where not masked, as their
    revealed token. They carry loss if the document's end does.

    A document piece ends at its last loss-carrying token when that token is one of `end_ids` (the
    model's EOS ids): the tail repeats that very token (a Llama-3 chat turn ends in `<|eot_id|>`, not
    the first EOS id). A piece without such an end ends at its last token if another segment follows
    it in the row (tail target `end_ids[0]`), and otherwise (a row's last piece, possibly cut) gets
    nothing. Empty `end_ids` leaves the layout as the clean half's. `block_size` may be traced.
    """
    tokens, seg, pos, loss = batch
    if not end_ids:
        return NoisyLayout(seg, pos, tokens, loss)
    batch_size, seq_len = seg.shape
    index = jnp.arange(seq_len)
    real = seg > 0
    # Each (row, segment) is one piece; its last loss-carrying position, by a segment max over pieces.
    piece = (jnp.arange(batch_size)[:, None] * (seq_len + 1) + seg).reshape(-1)
    count = batch_size * (seq_len + 1)

    def per_piece_max(x):
        return jax.ops.segment_max(x.reshape(-1), piece, num_segments=count)[piece].reshape(batch_size, seq_len)

    last_loss = per_piece_max(jnp.where(loss & real, index[None], -1))
    eos_end = (index[None] == last_loss) & jnp.isin(tokens, jnp.asarray(end_ids)) & real
    has_eos_end = per_piece_max(eos_end.astype(jnp.int32)) > 0
    followed = real & jnp.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (0, 1)))  # the last token, something after it
    ends = eos_end | (followed & ~has_eos_end)
    end_token = jnp.where(eos_end, tokens, end_ids[0])
    # The first document end in each block: positions after it in that block belong to that document.
    block_of = index // block_size
    end_index = jnp.where(ends, index, seq_len)
    first_end = jax.ops.segment_min(end_index.T, block_of, num_segments=seq_len)[block_of].T  # [B, L]
    tail = index[None] > first_end
    owner = jnp.minimum(first_end, seq_len - 1)

    def owners(x):
        return jnp.take_along_axis(x, owner, axis=1)

    return NoisyLayout(
        segment_ids=jnp.where(tail, owners(seg), seg),
        positions=jnp.where(tail, owners(pos) + index[None] - first_end, pos),
        tokens=jnp.where(tail, owners(end_token), tokens),
        loss_mask=jnp.where(tail, owners(loss), loss),
    )


def sbd_loss(
    params: Any,
    model: Transformer,
    batch: Batch,
    rng: jax.Array,
    *,
    block_size: Any,
    mask_id: int,
    w_ntp: float = 1.0,
    w_matp: float = 1.0,
    eta_range: tuple[float, float] = (0.0, 1.0),
    end_ids: tuple[int, ...] = (),
    block_sizes: tuple[int, int] | None = None,
    drafts: DraftTraining = DraftTraining(),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Joint loss `w_ntp * NTP + w_matp * MATP` and its metrics.

    NTP: cross-entropy over clean positions 2..L (shifted), within a document, where loss_mask.
    MATP: cross-entropy over noisy positions that were masked, target the clean token (not shifted),
    only inside full blocks (a trailing partial block is ignored), where loss_mask (`drafts` may change
    the noise, weights and targets: `DraftTraining`). With `end_ids` (the EOS ids), the noisy half extends
    each finished document to the end of its last block, target its EOS (`noisy_layout`). Each term is a
    mean over its own counted tokens. `block_size` may be a traced int32 scalar with `block_sizes` its
    (min, max) range: one compiled loss for every block size.
    """
    tokens = batch.tokens
    seq_len = tokens.shape[1]
    layout, masked, (inputs, positions, attn) = _noised(batch, rng, block_size, mask_id, eta_range, end_ids,
                                                        block_sizes, drafts)
    hidden, _ = forward(model, params, inputs, positions, mask=attn, compute_logits=False)
    kernel = output_kernel(params, model.config)
    # One chunked CE pass: clean position t targets token t+1, noisy position i targets token i.
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1], layout.tokens], axis=1)
    ce = token_cross_entropy(hidden, kernel, targets)
    ntp_weight = _next_token_weight(batch)
    ntp_count = ntp_weight.sum()
    ntp_loss_value = jnp.sum(ce[:, : seq_len - 1] * ntp_weight) / jnp.maximum(ntp_count, 1)
    matp_loss, matp_count = _matp(ce[:, seq_len:], hidden[:, seq_len:], hidden[:, :seq_len], kernel, batch, layout,
                                  masked, block_size, mask_id, drafts)
    loss = w_ntp * ntp_loss_value + w_matp * matp_loss
    return loss, _metrics(loss, ntp_loss_value, matp_loss, masked, layout, ntp_count, matp_count, batch)


def adapter_sbd_loss(
    adapter: Any,
    base: Any,
    model: Transformer,
    batch: Batch,
    rng: jax.Array,
    *,
    block_size: Any,
    mask_id: int,
    w_matp: float = 1.0,
    eta_range: tuple[float, float] = (0.0, 1.0),
    end_ids: tuple[int, ...] = (),
    block_sizes: tuple[int, int] | None = None,
    drafts: DraftTraining = DraftTraining(),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SBD's MATP loss for a gated adapter (`sbd_jax.model.adapter`) on a frozen `base`: gradients reach `adapter` only.

    Same noise, layout and attention as `sbd_loss`, run as two forwards: the clean half by the base alone
    (no adapter acts there and nothing trainable reaches it, so it is forward-only: its K/V and hidden
    states are kept, and no gradient flows back into it), then the noisy half, with the adapter, attending
    to those K/V as to a cache under the training mask's noisy-to-clean part. The NTP term is the base's
    own and constant, so it is neither computed nor trained (`ntp_loss` reads 0); the loss is `w_matp * MATP`.
    """
    from sbd_jax.model.kv_cache import KVCache

    seq_len = batch.tokens.shape[1]
    layout, masked, (inputs, positions, attn) = _noised(batch, rng, block_size, mask_id, eta_range, end_ids,
                                                        block_sizes, drafts)
    clean, noisy = jnp.arange(seq_len), seq_len + jnp.arange(seq_len)
    clean_hidden, clean_kv = jax.lax.stop_gradient(forward(
        model, base, batch.tokens, batch.positions, mask=attn.allowed(clean, clean), compute_logits=False))
    cache = KVCache(clean_kv.k, clean_kv.v, jnp.full((batch.tokens.shape[0],), seq_len, jnp.int32))
    params = merge(base, adapter)
    hidden, _ = forward(
        model.clone(gate_from=0), params, inputs[:, seq_len:], positions[:, seq_len:], mask=attn.allowed(noisy, noisy),
        cache=cache, cache_mask=attn.allowed(noisy, clean), compute_logits=False)
    kernel = output_kernel(params, model.config)
    ce = token_cross_entropy(hidden, kernel, layout.tokens)
    matp_loss, matp_count = _matp(ce, hidden, clean_hidden, kernel, batch, layout, masked, block_size, mask_id, drafts)
    zero = jnp.zeros((), jnp.float32)
    return w_matp * matp_loss, _metrics(w_matp * matp_loss, zero, matp_loss, masked, layout,
                                        jnp.zeros((), jnp.int32), matp_count, batch)


def _noised(batch: Batch, rng: jax.Array, block_size: Any, mask_id: int, eta_range: tuple[float, float],
            end_ids: tuple[int, ...], block_sizes: tuple[int, int] | None,
            drafts: DraftTraining) -> tuple[NoisyLayout, jax.Array, tuple[jax.Array, jax.Array, SBDTrainingMask]]:
    """Both losses' noisy half: its layout, which positions are masked, and the `[clean | noisy]` inputs."""
    layout = noisy_layout(batch, block_size, end_ids)
    masked = noise(layout.segment_ids, rng, eta_range, drafts.full_mask_share)
    return layout, masked, training_inputs(batch, layout, masked, mask_id, block_size, block_sizes)


def _matp(ce: jax.Array, noisy_hidden: jax.Array, clean_hidden: jax.Array, kernel: jax.Array, batch: Batch,
          layout: NoisyLayout, masked: jax.Array, block_size: Any, mask_id: int,
          drafts: DraftTraining) -> tuple[jax.Array, jax.Array]:
    """The MATP term (a weighted mean over counted positions) and how many positions count.

    `ce` `[B, L]`: each noisy position's cross-entropy against its data token; the hidden states give the
    soft targets' teacher (clean position i - 1 predicts token i) and student."""
    seq_len = ce.shape[1]
    index = jnp.arange(seq_len)
    full_blocks = (seq_len // block_size) * block_size
    counted = masked & layout.loss_mask & (index < full_blocks)[None]
    if drafts.soft_target:
        teacher = jax.lax.stop_gradient(jnp.pad(clean_hidden[:, :-1], ((0, 0), (1, 0), (0, 0))))
        soft = soft_cross_entropy(noisy_hidden, teacher, kernel, mask_id)
        seg = batch.segment_ids
        # Where position i - 1 of the same document predicts token i (not a document start, not a block tail).
        has_teacher = (index[None] > 0) & (seg == jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))) & (seg > 0) & \
            (layout.segment_ids == seg) & (layout.positions == batch.positions)
        ce = jnp.where(has_teacher, (1 - drafts.soft_target) * ce + drafts.soft_target * soft, ce)
    weight = counted.astype(jnp.float32)
    if drafts.position_decay:
        weight = weight * jnp.exp(-(index % block_size) / drafts.position_decay)[None]
    return jnp.sum(ce * weight) / jnp.maximum(weight.sum(), 1e-9), counted.sum()


def _metrics(loss, ntp_loss_value, matp_loss, masked, layout, ntp_count, matp_count, batch) -> dict[str, jax.Array]:
    return {
        "loss": loss, "ntp_loss": ntp_loss_value, "matp_loss": matp_loss,
        "masked_fraction": masked.sum() / jnp.maximum((layout.segment_ids > 0).sum(), 1),
        "ntp_tokens": ntp_count, "matp_tokens": matp_count, "tokens": (batch.segment_ids > 0).sum(),
    }


def training_inputs(batch: Batch, layout: NoisyLayout, masked: jax.Array, mask_id: int, block_size: Any,
                    block_sizes: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array, SBDTrainingMask]:
    """The one forward's `[clean | noisy]` tokens and positions `[B, 2L]` and its attention mask."""
    noisy = jnp.where(masked, mask_id, layout.tokens)
    inputs = jnp.concatenate([batch.tokens, noisy], axis=1)
    positions = jnp.concatenate([batch.positions, layout.positions], axis=1)
    attn = SBDTrainingMask(jnp.concatenate([batch.segment_ids, layout.segment_ids], axis=1),
                           seq_len=batch.tokens.shape[1], block_size=block_size, block_sizes=block_sizes)
    return inputs, positions, attn


def ntp_loss(params: Any, model: Transformer, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Plain next-token loss on `[B, L]` (causal within documents): the NTP-only baseline."""
    seg = batch.segment_ids
    mask = masks.causal(seg.shape[1])[None] & masks.same_segment(seg)
    hidden, _ = forward(model, params, batch.tokens, batch.positions, mask=mask, compute_logits=False)
    ce = token_cross_entropy(hidden[:, :-1], output_kernel(params, model.config), batch.tokens[:, 1:])
    weight = _next_token_weight(batch)
    count = weight.sum()
    loss = jnp.sum(ce * weight) / jnp.maximum(count, 1)
    zero = jnp.zeros((), jnp.float32)
    return loss, {"loss": loss, "ntp_loss": loss, "matp_loss": zero, "masked_fraction": zero,
                  "ntp_tokens": count, "matp_tokens": jnp.zeros((), jnp.int32), "tokens": (seg > 0).sum()}


def token_cross_entropy(hidden_BTD: jax.Array, kernel_DV: jax.Array, targets_BT: jax.Array,
                        chunk: int = 128) -> jax.Array:
    """Per-token CE `[B, T]` of `softmax(hidden @ kernel)` against targets, `chunk` tokens at a time.

    Each chunk's logits are rematerialised in the backward pass, so a `[B, T, vocab]` array never
    exists (for Llama-3's 128k vocabulary and 2 x 4096 tokens that would be 4 GiB per sequence).
    128 positions a chunk: faster than 512 for the SBD step at the SmolLM2 shape on a CPU, the same for
    NTP (`python -m benchmarks.train_step`).
    """
    kernel = kernel_DV.astype(hidden_BTD.dtype)

    def one_chunk(h, t):
        logits = vocab_logits(h, kernel)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    return _by_chunks(one_chunk, hidden_BTD, targets_BT, chunk=chunk)


def soft_cross_entropy(student_BTD: jax.Array, teacher_BTD: jax.Array, kernel_DV: jax.Array, mask_id: int,
                       chunk: int = 128) -> jax.Array:
    """Per-token `H(p, q)` `[B, T]`: the teacher's distribution p (its logits from `teacher_BTD`, the mask
    token removed) against the student's q, `chunk` tokens at a time (as `token_cross_entropy`). Its
    gradient is forward KL(p || q)'s; callers stop the teacher's gradient."""
    kernel = kernel_DV.astype(student_BTD.dtype)

    def one_chunk(s, t):
        teacher = vocab_logits(t, kernel).at[..., mask_id].set(-jnp.inf)
        return -jnp.sum(jax.nn.softmax(teacher, axis=-1) * jax.nn.log_softmax(vocab_logits(s, kernel), axis=-1), axis=-1)

    return _by_chunks(one_chunk, student_BTD, teacher_BTD, chunk=chunk)


def _by_chunks(fn: Any, *arrays_BT: jax.Array, chunk: int) -> jax.Array:
    """`fn` (per token, rematerialised in the backward pass) over `[B, T, ...]` arrays, `chunk` positions a time."""
    batch, length = arrays_BT[0].shape[:2]
    chunk = min(chunk, length)
    pad = -length % chunk

    def chunks(x):
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(batch, -1, chunk, *x.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(jax.checkpoint(lambda args: fn(*args)), tuple(chunks(x) for x in arrays_BT))  # [chunks, B, chunk]
    return out.swapaxes(0, 1).reshape(batch, -1)[:, :length]


def _next_token_weight(batch: Batch) -> jax.Array:
    """`[B, L-1]`: token t+1 is predicted from position t within one document, where it carries loss."""
    seg = batch.segment_ids
    return batch.loss_mask[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)

"""Token choice for decoding: the distribution tokens are drawn from, the draw, uncertainty scores and
the Entropy-Bounded reveal rule. Pure functions over the last (vocabulary) axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.choice import Choice


class Proxy(Choice):
    """SBD's uncertainty score of a masked position (`uncertainty` says how each is computed)."""

    ENTROPY = "entropy"
    CONFIDENCE = "confidence"
    MARGIN = "margin"
    LEFT_TO_RIGHT = "left_to_right"  # a diagnostic order, not an uncertainty


def without_token(logits: jax.Array, token_id: int | None) -> jax.Array:
    """The logits with `token_id` (the mask token, never a valid output) made impossible."""
    if token_id is None:
        return logits
    return logits.at[..., token_id].set(-jnp.inf)


def sampling_logits(logits: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Logits of the distribution tokens are drawn from: `logits / T`, -inf outside the top-p nucleus.

    Greedy decoding (T = 0) picks the argmax of the model's own distribution, which is returned as is.
    """
    if temperature == 0.0:
        return logits
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        cutoff_index = jnp.sum(cumulative < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def choose_tokens(logits: jax.Array, rng: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Greedy (temperature 0) or temperature sampling restricted to the top-p nucleus, over the last axis."""
    return draw(sampling_logits(logits, temperature, top_p), rng, temperature)


TWO_REDUCTIONS_FROM_VOCAB = 1024  # where `greedy_token` stops using XLA's argmax on a CPU


def greedy_token(logits: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first maximum on ties), as int32; a row holding NaN (a broken
    model) gets the index of a NaN or of its largest number, never one out of range.

    Lowered for a CPU with a large vocabulary it is a max, then a min over the positions that hold it:
    XLA's CPU argmax (one reduction over value-index pairs) is several times slower there, time a
    decoding step spends on every pass. A small vocabulary keeps the argmax: one fused operation, where
    the two reductions add several operations to each pass.
    """
    def argmax(x: jax.Array) -> jax.Array:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def two_reductions(x: jax.Array) -> jax.Array:
        top = x.max(axis=-1, keepdims=True)
        index = jnp.arange(x.shape[-1], dtype=jnp.int32)
        return jnp.where((x == top) | jnp.isnan(x), index, x.shape[-1]).min(axis=-1)

    if logits.shape[-1] < TWO_REDUCTIONS_FROM_VOCAB:
        return argmax(logits)
    return jax.lax.platform_dependent(logits, cpu=two_reductions, default=argmax)


def point_mass(tokens: jax.Array, vocab: int) -> jax.Array:
    """`tokens.shape + (vocab,)` logits of the distribution that is certain of each token."""
    return jnp.where(jnp.arange(vocab) == tokens[..., None], 0.0, -jnp.inf)


def draw(dist_logits: jax.Array, rng: jax.Array, temperature: float) -> jax.Array:
    """A token from logits already passed through `sampling_logits`: argmax if greedy, else a sample."""
    if temperature == 0.0:
        return greedy_token(dist_logits)
    return jax.random.categorical(rng, dist_logits, axis=-1).astype(jnp.int32)


def uncertainty(logits: jax.Array, proxy: str) -> jax.Array:
    """Non-negative uncertainty per position (lower = surer) of the distribution `softmax(logits)`.

    entropy: -sum p log p; confidence: 1 - max p; margin: 1 - (p_top1 - p_top2). Written as
    reductions over `exp(logits - max)` so the vocabulary is swept as few times as possible.
    left_to_right (a diagnostic, not an uncertainty): 1 + the position in the block, so γ = 0 reveals
    the leftmost masked position each pass, the order NTP decoding follows (no score is 0, so γ = 0
    never reveals a second one).
    """
    if proxy == Proxy.LEFT_TO_RIGHT:
        return jnp.broadcast_to(jnp.arange(1, logits.shape[-2] + 1, dtype=jnp.float32), logits.shape[:-1])
    shifted = logits.astype(jnp.float32) - jnp.max(logits, axis=-1, keepdims=True).astype(jnp.float32)
    unnormalised = jnp.exp(shifted)
    total = jnp.sum(unnormalised, axis=-1)
    if proxy == Proxy.ENTROPY:  # H = log Z - E[shifted]; -inf logits (outside top-p) contribute 0
        weighted = jnp.sum(jnp.where(unnormalised > 0, unnormalised * shifted, 0.0), axis=-1)
        return jnp.maximum(jnp.log(total) - weighted / total, 0.0)
    if proxy == Proxy.CONFIDENCE:
        return 1.0 - 1.0 / total
    second = jax.lax.top_k(shifted, 2)[0][..., 1]
    return 1.0 - (1.0 - jnp.exp(second)) / total


def eb_reveal(scores: jax.Array, still_masked: jax.Array, gamma: jax.Array | float) -> jax.Array:
    """The Entropy-Bounded rule: which still-masked positions of `[..., k]` to reveal now.

    Sort the masked positions by score ascending and reveal the largest s >= 1 of them such that the
    sum of the s - 1 smallest scores is <= gamma (the last, most uncertain one is not counted).
    Scores must be >= 0. Rows with nothing masked reveal nothing.
    """
    keyed = jnp.where(still_masked, scores, jnp.inf)
    order = jnp.argsort(keyed, axis=-1)
    sorted_scores = jnp.take_along_axis(keyed, order, axis=-1)
    finite = jnp.where(jnp.isfinite(sorted_scores), sorted_scores, 0.0)
    before = jnp.cumsum(finite, axis=-1) - finite  # sum of the scores sorted ahead of each one
    reveal_sorted = before <= gamma
    ranks = jnp.argsort(order, axis=-1)
    return still_masked & jnp.take_along_axis(reveal_sorted, ranks, axis=-1)


def leading_true(flags_BK: jax.Array) -> jax.Array:
    """[B]: how many of each row's flags are True before its first False (k if none is False).

    One min-reduction, where a cumulative product takes a `reduce_window` and a sum: operations a
    decoding loop runs every pass (dispatched one by one on a CPU)."""
    k = flags_BK.shape[1]
    return jnp.where(flags_BK, k, jnp.arange(k)).min(axis=1).astype(jnp.int32)


def speculative_accept(p_logits: jax.Array, q_logits: jax.Array, drafts: jax.Array, is_draft: jax.Array,
                       accept_rng: jax.Array, token_rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling over `[B, k]` drafts: how many are accepted, and the token after them.

    Draft j (where `is_draft`) was drawn from softmax(q_logits[:, j]); softmax(p_logits[:, j]) is the
    target distribution at its position. Accepted with probability min(1, p/q), left to right up to the
    first rejection; the token after the accepted drafts is drawn from normalize(max(0, p - q)) at a
    rejected position, from p after the last draft.
    """
    p = jax.nn.softmax(p_logits, axis=-1)
    q = jax.nn.softmax(q_logits, axis=-1)
    p_draft = jnp.take_along_axis(p, drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_rng, drafts.shape)
    accepted = leading_true(is_draft & (u * q_draft < p_draft))  # u < p/q, q > 0 for a draft
    at = accepted[:, None, None]
    p_next, q_next = jnp.take_along_axis(p, at, axis=1)[:, 0], jnp.take_along_axis(q, at, axis=1)[:, 0]
    residual = jnp.maximum(p_next - q_next, 0.0)
    rejected = (jnp.take_along_axis(is_draft, accepted[:, None], axis=1)[:, 0]
                & (residual.sum(axis=-1) > 0))  # p == q leaves no residual, and then never rejects
    weights = jnp.where(rejected[:, None], residual, p_next)
    return accepted, jax.random.categorical(token_rng, jnp.log(weights), axis=-1).astype(jnp.int32)

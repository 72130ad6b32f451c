"""Timing on this machine: the median of repeated calls, and the bare model forward of n tokens a row
(what a decoding pass costs with nothing around it). Shared by the block-size rule, the benchmarks and
the recipes."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sbd_jax.errors import UserError
from sbd_jax.model import masks
from sbd_jax.model.config import WithWeights
from sbd_jax.model.kv_cache import init_cache
from sbd_jax.model.transformer import Transformer, forward


def forward_seconds(model: WithWeights, batch: int, n: int, context: int, calls: int, inner: int = 8,
                    capacity: int | None = None) -> float:
    """Median time of one bare decoding forward of `n` new tokens per row at `batch` rows with `context`
    cached tokens in a cache of `capacity` slots (default `context + n`; attention reads every slot, so
    compare a decoding loop with the bare forward at the loop's own capacity). The model alone: no
    sampling, no cache update; `model` has `.config` and `.params`.

    Timed as `inner` forwards in one compiled loop, as a decoding loop runs them: a call per forward
    would add the host's dispatch time, which is most of a small model's forward on a CPU."""
    capacity = context + n if capacity is None else capacity
    if capacity < context:  # the n new tokens are attended beside the cache, as in decoding, not written into it
        raise UserError(f"capacity={capacity} cannot hold {context} cached tokens")
    cache = init_cache(model.config, batch, capacity)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    positions = cache.lengths[:, None] + jnp.arange(n)

    def forwards(params: Any, cache: Any) -> jax.Array:
        def one(_: int, total: jax.Array) -> jax.Array:
            tokens = jnp.zeros((batch, n), jnp.int32) + (total > jnp.inf)  # depends on the loop: not hoisted
            logits = forward(Transformer(model.config), params, tokens, positions,
                             mask=masks.bidirectional(n), cache=cache)[0]
            return total + logits.sum()  # every logit is used, as decoding reads them all

        return jax.lax.fori_loop(0, inner, one, jnp.float32(0))

    return median_seconds(jax.jit(forwards), model.params, cache, repeats=calls) / inner


def forward_cost_ratio(model: WithWeights, block_size: int, context: int = 40, calls: int = 200, batch: int = 1) -> float:
    """time(k) / time(1) of one decoding forward of k tokens with `context` cached tokens (medians)."""
    return (forward_seconds(model, batch, block_size, context, calls)
            / forward_seconds(model, batch, 1, context, calls))


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)

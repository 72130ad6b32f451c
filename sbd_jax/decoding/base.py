"""What every decoder shares, and NTP. Decoders are jit-compiled `lax.while_loop`s against the static
KV cache, one algorithm per class: `NTPDecoder` here, `SBDDecoder` (Entropy-Bounded blocks) in
`sbd.py`, `VerifiedSBDDecoder` (self-speculative: NTP's output, drafts from any source) in `verified.py`.

Counting convention, shared by every mode: the prompt minus its last token is prefilled, so NTP's
first forward feeds the last prompt token and SBD's first pass commits it. Every forward after
prefill is one pass of `nfe`; NTP has `nfe == new_tokens`. Rows of a batch keep their own cache
lengths, pass counts and EOS; tokens after a row's first EOS are dropped. Every `decode` takes the
right-padded prompt too (only lookup drafts read it). Settings that may change
between calls without a recompile (`TracedSettings`: γ) are an argument of `decode`, never fields of the hashed
decoder; every decoder takes them, and those that have no use for them ignore them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sbd_jax.decoding.token_choice import Proxy, choose_tokens, without_token
from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.kv_cache import KVCache, append, init_cache
from sbd_jax.model.transformer import Transformer, forward

DEFAULT_GAMMA = 0.35  # the SBD paper's entropy budget for chat models
# Temperatures below this decode greedily. A draw at T is the argmax of logits / T plus Gumbel noise, so below it
# only logits closer than ~1e-5 ever swap; and logits / T for T near 1e-9 overflow the float32 softmax that
# verification's accept test forms (XLA's CPU softmax returned NaN there, and the output was garbage).
GREEDY_BELOW = 1e-5


class DecodeOutput(struct.PyTreeNode):
    """What a decode loop returns (a pytree: read it by name)."""

    tokens: jax.Array  # [B, N] generated ids; only the first num_tokens[b] are meaningful
    num_tokens: jax.Array  # [B] up to and including the first EOS, at most max_new_tokens
    nfe: jax.Array  # [B] decoding forward passes this row needed (prefill excluded)
    reveal_pass: jax.Array  # [B, N] the row's pass (1-based) that produced (verified: accepted) each token
    corrected: jax.Array  # [B, N] verified mode: the token is NTP's correction of a rejected draft
    drafted: jax.Array  # [B] verified mode: drafted tokens submitted for verification
    accepted: jax.Array  # [B] verified mode: of those, accepted
    lookup_drafted: jax.Array  # [B] verified mode: of the drafted tokens, those prompt lookup proposed
    lookup_accepted: jax.Array  # [B] verified mode: of those, accepted
    narrow_passes: jax.Array  # [B] verified lookup: of the row's passes, those run as the exact token alone
    memory: Any = None  # verified with draft_memory: what the draft source keeps for the next call (`DraftMemory`)


def kept_through_eos(is_eos_BK: jax.Array, limit_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Of each row's first `limit` new tokens, how many count (up to and including the first EOS among
    them), and whether that EOS ends the row. Nothing after an EOS ever counts."""
    k = is_eos_BK.shape[1]
    eos_at = jnp.where(is_eos_BK, jnp.arange(k), k).min(axis=1)
    return jnp.minimum(eos_at + 1, limit_B), eos_at < limit_B


def check_whole_number(name: str, value: object, minimum: int) -> None:
    """Raises UserError unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise UserError(f"{name}={value!r} must be >= {minimum} (a whole number)")


def check_flag(name: str, value: object) -> None:
    """Raises UserError unless `value` is True or False (a string such as "no" would read as True)."""
    if not isinstance(value, bool):
        raise UserError(f"{name}={value!r} must be True or False")


def is_finite_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def check_decoding_options(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Raises UserError for settings no decoder accepts (callable before any model is loaded). NaN and
    infinity are refused: T = inf makes every logit 0 (the mask token among them), NaN every draw token 0."""
    check_whole_number("max_new_tokens", max_new_tokens, 1)
    if not is_finite_number(temperature) or temperature < 0:
        raise UserError(f"temperature={temperature!r} must be >= 0 and finite (0 = greedy)")
    if not is_finite_number(top_p) or not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p={top_p!r} must be a number in (0, 1]")


def check_block_size(block_size: int) -> None:
    """Raises UserError for a block size that cannot work (callable before any model is loaded)."""
    check_whole_number("block_size", block_size, 1)


def check_proxy(proxy: str) -> Proxy:
    """The uncertainty proxy named `proxy`; UserError for an unknown one (callable before any model is loaded)."""
    return Proxy.parse(proxy, "proxy")


def check_gamma(gamma: float) -> None:
    """Raises UserError unless γ is a number >= 0 (NaN included: it would silently reveal one token a pass)."""
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real) or not gamma >= 0:
        raise UserError(f"gamma={gamma!r} must be a number >= 0 (0 reveals one token per pass)")


class TracedSettings(struct.PyTreeNode):
    """Settings traced into `decode`: a new value never recompiles."""

    gamma: jax.Array  # SBD's entropy budget per pass; NTP and verified SBD ignore it

    @classmethod
    def create(cls, gamma: float = DEFAULT_GAMMA) -> "TracedSettings":
        check_gamma(gamma)
        return cls(gamma=jnp.float32(gamma))


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What every decoding mode shares. Hashable: jitted methods take `self` as a static argument."""

    config: ModelConfig
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_decoding_options(self.max_new_tokens, self.temperature, self.top_p)
        if self.temperature < GREEDY_BELOW:  # one rule for every decoder, so all of them agree at such a T
            object.__setattr__(self, "temperature", 0.0)

    @property
    def output_len(self) -> int:
        """Width of the generated-token buffer (and of cache slots needed past the prompt)."""
        return self.max_new_tokens

    @property
    def output_label(self) -> str:
        return "max_new_tokens"

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array, knobs: TracedSettings,
               prompt_BT: jax.Array | None = None, prompt_lens_B: jax.Array | None = None) -> DecodeOutput:
        """Generates after `prefill` until every row hit EOS or its budget: each mode's own loop."""
        raise NotImplementedError(f"{type(self).__name__} defines no decoding loop")

    def fresh_memory(self) -> Any:
        """What a first call starts from where draft sources keep a memory across calls (`DraftMemory`); None:
        this decoder keeps none."""
        return None

    @functools.partial(jax.jit, static_argnames=("self", "capacity"))
    def prefill(self, params: Any, prompt_BT: jax.Array, prompt_lens_B: jax.Array,
                capacity: int) -> tuple[KVCache, jax.Array]:
        """Caches right-padded prompts `[B, T]` (true lengths `[B]`) but for each row's last token.

        Returns the cache (`capacity` slots per row) and the last prompt tokens `[B]`, fed first.
        """
        batch, prompt_len = prompt_BT.shape
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
        _, kv = forward(Transformer(self.config), params, prompt_BT, positions, compute_logits=False)
        # Pad slots are written too but stay beyond each row's length: never read, later overwritten.
        cache = append(init_cache(self.config, batch, capacity), kv.k, kv.v, prompt_lens_B - 1)
        return cache, jnp.take_along_axis(prompt_BT, (prompt_lens_B - 1)[:, None], axis=1)[:, 0]

    def _is_eos(self, tokens: jax.Array) -> jax.Array:
        return jnp.isin(tokens, jnp.asarray(self.eos_ids or (-1,), jnp.int32))


class _NTPState(struct.PyTreeNode):
    step: jax.Array
    cache: KVCache
    last: jax.Array  # [B] the token fed next
    tokens: jax.Array  # [B, N]
    count: jax.Array  # [B]
    done: jax.Array  # [B]


@dataclasses.dataclass(frozen=True)
class NTPDecoder(Decoder):
    """Causal next-token decoding: one token per forward."""

    @functools.partial(jax.jit, static_argnames=("self",))
    def decode(self, params: Any, cache: KVCache, last_token_B: jax.Array, rng: jax.Array, knobs: TracedSettings,
               prompt_BT: jax.Array | None = None, prompt_lens_B: jax.Array | None = None) -> DecodeOutput:
        """Generates up to `max_new_tokens` per row, one forward each, stopping rows at EOS (the prompt is
        unused: only lookup drafts read it)."""
        model = Transformer(self.config)
        batch = last_token_B.shape[0]

        def body(s: _NTPState) -> _NTPState:
            logits, kv = forward(model, params, s.last[:, None], s.cache.lengths[:, None], cache=s.cache)
            token = choose_tokens(without_token(logits[:, -1], self.config.mask_token_id),
                                  jax.random.fold_in(rng, s.step), self.temperature, self.top_p)
            token = jnp.where(s.done, 0, token)
            return s.replace(step=s.step + 1, cache=append(s.cache, kv.k, kv.v, 1), last=token,
                             tokens=jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step)),
                             count=s.count + ~s.done, done=s.done | self._is_eos(token))

        zeros = jnp.zeros((batch,), jnp.int32)
        init = _NTPState(step=jnp.int32(0), cache=cache, last=last_token_B,
                         tokens=jnp.zeros((batch, self.max_new_tokens), jnp.int32), count=zeros,
                         done=jnp.zeros((batch,), bool))
        final = jax.lax.while_loop(lambda s: (s.step < self.max_new_tokens) & ~jnp.all(s.done), body, init)
        return DecodeOutput(
            tokens=final.tokens, num_tokens=final.count, nfe=final.count,
            reveal_pass=jnp.broadcast_to(jnp.arange(1, self.max_new_tokens + 1), final.tokens.shape),
            corrected=jnp.zeros(final.tokens.shape, bool), drafted=zeros, accepted=zeros, lookup_drafted=zeros,
            lookup_accepted=zeros, narrow_passes=zeros)

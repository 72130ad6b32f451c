"""Prompt-lookup drafts: the tokens that followed an earlier occurrence of the context's last n tokens.

A draft source that needs no training and no mask token (`transformers`' `prompt_lookup_num_tokens`,
vLLM's n-gram proposer): given prompt + output so far, find an earlier place where its last `n` tokens
occur (`n` from `max_ngram` down to 1, the longest that matches wins) and propose the tokens that
followed there. Written with static shapes over a fixed-width history buffer so that it runs inside the
compiled decoding loop, with no host round trip. `lookup_drafts` (device) and `replay_lookup` (host, numpy:
what verification would accept on a known greedy output) share one rule, so a decoder run can be checked
against a replay of committed outputs.

The rule, chosen on the real-text recipe's validation outputs (`benchmarks/lookup_rule.py` →
`benchmarks/results/lookup_rule.json`, which also holds every other rule's figures): the *latest* earlier
occurrence of the longest matching n-gram, n from 4 down to 1, with the periodic extension. The rules
differ little there (all within a few percent at a given block size); the ranking is in the file.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_NGRAM = 4  # the longest suffix looked up  } the measured choice
LATEST = True  # the occurrence nearest the end  } (see the module docstring)
EXTEND = True  # periodic extension             }


def match_ends(history_BW: jax.Array, length_B: jax.Array, max_ngram: int = MAX_NGRAM,
               min_match: int = 1, start: int = 0) -> jax.Array:
    """`[B, W]`: where an earlier occurrence of the longest suffix of `history[b, start:length[b]]` that recurs
    (`min_match`..`max_ngram` tokens) ends; all False where none does. An occurrence must end before the last
    token, so at least one token follows it; it may lie before `start`."""
    batch, width = history_BW.shape
    index = jnp.arange(width)
    last = length_B[:, None] - 1  # [B, 1] position of the newest token
    # matches[b, i] after m + 1 rounds: history[i - m .. i] equals the suffix's last m + 1 tokens
    matches = jnp.ones((batch, width), bool)
    ends = jnp.zeros((batch, width), bool)
    for m in range(max_ngram):
        suffix_token = jnp.take_along_axis(history_BW, jnp.maximum(last - m, 0), axis=1)
        shifted = jnp.roll(history_BW, m, axis=1)  # shifted[i] = history[i - m]
        matches = matches & (shifted == suffix_token) & (index >= m) & (last - m >= start)
        earlier = matches & (index < last)
        if m + 1 >= min_match:  # a longer n-gram's matches replace a shorter one's
            ends = jnp.where(earlier.any(axis=1, keepdims=True), earlier, ends)
    return ends


def continuation(history_BW: jax.Array, end_BO: jax.Array, length_B: jax.Array, num_tokens: int,
                 extend: bool = EXTEND) -> jax.Array:
    """`[B, O, num_tokens]`: the tokens after each match end (`end_BO` >= 0). `extend`: a match P tokens back
    whose continuation runs into the end of the history is read as a repeat with period P (token m is
    history[end + 1 + m % P])."""
    period = jnp.maximum(length_B[:, None] - 1 - end_BO, 1)
    j = jnp.arange(num_tokens)
    offset = j % period[..., None] if extend else jnp.broadcast_to(j, end_BO.shape + (num_tokens,))
    taken = jnp.clip(end_BO[..., None] + 1 + offset, 0, history_BW.shape[1] - 1)
    return jnp.take_along_axis(history_BW[:, None, :], taken, axis=2)


def lookup_drafts(history_BW: jax.Array, length_B: jax.Array, num_drafts: int, max_ngram: int = MAX_NGRAM,
                  latest: bool = LATEST, extend: bool = EXTEND, min_match: int = 1) -> tuple[jax.Array, jax.Array]:
    """Drafts for the token after each row's `history[b, :length[b]]`.

    Returns `[B, num_drafts]` proposed tokens (0 past the count) and `[B]` how many are real: the tokens
    that followed the chosen earlier occurrence of the history's longest recurring suffix (`match_ends`), as
    many as the history holds after it, at most `num_drafts` (with `extend`, as many as asked: `continuation`);
    0 where no n-gram of length `min_match`..`max_ngram` recurs. `latest` picks the occurrence nearest the end,
    else the first one.
    """
    width = history_BW.shape[1]
    index = jnp.arange(width)
    ends = match_ends(history_BW, length_B, max_ngram, min_match)
    if latest:
        best_end = jnp.where(ends, index, -1).max(axis=1)
    else:
        best_end = jnp.where(ends.any(axis=1), jnp.where(ends, index, width).min(axis=1), -1)
    found = best_end >= 0
    period = length_B - 1 - best_end  # tokens from the match's end to the last one: all of its continuation
    count = jnp.where(found, num_drafts if extend else jnp.minimum(num_drafts, period), 0)
    tokens = continuation(history_BW, best_end[:, None], length_B, num_drafts, extend)[:, 0]
    drafts = jnp.where(jnp.arange(num_drafts) < count[:, None], tokens, 0)
    return drafts.astype(jnp.int32), count.astype(jnp.int32)


def lookup_once(context: Sequence[int], num_drafts: int, max_ngram: int = MAX_NGRAM, latest: bool = LATEST,
                extend: bool = EXTEND, min_match: int = 1) -> list[int]:
    """`lookup_drafts` for one context on the host (numpy): the proposed tokens."""
    tokens = np.asarray(context)
    last = len(tokens) - 1
    for n in range(min(max_ngram, last), min_match - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:last], n)  # window i ends at i + n - 1 < last
        starts = np.flatnonzero((windows == tokens[last - n + 1:]).all(axis=1))
        if len(starts):
            end = (starts[-1] if latest else starts[0]) + n - 1
            continuation = tokens[end + 1:].tolist()
            if extend:
                continuation = [continuation[i % len(continuation)] for i in range(num_drafts)]
            return continuation[:num_drafts]
    return []


class Replay(NamedTuple):
    forwards: int
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens kept
    drafting_passes: int  # forwards that carried drafts (at batch 1 the others are one-token passes)


def replay_lookup(prompt: Sequence[int], output: Sequence[int], num_drafts: int, max_new_tokens: int,
                  max_ngram: int = MAX_NGRAM, latest: bool = LATEST, extend: bool = EXTEND,
                  min_match: int = 1) -> Replay:
    """What verified decoding with lookup drafts does to produce `output` (a greedy NTP output:
    verification keeps it fixed, so only the forwards depend on the drafts).

    Each forward feeds the newest exact token and its drafts, accepts the drafts that equal the output,
    and emits one more exact token; drafts never reach past `max_new_tokens`.
    """
    emitted, forwards, drafted, accepted, drafting = 0, 0, 0, 0, 0
    context = list(prompt)
    while emitted < len(output):
        drafts = lookup_once(context, min(num_drafts, max_new_tokens - emitted), max_ngram, latest, extend, min_match)
        good = 0
        while good < len(drafts) and emitted + good < len(output) and drafts[good] == output[emitted + good]:
            good += 1
        step = min(good + 1, len(output) - emitted)
        context += list(output[emitted: emitted + step])
        emitted += step
        forwards += 1
        drafted += len(drafts)
        drafting += bool(drafts)
        accepted += min(good, step)
    return Replay(forwards, drafted, accepted, drafting)

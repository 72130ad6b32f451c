"""Which block size verified SBD should use at a batch size: the rule, from measured quantities.

A verified pass at block k runs 2k tokens a row (k pending, k masked) and emits `tokens_per_forward[k]`
tokens a row on average; an NTP step runs one token and emits one. So verified SBD at k is faster than
NTP by about tokens_per_forward[k] x time(1) / time(2k), where time(n) is the bare forward of n tokens
a row *at this batch size*. Acceptance (tokens per forward) is a property of the model and the text,
measured once on a few calibration prompts; time(n) is a property of the machine and the batch, and
grows with n sooner at larger batches (compute, not weight reads, bounds the pass), which is why the
best k shrinks as the batch grows and NTP wins at some batch.
"""

from __future__ import annotations

from typing import Mapping

from sbd_jax.errors import UserError


def predicted_speedup(tokens_per_forward: float, pass_seconds: float, ntp_step_seconds: float) -> float:
    """Verified SBD's decoding speed over NTP's if the loop cost nothing beyond the model's forwards."""
    return tokens_per_forward * ntp_step_seconds / pass_seconds


def choose_block_size(tokens_per_forward: Mapping[int, float], pass_seconds: Mapping[int, float],
                      ntp_step_seconds: float) -> int:
    """The block size with the highest predicted speed-up, or 1 (NTP) when none is predicted to beat NTP.

    `tokens_per_forward[k]`: measured for the model at block k (calibration prompts); `pass_seconds[k]`:
    a bare forward of 2k tokens a row at the batch size in question; `ntp_step_seconds`: of one token."""
    if set(tokens_per_forward) != set(pass_seconds) or not tokens_per_forward:
        raise UserError("tokens_per_forward and pass_seconds must name the same block sizes")
    best = max(tokens_per_forward, key=lambda k: predicted_speedup(tokens_per_forward[k], pass_seconds[k],
                                                                    ntp_step_seconds))
    return best if predicted_speedup(tokens_per_forward[best], pass_seconds[best], ntp_step_seconds) > 1 else 1

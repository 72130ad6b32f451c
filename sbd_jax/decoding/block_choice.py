"""Which block size verified SBD should use at a batch size: the rule, from measured quantities.

A verified pass at block k runs 2k tokens a row (k pending, k masked; with lookup drafts only the k
pending, and only the one exact token where no row has drafts) and emits `tokens_per_forward[k]`
tokens a row on average; an NTP step runs one token and emits one. So verified SBD at k is faster than
NTP by about tokens_per_forward[k] x time(1) / time(2k), where time(n) is the bare forward of n tokens
a row *at this batch size* (lookup: tokens_per_forward[k] x time(1) / ((1 - s) time(k) + s time(1)), s the
share of passes run narrow). Acceptance (tokens per forward, and s) is a property of the model, the text
and, for s, the batch (a pass runs narrow only where no row of the batch has drafts), measured once on a
few calibration prompts at the batch in question; time(n) is a property of the machine and the batch, and
grows with n sooner at larger batches (compute, not weight reads, bounds the pass), which is why the
best k shrinks as the batch grows and NTP wins at some batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

from sbd_jax.decoding.chain_drafts import fallbacks_used
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.errors import UserError
from sbd_jax.model.config import WithWeights

BLOCK_SIZES = (4, 8, 16)  # the candidates `measure_block_choice` tries by default


def predicted_speedup(tokens_per_forward: float, pass_seconds: float, ntp_step_seconds: float,
                      narrow_share: float = 0.0) -> float:
    """Verified SBD's decoding speed over NTP's if the loop cost nothing beyond the model's forwards;
    `narrow_share` of the passes cost an NTP step (lookup drafts: no row had drafts), the rest `pass_seconds`."""
    if not (pass_seconds > 0 and ntp_step_seconds > 0):
        raise UserError(f"forward times must be > 0 seconds (got a pass of {pass_seconds}, an NTP step of "
                        f"{ntp_step_seconds})")
    return tokens_per_forward * ntp_step_seconds / mean_pass_seconds(pass_seconds, ntp_step_seconds, narrow_share)


def mean_pass_seconds(pass_seconds: float, ntp_step_seconds: float, narrow_share: float) -> float:
    """A pass's bare cost on average where `narrow_share` of them run the exact token alone."""
    return (1 - narrow_share) * pass_seconds + narrow_share * ntp_step_seconds


def choose_block_size(tokens_per_forward: Mapping[int, float], pass_seconds: Mapping[int, float],
                      ntp_step_seconds: float, narrow_share: Mapping[int, float] | None = None) -> int:
    """The block size with the highest predicted speed-up, or 1 (NTP) when none is predicted to beat NTP.

    `tokens_per_forward[k]`: measured for the model at block k (calibration prompts); `pass_seconds[k]`:
    a bare forward of a pass's tokens a row at the batch size in question; `ntp_step_seconds`: of one token;
    `narrow_share[k]` (default 0): the share of passes that ran the exact token alone."""
    if set(tokens_per_forward) != set(pass_seconds) or not tokens_per_forward:
        raise UserError("tokens_per_forward and pass_seconds must name the same block sizes")
    narrow = narrow_share or {}

    def speedup(k: int) -> float:
        return predicted_speedup(tokens_per_forward[k], pass_seconds[k], ntp_step_seconds, narrow.get(k, 0.0))

    best = max(tokens_per_forward, key=speedup)
    return best if speedup(best) > 1 else 1


@dataclasses.dataclass(frozen=True)
class BlockChoice:
    """The rule's answer and the measurements it read (print them: a user can pin the block size)."""

    block_size: int  # 1: NTP (no block size is predicted to beat it)
    tokens_per_forward: dict[int, float]  # verified SBD at each candidate k, on the calibration prompts
    bare_seconds: dict[int, float]  # a bare forward at the batch: key 1 = one token a row, k = a pass's tokens
    narrow_share: dict[int, float] = dataclasses.field(default_factory=dict)  # lookup: passes run narrow, at k

    @property
    def predicted_speedups(self) -> dict[int, float]:
        return {k: predicted_speedup(t, self.bare_seconds[k], self.bare_seconds[1], self.narrow_share.get(k, 0.0))
                for k, t in self.tokens_per_forward.items()}

    def describe(self) -> str:
        picked = "NTP" if self.block_size == 1 else f"block size {self.block_size}"
        return f"picked {picked}; " + ", ".join(
            f"k={k}: {self.tokens_per_forward[k]:.2f} tokens/forward"
            + (f" ({self.narrow_share[k]:.0%} of passes one token)" if self.narrow_share.get(k) else "")
            + f", predicted {s:.2f}x NTP"
            for k, s in self.predicted_speedups.items())


VERIFIED = Settings(mode=Mode.SBD, verify=True)  # the drafts the rule calibrates unless told: SBD's block


def at_block_size(verified: Settings, block_size: int, max_new_tokens: int) -> Settings:
    """Greedy NTP (`block_size` 1), or greedy verified decoding with `verified`'s draft options (source,
    shortest lookup match, fallback blocks) at `block_size`, up to `max_new_tokens`. Greedy whatever
    `verified`'s temperature: the rule calibrates on greedy decodes, which are reproducible."""
    if not verified.verify:
        raise UserError("the block-size rule measures verified SBD: give settings with mode 'sbd' and verify "
                        "(--mode sbd --verify)")
    if block_size == 1:
        return Settings(max_new_tokens=max_new_tokens)
    return dataclasses.replace(verified, block_size=block_size, max_new_tokens=max_new_tokens, temperature=0.0,
                               top_p=1.0)


def decoder_for(config: Any, block_size: int, max_new_tokens: int, verified: Settings = VERIFIED) -> Any:
    """The decoder of `at_block_size`, stopping at the model's EOS ids."""
    return at_block_size(verified, block_size, max_new_tokens).decoder(config)


def pass_tokens(block_size: int, verified: Settings = VERIFIED) -> int:
    """Tokens a row in one forward at `block_size` (1: NTP's one token): the k pending tokens, and where the
    drafts come from SBD's block the k-token masked block and its fallback copies (at most k - 1); tree drafts:
    the exact token and `draft_nodes` candidates."""
    if block_size == 1:
        return 1
    nodes = verified.draft_nodes if verified.drafts.is_tree else block_size - 1
    if not verified.drafts.reads_masked_block:
        return 1 + nodes
    return 1 + nodes + (1 + fallbacks_used(verified.fallback_blocks, block_size)) * block_size


def cache_slots(config: Any, prompts: Sequence[Sequence[int]], block_size: int, max_new_tokens: int,
                pad_to: int = 0) -> int:
    """The KV-cache slots `generate` gives NTP (`block_size` 1) or verified SBD for these prompts."""
    from sbd_jax.decoding.generate import pad_prompts

    # every draft source gets the same slots; lookup's decoder needs no mask token
    decoder = decoder_for(config, block_size, max_new_tokens, dataclasses.replace(VERIFIED, drafts=Drafts.LOOKUP))
    return pad_prompts(prompts, decoder.max_new_tokens, decoder.output_len, None, config, pad_to=pad_to)[2]


def bare_forward_seconds(model: WithWeights, prompts: Sequence[Sequence[int]], block_sizes: Sequence[int], batch: int,
                         max_new_tokens: int, calls: int = 10, pad_to: int = 0,
                         verified: Settings = VERIFIED) -> dict[int, float]:
    """Seconds of one bare forward at `batch` rows, in the middle of decoding these prompts, in the cache
    the decoder would get: key 1 for NTP's one token a row, key k for a verified pass (`pass_tokens`)."""
    from sbd_jax.decoding.timing import forward_seconds

    context = max(pad_to, *map(len, prompts)) + max_new_tokens // 2
    return {k: forward_seconds(model, batch, pass_tokens(k, verified), context, calls,
                               capacity=cache_slots(model.config, prompts, k, max_new_tokens, pad_to))
            for k in (1, *block_sizes)}


class Calibration(NamedTuple):
    """Greedy verified decoding measured at each block size k on calibration prompts."""

    tokens_per_forward: dict[int, float]
    narrow_share: dict[int, float]  # of the passes, those run as the exact token alone (lookup drafts only)


def calibrate(model: WithWeights, prompts: Sequence[Sequence[int]], block_sizes: Sequence[int], max_new_tokens: int,
              batch: int = 8, verified: Settings = VERIFIED) -> Calibration:
    """Greedy verified decoding of these prompts at each block size, `batch` rows at a time (its output is
    NTP's at every k; only the forwards it takes differ, and with lookup drafts which of them run narrow,
    which depends on the batch)."""
    from sbd_jax.decoding.generate import generate_batched, tokens_per_pass

    tokens, narrow = {}, {}
    for k in block_sizes:
        decoder = decoder_for(model.config, k, max_new_tokens, verified)
        generations = generate_batched(decoder, model.params, prompts, batch)[0]
        tokens[k] = tokens_per_pass(generations)
        narrow[k] = sum(g.narrow_passes for g in generations) / max(sum(g.nfe for g in generations), 1)
    return Calibration(tokens, narrow)


def measure_block_choice(model: WithWeights, prompts: Sequence[Sequence[int]], batch: int,
                         block_sizes: Sequence[int] = BLOCK_SIZES, max_new_tokens: int = 128,
                         calibration_tokens: int = 64, calls: int = 10, verified: Settings = VERIFIED) -> BlockChoice:
    """Calibrates and applies the rule for verified SBD at `batch` rows generating up to `max_new_tokens`:
    tokens per forward (and, with lookup drafts, the share of passes run narrow) measured on the first
    `calibration_tokens` of greedy verified decoding of `prompts` (a few like those to be served) at `batch`
    rows, bare forwards timed on this machine in the cache such a decode gets. `verified` carries the draft
    options (source, shortest lookup match, fallback blocks; its block size and temperature are not read).
    `model` has `.config` (with a mask token unless the drafts are lookup) and `.params`. Costs a short
    greedy decode per candidate and a few hundred forwards. The draft source is the caller's, not chosen
    here: sbd / hybrid need an SBD fine-tune, and which source to trust is the user's call; each source's k
    is a separate calibration."""
    from sbd_jax.decoding.base import check_whole_number

    check_whole_number("batch", batch, 1)
    check_whole_number("calibration_tokens", calibration_tokens, 1)
    check_whole_number("max_new_tokens", max_new_tokens, 1)
    if not block_sizes or min(block_sizes) < 2:
        raise UserError(f"block sizes to choose from must be >= 2 (got {list(block_sizes)})")
    measured = calibrate(model, prompts, block_sizes, min(max_new_tokens, calibration_tokens), batch, verified)
    bare = bare_forward_seconds(model, prompts, block_sizes, batch, max_new_tokens, calls, verified=verified)
    chosen = choose_block_size(measured.tokens_per_forward, {k: bare[k] for k in block_sizes}, bare[1],
                               measured.narrow_share)
    return BlockChoice(chosen, measured.tokens_per_forward, bare, measured.narrow_share)

"""Decoding settings, checked once when made, and the decoder class that runs them."""

from __future__ import annotations

import dataclasses
from typing import Any

from sbd_jax.choice import Choice
from sbd_jax.decoding.base import (
    DEFAULT_GAMMA,
    Decoder,
    NTPDecoder,
    check_block_size,
    check_decoding_options,
    check_flag,
    check_gamma,
    check_proxy,
    check_whole_number,
    is_finite_number,
)
from sbd_jax.decoding.drafts import (
    Drafts,
    check_draft_memory,
    check_fallback_blocks,
    check_lookup_min_match,
    draft_source,
)
from sbd_jax.decoding.sbd import SBDDecoder
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.decoding.verified import DEFAULT_DRAFT_NODES, VerifiedSBDDecoder, check_pass_widths
from sbd_jax.errors import UserError

DEFAULT_BLOCK = 16  # Settings.block_size unless given


class Mode(Choice):
    """How a decoder emits tokens."""

    NTP = "ntp"  # one token per forward
    SBD = "sbd"  # blocks of tokens per forward (verify: only the tokens NTP would have emitted)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to decode. Every field is checked here, once, when the settings are made (before any model
    is loaded); `decoder` then builds the decoder class that runs them."""

    mode: Mode = Mode.NTP
    max_new_tokens: int = 128
    block_size: int = DEFAULT_BLOCK  # sbd: tokens per block
    gamma: float | None = None  # sbd: entropy budget per pass (None: decoders.DEFAULT_GAMMA); not with verify
    proxy: Proxy = Proxy.ENTROPY  # sbd: uncertainty score (entropy, confidence, margin; left_to_right: a diagnostic)
    verify: bool = False  # sbd: keep drafts only where NTP agrees (exactly NTP's output / distribution)
    drafts: Drafts = Drafts.SBD  # verify: what proposes the drafts (a chain or a tree a pass: `Drafts`)
    lookup_min_match: int = 1  # lookup / hybrid: the shortest n-gram match that proposes drafts (1-4)
    fallback_blocks: int = 0  # drafts from the masked block: masked blocks after the first N places a draft can be
    # rejected, so a rejection still leaves drafts (pass (2 + N) k tokens; at most k - 1 used)
    draft_nodes: int = DEFAULT_DRAFT_NODES  # tree drafts: candidate nodes a pass (at most block_size - 1 deep)
    # tree drafts: (pass width, seconds) measured here (`tree_width.measure_pass_costs`); each pass then runs the
    # width with the most expected tokens per second. Empty: every node, or the root alone where no row has one.
    pass_costs: tuple[tuple[int, float], ...] = ()
    # tree drafts: keep the model's successor table (Token Recycling's hot start) and the last earlier answers
    # (SuffixDecoding) from call to call of one model and batch to batch of a dataset: forwards then depend on
    # what was decoded before, outputs never
    draft_memory: bool = False
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode, "mode"))  # a name given as a str
        check_decoding_options(self.max_new_tokens, self.temperature, self.top_p)
        check_flag("verify", self.verify)
        object.__setattr__(self, "drafts", draft_source(self.drafts))  # a name given as a str
        check_lookup_min_match(self.lookup_min_match, self.drafts)
        check_fallback_blocks(self.fallback_blocks, self.drafts)
        if self.fallback_blocks and not self.verify:
            raise UserError("fallback_blocks (--fallback-blocks) draft after a rejected draft: add verify "
                            "(--mode sbd --verify)")
        check_whole_number("draft_nodes", self.draft_nodes, 1)
        if self.draft_nodes != DEFAULT_DRAFT_NODES and not self.drafts.is_tree:
            raise UserError("draft_nodes (--draft-nodes) sizes the trees of tree drafts: use it with drafts "
                            f"{', '.join(d.value for d in Drafts if d.is_tree)} (--drafts)")
        if self.pass_costs and (not self.drafts.is_tree or self.drafts.reads_masked_block):
            raise UserError("pass_costs price the widths of tree drafts without masked blocks: use them with drafts "
                            f"{', '.join(d.value for d in Drafts if d.is_tree and not d.reads_masked_block)} "
                            "(--drafts)")
        for width, seconds in self.pass_costs:
            check_whole_number("pass_costs width", width, 1)
            if not is_finite_number(seconds) or seconds <= 0:
                raise UserError(f"pass_costs seconds={seconds!r} must be a positive number")
        check_pass_widths(tuple(w for w, _ in self.pass_costs), self.draft_nodes)
        check_draft_memory(self.draft_memory, self.verify and self.drafts.keeps_memory, self.temperature)
        if self.drafts != Drafts.SBD and not self.verify:
            raise UserError(f"drafts {self.drafts.value!r} (--drafts) are proposals for verification: add verify "
                            "(--mode sbd --verify)")
        if self.verify and self.mode != Mode.SBD:
            raise UserError("verify (--verify) checks SBD's drafts: use it with mode 'sbd' (--mode sbd)")
        if self.verify and self.gamma is not None:
            raise UserError("gamma (--gamma) has no effect with verify (--verify): drafts come from one pass and "
                            "verification decides what is kept; drop gamma, or drop verify for Entropy-Bounded "
                            "decoding")
        check_block_size(self.block_size)
        object.__setattr__(self, "proxy", check_proxy(self.proxy))  # a bad name is an error in any mode
        # Options that would change nothing are refused, not ignored: the user meant another mode.
        if self.mode == Mode.NTP:
            unused = [name for name, value, default in (("gamma (--gamma)", self.gamma, None),
                                                        ("proxy (--proxy)", self.proxy, Proxy.ENTROPY),
                                                        ("block_size (--block-size)", self.block_size, DEFAULT_BLOCK))
                      if value != default]
            if unused:
                raise UserError(f"{', '.join(unused)}: SBD's, not NTP's: add mode 'sbd' (--mode sbd), or drop them")
        if self.verify and self.proxy != Proxy.ENTROPY:
            raise UserError("proxy (--proxy) orders plain SBD's reveals; with verify (--verify) every draft is "
                            "checked in order: drop proxy, or drop verify for Entropy-Bounded decoding")
        if self.drafts.is_tree and self.block_size < 2:
            raise UserError(f"drafts {self.drafts.value!r} form trees block_size - 1 deep: give block_size >= 2")
        if self.gamma is not None:
            check_gamma(self.gamma)

    @classmethod
    def ntp(cls, **options: Any) -> "Settings":
        """NTP: one token a forward (`options`: the other fields, e.g. max_new_tokens, temperature)."""
        return cls(mode=Mode.NTP, **options)

    @classmethod
    def plain_sbd(cls, block_size: int, gamma: float | None = None, **options: Any) -> "Settings":
        """SBD's Entropy-Bounded sampler in blocks of `block_size` at entropy budget `gamma` (None: the default)."""
        return cls(mode=Mode.SBD, block_size=block_size, gamma=gamma, **options)

    @classmethod
    def verified(cls, block_size: int, drafts: Drafts = Drafts.SBD, **options: Any) -> "Settings":
        """Verified decoding, exactly NTP's output, with `drafts` checked `block_size - 1` deep (SBD's block needs
        the fine-tune's mask token; lookup and the context and successor trees need no fine-tune)."""
        return cls(mode=Mode.SBD, block_size=block_size, verify=True, drafts=drafts, **options)

    @property
    def entropy_budget(self) -> float:
        """γ as the decoder receives it (plain SBD's default when unset; the other decoders ignore it)."""
        return DEFAULT_GAMMA if self.gamma is None else self.gamma

    def as_ntp(self) -> "Settings":
        """NTP with these settings' length and sampling, every SBD and draft option back at its default (what a
        block-size rule that picked NTP decodes)."""
        return Settings(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    def decoder(self, config: Any) -> Decoder:
        """The decoder that runs these settings for a model of `config`; it stops at the model's EOS ids."""
        common = dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                      eos_ids=config.eos_token_ids)
        if self.mode == Mode.NTP:
            return NTPDecoder(config, **common)
        if self.verify:
            return VerifiedSBDDecoder(config, block_size=self.block_size, drafts=self.drafts,
                                      lookup_min_match=self.lookup_min_match, fallback_blocks=self.fallback_blocks,
                                      draft_nodes=self.draft_nodes, widths=tuple(w for w, _ in self.pass_costs),
                                      costs=tuple(c for _, c in self.pass_costs), draft_memory=self.draft_memory,
                                      **common)
        return SBDDecoder(config, block_size=self.block_size, proxy=self.proxy, **common)

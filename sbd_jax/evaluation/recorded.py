"""A decoding setting as result files record it: the fields of `sbd_jax.decoding.settings.Settings` that tell
decoders apart, flat in each row, so that studies cache, select and label their rows by the same fields that
build the decoder (no second vocabulary of mode names). A run's length and sampling are the run's, not the
setting's: they are recorded once per file."""

from __future__ import annotations

from typing import Any

from sbd_jax.decoding import chain_drafts
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.decoding.verified import DEFAULT_DRAFT_NODES

# Every row has these; a field that does not apply to its decoder is None (0 for fallback_blocks).
FIELDS = ("mode", "block_size", "gamma", "proxy", "verify", "drafts", "fallback_blocks")
OPTIONAL = ("lookup_min_match", "draft_nodes", "hybrid_rule", "draft_memory")  # where they apply (`record`)


def record(settings: Settings) -> dict[str, Any]:
    """`FIELDS` of `settings` (NTP: block 1; γ (the default where unset) and the proxy only for plain SBD, the
    draft source only when verifying), and where they apply the lookup's shortest match, the tree's nodes, a kept draft memory and hybrid's rule (so that
    rows of another rule or width are never mistaken for these). The fallback blocks are those a pass runs, at
    most k - 1 (`chain_drafts.fallbacks_used`): asking for more decodes the same, so it is the same row."""
    sbd, verify = settings.mode == Mode.SBD, settings.verify
    block_size = settings.block_size if sbd else 1
    row: dict[str, Any] = {"mode": settings.mode, "block_size": block_size,
                           "gamma": settings.entropy_budget if sbd and not verify else None,
                           "proxy": settings.proxy if sbd and not verify else None, "verify": verify,
                           "drafts": settings.drafts if verify else None,
                           "fallback_blocks": chain_drafts.fallbacks_used(settings.fallback_blocks, block_size)}
    if verify and settings.drafts.reads_context and settings.lookup_min_match != 1:
        row["lookup_min_match"] = settings.lookup_min_match
    if verify and settings.drafts.is_tree and settings.draft_nodes != DEFAULT_DRAFT_NODES:
        row["draft_nodes"] = settings.draft_nodes
    if settings.draft_memory:
        row["draft_memory"] = True
    if verify and settings.drafts == Drafts.HYBRID:
        row["hybrid_rule"] = chain_drafts.HYBRID_RULE  # read when called: a test may change the rule
    return row


def cache_key(settings: Settings) -> str:
    """`record(settings)` as one string, for the keys of entry caches (`key_of`)."""
    return key_of(record(settings))


def key_of(row: dict[str, Any]) -> str:
    """The cache key of a recorded setting: `FIELDS`, then the optional fields `record` adds, `name=value` each."""
    names = [*FIELDS, *(name for name in OPTIONAL if name in row)]
    return ",".join(f"{name}={getattr(row[name], 'value', row[name])}" for name in names)


def has(row: dict[str, Any], **fields: Any) -> bool:
    """Whether the recorded setting `row` has these field values (`has(row, verify=True, drafts=Drafts.SBD)`):
    rows are selected by their fields, never by `describe`'s wording. An optional field is recorded only where
    it applies and differs from its default (`record`), so a row without it has it at its default."""
    unknown = set(fields) - set(FIELDS) - set(OPTIONAL)
    if unknown:
        raise ValueError(f"not a recorded field: {', '.join(sorted(unknown))} (fields: {', '.join(FIELDS + OPTIONAL)})")
    defaults = {"lookup_min_match": 1, "draft_nodes": DEFAULT_DRAFT_NODES, "draft_memory": False}
    return all(row.get(name, defaults.get(name)) == value for name, value in fields.items())


def describe(row: dict[str, Any]) -> str:
    """A recorded setting in words, for tables: "NTP", "SBD" (", left_to_right order" for another proxy than
    entropy), "verified SBD", "verified, lookup drafts", ..., with ", N fallback blocks" where it has them (γ and
    the block size are columns of their own), and ", draft memory" where the drafts' memory was kept."""
    if row["mode"] == Mode.NTP:
        return "NTP"
    if not row["verify"]:
        return "SBD" if row["proxy"] in (None, Proxy.ENTROPY) else f"SBD, {Proxy(row['proxy']).value} order"
    words = "verified SBD" if row["drafts"] == Drafts.SBD else f"verified, {Drafts(row['drafts']).value} drafts"
    return (words + (f", {row['fallback_blocks']} fallback blocks" if row["fallback_blocks"] else "")
            + (", draft memory" if row.get("draft_memory") else ""))

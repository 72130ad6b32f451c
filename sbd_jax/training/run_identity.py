"""What a workdir's checkpoints were trained from, recorded when a run starts and compared on every resume.

A checkpoint restores whatever the config says about the model: an adapter run's checkpoint holds only the
adapter (the frozen base comes from `model.name`), and a full fine-tune's tokenizer, EOS ids and rope settings
come from `model.name` too. So a resume with another base, mask token, adapter scale or objective would train
on silently and export a model that is neither run's. The run's identity (the base weights' fingerprint, the
model config's fields that say what the weights are, the adapter, the objective) is written to the workdir
at the run's first start and a resume that differs is refused, naming each difference.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from sbd_jax.errors import UserError
from sbd_jax.model.config import ModelConfig

IDENTITY = "run_identity.json"
HOW_IT_RUNS = ("dtype", "param_dtype", "scan_layers")  # ModelConfig fields that leave the weights' meaning as is


def run_identity(config: ModelConfig, base_fingerprint: str, objective: str) -> dict[str, Any]:
    """The identity of a run training `config` (with its mask token and adapter) from the base weights of
    `base_fingerprint` ("" for a model trained from scratch) with `objective`, as JSON values."""
    model = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
             if f.name not in HOW_IT_RUNS and f.name != "adapter"}  # the adapter: a key of its own
    adapter = dataclasses.asdict(config.adapter) if config.adapter else None
    return json.loads(json.dumps({"objective": objective, "base_fingerprint": base_fingerprint,
                                  "adapter": adapter, "model": model}, default=_plain))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return getattr(value, "value", str(value))


def recorded(workdir: str) -> bool:
    """Whether `workdir` records its run's identity."""
    return os.path.isfile(os.path.join(workdir, IDENTITY))


def record(workdir: str, identity: dict[str, Any]) -> None:
    """Writes `identity` as the workdir's (whole or not at all)."""
    path = os.path.join(workdir, IDENTITY)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(identity, f, indent=2)
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror}); free space or fix the directory, then run the same "
                        "command again") from None


def check_same_run(source: str, identity: dict[str, Any], config_key: str) -> None:
    """Raises UserError if the checkpoints in `source` (this workdir, or the run `init_from` names) were
    trained as another run than `identity`. A workdir written before identities were recorded is not
    checked, nor is a field the record lacks (added to the config since). `config_key`: how the config names
    `source` (in the message)."""
    if not recorded(source):
        return
    path = os.path.join(source, IDENTITY)
    try:
        with open(path) as f:
            changed = _differences(json.load(f), identity)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}: {e}): it records what the checkpoints beside it "
                        "were trained as; restore it, or start a new run in another --workdir") from None
    if changed:
        raise UserError(f"the checkpoints in {config_key} {source} were trained as another run ({'; '.join(changed)}"
                        f"): resume with the model, mask token, adapter and objective that wrote them ({path} "
                        "records them), or start a new run in another --workdir")


def _differences(before: Any, now: Any, prefix: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(now, dict):
        return [line for key in sorted(set(before) & set(now))
                for line in _differences(before[key], now[key], f"{prefix}{key}.")]
    return [] if before == now else [f"{prefix.rstrip('.')} {before!r} -> {now!r}"]

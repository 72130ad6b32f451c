"""The SmolLM2 arithmetic recipe (experiments/smollm2_arith): the whole pipeline at toy sizes on a tiny base model."""

import json
import os
import subprocess
import sys

import pytest

from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode
from sbd_jax.evaluation.recorded import describe, has

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_base(path: str) -> str:
    """A random tiny Llama with the character tokenizer, saved as an HF directory (a stand-in for SmolLM2)."""
    from experiments.small_scale.config import SMOKE_ARCHITECTURE
    from sbd_jax.checkpoints.hf import save_hf
    from sbd_jax.checkpoints.tokenizer import load_tokenizer
    from sbd_jax.evaluation.char_tokenizer import save_char_tokenizer
    from sbd_jax.model.config import ModelConfig
    from sbd_jax.model.transformer import init_params

    tokenizer = load_tokenizer(save_char_tokenizer(os.path.join(path, "tok")))
    config = ModelConfig(**SMOKE_ARCHITECTURE, vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,))
    save_hf(os.path.join(path, "base"), config, init_params(config), tokenizer=tokenizer)
    return os.path.join(path, "base")


@pytest.mark.slow
def test_smoke_run_trains_both_stages_evaluates_every_setting_and_resumes(tmp_path):
    base = tiny_base(str(tmp_path))
    work = str(tmp_path / "work")
    command = [sys.executable, "-m", "experiments.smollm2_arith.run", "--workdir", work,
               "--smoke", "--base", base]
    env = dict(os.environ, XLA_FLAGS="")
    subprocess.run(command, check=True, env=env, cwd=ROOT, timeout=600)
    results = json.load(open(os.path.join(work, "results.json")))
    entries = results["entries"]
    keys = {(e["model"], describe(e), e["split"], e["block_size"]) for e in entries}
    for key in [("base", "NTP", "test", 1), ("stage1", "NTP", "test", 1), ("stage2", "NTP", "test", 1),
                ("stage2", "NTP", "valid", 1), ("stage2", "verified SBD", "test", 4), ("stage2", "NTP", "speed", 1),
                ("stage2", "verified SBD", "speed", 4)]:
        assert key in keys, key
    assert len([e for e in entries if has(e, mode=Mode.SBD, verify=False) and e["split"] == "valid"]) == 2  # block 4 x 2 γ
    ntp = next(e for e in entries if e["model"] == "stage2" and has(e, mode=Mode.NTP) and e["split"] == "test")
    verified = next(e for e in entries if has(e, verify=True, drafts=Drafts.SBD) and e["split"] == "test")
    assert verified["n"] == 4 and verified["correct"] == ntp["correct"][:4]  # lossless, even untrained
    assert [r["step"] for r in results["loss_curves"]["stage2"]] == [1, 2, 3]
    assert all(r["matp_loss"] > 0 for r in results["loss_curves"]["stage2"])
    assert all(r["matp_loss"] == 0 for r in results["loss_curves"]["stage1"])  # stage 1 is NTP only
    train = [json.loads(line) for line in open(os.path.join(work, "data", "train.jsonl"))]
    assert len(train) == 200 and all(r["prompt"].endswith("=") and r["completion"] for r in train)
    assert "## Targets" in open(os.path.join(work, "results.md")).read()
    assert os.path.getsize(os.path.join(work, "accuracy_vs_passes.png")) > 0
    # A rerun trains nothing and re-evaluates nothing (every entry cached): it only re-measures speed.
    again = subprocess.run(command, check=True, env=env, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert "whole " not in again.stdout and "speed batch 1" in again.stdout

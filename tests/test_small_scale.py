"""The small-scale experiment (experiments/small_scale): its task, tokenizer and a smoke run of the whole pipeline."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sbd_jax.checkpoints.tokenizer import load_tokenizer
from sbd_jax.errors import UserError
from sbd_jax.evaluation.arithmetic import (
    final_result,
    problems,
    splits,
    with_places,
    worked_answer,
)
from sbd_jax.evaluation.char_tokenizer import save_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_worked_answers_add_up_and_chain_carries():
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, 10**6, size=(200, 2)):
        answer = worked_answer(int(a), int(b))
        assert final_result(answer) == a + b
        steps, carry = answer.split(">")[0].split(","), 0
        for step in steps:  # "c5+0+1=06": the carry written is the previous step's tens digit
            x, y, c = int(step[1]), int(step[3]), int(step[5])
            assert c == carry and int(step[7:9]) == x + y + c
            carry = (x + y + c) // 10
    assert worked_answer(572, 86) == "a2+6+0=08,b7+8+0=15,c5+0+1=06>c6b5a8"
    assert with_places(1000) == "d1c0b0a0"


@pytest.mark.parametrize("text", ["", "a2+6+0=08", "x>", ">a1b2", ">b1a", ">b1ax", ">a12"])
def test_final_result_rejects_malformed_answers(text):
    assert final_result(text) is None


def test_heldout_problems_are_unseen():
    train = problems(2000, 3, seed=0)
    test = problems(300, 3, seed=1, exclude=frozenset(p.question for p in train))
    assert len({p.question for p in train}) == 2000
    assert not {p.question for p in train} & {p.question for p in test}


def test_the_split_rule_draws_disjoint_reproducible_splits():
    study = splits(2000, 200, 300, 3)
    sets = [{p.question for p in split} for split in study]
    assert [len(s) for s in sets] == [2000, 200, 300] and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert study == splits(2000, 200, 300, 3) and study.train == problems(2000, 3, seed=0)
    assert study.test == problems(300, 3, seed=1, exclude=frozenset(sets[0]))  # the rule the studies ran with


def test_char_tokenizer_round_trips_code_and_renders_chats(tmp_path):
    tokenizer = load_tokenizer(save_char_tokenizer(str(tmp_path)))
    code = "def f(x):\n\treturn {'a': x ** 2}  # ok\n"
    ids = tokenizer(code)["input_ids"]
    assert len(ids) == len(code) and tokenizer.decode(ids) == code
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "b1a2+a3"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "b1a2+a3="


@pytest.mark.slow
def test_smoke_run_writes_every_result(tmp_path):
    """The whole pipeline (data, trainings, evaluation grid, speed, report, plots) at toy sizes."""
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    subprocess.run([sys.executable, "-m", "experiments.small_scale.run", "--smoke",
                    "--workdir", str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=900)
    with open(tmp_path / "results.json") as f:
        results = json.load(f)
    sizes = results["sizes"]
    entries = [e for e in results["entries"] if e["split"] != "speed"]
    grid = len(sizes["block_sizes"]) * len(sizes["gammas"])
    # NTP decoding of the five models; the diagnostic of the four SBD ones; the whole grid for the
    # headline fine-tune, the largest block only for the other three; each on validation and test.
    assert len(entries) == 2 * (5 + 4 + grid + 3 * len(sizes["gammas"]))
    for e in results["entries"]:
        assert {"model", "mode", "block_size", "gamma", "split", "n", "accuracy", "accuracy_final_number",
                "ci95", "tokens_per_pass", "tokens_per_second", "batch"} <= e.keys() or e["split"] == "speed"
    for e in entries:
        assert 0.0 <= e["ci95"][0] <= e["accuracy"] <= e["ci95"][1] <= 1.0
        assert e["accuracy"] <= e["accuracy_final_number"] + 1e-9  # a whole right answer has the right result
        assert e["n"] == (sizes["test_problems"] if e["split"] == "test" else sizes["valid_problems"])
        if e["mode"] == "ntp":
            assert e["tokens_per_pass"] == 1.0
        else:
            # Below 1 is possible: tokens revealed after an EOS that is revealed later are dropped.
            assert 0.0 < e["tokens_per_pass"] <= e["block_size"]
    speed = [e for e in results["entries"] if e["split"] == "speed"]
    assert {e["batch"] for e in speed} == {1, 8} and all(e["tokens_per_second"] > 0 for e in speed)
    assert set(results["heldout_ntp_loss"]) == {"ntp", "ft_10", "ft_20", "sbd", "sbd_no_ntp"}
    steps = {name: len(curve) for name, curve in results["loss_curves"].items()}
    assert steps == {"ntp": 6, "ft_10": 10, "ft_20": 20, "sbd": 4, "sbd_no_ntp": 4}
    assert 0.0 <= results["padding_fraction"]["arithmetic"] < 0.5
    report = (tmp_path / "results.md").read_text()
    assert "## Headline" in report and results["command"] in report and "across fine-tuning budgets" in report
    assert results["provenance"]["commit"] != "unknown" and f"at commit {results['provenance']['commit']}" in report
    for plot in ("accuracy_vs_passes.png", "loss_curves.png", "gamma0_diagnostic.png", "budget_trend.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_first_difference_names_where_sbd_departs_from_ntp():
    from experiments.small_scale.error_positions import first_difference

    ntp = [5, 6, 7, 8, 9, 1]
    assert first_difference(ntp, ntp, [1] * 6, 4) is None
    # Position 5 = block 2's position 1 ("early"), the only one pass 3 revealed; the block's first pass was 2.
    assert first_difference(ntp, [5, 6, 7, 8, 9, 2], [1, 1, 1, 1, 2, 3], 4) == {
        "kind": "token", "band": "early", "first_pass": False, "alone": True}
    assert first_difference(ntp, [5, 6, 7, 3, 9, 1], [1, 2, 2, 2, 3, 3], 4) == {
        "kind": "token", "band": "last", "first_pass": False, "alone": False}
    assert first_difference(ntp, [5, 6, 7, 3], [1, 1, 1, 1], 4)["first_pass"]
    assert first_difference(ntp, ntp[:3], [1, 1, 1], 4) == {"kind": "stopped early"}
    assert first_difference(ntp[:3], ntp, [1] * 6, 4) == {"kind": "went on"}


def test_the_budget_trend_extrapolates_a_power_law_and_refuses_a_flat_one():
    from experiments.small_scale.report import implied_steps

    # gap = 0.64 (steps / 600)^-1: 0.01 is 64x below 0.64, so 64 x 600 steps.
    assert implied_steps([600, 1200, 2400], [0.64, 0.32, 0.16]) == pytest.approx(38_400)
    # gap = 0.5 (steps / 600)^-0.5: 0.01 is 50x below, so 2,500 x 600 steps; a closed gap (0) is left out of the fit.
    assert implied_steps([600, 2400, 9600], [0.5, 0.25, 0.0]) == pytest.approx(1_500_000)
    assert implied_steps([600, 1200], [0.3, 0.3]) is None  # not shrinking: no budget implied
    assert implied_steps([600, 1200], [0.3, 0.0]) is None  # one point: no slope


def test_a_longer_study_extends_the_presets_budgets_only_where_the_trunk_can_branch():
    from experiments.small_scale.config import FULL
    from experiments.small_scale.run import model_plan, study_sizes

    sizes = study_sizes(False, [24000, 600, 1200], 600)
    assert sizes["budgets"] == (600, 1200, 24000) and sizes["scratch_steps"] == 600
    assert FULL["budgets"] == (600, 1200, 2400, 6000, 12000)  # the preset itself is unchanged
    plan = model_plan(sizes)
    assert ("trunk", "trunk", 21600) in plan and ("ft_24000", "ft", 24000) in plan and ("sbd", "sbd", 600) in plan
    assert ("trunk", "trunk", 10800) in model_plan(study_sizes(False))
    with pytest.raises(UserError, match="must be a multiple of the smallest one's"):
        study_sizes(False, [600, 1000])  # 900 is no multiple of 540: the trunk keeps no state to branch from
    proc = subprocess.run([sys.executable, "-m", "experiments.small_scale.run", "--budgets", "600", "650"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --budgets 600 650") and "Traceback" not in proc.stderr


def test_a_trunk_extended_by_a_larger_study_is_kept_as_it_is_by_a_smaller_one(tmp_path):
    # A trainer refuses train.steps below its checkpoint's: the smaller study's trunk asks for what is saved.
    from experiments.small_scale.run import saved_steps

    assert saved_steps(str(tmp_path)) == 0
    for name in ("540", "1080", "1080.orbax-checkpoint-tmp", "damaged"):
        os.makedirs(tmp_path / "checkpoints" / name)
    assert saved_steps(str(tmp_path)) == 1080


def _entry(model: str, mode: str, split: str, correct: str, block_size: int = 1, gamma=None, per_pass=1.0) -> dict:
    accuracy = correct.count("1") / len(correct)
    return {"model": model, "mode": mode, "split": split, "block_size": block_size, "gamma": gamma, "verify": False,
            "proxy": "entropy" if mode == "sbd" else None,
            "correct": correct, "accuracy": accuracy, "ci95": [accuracy, accuracy], "n": len(correct),
            "tokens_per_pass": per_pass}


def test_a_model_without_ntp_skill_does_not_pass_by_matching_its_own_failure():
    """The bar is the better NTP decoding of the model's own and the NTP-only model's: SBD without the NTP
    term (own NTP decoding 0%) at 40% is no match for NTP, while a fine-tune 1 point below its NTP is."""
    from experiments.small_scale.report import chosen_on_validation, headline_rows

    right, wrong = "1" * 100, "0" * 100
    entries = []
    for split in ("valid", "test"):
        entries += [_entry("ntp", "ntp", split, right), _entry("ft_600", "ntp", split, right),
                    _entry("sbd_no_ntp", "ntp", split, wrong),
                    _entry("ft_600", "sbd", split, "0" + "1" * 99, 16, 0.1, 5.0),
                    _entry("sbd_no_ntp", "sbd", split, "1" * 40 + "0" * 60, 16, 1.0, 11.8)]
    assert chosen_on_validation(entries, "ft_600", 16)["gamma"] == 0.1
    assert chosen_on_validation(entries, "sbd_no_ntp", 16) is None
    rows = headline_rows({"entries": entries, "heldout_ntp_loss": {"ntp": {}, "ft_600": {}, "sbd_no_ntp": {}}})
    ft, no_ntp = rows[2].split(" | "), rows[3].split(" | ")
    assert ft[2] == "0.1" and ft[-1] == "yes |" and "NTP-only" not in ft[4]
    assert no_ntp[2] == "none within 1 point" and no_ntp[-1] == "no |" and "(NTP-only's)" in no_ntp[4]

"""The SmolLM2 SBD recipe (recipes/smollm2_sbd): prompts, the HumanEval harness, and a smoke run of the GPU script."""

import json
import os
import subprocess

from recipes.smollm2_sbd.distill import HELDOUT_EVERY, write_distilled
from recipes.smollm2_sbd.humaneval import completion_from_answer, pass_rate, problems
from recipes.smollm2_sbd.prompts import make_prompts
from sbd_jax.sampler import Generation
from tests.conftest import requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prompts_are_deterministic_distinct_and_mixed():
    prompts = make_prompts(300, seed=0)
    assert prompts == make_prompts(300, seed=0) and len(set(prompts)) == 300
    assert prompts != make_prompts(300, seed=1)
    coding = sum(p.startswith(("Write a Python", "Implement", "In Python")) for p in prompts)
    arithmetic = sum(p.endswith("Explain step by step.") for p in prompts)
    assert 0.3 < coding / 300 < 0.6 and 0.2 < arithmetic / 300 < 0.5


def test_humaneval_harness_passes_right_code_and_fails_wrong_code():
    tasks = problems(3)
    ids = [t["task_id"] for t in tasks]
    solution = tasks[1]["prompt"] + tasks[1]["canonical_solution"]
    wrapped = completion_from_answer(f"Here:\n```python\n{solution}```\nDone.")
    completions = [tasks[0]["canonical_solution"], wrapped, "    return None\n"]
    assert pass_rate(ids, completions) == [True, True, False]
    assert pass_rate(ids[:1], ["    while True:\n        pass\n"], timeout=1.0) == [False]  # timed out


def test_distilled_data_holds_out_every_tenth_prompt_and_drops_cut_off_answers(tmp_path):
    eos = 2
    prompts = [f"q{i}" for i in range(25)]
    generations = [Generation([5, eos] if i % 3 else [5, 6], 2, [1, 2]) for i in range(25)]
    counts = write_distilled(str(tmp_path), prompts, [f"a{i}" for i in range(25)], generations, (eos,))
    heldout = [json.loads(line) for line in open(tmp_path / "heldout.jsonl")]
    train = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    assert [h["prompt"] for h in heldout] == prompts[::HELDOUT_EVERY]
    assert not {t["messages"][0]["content"] for t in train} & {h["prompt"] for h in heldout}
    assert all(int(t["messages"][0]["content"][1:]) % 3 for t in train)  # only finished answers
    assert counts == {"train": len(train), "heldout": 3, "dropped_unfinished": 22 - len(train)}


@requires_smollm2
def test_gpu_script_smoke_runs_the_whole_recipe(tmp_path):
    """distill -> SBD fine-tune -> evaluation on the real SmolLM2, toy sizes, through the GPU script."""
    env = dict(os.environ, XLA_FLAGS="", OUT=str(tmp_path))
    subprocess.run(["bash", os.path.join(ROOT, "recipes", "smollm2_sbd", "gpu.sh"), "--smoke"], check=True,
                   env=env, cwd=ROOT, timeout=900)
    assert sorted(os.listdir(tmp_path)) == ["recipe_log.txt", "recipe_preflight.json", "results.json", "results.md",
                                            "run.json"]
    assert "recipe: exit 0" in (tmp_path / "recipe_log.txt").read_text()
    rows = json.load(open(tmp_path / "results.json"))["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("base", "ntp"), ("sbd-tuned", "ntp"), ("sbd-tuned", "sbd")]
    base, tuned, sbd = rows
    assert base["agreement_with_base"] == 1.0  # the base model reproduces its own distilled answers
    assert base["tokens_per_pass"] == tuned["tokens_per_pass"] == 1.0 and tuned["speedup_batch1"] == 1.0
    # Below 1 is possible: a pass can reveal tokens after an EOS revealed later, which are then dropped.
    assert 0.0 < sbd["tokens_per_pass"] <= sbd["block_size"]
    assert all(r["humaneval_problems"] == 2 and 0 <= r["humaneval_pass_at_1"] <= 1 for r in rows)
    run = json.load(open(tmp_path / "run.json"))
    assert set(run["loss_last_tenth"]) == {"ntp_loss", "matp_loss"} and run["sizes"]["steps"] == 2


@requires_smollm2
def test_gpu_script_returns_its_log_and_preflight_when_cut_short(tmp_path):
    env = dict(os.environ, XLA_FLAGS="", OUT=str(tmp_path))
    script = os.path.join(ROOT, "recipes", "smollm2_sbd", "gpu.sh")
    proc = subprocess.run(["timeout", "--kill-after=2", "25", "bash", script, "--smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (124, 137)  # cut short
    assert json.load(open(tmp_path / "recipe_preflight.json"))["tiny_layer"]["finite"]
    assert (tmp_path / "recipe_log.txt").stat().st_size > 0  # the log was teed into $OUT as it ran

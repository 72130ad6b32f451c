"""The SmolLM2 SBD recipe (recipes/smollm2_sbd): prompts, the HumanEval harness, and a smoke run of the GPU script."""

import json
import os
import subprocess
import sys

import pytest

from recipes.smollm2_sbd.distill import repetition, write_distilled
from recipes.smollm2_sbd.humaneval import completion_from_answer, pass_rate, problems
from recipes.smollm2_sbd.prompts import HELDOUT_MODULES, MODULES, make_prompts
from sbd_jax.decoding.generate import Generation
from sbd_jax.errors import UserError
from sbd_jax.evaluation.recorded import describe
from tests.conftest import requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prompts_are_deterministic_distinct_and_mixed():
    prompts = make_prompts(300, seed=0)
    assert prompts == make_prompts(300, seed=0) and len(set(prompts)) == 300
    assert prompts != make_prompts(300, seed=1)
    coding = sum(p.startswith(("Write a Python", "Implement", "In Python")) for p in prompts)
    arithmetic = sum(p.endswith("Explain step by step.") for p in prompts)
    assert 0.3 < coding / 300 < 0.6 and 0.2 < arithmetic / 300 < 0.5


def test_the_recipes_prompts_are_the_same_in_every_process():
    """A default's repr held a memory address, so a prompt differed from process to process and a resumed
    distillation could refuse its own answers. Made as the recipe makes them (its imports first: libraries it
    imports add methods to standard-library classes, so this pytest process is not the recipe's)."""
    script = ("import json, recipes.smollm2_sbd.run; from recipes.smollm2_sbd.prompts import make_prompts; "
              "print(json.dumps(make_prompts(3200, seed=0)))")
    made = [json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                                      check=True, env=dict(os.environ, PYTHONPATH=ROOT)).stdout) for _ in range(2)]
    assert made[0] == made[1] and not any(" at 0x" in p for p in made[0])


def test_humaneval_harness_passes_right_code_and_fails_wrong_code():
    tasks = problems(3)
    ids = [t["task_id"] for t in tasks]
    solution = tasks[1]["prompt"] + tasks[1]["canonical_solution"]
    wrapped = completion_from_answer(f"Here:\n```python\n{solution}```\nDone.")
    completions = [tasks[0]["canonical_solution"], wrapped, "    return None\n"]
    assert pass_rate(ids, completions) == [True, True, False]
    assert pass_rate(ids[:1], ["    while True:\n        pass\n"], timeout=1.0) == [False]  # timed out


def test_training_and_heldout_prompts_share_no_module_and_no_text():
    train, heldout = make_prompts(600, seed=0), make_prompts(300, seed=0, split="heldout")
    assert not set(train) & set(heldout) and len(set(heldout)) == 300

    def modules(prompts):  # the modules named in coding and explanation prompts
        return {m for p in prompts for m in MODULES if f"`{m}." in p or f"`{m}`" in p}

    assert modules(heldout) <= set(HELDOUT_MODULES) and not modules(train) & set(HELDOUT_MODULES)
    assert len(modules(heldout)) >= 5
    assert sum(p.endswith("Explain step by step.") for p in heldout) > 50  # arithmetic is held out too


def test_distilled_data_keeps_finished_answers_and_measures_repetition(tmp_path):
    eos = 2
    prompts = [f"q{i}" for i in range(6)]
    loop = [7, 8] * 20  # 40 tokens: a 16-token window repeats
    ids = [[5, eos] if i % 3 else loop for i in range(6)]
    counts = write_distilled(str(tmp_path), prompts, [f"a{i}" for i in range(6)], ids, (eos,))
    train = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    assert [t["messages"][0]["content"] for t in train] == ["q1", "q2", "q4", "q5"]  # the loops were cut off
    assert counts == {"train": 4, "dropped_unfinished": 2}
    stats = repetition(ids, (eos,))
    assert stats["cut_off"] == stats["repeat_16_token_window"] == 2 / 6
    # distinct 4-grams: [7, 8, 7, 8] and [8, 7, 8, 7] of 37 in a loop; answers of 2 tokens have none
    assert abs(stats["distinct_4gram_share"] - 2 / 37) < 1e-12 and stats["mean_tokens"] == (2 * 40 + 4 * 2) / 6


def test_a_killed_distillation_resumes_after_its_last_whole_answer(tmp_path, monkeypatch):
    from recipes.smollm2_sbd import distill

    decoded = []  # the prompts (as encoded) each batch decoded

    def fake_generate(decoder, params, prompts, pad_to, gamma, executables):
        assert pad_to == 5  # the longest of all the prompts (q0's), whatever is left to decode: one compiled shape
        decoded.append([p[0] for p in prompts])
        return [Generation([p[0], 2], 1, [1, 1]) for p in prompts], None

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return f"answer to {ids[0]}"

    monkeypatch.setattr(distill, "generate", fake_generate)
    monkeypatch.setattr(distill, "encode_prompt", lambda tokenizer, prompt, chat: [int(prompt[1:])] * (
        5 if prompt == "q0" else 1))
    prompts = [f"q{i}" for i in range(7)]
    cache = str(tmp_path / distill.ANSWERS)
    settings = {"base": "m", "answer_tokens": 2}
    texts, ids, resumed = distill.chat_answers(None, None, Tokenizer(), prompts[:3], batch_size=2, cache=cache,
                                               settings=settings)
    assert resumed == 0
    assert (decoded, ids) == ([[0, 1], [2, 2]], [[0, 2], [1, 2], [2, 2]])  # the last batch filled with its last
    with open(cache, "a") as f:
        f.write('{"prompt": "q3", "tok')  # a kill while writing the next batch
    decoded.clear()
    texts, ids, resumed = distill.chat_answers(None, None, Tokenizer(), prompts, batch_size=2, cache=cache,
                                               settings=settings)
    assert decoded == [[3, 4], [5, 6]] and resumed == 3  # only what the file did not hold whole
    assert ids == [[i, 2] for i in range(7)] and texts == [f"answer to {i}" for i in range(7)]
    lines = [json.loads(line) for line in open(cache)]
    assert lines[0] == {"settings": settings} and [a["prompt"] for a in lines[1:]] == prompts
    with pytest.raises(UserError, match=r"answer 1 is to another prompt than this distillation's: remove it"):
        distill.chat_answers(None, None, Tokenizer(), ["q99"] + prompts, batch_size=2, cache=cache, settings=settings)
    with pytest.raises(UserError, match=r"holds answers made with \{'base': 'm', 'answer_tokens': 2\}, not this "
                                        r"distillation's \{'base': 'other', 'answer_tokens': 2\}: remove it"):
        distill.chat_answers(None, None, Tokenizer(), prompts, batch_size=2, cache=cache,
                             settings=dict(settings, base="other"))


def test_a_fresh_workdir_starts_from_the_kept_data_only_when_it_was_made_with_the_same_settings(tmp_path, monkeypatch):
    from recipes.smollm2_sbd import run

    kept = tmp_path / "kept"
    (kept / "cpu").mkdir(parents=True)
    made_with = run.made_with(run.DEFAULT_BASE, run.CPU, "float32")
    data = {"train": 1, "dropped_unfinished": 0, "train_prompts": 1, "answer_tokens": 256, "valid": 1, "test": 1,
            "heldout_modules": [], "repetition": {"answers": 1, "mean_tokens": 3, "cut_off": 0.0,
                                                  "repeat_16_token_window": 0.0, "distinct_4gram_share": 1.0},
            "made_with": made_with, "made_at": {"commit": "abc1234"}, "seconds": 60.0}
    (kept / "cpu" / "data.json").write_text(json.dumps(data))
    (kept / "cpu" / "train.jsonl").write_text('{"messages": []}\n')
    monkeypatch.setattr(run, "KEPT_DATA", str(kept))
    assert run.kept_data("cpu", run.DEFAULT_BASE, run.CPU, "float32") == str(kept / "cpu")
    assert run.kept_data("cpu", "/other/model", run.CPU, "float32") is None
    assert run.kept_data("cpu", run.DEFAULT_BASE, dict(run.CPU, train_prompts=801), "float32") is None
    assert run.kept_data("gpu", run.DEFAULT_BASE, run.GPU, "float32") is None

    run.main(["--workdir", str(tmp_path / "w"), "--cpu", "--stop-after", "distill", "--results", str(tmp_path / "r")])
    assert (tmp_path / "w" / "data" / "train.jsonl").read_text() == '{"messages": []}\n'
    assert json.load(open(tmp_path / "r" / "results.json"))["data"]["made_at"]["commit"] == "abc1234"
    assert "distillation 1 min (at commit abc1234)" in (tmp_path / "r" / "results.md").read_text()

    # A later piece of the same run keeps the earlier pieces' measurements in the report until it redoes them.
    results = json.load(open(tmp_path / "r" / "results.json"))
    trend = [{"steps": 50, "verified": {"tokens_per_forward": 1.14}, "sbd": {"tokens_per_forward": 1.09,
                                                                             "agreement_with_ntp": 0.0}}]
    (tmp_path / "r" / "results.json").write_text(json.dumps(dict(results, trend=trend)))
    run.main(["--workdir", str(tmp_path / "w"), "--cpu", "--stop-after", "distill", "--results", str(tmp_path / "r")])
    kept_results = json.load(open(tmp_path / "r" / "results.json"))
    commit = results["provenance"]["commit"]
    assert kept_results["trend"] == trend and kept_results["earlier_stages"] == {"trend": commit}
    assert f"(carried from earlier invocations until this one redoes them: trend at {commit})" in (
        tmp_path / "r" / "results.md").read_text()
    assert "| 50 | 1.14 | 1.09 | 0.0% |" in (tmp_path / "r" / "results.md").read_text()

    # Another run (other steps) written to the same folder carries nothing of this one's, and its command says so.
    run.main(["--workdir", str(tmp_path / "w"), "--cpu", "--steps", "300", "--stop-after", "distill",
              "--results", str(tmp_path / "r")])
    other = json.load(open(tmp_path / "r" / "results.json"))
    assert "trend" not in other and "earlier_stages" not in other
    assert other["command"].endswith("--cpu --steps 300") and other["sizes"]["steps"] == 300

    # Without --results, each variant's flag names its folder, in the order its command spells the flags.
    monkeypatch.setattr(run, "HERE", str(tmp_path / "recipe"))
    run.main(["--workdir", str(tmp_path / "w"), "--cpu", "--adapter-rank", "16", "--steps", "300", "--paper-objective",
              "--stop-after", "distill"])
    variant = json.load(open(tmp_path / "recipe" / "results" / "cpu_paper_objective_adapter_300steps" / "results.json"))
    assert variant["command"].endswith("--cpu --paper-objective --adapter-rank 16 --steps 300")

    # More training prompts: their own kept folder (data/cpu_900prompts), results folder and command.
    (kept / "cpu_900prompts").mkdir()
    more = dict(data, train=2, made_with=run.made_with(run.DEFAULT_BASE, dict(run.CPU, train_prompts=900), "float32"))
    (kept / "cpu_900prompts" / "data.json").write_text(json.dumps(more))
    (kept / "cpu_900prompts" / "train.jsonl").write_text('{"messages": []}\n' * 2)
    run.main(["--workdir", str(tmp_path / "w900"), "--cpu", "--train-prompts", "900", "--stop-after", "distill"])
    assert (tmp_path / "w900" / "data" / "train.jsonl").read_text() == '{"messages": []}\n' * 2
    variant = json.load(open(tmp_path / "recipe" / "results" / "cpu_900prompts" / "results.json"))
    assert variant["command"].endswith("--cpu --train-prompts 900") and variant["data"]["train"] == 2
    with pytest.raises(UserError, match="--train-prompts 0: give at least 1"):
        run.main(["--workdir", str(tmp_path / "w0"), "--cpu", "--train-prompts", "0"])
    with pytest.raises(UserError, match=r"w/data was distilled with .*'train_prompts': 800.*, not this run's "
                                        r".*'train_prompts': 900.*: give another --workdir"):
        run.main(["--workdir", str(tmp_path / "w"), "--cpu", "--train-prompts", "900", "--stop-after", "distill"])
    run.main(["--workdir", str(tmp_path / "w"), "--cpu", "--train-prompts", "800", "--stop-after", "distill"])
    assert json.load(open(tmp_path / "recipe" / "results" / "cpu" / "results.json"))["command"].endswith("--cpu")

    # A distillation killed after its data.json, before it kept a copy: the next invocation keeps it.
    (tmp_path / "w901" / "data").mkdir(parents=True)
    made = dict(data, made_with=run.made_with(run.DEFAULT_BASE, dict(run.CPU, train_prompts=901), "float32"))
    (tmp_path / "w901" / "data" / "data.json").write_text(json.dumps(made))
    (tmp_path / "w901" / "data" / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "w901" / "data" / "answers.partial.jsonl").write_text("{}\n")
    run.main(["--workdir", str(tmp_path / "w901"), "--cpu", "--train-prompts", "901", "--stop-after", "distill"])
    assert sorted(os.listdir(kept / "cpu_901prompts")) == ["data.json", "train.jsonl"]


@requires_smollm2
@pytest.mark.slow
def test_gpu_script_smoke_runs_the_whole_recipe(tmp_path):
    """distill -> SBD fine-tune -> evaluation on the real SmolLM2, toy sizes, through the GPU script."""
    env = dict(os.environ, XLA_FLAGS="", OUT=str(tmp_path))
    subprocess.run(["bash", os.path.join(ROOT, "recipes", "smollm2_sbd", "gpu.sh"), "--smoke"], check=True,
                   env=env, cwd=ROOT, timeout=900)
    assert sorted(os.listdir(tmp_path)) == ["entries.json", "recipe_log.txt", "recipe_preflight.json", "results.json",
                                            "results.md", "results.png"]
    assert all("@" in key for key in json.load(open(tmp_path / "entries.json")))  # keyed by the weights too
    assert "recipe: exit 0" in (tmp_path / "recipe_log.txt").read_text()
    results = json.load(open(tmp_path / "results.json"))
    rows = results["evaluation"]["rows"]
    assert [(r["model"], describe(r)) for r in rows][:2] == [("base", "NTP"), ("tuned", "NTP")]
    verified = {"verified SBD", "verified, lookup drafts", "verified, hybrid drafts"}  # SBD's, lookup's and both's
    assert {describe(r) for r in rows[2:]} == {"SBD"} | verified
    assert ("base", "verified, lookup drafts") in [(r["model"], describe(r)) for r in rows]  # no fine-tune needed
    tuned = rows[1]
    assert tuned["test"]["agreement_with_ntp"] == 1.0 and tuned["test"]["tokens_per_forward"] == 1.0
    for row in rows:
        if row["verify"]:  # lossless: the same outputs as the model's NTP
            assert row["test"]["agreement_with_ntp"] == 1.0 and row["humaneval"]["passed_vs_ntp"] == 0
        # Below 1 is possible for plain SBD: a pass can reveal tokens after an EOS revealed later.
        assert 0.0 < row["humaneval"]["tokens_per_forward"] <= row["block_size"] + 1
        assert row["humaneval"]["n"] == 2 and 0 <= row["humaneval"]["pass_at_1"] <= 1
    assert [t["steps"] for t in results["trend"]] == [1, 2, 3]
    assert set(results["evaluation"]["heldout_ntp_loss"]) == {"base", "tuned", "ntp_control"}
    assert results["train"]["steps"] == 3 and results["provenance"]["commit"]
    assert "## HumanEval and held-out prompts" in (tmp_path / "results.md").read_text()


@requires_smollm2
@pytest.mark.slow
def test_gpu_script_returns_its_log_and_preflight_when_cut_short(tmp_path):
    env = dict(os.environ, XLA_FLAGS="", OUT=str(tmp_path))
    script = os.path.join(ROOT, "recipes", "smollm2_sbd", "gpu.sh")
    proc = subprocess.run(["timeout", "--kill-after=2", "25", "bash", script, "--smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (124, 137)  # cut short
    assert json.load(open(tmp_path / "recipe_preflight.json"))["tiny_layer"]["finite"]
    assert (tmp_path / "recipe_log.txt").stat().st_size > 0  # the log was teed into $OUT as it ran


def test_a_sigterm_during_a_stage_still_counts_its_time(tmp_path, monkeypatch):
    """A killed invocation (a device call's time limit, an operator's kill) adds the seconds it spent
    to the stage's total before it exits, so the report's stage times are not undercounted."""
    import signal
    import time

    from recipes.smollm2_sbd import run

    def distill_until_killed(*args):
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler interrupts this
        raise AssertionError("SIGTERM did not stop the stage")

    monkeypatch.setattr(run, "distill", distill_until_killed)

    def not_replaced(*args):
        raise AssertionError("the recipe left SIGTERM's handler as it was: a plain kill would skip the stage's finally")

    previous = signal.signal(signal.SIGTERM, not_replaced)
    try:
        with pytest.raises(SystemExit) as stopped:
            run.main(["--workdir", str(tmp_path), "--smoke"])
        assert signal.getsignal(signal.SIGTERM) is not_replaced  # the stage's handler lives only as long as it does
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert 0.2 <= json.load(open(tmp_path / "seconds.json"))["distill"] < 30


def test_the_recipe_trains_an_adapter_at_ten_times_the_learning_rate(tmp_path):
    from recipes.smollm2_sbd.run import ADAPTER_LR_SCALE, OBJECTIVE, training_config

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "smollm2_135m.py")
    sizes = dict(steps=10, batch=4, seq_len=64, milestones=2)
    full = training_config(config, "smollm2-135m", str(tmp_path), sizes, "float32")
    adapter = training_config(config, "smollm2-135m", str(tmp_path), sizes, "float32", adapter_rank=16)
    assert ADAPTER_LR_SCALE == 10.0 and adapter.optimizer.lr == 10.0 * full.optimizer.lr
    assert (full.adapter.rank, adapter.adapter.rank) == (0, 16)
    assert all(full.objective[k] == v and adapter.objective[k] == v for k, v in OBJECTIVE.items())

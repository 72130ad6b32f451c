"""The SmolLM2 SBD recipe (recipes/smollm2_sbd): prompts, the HumanEval harness, and a smoke run of the GPU script."""

import json
import os
import subprocess

import pytest

from recipes.smollm2_sbd import eval as recipe_eval
from recipes.smollm2_sbd.distill import repetition, write_distilled
from recipes.smollm2_sbd.eval import choose_gamma
from recipes.smollm2_sbd.humaneval import completion_from_answer, pass_rate, problems
from recipes.smollm2_sbd.inputs import sbd_setting
from recipes.smollm2_sbd.prompts import HELDOUT_MODULES, MODULES, make_prompts
from recipes.smollm2_sbd.report import markdown
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.generate import Generation
from sbd_jax.decoding.settings import Mode
from sbd_jax.evaluation.recorded import describe, record
from sbd_jax.evaluation.scoring import first_difference
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
    generations = [Generation([5, eos] if i % 3 else loop, 2, [1, 2]) for i in range(6)]
    counts = write_distilled(str(tmp_path), prompts, [f"a{i}" for i in range(6)], generations, (eos,))
    train = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    assert [t["messages"][0]["content"] for t in train] == ["q1", "q2", "q4", "q5"]  # the loops were cut off
    assert counts == {"train": 4, "dropped_unfinished": 2}
    stats = repetition(generations, (eos,))
    assert stats["cut_off"] == stats["repeat_16_token_window"] == 2 / 6
    # distinct 4-grams: [7, 8, 7, 8] and [8, 7, 8, 7] of 37 in a loop; answers of 2 tokens have none
    assert abs(stats["distinct_4gram_share"] - 2 / 37) < 1e-12 and stats["mean_tokens"] == (2 * 40 + 4 * 2) / 6


def test_first_difference_and_gamma_chosen_on_validation_only():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    grid = [{"mode": "sbd", "verify": False, "block_size": 8, "gamma": g, "agreement_with_ntp": a, "tokens_per_forward": t}
            for g, a, t in ((0.0, 1.0, 1.0), (0.1, 0.9, 2.0), (0.35, 0.6, 3.0), (0.6, 0.4, 4.0))]
    assert choose_gamma(grid, 8) == 0.35  # the most tokens per forward with agreement >= 0.5
    assert choose_gamma([dict(g, agreement_with_ntp=0.1) for g in grid if g["gamma"]], 8) is None
    assert choose_gamma(grid, 4) is None


def test_an_entry_summary_counts_answers_that_loop():
    loop = list(range(16)) * 2  # a 16-token window, twice
    entry = {"model": "tuned", **record(sbd_setting(4, 0.35)), "split": "test", "n": 4, "seconds": 1.0,
             "outputs": [loop, list(range(32)), loop[:31], [7] * 17], "nfe": [8, 8, 8, 8], "drafted": 0, "accepted": 0}
    # [7] * 17 holds the window (7,) * 16 twice (starting at 0 and 1); 31 tokens of the loop do not hold one twice
    assert recipe_eval.summary(entry, None)["repeating"] == 0.5


class FakeEvaluations:
    """Entries without a model: NTP emits [1, 2, 3, 4] in 4 forwards; verified SBD the same in 2; plain SBD
    at γ g emits [1, 2, 3, 9] (differs at token 3) in 1 forward when g >= 0.6, else agrees in 4."""

    def __init__(self):
        self.models = {"base": type("M", (), {"tokenizer": None}), "tuned": type("M", (), {"tokenizer": None})}
        self.cache = type("Cache", (), {"save": lambda self: None})()
        self.asked = []

    def get(self, model, setting, split):
        row = record(setting)
        self.asked.append((model, describe(row), row["block_size"], row["gamma"], split))
        n = 2
        outputs, nfe = [[1, 2, 3, 4]] * n, [4] * n
        if row["verify"]:
            nfe = [2] * n
        elif row["mode"] == Mode.SBD and row["gamma"] >= 0.6:
            outputs, nfe = [[1, 2, 3, 9]] * n, [1] * n
        drafted = row["mode"] != Mode.NTP
        return {"model": model, **row, "split": split, "n": n, "seconds": 900.0, "outputs": outputs, "nfe": nfe,
                "drafted": 6 if drafted else 0, "accepted": 2 if drafted else 0}


def test_evaluation_reports_ntp_and_verified_rows_before_the_validation_grid(monkeypatch):
    monkeypatch.setattr(recipe_eval, "humaneval_scores", lambda entry, tokenizer, problems: [True, False])
    evaluations, seen, timed = FakeEvaluations(), [], []
    results = recipe_eval.evaluate(evaluations, [], (4, 8), (0.35, 0.6),
                                   lambda partial: seen.append((len(partial["rows"]), len(partial["validation"]))),
                                   after_grid=lambda partial: timed.append(
                                       (len(partial["rows"]), len(partial["validation"]), partial["chosen_gamma"])))
    labels = [(r["model"], describe(r), r["block_size"]) for r in results["rows"]]
    assert labels[:4] == [("base", "NTP", 1), ("tuned", "NTP", 1), ("tuned", "verified SBD", 4),
                          ("tuned", "verified SBD", 8)]
    assert labels[4:10] == [(m, f"verified, {d} drafts", k) for k in (4, 8)
                            for m, d in (("base", "lookup"), ("tuned", "lookup"), ("tuned", "hybrid"))]
    first_valid = next(i for i, a in enumerate(evaluations.asked) if a[1] == "SBD" and a[4] == "valid")
    assert all(a[1] != "SBD" for a in evaluations.asked[:first_valid])  # no plain SBD before its γ is chosen
    assert seen[:11] == [(n, 0) for n in range(1, 11)] + [(10, 1)] and seen[-1] == (len(results["rows"]), 4)
    assert results["chosen_gamma"] == {4: 0.35, 8: 0.35}  # γ 0.6 agrees on 0% of validation prompts
    assert timed == [(10, 4, {4: 0.35, 8: 0.35})]  # the wall clock: once γ is chosen, before the plain SBD rows
    assert [r["gamma"] for r in results["rows"][10:]] == [0.35, 0.6, 0.35, 0.6]
    assert results["rows"][10]["chosen_on_validation"] and not results["rows"][11]["chosen_on_validation"]
    partial = {"rows": results["rows"][:3], "validation": [], "chosen_gamma": {}, "complete": False, "seconds": 600,
               "prompts": {"humaneval": 2, "test": 2, "valid": 2}}
    partial_data = {"train_prompts": 1, "answer_tokens": 1, "train": 1, "dropped_unfinished": 0, "valid": 2, "test": 2,
                    "heldout_modules": ["x"], "repetition": {"answers": 1, "mean_tokens": 1, "cut_off": 0,
                                                             "repeat_16_token_window": 0, "distinct_4gram_share": 1}}
    report = markdown({"preset": "cpu", "command": "c", "provenance": {"commit": "abc"}, "machine": "m",
                       "seconds": {"distill": 0, "train": 60, "eval": 60}, "data": partial_data,
                       "evaluation": partial})
    assert "evaluation in progress (10 min into this invocation: 3 rows and 0 validation entries so far)" in report
    assert "| tuned, verified SBD | 4 |  | 50.0% (1) | +0 | 2.00 |" in report
    assert "γ chosen on 2 validation prompts: not yet" in report and "Validation grid" not in report
    # Finished: the stage's time is the entries' own decoding seconds, whatever invocations they ran in.
    done = markdown({"preset": "cpu", "command": "c", "provenance": {"commit": "abc"}, "machine": "m",
                     "seconds": {"distill": 0, "train": 60, "eval": 60}, "data": partial_data,
                     "evaluation": dict(results, complete=True, prompts=partial["prompts"])})
    assert results["validation_ntp"]["mode"] == "ntp" and results["validation_ntp"]["split"] == "valid"
    entries = 2 * len(results["rows"]) + len(results["validation"]) + 1  # + the NTP reference on validation
    assert f"evaluation {entries * 900 / 3600:.1f} h of decoding summed over its entries" in done


def test_cached_entries_are_keyed_by_the_exact_weights(tmp_path):
    from types import SimpleNamespace

    import numpy as np

    from recipes.smollm2_sbd.eval import Evaluations
    from recipes.smollm2_sbd.inputs import Prompt, ntp_setting

    def key(params):
        models = {"tuned": SimpleNamespace(params=params)}
        return Evaluations(str(tmp_path / "e.json"), models, {"valid": [Prompt("q")]}, 8, 1).key(
            "tuned", ntp_setting(), "valid")

    weights = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
    assert key(weights) == key({k: v.copy() for k, v in weights.items()})  # the same weights, another copy
    changed = dict(weights, b=np.array([1.0, np.nextafter(np.float32(1), np.float32(2))], np.float32))
    assert key(changed) != key(weights)  # one bit of one weight
    assert key(dict(weights, a=weights["a"].reshape(3, 2))) != key(weights)  # same bytes, other shape


def test_cached_hybrid_entries_are_keyed_by_the_rule_that_chose_their_drafts(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import numpy as np

    import sbd_jax.decoding.chain_drafts as chain_drafts
    from recipes.smollm2_sbd.eval import Evaluations
    from recipes.smollm2_sbd.inputs import Prompt, verified_setting

    models = {"tuned": SimpleNamespace(params={"a": np.zeros(2, np.float32)})}
    evaluations = Evaluations(str(tmp_path / "e.json"), models, {"valid": [Prompt("q")]}, 8, 1)
    hybrid, lookup = evaluations.key("tuned", verified_setting(8, Drafts.HYBRID), "valid"), \
        evaluations.key("tuned", verified_setting(8, Drafts.LOOKUP), "valid")
    monkeypatch.setattr(chain_drafts, "HYBRID_RULE", "another rule")
    # greedy outputs alike, forwards not; lookup has no rule to change
    assert evaluations.key("tuned", verified_setting(8, Drafts.HYBRID), "valid") != hybrid
    assert evaluations.key("tuned", verified_setting(8, Drafts.LOOKUP), "valid") == lookup


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


def test_the_headline_compares_every_row_with_the_base_models_ntp():
    from recipes.smollm2_sbd.headline import measure

    evaluations = FakeEvaluations()
    adapter = measure(evaluations, "test", 8, adapter=True)
    assert [(r["model"], describe(r), r["block_size"]) for r in adapter] == [
        ("base", "NTP", 1), ("tuned", "verified SBD", 8), ("tuned", "verified, hybrid drafts", 8),
        ("base", "verified, lookup drafts", 8), ("tuned", "verified, sbd-tree drafts", 8)]
    assert evaluations.asked[0] == ("base", "NTP", 1, None, "test")  # the reference, asked first and once
    assert evaluations.asked.count(evaluations.asked[0]) == 1
    assert [r["drafts"] for r in adapter] == [None, Drafts.SBD, Drafts.HYBRID, Drafts.LOOKUP, Drafts.SBD_TREE]
    assert all(r["agreement_with_ntp"] == 1.0 for r in adapter)  # FakeEvaluations: every decoder emits NTP's output
    assert adapter[0]["tokens_per_forward"] == 1.0 and adapter[1]["tokens_per_forward"] == 2.0
    assert adapter[1]["accepted_fraction"] == 2 / 6
    full = measure(FakeEvaluations(), "test", 8, adapter=False)  # a full fine-tune's own NTP and lookup too
    assert [(r["model"], describe(r)) for r in full][5:] == [("tuned", "NTP"), ("tuned", "verified, lookup drafts")]
    fallback = measure(FakeEvaluations(), "test", 8, adapter=True, fallback_blocks=7)  # their own rows, last
    assert [describe(r) for r in fallback][5:] == ["verified, hybrid drafts, 7 fallback blocks",
                                                   "verified SBD, 7 fallback blocks"]


def test_plain_sbd_chooses_gamma_on_validation_then_measures_it_on_test_against_ntp():
    from recipes.smollm2_sbd.plain import closest_to_ntp, measure

    evaluations, seen = FakeEvaluations(), []
    results = measure(evaluations, 8, (0.35, 0.6), adapter=True, progress=lambda r: seen.append(len(r["valid"] + r["test"])))
    assert [(r["split"], r["gamma"]) for r in results["valid"] + results["test"]] == [
        ("valid", 0.35), ("valid", 0.6), ("test", 0.35)]
    assert [r["agreement_with_ntp"] for r in results["valid"]] == [1.0, 0.0]  # γ 0.6 differs at token 3
    assert results["valid"][1]["median_first_difference"] == 3
    assert [r["mean_tokens_before_difference"] for r in results["valid"]] == [4.0, 3.0]  # identical: its length
    assert results["chosen_gamma"] == 0.35 and "50%" in results["rule"] and seen == [1, 2, 3]
    assert {a[0] for a in evaluations.asked if a[1] == "NTP"} == {"base"}  # an adapter's NTP is the base's
    assert not any(a[1] == "SBD" and a[4] == "test" and a[3] != 0.35 for a in evaluations.asked)  # test: chosen γ only
    full = FakeEvaluations()
    measure(full, 8, (0.35,), adapter=False)
    assert {a[0] for a in full.asked if a[1] == "NTP"} == {"tuned"}  # a full fine-tune against its own NTP
    # No γ reaches the floor: the most identical outputs, then the most tokens before the first difference.
    grid = [{"mode": "sbd", "verify": False, "block_size": 4, "gamma": g, "agreement_with_ntp": a,
             "mean_tokens_before_difference": m,
             "tokens_per_forward": t} for g, a, m, t in ((0.1, 0.0, 40, 1.1), (0.35, 0.0, 12, 1.5), (0.6, 0.04, 3, 2.0),
                                                         (1.0, 0.04, 3, 2.5))]
    assert closest_to_ntp(grid, 4)[0] == 1.0
    assert closest_to_ntp(grid[:2], 4)[0] == 0.1 and "closest" in closest_to_ntp(grid[:2], 4)[1]
    with pytest.raises(ValueError, match="block 8"):
        closest_to_ntp(grid, 8)

"""The SmolLM2 recipe's evaluations (recipes/smollm2_sbd/eval.py, headline.py, plain.py) on entries without a
model: the rows, their order, γ chosen on validation only, the cache keys, the report."""

import pytest

from recipes.smollm2_sbd import eval as recipe_eval
from recipes.smollm2_sbd.eval import choose_gamma
from recipes.smollm2_sbd.report import markdown
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.evaluation.recorded import describe, record
from sbd_jax.evaluation.scoring import first_difference


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
    entry = {"model": "tuned", **record(Settings.plain_sbd(4, 0.35)), "split": "test", "n": 4, "seconds": 1.0,
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
    from recipes.smollm2_sbd.inputs import Prompt

    def key(params):
        models = {"tuned": SimpleNamespace(params=params)}
        return Evaluations(str(tmp_path / "e.json"), models, {"valid": [Prompt("q")]}, 8, 1).key(
            "tuned", Settings.ntp(), "valid")

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
    from recipes.smollm2_sbd.inputs import Prompt

    models = {"tuned": SimpleNamespace(params={"a": np.zeros(2, np.float32)})}
    evaluations = Evaluations(str(tmp_path / "e.json"), models, {"valid": [Prompt("q")]}, 8, 1)
    hybrid, lookup = evaluations.key("tuned", Settings.verified(8, Drafts.HYBRID), "valid"), \
        evaluations.key("tuned", Settings.verified(8, Drafts.LOOKUP), "valid")
    monkeypatch.setattr(chain_drafts, "HYBRID_RULE", "another rule")
    # greedy outputs alike, forwards not; lookup has no rule to change
    assert evaluations.key("tuned", Settings.verified(8, Drafts.HYBRID), "valid") != hybrid
    assert evaluations.key("tuned", Settings.verified(8, Drafts.LOOKUP), "valid") == lookup


def test_the_headline_compares_every_row_with_the_base_models_ntp():
    from recipes.smollm2_sbd.headline import measure

    evaluations = FakeEvaluations()
    adapter = measure(evaluations, "test", 8, adapter=True)
    assert [(r["model"], describe(r), r["block_size"]) for r in adapter] == [
        ("base", "NTP", 1), ("tuned", "verified SBD", 8), ("base", "verified, lookup drafts", 8),
        ("tuned", "verified, tree-sbd drafts", 8), ("tuned", "verified, hybrid drafts", 8),
        ("tuned", "verified, sbd-tree drafts", 8)]
    assert evaluations.asked[0] == ("base", "NTP", 1, None, "test")  # the reference, asked first and once
    assert evaluations.asked.count(evaluations.asked[0]) == 1
    assert [r["drafts"] for r in adapter] == [None, Drafts.SBD, Drafts.LOOKUP, Drafts.TREE_SBD, Drafts.HYBRID,
                                              Drafts.SBD_TREE]
    assert all(r["agreement_with_ntp"] == 1.0 for r in adapter)  # FakeEvaluations: every decoder emits NTP's output
    assert adapter[0]["tokens_per_forward"] == 1.0 and adapter[1]["tokens_per_forward"] == 2.0
    assert adapter[1]["accepted_fraction"] == 2 / 6
    full = measure(FakeEvaluations(), "test", 8, adapter=False)  # a full fine-tune's own NTP and lookup too
    assert [(r["model"], describe(r)) for r in full][6:] == [("tuned", "NTP"), ("tuned", "verified, lookup drafts")]
    fallback = measure(FakeEvaluations(), "test", 8, adapter=True, fallback_blocks=7)  # their own rows, last
    assert [describe(r) for r in fallback][6:] == ["verified, hybrid drafts, 7 fallback blocks",
                                                   "verified SBD, 7 fallback blocks"]
    memory = measure(FakeEvaluations(), "test", 8, adapter=True, draft_memory=True)  # tree-sbd's twin, after it
    assert [describe(r) for r in memory][3:5] == ["verified, tree-sbd drafts", "verified, tree-sbd drafts, draft memory"]
    assert memory[4]["draft_memory"] and "draft_memory" not in memory[3]  # rows stay apart for the README's picks
    assert len(memory) == len(adapter) + 1


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

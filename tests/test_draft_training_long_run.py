"""The long run's measurement reads what the recipe recorded: its milestone exports, command and schedule."""

import json
import os

import pytest


def recipe_results(tmp_path, milestones, adapter_rank=16, name="cpu_adapter_450steps"):
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "results.json"
    path.write_text(json.dumps({
        "provenance": {"commit": "abc1234"}, "adapter_rank": adapter_rank,
        "command": "python -m recipes.smollm2_sbd.run --workdir WORKDIR --cpu --adapter-rank 16 --steps 450",
        "train": {"steps": 450, "median_seconds_per_step": 27.0, "milestones": milestones}}))
    return str(path)


@pytest.fixture
def study(tmp_path, monkeypatch):
    from experiments.draft_training import long_run

    measured = []
    key = long_run.FALLBACK_KEY

    def fake_measure(arm, export, step, sizes, base):
        measured.append((arm, export, step))
        return {"step": step, "verified_sbd_8": 1.0 + step / 1000, key: 1.5}

    monkeypatch.setattr(long_run, "measure", fake_measure)
    monkeypatch.setattr(long_run, "model_and_prompts", lambda arm, export, sizes: measured.append(("fallback", export))
                        or ("model", "prompts"))
    monkeypatch.setattr(long_run, "fallback_rows", lambda model, prompts, ntp, sizes: {key: 1.6})
    results = tmp_path / "study.json"
    results.write_text(json.dumps({"provenance": {}, "base": {"outputs": []}, "long_runs": {"cpu_adapter": {"points": [1]}}}))
    return long_run, str(results), measured


def test_every_recorded_milestone_is_measured_once_under_the_runs_folder_name(tmp_path, study):
    long_run, results, measured = study
    exports = {str(s): str(tmp_path / "elsewhere" / f"adapter_{s}") for s in (150, 300)}
    for path in exports.values():
        os.makedirs(path)
    recipe = recipe_results(tmp_path, exports)
    out = long_run.main(["--recipe-results", recipe, "--results", results])
    assert measured == [("adapter_lr10", exports["150"], 150), ("adapter_lr10", exports["300"], 300)]
    run = out["long_runs"]["cpu_adapter_450steps"]
    assert [p["step"] for p in run["points"]] == [150, 300]
    assert run["command"].endswith("--steps 450") and run["steps"] == 450 and run["seconds_per_step"] == 27.0
    assert out["long_runs"]["cpu_adapter"] == {"points": [1]}  # another run's points untouched
    long_run.main(["--recipe-results", recipe, "--results", results])  # resumed: nothing measured again
    assert len(measured) == 2
    assert json.load(open(results))["long_runs"]["cpu_adapter_450steps"]["points"][1]["step"] == 300


def test_a_missing_export_names_the_command_and_a_full_fine_tune_is_refused(tmp_path, study):
    long_run, results, _ = study
    recipe = recipe_results(tmp_path, {"150": str(tmp_path / "gone")})
    with pytest.raises(SystemExit, match="--steps 450 --train-until 150"):
        long_run.main(["--recipe-results", recipe, "--results", results])
    full = recipe_results(tmp_path, {}, adapter_rank=0, name="cpu")
    with pytest.raises(SystemExit, match="not a gated adapter's run"):
        long_run.main(["--recipe-results", full, "--results", results])


def test_a_point_measured_before_fallback_blocks_gets_their_rows_once(tmp_path, study):
    long_run, results, measured = study
    exports = {str(s): str(tmp_path / f"adapter_{s}") for s in (150, 300)}
    for path in exports.values():
        os.makedirs(path)
    study_results = json.load(open(results))
    study_results["long_runs"]["cpu_adapter_450steps"] = {"points": [{"step": 150, "verified_sbd_8": 1.3}]}
    json.dump(study_results, open(results, "w"))
    recipe = recipe_results(tmp_path, exports)
    out = long_run.main(["--recipe-results", recipe, "--results", results])
    points = out["long_runs"]["cpu_adapter_450steps"]["points"]
    key = long_run.FALLBACK_KEY
    assert points[0]["verified_sbd_8"] == 1.3 and points[0][key] == 1.6 and "fallback_commit" in points[0]
    assert points[1][key] == 1.5  # a new point: measure() gave its rows
    assert measured == [("fallback", exports["150"]), ("adapter_lr10", exports["300"], 300)]
    long_run.main(["--recipe-results", recipe, "--results", results])
    assert len(measured) == 2  # nothing measured or added again

"""Every result file says which commit it was measured at, when, and on what."""

import glob
import json
import os
import subprocess

from sbd_jax.evaluation import results as provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_results_carry_their_commit(tmp_path):
    from sbd_jax.evaluation.results import write_json

    write_json(str(tmp_path / "result.json"), {"x": 1})
    data = json.load(open(tmp_path / "result.json"))
    began = data["provenance"]["commit"].split("+")[0]
    assert data["x"] == 1 and data["provenance"]["commit"] == provenance.STARTED_AT_COMMIT
    # the commit this process began at: HEAD, or an ancestor of it where a commit was made while the tests ran
    in_history = subprocess.run(["git", "merge-base", "--is-ancestor", began, "HEAD"], cwd=ROOT, capture_output=True)
    assert in_history.returncode == 0 or began == "unknown", began
    assert data["provenance"]["measured_at"].startswith("20") and data["provenance"]["device"]


def test_a_run_that_outlasts_a_commit_records_the_commit_it_began_with(monkeypatch):
    """The code is read when a run starts and its file written when it ends: a commit made meanwhile (another
    change of the same session) must not pass for the code that measured."""
    monkeypatch.setattr(provenance, "STARTED_AT_COMMIT", "abc1234")
    stamp = provenance.provenance()
    assert stamp["commit"] == "abc1234" and stamp["written_at_commit"] == provenance.commit()
    monkeypatch.setattr(provenance, "STARTED_AT_COMMIT", provenance.commit())
    assert "written_at_commit" not in provenance.provenance()


def test_a_copy_without_git_takes_the_commit_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "ROOT", str(tmp_path))
    monkeypatch.setenv("SBD_COMMIT", "abc1234")
    assert provenance.commit() == "abc1234"
    monkeypatch.delenv("SBD_COMMIT")
    assert provenance.commit() == "unknown"


def test_only_changed_code_makes_a_measurement_dirty(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "deep").mkdir()
    for name in ("deep/code.py", "run.sh", "result.json", "README.md"):
        (tmp_path / name).write_text("a\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    monkeypatch.setattr(provenance, "ROOT", str(tmp_path))
    head = provenance.commit()
    assert head and "+" not in head
    (tmp_path / "result.json").write_text("b\n")  # an earlier benchmark of the same session wrote its result
    (tmp_path / "README.md").write_text("b\n")
    assert provenance.commit() == head
    for name in ("deep/code.py", "run.sh"):
        (tmp_path / name).write_text("b\n")
        assert provenance.commit() == head + "+dirty"
        (tmp_path / name).write_text("a\n")


def test_every_result_file_has_a_producing_script_or_folder():
    from benchmarks.results_index import RESULT_GLOBS, ROOT, producer

    paths = [os.path.relpath(p, ROOT) for g in RESULT_GLOBS for p in glob.glob(os.path.join(ROOT, g))]
    assert len(paths) >= 10
    for path in paths:
        assert os.path.exists(os.path.join(ROOT, producer(path))), path
    assert producer("benchmarks/results/compile_8b_llama3_8b.json") == "benchmarks/compile_8b.py"
    assert producer("recipes/smollm2_sbd/results/cpu/results.json") == "recipes/smollm2_sbd/"


def test_every_committed_result_file_carries_its_commit():
    """Stamped by its writer, or (made before results were stamped) marked "at or before" the commit
    that last wrote it."""
    from benchmarks.results_index import RESULT_GLOBS, ROOT, stamped_commit

    paths = [os.path.relpath(p, ROOT) for g in RESULT_GLOBS for p in glob.glob(os.path.join(ROOT, g))]
    dated = {path: stamped_commit(path) for path in paths}
    assert all(commit for commit, _ in dated.values()), [p for p, (c, _) in dated.items() if not c]
    assert {how for _, how in dated.values()} <= {"stamped", "at or before"}

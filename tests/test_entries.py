"""The evaluation's entry cache: computed once, kept across runs, each entry naming the commit it was measured at."""

from sbd_jax.evaluation.entries import EntryCache
from sbd_jax.evaluation.results import STARTED_AT_COMMIT


def test_an_entry_is_computed_once_and_records_its_commit(tmp_path):
    path = str(tmp_path / "entries.json")
    calls = []

    def compute():
        calls.append(1)
        return {"outputs": [[1, 2]]}

    first = EntryCache(path).get("k", compute, describe=lambda e: "k")
    assert first["commit"] == STARTED_AT_COMMIT and first["outputs"] == [[1, 2]] and first["seconds"] >= 0
    # a later run (a new cache on the same file) reads it back, commit included, without computing again
    again = EntryCache(path).get("k", compute, describe=lambda e: "k")
    assert again == first and len(calls) == 1

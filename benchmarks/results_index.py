"""Every committed result file with the commit it was measured at and whether the code it depends on
changed since, as a Markdown table; `--readme` rewrites the table in benchmarks/README.md.

    python -m benchmarks.results_index [--readme] [--stamp-history]

A result's commit is the one its writer stamped in it (`provenance.commit`); a file made before results
were stamped carries the last commit that wrote it, marked "at or before" (`--stamp-history` records it
once, before a later edit of the file could move that commit). It depends on the package (`sbd_jax/`)
and on the script or folder that produced it; "changed since" counts the files among those that differ
between its commit and the working tree (so a table made before a commit already counts it). A changed
dependency does not make a number wrong; it says the number was not measured on today's code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- results-index: begin (python -m benchmarks.results_index --readme) -->", "<!-- results-index: end -->"
RESULT_GLOBS = ("benchmarks/results/*.json", "experiments/*/results.json", "recipes/*/results.json",
                "recipes/*/results/*/results.json")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def producer(path: str) -> str:
    """The script (benchmarks: the longest script name its file name starts with) or folder behind a result."""
    if path.startswith("benchmarks/results/"):
        name = os.path.basename(path)
        scripts = [os.path.basename(s)[:-3] for s in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))]
        matches = [s for s in scripts if name.startswith(s + "_") or name == s + ".json"]
        if not matches:
            raise SystemExit(f"{path}: no benchmarks/*.py script matches its name; rename it <script>_<what>.json")
        return f"benchmarks/{max(matches, key=len)}.py"
    parts = path.split("/")
    return "/".join(parts[:2]) + "/"


def stamped_commit(path: str) -> tuple[str | None, str]:
    """The commit a file says it was measured at, and how sure that is: "stamped" when the writer recorded
    it, "at or before" for a file written before results were stamped (`--stamp-history` recorded the
    last commit that wrote it, which the measurement cannot postdate)."""
    with open(os.path.join(ROOT, path)) as f:
        data = json.load(f)
    provenance = data.get("provenance") or {}
    commit = provenance.get("commit") or data.get("commit")
    if not commit or commit == "unknown":
        return None, "at or before"
    return commit.removesuffix("+dirty"), provenance.get("commit_is", "stamped")


def stamp_history(path: str) -> bool:
    """Writes the "at or before" commit into an unstamped file (before any later edit of the file would
    move its last commit); True if it did."""
    if stamped_commit(path)[0]:
        return False
    full = os.path.join(ROOT, path)
    with open(full) as f:
        data = json.load(f)
    commit = git("log", "-1", "--format=%h", "--", path)
    data = {"provenance": {"commit": commit, "commit_is": "at or before",
                           "note": "written before results were stamped; the commit that last wrote this file"},
            **data}
    with open(full, "w") as f:
        json.dump(data, f, indent=1)
    return True


def row(path: str) -> dict:
    commit, dated = stamped_commit(path)
    commit = commit or git("log", "-1", "--format=%h", "--", path)
    depends = ["sbd_jax/", producer(path)]
    changed = git("diff", "--name-only", commit, "--", *depends).splitlines()  # to the working tree
    changed = [c for c in changed if not c.endswith((".json", ".md", ".png"))]  # results, not code
    when = git("show", "-s", "--format=%cs", commit)
    return {"file": path, "commit": commit, "dated": dated, "date": when, "producer": producer(path),
            "changed": len(changed)}


def table(rows: list[dict]) -> str:
    lines = ["| result | measured at | commit date | made by | code files changed since |", "|---|---|---|---|---|"]
    for r in rows:
        commit = r["commit"] if r["dated"] == "stamped" else f"≤ {r['commit']}"
        changed = "none (current)" if r["changed"] == 0 else str(r["changed"])
        lines.append(f"| `{r['file']}` | {commit} | {r['date']} | `{r['producer']}` | {changed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", action="store_true", help="rewrite the table between benchmarks/README.md's markers")
    parser.add_argument("--stamp-history", action="store_true",
                        help="record in each unstamped file the last commit that wrote it (\"at or before\")")
    args = parser.parse_args()
    paths = sorted({os.path.relpath(p, ROOT) for g in RESULT_GLOBS for p in glob.glob(os.path.join(ROOT, g))})
    if args.stamp_history:
        print(f"stamped {sum(stamp_history(p) for p in paths)} files with the commit that last wrote them")
    text = table([row(p) for p in paths])
    if not args.readme:
        print(text)
        return
    readme = os.path.join(ROOT, "benchmarks", "README.md")
    content = open(readme).read()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"benchmarks/README.md has no {BEGIN} ... {END} markers")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    print(f"benchmarks/README.md: {len(paths)} result files")


if __name__ == "__main__":
    main()

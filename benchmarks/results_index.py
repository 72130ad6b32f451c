"""Every committed result file with the commit it was measured at and whether the code it depends on
changed since, as a Markdown table; `--readme` rewrites the table in README.md's Measured section.

    python benchmarks/results_index.py [--readme]

A result's commit is the one stamped in it (`provenance.commit`, or `commit` for the recipes); a file
without one is dated by the last commit that wrote it ("at or before"). It depends on the package
(`sbd_jax/`) and on the script or folder that produced it; "changed since" counts the files among those
that differ between its commit and the working tree (so a table made before a commit already counts it). A changed dependency does not make a number wrong; it says the
number was not measured on today's code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- results-index: begin (python benchmarks/results_index.py --readme) -->", "<!-- results-index: end -->"
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


def stamped_commit(path: str) -> str | None:
    with open(os.path.join(ROOT, path)) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        return None
    commit = (data.get("provenance") or {}).get("commit") or data.get("commit")
    return commit.removesuffix("+dirty") if commit and commit != "unknown" else None


def row(path: str) -> dict:
    commit = stamped_commit(path)
    dated = "stamped" if commit else "at or before"
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
    parser.add_argument("--readme", action="store_true", help="rewrite the table between the README's markers")
    args = parser.parse_args()
    paths = sorted({os.path.relpath(p, ROOT) for g in RESULT_GLOBS for p in glob.glob(os.path.join(ROOT, g))})
    text = table([row(p) for p in paths])
    if not args.readme:
        print(text)
        return
    readme = os.path.join(ROOT, "README.md")
    content = open(readme).read()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    print(f"README.md: {len(paths)} result files")


if __name__ == "__main__":
    main()

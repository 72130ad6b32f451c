"""The documentation matches its sources: README.md's results table matches the committed result files it names,
the generated reference pages match the parsers, config dataclasses and module docstrings they come from (run
`python -m benchmarks.docs` after changing any of them), every result file has a page saying what its run found,
every relative Markdown link resolves, and hand-written Markdown stays readable (no line of prose over 200
characters, no title repeated as a heading)."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = "; run python -m benchmarks.docs"


def test_readme_results_table_matches_the_result_files():
    from benchmarks import docs

    with open(docs.README) as f:
        readme = f.read()
    assert docs.BEGIN in readme and docs.END in readme
    assert readme == docs.with_table(readme, docs.headline_table()), "README.md's results table is stale" + FIX


def test_every_headline_row_names_a_committed_result_file():
    from benchmarks import docs, results_index

    committed = set(results_index.result_files())
    for row in docs.HEADLINE:
        assert set(row.files) <= committed, row.files


def test_generated_reference_pages_are_current():
    from benchmarks import reference

    for path, text in reference.pages().items():
        with open(os.path.join(ROOT, path)) as f:
            assert f.read() == text, f"{path} is stale" + FIX


def test_every_result_file_has_a_page_saying_what_its_run_found():
    from benchmarks import results_index

    assert [p for p in results_index.result_files() if results_index.notes(p) is None] == []


def markdown_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted({p for p in out if os.path.exists(os.path.join(ROOT, p))})


def test_hand_written_markdown_has_no_line_of_prose_over_200_characters():
    long = []
    for path in markdown_files():
        if os.path.basename(path) == "results.md":  # generated from results.json by each study's report
            continue
        code = False
        for number, line in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1):
            code = code != line.startswith("```")
            if not code and not line.startswith("|") and len(line.rstrip("\n")) > 200:
                long.append(f"{path}:{number} ({len(line)} characters)")
    assert long == []


def test_no_page_repeats_its_title_as_a_heading():
    repeated = []
    for path in markdown_files():
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        title = re.match(r"# (.+)", text)
        if title and re.search(rf"^##+ {re.escape(title.group(1).strip())}\s*$", text, re.M):
            repeated.append(path)
    assert repeated == []


def test_every_relative_markdown_link_resolves():
    broken = []
    for path in markdown_files():
        for number, line in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1):
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
                if "://" not in target and not target.startswith("mailto:") and not os.path.exists(
                        os.path.join(ROOT, os.path.dirname(path), target)):
                    broken.append(f"{path}:{number}: {target}")
    assert broken == []

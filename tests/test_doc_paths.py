"""Every module or file path that the documentation names exists: dotted module paths (`sbd_jax.decoding.lookup`,
`python -m benchmarks.decode`, `sbd_jax.decoding.lookup.replay_lookup`) and file paths ending in `.py`
(`sbd_jax/decoding/verified.py`, `decoding/verified.py`, `../benchmarks/decode.py`, a bare `verified.py`), in
every Markdown file and in the docstrings, comments and string literals (help texts, errors) of every Python
file git tracks. A path goes stale when a module moves; this test names the file and line that still point to
the old place. A module named without its package (`step.make_optimizer`) is not checked: too many variables
read the same way."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("sbd_jax", "benchmarks", "recipes", "experiments", "tests", "configs")
DOTTED = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)(?![\w/-])" % "|".join(PACKAGES))
FILE = re.compile(r"(?<![\w{}.*/-])((?:\.\./|\./)*(?:[\w-]+/)*[\w-]+\.py)(?![\w/])")
# Where a relative file path may start, besides the naming file's own folder: the root and the package.
BASES = ("", "sbd_jax")


def tracked(*patterns: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.splitlines() if os.path.exists(os.path.join(ROOT, p))]


def python_text(path: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and string literals (a test's: comments and docstrings, since
    its other strings are made-up paths)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        source = f.read()
    docstrings: set[int] = set()
    if path.startswith("tests/"):
        tree = ast.parse(source)
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        docstrings = {n.body[0].lineno for n in nodes if ast.get_docstring(n) is not None}
    pieces = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and (
                not path.startswith("tests/") or token.start[0] in docstrings)):
            pieces.append((token.start[0], token.string))
    return pieces


def markdown_text(path: str) -> list[tuple[int, str]]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return list(enumerate(f.read().splitlines(), 1))


def top_level_names(module_file: str) -> set[str]:
    """Names a module defines or imports at its top level (classes, functions, assignments, imports)."""
    with open(module_file, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def dotted_exists(name: str) -> bool:
    """A module or package, optionally followed by a name defined at its top level
    (`sbd_jax.decoding.lookup.replay_lookup`; what follows that name is not checked)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:cut])
        if os.path.isfile(base + ".py"):
            module: str | None = base + ".py"
        elif os.path.isdir(base):
            init = os.path.join(base, "__init__.py")
            module = init if os.path.isfile(init) else None
        else:
            continue
        rest = parts[cut:]
        return not rest or (module is not None and rest[0] in top_level_names(module))
    return False


def file_exists(path: str, naming_file: str, basenames: dict[str, set[str]]) -> bool:
    """A path from the naming file's folder, the root or the package; a bare file name anywhere, except that the
    library's own docstrings and comments name the library's files (or the root's)."""
    if "/" not in path:
        folders = basenames.get(path, set())
        return bool(folders & {"sbd_jax", ""}) if naming_file.startswith("sbd_jax/") else bool(folders)
    folders = [os.path.dirname(naming_file), *BASES]
    return any(os.path.isfile(os.path.normpath(os.path.join(ROOT, folder, path))) for folder in folders)


def stale_paths() -> list[str]:
    found = []
    basenames: dict[str, set[str]] = {}
    for p in tracked("*.py"):
        basenames.setdefault(os.path.basename(p), set()).add(p.split("/")[0] if "/" in p else "")
    for path in tracked("*.py", "*.md"):
        pieces = python_text(path) if path.endswith(".py") else markdown_text(path)
        for line, text in pieces:
            for offset, chunk in enumerate(text.splitlines()):
                for name in DOTTED.findall(chunk):
                    name = name.rstrip(".")
                    if not dotted_exists(name):
                        found.append(f"{path}:{line + offset}: {name}")
                for name in FILE.findall(chunk):
                    if not file_exists(name, path, basenames):
                        found.append(f"{path}:{line + offset}: {name}")
    return found


def test_every_named_module_and_file_exists():
    stale = stale_paths()
    assert not stale, "paths named in docs, docstrings or comments that do not exist:\n" + "\n".join(stale)

"""The repository's import graph has no cycle (imports inside functions included)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("sbd_jax", "experiments", "recipes", "benchmarks", "configs")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every Python file of the repository's packages and scripts."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for file in files:
                if file.endswith(".py"):
                    path = os.path.join(folder, file)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    found[name] = path
    return found


def imports_of(name: str, path: str, known: dict[str, str]) -> set[str]:
    """Repository modules `path` imports: absolute ones, and a script's siblings (`from timing import x`)."""
    folder = name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from package import submodule` depends on the submodule, not on the package's __init__
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            for candidate in (target, f"{folder}.{target}"):
                if candidate in known and candidate != name:
                    out.add(candidate)
    return out


def test_no_import_cycles():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "experiments.small_scale.evaluate" in graph and graph["benchmarks.decode"] >= {"benchmarks.timing"}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])

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
    """Repository modules `path` imports (absolute imports: scripts run as modules from the root)."""
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
        out.update(target for target in targets if target in known and target != name)
    return out


def test_no_import_cycles():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "experiments.small_scale.evaluate" in graph and graph["benchmarks.decode"] >= {"sbd_jax.evaluation.results"}
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


def test_scripts_reach_the_package_without_editing_sys_path():
    """Scripts run as modules from the checkout's root (`python -m benchmarks.decode`), so none needs
    `sys.path.insert`; only tests may."""
    offenders = [os.path.relpath(path, ROOT) for path in modules().values() if "sys.path.insert" in open(path).read()]
    offenders += [name for name in ("train.py", "sample.py") if "sys.path.insert" in open(os.path.join(ROOT, name)).read()]
    assert offenders == []


# The package's rooms, lowest first: a module may import its own room and rooms below it, never above.
LAYERS = {"errors": 0, "choice": 0, "cli": 0, "config_files": 0, "model": 1, "checkpoints": 2, "roofline": 2, "data": 3,
          "decoding": 4, "training": 5, "evaluation": 6, "api": 7, "convert": 7, "lower": 7}


def test_no_room_imports_a_room_above_it():
    known = modules()
    rooms = {name.split(".")[1] for name in known if name.startswith("sbd_jax.")}
    assert rooms == set(LAYERS), f"give every room of sbd_jax a layer: {sorted(rooms ^ set(LAYERS))}"
    upward = []
    for name, path in known.items():
        if not name.startswith("sbd_jax."):
            continue
        room = name.split(".")[1]
        for target in imports_of(name, path, known):
            if target.startswith("sbd_jax.") and LAYERS[target.split(".")[1]] > LAYERS[room]:
                upward.append(f"{name} -> {target}")
    assert upward == []

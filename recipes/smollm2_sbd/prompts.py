"""Offline prompts for self-distillation: nothing is downloaded, everything is derived from local sources.

Three kinds, mixed: coding requests built from the signatures and docstrings of standard-library
functions, templated grade-school arithmetic word problems, and short explanation requests about
standard-library modules. The list is a pure function of (count, seed).
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np

# Pure-Python modules with many documented functions; importing them has no side effects.
MODULES = ("textwrap", "string", "statistics", "heapq", "bisect", "fnmatch", "posixpath", "shlex", "json",
           "base64", "difflib", "calendar", "colorsys", "html", "ipaddress", "keyword", "operator",
           "random", "re", "copy", "functools", "itertools", "glob", "shutil", "tempfile", "urllib.parse",
           "uuid", "zlib", "hashlib", "fractions", "decimal", "datetime", "collections", "csv", "math")

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jin", "Kofi", "Lena")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")


def function_specs() -> list[tuple[str, str, str]]:
    """(module, name + signature, first docstring sentence) of documented public functions."""
    specs = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            if doc and len(signature) < 80:
                sentence = doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
                if 10 < len(sentence) < 200:
                    specs.append((module_name, name + signature, sentence))
    return specs


def coding_prompt(spec: tuple[str, str, str], rng: np.random.Generator) -> str:
    _, signature, sentence = spec
    templates = ("Write a Python function `{sig}` that does the following: {doc}.",
                 "Implement `{sig}` in Python. Its docstring says: \"{doc}.\"",
                 "In Python, write `def {sig}`. Purpose: {doc}. Keep it short.")
    return templates[int(rng.integers(len(templates)))].format(sig=signature, doc=sentence)


def explanation_prompt(spec: tuple[str, str, str], rng: np.random.Generator) -> str:
    module, signature, _ = spec
    templates = ("Explain in two sentences what the Python function `{module}.{name}` is used for.",
                 "What does the `{module}` module in Python's standard library do? Answer briefly.",
                 "Give one short example of calling `{module}.{name}` and say what it returns.")
    return templates[int(rng.integers(len(templates)))].format(module=module, name=signature.split("(")[0])


def arithmetic_prompt(rng: np.random.Generator) -> str:
    name, other = rng.choice(NAMES, size=2, replace=False)
    item = rng.choice(ITEMS)
    a, b, c = (int(x) for x in rng.integers(2, 60, size=3))
    templates = (f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?",
                 f"{name} had {a + b} {item} and gave {b} to {other}. How many {item} are left?",
                 f"A box holds {a} {item}. How many {item} are in {c % 9 + 2} boxes?",
                 f"{name} buys {a} {item} on Monday and {b} on Tuesday, then loses {min(c, a + b)}. "
                 f"How many {item} does {name} have?",
                 f"{a * (c % 5 + 2)} {item} are shared equally among {c % 5 + 2} friends. How many does each get?")
    return templates[int(rng.integers(len(templates)))] + " Explain step by step."


def make_prompts(count: int, seed: int) -> list[str]:
    """`count` distinct prompts, about 45% coding, 20% explanation, 35% arithmetic."""
    rng = np.random.default_rng(seed)
    specs = function_specs()
    prompts: dict[str, None] = {}
    while len(prompts) < count:
        kind = rng.random()
        if kind < 0.45:
            prompt = coding_prompt(specs[int(rng.integers(len(specs)))], rng)
        elif kind < 0.65:
            prompt = explanation_prompt(specs[int(rng.integers(len(specs)))], rng)
        else:
            prompt = arithmetic_prompt(rng)
        prompts[prompt] = None
    return list(prompts)

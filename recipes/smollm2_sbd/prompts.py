"""Offline prompts for self-distillation: nothing is downloaded, everything is derived from local sources.

Three kinds, mixed: coding requests built from the signatures and docstrings of standard-library
functions and methods, templated grade-school arithmetic word problems, and short explanation
requests about standard-library modules. Training and held-out prompts never share a module: every
fifth module (sorted by name) is held out, and an arithmetic prompt is held out by a hash of its text.
The lists are pure functions of (count, seed, split) within one program: the functions are read from the
imported modules, and a library the program imports can add methods to standard-library classes (transformers
adds `logging.Logger.warning_advice`), so the recipe's prompts are those its own process sees. Memory addresses
in default values' reprs are dropped (they made a prompt differ from run to run).
"""

from __future__ import annotations

import importlib
import inspect
import re
import zlib

import numpy as np

# Standard-library modules with many documented functions or methods; importing them has no side effects.
MODULES = ("ast", "base64", "bz2", "calendar", "cmd", "codecs", "collections", "configparser", "contextlib",
           "dataclasses", "difflib", "dis", "email.message", "email.utils", "enum", "fileinput", "fnmatch",
           "functools", "graphlib", "gzip", "heapq", "hmac", "html", "http.cookies", "inspect", "ipaddress",
           "locale", "logging", "lzma", "mimetypes", "optparse", "os", "pathlib", "pickletools", "posixpath",
           "pprint", "queue", "quopri", "random", "re", "selectors", "shlex", "shutil", "socket", "statistics",
           "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
           "traceback", "typing", "urllib.parse", "urllib.request", "uuid", "weakref", "xml.dom.minidom",
           "zipfile")
HELDOUT_MODULES = MODULES[::5]
SPLITS = ("train", "heldout")

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jin", "Kofi", "Lena")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")


def function_specs() -> list[tuple[str, str, str]]:
    """(module, name + signature, first docstring sentence) of documented public functions and methods
    (`Class.method`) of `MODULES`."""
    specs = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                members = [(name, obj)]
            elif inspect.isclass(obj):
                members = [(f"{name}.{m}", f) for m, f in sorted(vars(obj).items())
                           if not m.startswith("_") and inspect.isfunction(f)]
            else:
                continue
            for qualified, function in members:
                spec = _spec(module_name, qualified, function)
                if spec:
                    specs.append(spec)
    return specs


def _spec(module_name: str, name: str, function: object) -> tuple[str, str, str] | None:
    doc = inspect.getdoc(function)
    try:
        signature = str(inspect.signature(function))
    except (TypeError, ValueError):
        return None
    if not doc or len(signature) >= 80:  # measured with any address in it, as the committed data was made
        return None
    # A default's repr can hold a memory address ("<built-in method match of re.Pattern object at 0x7f...>"),
    # which made such a prompt differ from process to process (and a resumed distillation refuse its own file).
    signature = re.sub(r" at 0x[0-9a-f]+", "", signature)
    sentence = doc.split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
    return (module_name, name + signature, sentence) if 10 < len(sentence) < 200 else None


def heldout_source_files() -> list[str]:
    """The source files of the held-out modules: real text nobody here wrote, for held-out NTP loss."""
    return [inspect.getsourcefile(importlib.import_module(m)) for m in HELDOUT_MODULES]


def split_of(prompt: str, module: str | None) -> str:
    """'heldout' for prompts about a held-out module and for one arithmetic prompt in five (by a hash of
    its text, so the same text always falls on the same side); else 'train'."""
    if module is not None:
        return "heldout" if module in HELDOUT_MODULES else "train"
    return "heldout" if zlib.crc32(prompt.encode()) % 5 == 0 else "train"


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


def make_prompts(count: int, seed: int, split: str = "train") -> list[str]:
    """`count` distinct prompts of one split, about 45% coding, 20% explanation, 35% arithmetic."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    rng = np.random.default_rng(seed)
    specs = function_specs()
    prompts: dict[str, None] = {}
    while len(prompts) < count:
        kind = rng.random()
        spec = specs[int(rng.integers(len(specs)))]
        if kind < 0.45:
            prompt, module = coding_prompt(spec, rng), spec[0]
        elif kind < 0.65:
            prompt, module = explanation_prompt(spec, rng), spec[0]
        else:
            prompt, module = arithmetic_prompt(rng), None
        if split_of(prompt, module) == split:
            prompts[prompt] = None
    return list(prompts)

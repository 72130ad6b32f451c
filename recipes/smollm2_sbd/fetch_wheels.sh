#!/usr/bin/env bash
# Downloads gpu_wheels.txt as CPython 3.12 manylinux x86-64 wheels into .whl/ (ignored by git), for the GPU
# image, which has no network: carry .whl with the device tool; gpu.sh installs them first.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^#' recipes/smollm2_sbd/gpu_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl
ls .whl

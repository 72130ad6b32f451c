# Sourced by benchmarks/h200.sh and recipes/smollm2_sbd/gpu.sh, from the repository root, with the modules the
# script needs: where any fails to import (the GPU image) and wheels were carried in .whl/ (fetch_wheels.sh),
# installs them once per machine into /tmp/sbd_site (a later call on the same warm machine reuses it) and puts
# that on PYTHONPATH. A machine with the project installed keeps its own packages.
#   source recipes/smollm2_sbd/carried_wheels.sh grain ml_collections gguf
if ! python3 -c "import $(IFS=,; echo "$*")" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  [[ -d /tmp/sbd_site ]] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sbd_site .whl/*.whl
  export PYTHONPATH="/tmp/sbd_site:${PYTHONPATH:-}"
fi

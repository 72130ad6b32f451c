#!/usr/bin/env bash
# All GPU measurements of the roofline issue in one script, for one H200 (about 8 minutes):
#   1. forward-cost grid, Llama-3.1-8B shape, bf16, random weights: time(k)/time(1) for k = 1..64,
#      batch 1 and 8, KV 1k-16k, beside the H200 roofline; k = 1 is the NTP decode step, whose
#      measured/roofline ratio is the HBM-efficiency number (target <= 1.2);
#   2. e2e NTP vs SBD decode on the SmolLM2-135M shape (random weights: the model file is larger than
#      what travels to the GPU machine), wall-clock speedup beside the roofline's for the observed NFE.
# Results: benchmarks/results/h200_*.json (and $OUT/ when set, for the device tool).
#   bash benchmarks/h200.sh            # on the H200
#   bash benchmarks/h200.sh --smoke    # tiny shapes, any machine (CPU): tests the script itself
# Packages: jax (CUDA), flax, optax, transformers come with the GPU image, and these two benchmarks import
# nothing else (grain, ml-collections and gguf are not needed: checked by running them with those
# modules blocked). Any extra package can come as wheel files in benchmarks/wheels/ (no network there).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sbd_site benchmarks/wheels/*.whl
  export PYTHONPATH="/tmp/sbd_site:${PYTHONPATH:-}"
fi
results=benchmarks/results
mkdir -p "$results"
if [[ "${1:-}" == "--smoke" ]]; then
  prefix="$results/smoke"
  python3 benchmarks/forward_cost.py --model smollm2-135m --ks 1 2 --batches 1 --kv 64 --repeats 1 \
    --out "${prefix}_forward_cost.json"
  python3 benchmarks/e2e.py --model smollm2-135m --random --batches 1 --gammas 0.35 --block-size 4 \
    --max-new-tokens 8 --repeats 1 --out "${prefix}_e2e.json"
else
  prefix="$results/h200"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "${prefix}_gpu.txt"
  python3 benchmarks/forward_cost.py --model llama3-8b --dtype bfloat16 --ks 1 2 4 8 16 32 64 --batches 1 8 \
    --kv 1024 4096 16384 --max-cache-gib 40 --repeats 10 --out "${prefix}_forward_cost_llama3_8b.json"
  python3 benchmarks/e2e.py --model smollm2-135m --random --dtype bfloat16 --batches 1 8 \
    --gammas 0.1 0.35 1.0 --block-size 16 --max-new-tokens 256 --repeats 3 --out "${prefix}_e2e_smollm2.json"
fi
if [[ -n "${OUT:-}" ]]; then cp "${prefix}"_* "$OUT"/; fi
echo "done: ${prefix}_*"

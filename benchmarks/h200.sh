#!/usr/bin/env bash
# All GPU measurements of the roofline and verify issues in one script, for one H200.
# Run it under a 540 s limit (the device tool's per-command cap is 600 s; leave room to copy back):
#   run(command="bash benchmarks/h200.sh", timeout_s=560)       # on the H200; results come back from $OUT
#   bash benchmarks/h200.sh --smoke                              # tiny shapes, any machine (CPU): tests the script
#   bash benchmarks/h200.sh --dry-run                            # print the plan (compiles, forwards, minutes)
# Stages, each under its own timeout so a failure or an overrun costs only itself:
#   0. preflight (~10 s): versions, devices, a tiny jitted layer, nvidia-smi clocks -> h200_preflight.json
#   1. forward cost (<= 330 s), Llama-3.1-8B shape, bf16, random weights: time(k)/time(1) for k = 1..64 beside
#      the H200 roofline, at datasheet and at measured HBM bandwidth; k = 1 is the NTP decode step.
#      Grid order: batch 1 (KV 1k, 4k, 16k), then batch 8 (1k, 4k, 16k). If short of time, cut from the end:
#      batch 8 KV 16k first, then the rest of batch 8.
#   2. e2e (<= 150 s), SmolLM2-135M shape, random weights: NTP vs SBD at γ 0 / 25 / 1e9 (with random weights
#      every entropy is ~10.7 nats, so these span 1 -> 16 tokens per pass) and the same points verified.
#      If short, cut batch 8 first.
# Every stage rewrites its JSON after each point, and the log is teed, into ${OUT:-benchmarks/results}:
# a run cut short returns what it measured. Files: h200_preflight.json, h200_forward_cost_llama3_8b.json,
# h200_e2e_smollm2.json, h200_log.txt. Packages: jax (CUDA), flax, optax, transformers come with the GPU
# image and these scripts import nothing else; extra wheels in benchmarks/wheels/ are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sbd_site benchmarks/wheels/*.whl
  export PYTHONPATH="/tmp/sbd_site:${PYTHONPATH:-}"
fi
mode="${1:-}"
if [[ "$mode" == "--dry-run" ]]; then
  python3 benchmarks/forward_cost.py --dry-run --model llama3-8b --ks 1 2 4 8 16 32 64 --batches 1 8 \
    --kv 1024 4096 16384 --repeats 10 --compile-seconds 6
  python3 benchmarks/e2e.py --dry-run --batches 1 8 --gammas 0 25 1e9 --verify --repeats 3 --compile-seconds 4
  echo "plan assumptions: ~6 s per compile of the scanned 8B forward, ~4 s per SmolLM2-shape decoder compile;" \
       "start-up of the machine (1-2 min) counts against the 15-minute budget but not against this command"
  exit 0
fi
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
prefix="$out/h200"
[[ "$mode" == "--smoke" ]] && prefix="$out/smoke"
exec > >(tee -a "${prefix}_log.txt") 2>&1

stage() {  # stage NAME SECONDS COMMAND...: runs under its own timeout; never stops the script
  local name=$1 limit=$2
  shift 2
  local began=$SECONDS
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  echo "stage $name: exit $rc after $((SECONDS - began)) s$([[ $rc == 124 ]] && echo ' (timed out: partial results kept)')"
}

if [[ "$mode" == "--smoke" ]]; then
  stage preflight 60 python3 benchmarks/preflight.py --out "${prefix}_preflight.json"
  stage forward_cost 300 python3 benchmarks/forward_cost.py --model smollm2-135m --ks 1 2 --batches 1 --kv 64 \
    --repeats 1 --out "${prefix}_forward_cost.json"
  stage e2e 300 python3 benchmarks/e2e.py --model smollm2-135m --random --batches 1 --gammas 0 1e9 --verify \
    --block-size 4 --max-new-tokens 8 --repeats 1 --out "${prefix}_e2e.json"
else
  stage preflight 40 python3 benchmarks/preflight.py --out "${prefix}_preflight.json"
  stage forward_cost 330 python3 benchmarks/forward_cost.py --model llama3-8b --dtype bfloat16 \
    --ks 1 2 4 8 16 32 64 --batches 1 8 --kv 1024 4096 16384 --max-cache-gib 40 --repeats 10 \
    --out "${prefix}_forward_cost_llama3_8b.json"
  stage e2e 150 python3 benchmarks/e2e.py --model smollm2-135m --random --dtype bfloat16 --batches 1 8 \
    --gammas 0 25 1e9 --verify --block-size 16 --max-new-tokens 128 --repeats 3 --out "${prefix}_e2e_smollm2.json"
fi
echo "done: ${prefix}_*"

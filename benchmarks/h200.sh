#!/usr/bin/env bash
# All GPU measurements of the project, for one H100 / H200, in calls on one warm machine (15 minutes of
# device time, start-up included; the machine is released 30 s after a call, so make the next at once).
# The lookup stage needs the base SmolLM2, a 98 MB GGUF; a call carries 64 MiB with the working tree (32 MB
# since the shipped adapter; tests/test_gpu_scripts.py checks the sum) included, so the file travels in five
# 20 MB parts, one a call. Here, once:
#   bash recipes/smollm2_sbd/fetch_wheels.sh       # grain, ml-collections, gguf, ... as wheels in .whl/
#   mkdir -p .model && split -b 20M "$(python -c 'from sbd_jax.checkpoints.load import resolve; print(resolve("smollm2-135m"))')" .model/smollm2.gguf.
# then, each call at once after the last (results come back from $OUT, each JSON with that commit: the copy
# has no .git; ignored paths a call carried stay on the warm machine for the next):
#   run(command="SBD_COMMIT=<git rev-parse --short HEAD here> bash benchmarks/h200.sh",
#       carry=[".whl", ".model/smollm2.gguf.aa"], timeout_s=480)
#   run(command="true", carry=[".model/smollm2.gguf.ab"], timeout_s=30)     # and so .ac, .ad
#   run(command="cat .model/smollm2.gguf.a? > /tmp/smollm2.gguf && SBD_COMMIT=<same> bash benchmarks/h200.sh
#       --lookup /tmp/smollm2.gguf", carry=[".model/smollm2.gguf.ae"], timeout_s=230)
# Budget: start-up (1-2 min) + 480 s + three short calls (~15 s each, the transfer) + 230 s: about 14 of the 15
# minutes at the caps; a stage cut short keeps what it measured.
#   bash benchmarks/h200.sh --smoke                              # tiny shapes, any machine (CPU): tests the script
#   bash benchmarks/h200.sh --dry-run                            # print the plan (compiles, forwards, minutes)
# Stages, each under its own timeout so a failure or an overrun costs only itself, most valuable first:
#   0. preflight (~10 s): versions, devices, a tiny jitted layer, nvidia-smi clocks -> h200_preflight.json
#   1. sbd (<= 220 s): the shipped small-scale SBD model (trained, 3 MB) in bf16: accuracy and tokens per pass
#      of NTP, plain SBD (validation-chosen γ) and verified SBD on 500 test problems, decoding tokens/s at
#      batch 1, 8 and 32, then 200 SBD training steps (throughput) -> h200_sbd.json (benchmarks/sbd_gpu.py)
#   2. forward cost (<= 180 s), Llama-3.1-8B shape, bf16, random weights: time(k)/time(1) for k = 1..64 beside
#      the H200 roofline, at datasheet and at measured HBM bandwidth; k = 1 is the NTP decode step.
#      Grid order: batch 1 (KV 1k, 4k, 16k), then batch 8 (1k, 4k, 16k). If short of time, cut from the end:
#      batch 8 KV 16k first, then the rest of batch 8.
#   3. lookup (last call, <= 90 s): verified decoding with prompt-lookup drafts on the base SmolLM2 (no
#      fine-tune; fp32 at full matmul precision, so outputs are NTP's) against NTP on the recipe's test
#      prompts: tokens/s at batch 1 (8 prompts) then 8 (16), blocks 4 / 8 / 16 -> h200_lookup_smollm2.json
#      (benchmarks/lookup_decode.py)
#   4. tree (last call, <= 100 s): the same with the shipped adapter (smollm2-135m-sbd, in the repository): its
#      SBD block as a chain and tree-sbd at block 4, the rows the recipe counts forwards of (does the adapter
#      pay on a GPU?); then tree drafts (context matches and the model's own successors) at 16, 32 and 64
#      nodes and with the width rule on costs measured there, also with the draft memory (successors, earlier
#      answers) kept from prompt to prompt (--draft-memory); rows cut from the end if short of time
#      -> h200_tree_smollm2.json (benchmarks/tree_decode.py --parts speed)
# Every stage rewrites its JSON after each point, and the log is teed, into ${OUT:-benchmarks/results}:
# a run cut short returns what it measured. Files: h200_preflight.json, h200_sbd.json,
# h200_forward_cost_llama3_8b.json, h200_lookup_smollm2.json, h200_log.txt. The GPU image has jax (CUDA),
# flax, optax, orbax and transformers but not grain or ml-collections (the training stage needs them) or gguf
# (the lookup stage): carried as wheels in .whl/, installed only where the imports fail.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
source recipes/smollm2_sbd/carried_wheels.sh grain ml_collections gguf
mode="${1:-}"
if [[ "$mode" == "--dry-run" ]]; then
  python3 -m benchmarks.forward_cost --dry-run --model llama3-8b --ks 1 2 4 8 16 32 64 --batches 1 8 \
    --kv 1024 4096 16384 --repeats 10 --compile-seconds 6
  python3 -m benchmarks.sbd_gpu --dry-run
  echo "plan assumptions: ~6 s per compile of the scanned 8B forward, ~3 s per small-scale decoder compile;" \
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

lookup() {  # lookup LIMIT MODEL ARGS...: the lookup stage on MODEL (a known name or a .gguf file)
  local limit=$1 model=$2
  shift 2
  JAX_DEFAULT_MATMUL_PRECISION=highest stage lookup "$limit" python3 -m benchmarks.lookup_decode --model "$model" \
    --parts speed --min-matches 1 --out "${prefix}_lookup_smollm2.json" "$@"
}

tree() {  # tree LIMIT MODEL ARGS...: the tree stage on MODEL
  local limit=$1 model=$2
  shift 2
  JAX_DEFAULT_MATMUL_PRECISION=highest stage tree "$limit" python3 -m benchmarks.tree_decode --model "$model" \
    --parts speed --out "${prefix}_tree_smollm2.json" "$@"
}

if [[ "$mode" == "--lookup" ]]; then
  [[ -f "${2:-}" ]] || { echo "--lookup needs the SmolLM2 GGUF file, joined on this machine (see the header)"; exit 2; }
  lookup 90 "$2" --block-sizes 8 4 16
  tree 100 "$2" --nodes 16 32 64 --batch1-prompts 8 --draft-memory --adapter smollm2-135m-sbd
elif [[ "$mode" == "--smoke" ]]; then
  stage preflight 60 python3 -m benchmarks.preflight --out "${prefix}_preflight.json"
  stage forward_cost 300 python3 -m benchmarks.forward_cost --model smollm2-135m --ks 1 2 --batches 1 --kv 64 \
    --repeats 1 --out "${prefix}_forward_cost.json"
  stage sbd 600 python3 -m benchmarks.sbd_gpu --smoke --out "${prefix}_sbd.json"
  lookup 600 smollm2-135m --block-sizes 4 --batch1-prompts 1 --max-new-tokens 8
  tree 600 smollm2-135m --nodes 4 --batch1-prompts 1 --max-new-tokens 8 --draft-memory --adapter smollm2-135m-sbd
else
  stage preflight 40 python3 -m benchmarks.preflight --out "${prefix}_preflight.json"
  stage sbd 220 python3 -m benchmarks.sbd_gpu --out "${prefix}_sbd.json"
  stage forward_cost 180 python3 -m benchmarks.forward_cost --model llama3-8b --dtype bfloat16 \
    --ks 1 2 4 8 16 32 64 --batches 1 8 --kv 1024 4096 16384 --max-cache-gib 40 --repeats 10 \
    --out "${prefix}_forward_cost_llama3_8b.json"
fi
echo "done: ${prefix}_*"

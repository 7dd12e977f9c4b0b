#!/usr/bin/env bash
# The GPU check, one command, within LIMIT seconds (default 480: 8 minutes on one H100), in
# this order: the GPU tests (every family's methods and FLUX's GPU checks), the per-family
# engine sweep (bf16, eager and compiled pools vs each family's diffusers pipeline; its models
# are built on the CPU while the tests run), then, with FULL=1, the FLUX.1-dev figures (a
# ~24 GB build) in what time is left. Everything lands in $OUT (default ./gpu-suite-out):
# one log per part, timings.log, the sweep's bench.md / bench.json. Exit status 1 when a part
# failed or had no time left to run.
#   bash benchmarks/gpu_suite.sh
#   FAMILIES=flux,wan LIMIT=300 bash benchmarks/gpu_suite.sh    # a subset, a shorter slot
#   TESTS_MAX=400 LIMIT=700 bash benchmarks/gpu_suite.sh        # more time for the tests
#   FULL=1 LIMIT=1500 bash benchmarks/gpu_suite.sh              # also the FLUX.1-dev figures
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-suite-out}"
LIMIT="${LIMIT:-480}"
TESTS_MAX="${TESTS_MAX:-270}"  # the tests' share, so the sweep keeps ~3 minutes
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$SECONDS
status=0
left() { echo $((LIMIT - (SECONDS - start))); }

part() {  # part NAME SECONDS COMMAND...: run it under a time limit, log its output and time
  local name=$1 limit=$2 t=$SECONDS rc
  shift 2
  if [ "$limit" -lt 20 ]; then
    echo "$name: not run, ${limit} s left" | tee -a "$OUT/timings.log"
    status=1
    return
  fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name: exit $rc, $((SECONDS - t)) s (limit $limit s)" | tee -a "$OUT/timings.log"
  [ "$rc" -eq 0 ] || status=1
}

# SWEEP_ARGS: more sweep options (e.g. "--depth 1"; "--quick --device cpu" checks this script)
SWEEP=("$PY" -m comfyui_xdit bench --engine --families "${FAMILIES:-all}" --device cuda
  ${SWEEP_ARGS:-})
FLUX=("$PY" -m comfyui_xdit bench --engine --preset flux-dev --device cuda)
: >"$OUT/timings.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
OMP_NUM_THREADS=8 timeout "$LIMIT" "${SWEEP[@]}" --build-only --out "$OUT/engine-families-build" \
  >"$OUT/engine-families-build.log" 2>&1 &
builder=$!

tests_limit=$(left)
[ "$tests_limit" -gt "$TESTS_MAX" ] && tests_limit=$TESTS_MAX
part gpu_tests "$tests_limit" "$PY" -m pytest -v -s -p no:cacheprovider --durations=15 \
  tests/test_gpu_families.py tests/test_gpu_shared.py
wait "$builder" || { echo "engine-families-build: failed (see its log)" | tee -a "$OUT/timings.log"; status=1; }
part engine_families "$(left)" "${SWEEP[@]}" --compile --budget $(($(left) - 25)) \
  --out "$OUT/engine-families"

if [ -n "${FULL:-}" ]; then
  part flux_dev_build "$(left)" "${FLUX[@]}" --build-only
  part engine_bf16 "$(left)" "${FLUX[@]}" --compile --out "$OUT/engine-bf16"
  part engine_fp8_compute "$(left)" "${FLUX[@]}" --weights fp8 --out "$OUT/engine-fp8-compute"
  XDIT_FP8_COMPUTE=off part engine_fp8_upcast "$(left)" "${FLUX[@]}" --weights fp8 \
    --out "$OUT/engine-fp8-upcast"
else
  echo "flux-dev figures: skipped (FULL=1 runs them: a ~24 GB build)" | tee -a "$OUT/timings.log"
fi
echo "total: $((SECONDS - start)) s, exit $status" | tee -a "$OUT/timings.log"
exit $status

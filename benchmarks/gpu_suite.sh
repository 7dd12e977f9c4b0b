#!/usr/bin/env bash
# The GPU check, one command (docs/testing.md): the GPU test suite, then the engine figures
# on FLUX.1-dev's dimensions (random weights, built once, ~24 GB): eager vs compiled (CUDA
# graphs), and fp8 weights with fp8 compute on and off. Logs and bench reports land in $OUT
# (default ./gpu-suite-out).
#   bash benchmarks/gpu_suite.sh            # everything (~15 min on one H100)
#   SKIP_TESTS=1 bash benchmarks/gpu_suite.sh   # the figures only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-suite-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
PY="${PYTHON:-python3}"
bench() { "$PY" -m comfyui_xdit bench --engine --preset flux-dev --device cuda "$@"; }
bench --build-only 2>&1 | tail -1
if [ -z "${SKIP_TESTS:-}" ]; then
  "$PY" -m pytest -q -s -p no:cacheprovider tests/test_gpu_shared.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
bench --compile --out "$OUT/engine-bf16" 2>&1 | tee "$OUT/engine-bf16.log" || status=1
bench --weights fp8 --out "$OUT/engine-fp8-compute" 2>&1 | tee "$OUT/engine-fp8-compute.log" || status=1
XDIT_FP8_COMPUTE=off bench --weights fp8 --out "$OUT/engine-fp8-upcast" 2>&1 \
  | tee "$OUT/engine-fp8-upcast.log" || status=1
exit $status

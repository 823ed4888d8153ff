#!/usr/bin/env bash
# One device call for a performance iteration: the GPU tests and the sanitizers (tools/gpu_check.sh,
# pytest -k filter optional), then the grid (tools/grid_run.sh) in the time left of CALL_LIMIT
# seconds (default 570; the device call's limit less ~20 s). Results: $OUT/grid.tgz and the logs of
# gpu_check.sh, plus the printed tables.
#   SANTA_CUPY_COMMIT=<hash> bash tools/perf_run.sh ["pytest -k expr"]
# Settings (environment): gpu_check.sh's SMOKE / TEST_TIMEOUT / SKIP_SANITIZER / PYTEST_STOP and
# grid_run.sh's METHODS. gpu_check.sh first warms every CI module (~5 minutes on a fresh machine)
# and the whole suite takes ~6 more: on a short budget pass a -k filter, or run grid_run.sh alone.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
SKIP_BENCH=1 bash tools/gpu_check.sh "${1:-}" 2>&1 | tail -12
LIMIT=$(( ${CALL_LIMIT:-570} - SECONDS )) OUT=$OUT bash tools/grid_run.sh

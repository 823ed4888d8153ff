#!/usr/bin/env bash
# One device call for a performance iteration: GPU tests (-k filter optional), memcheck, the kernel
# bench grid for llama8b, bench stages and e2e. Results: $OUT/perf.tgz plus the printed tables.
#   SANTA_CUPY_COMMIT=<hash> bash tools/perf_run.sh ["pytest -k expr"]
# Settings (environment): METHODS, SHAPES, BATCHES, CONTEXTS, BENCH_TIMEOUT, SKIP_E2E, and gpu_check.sh's
# SMOKE / TEST_TIMEOUT / SKIP_SANITIZER / PYTEST_STOP. After a kernel change on a short budget, e.g.
#   SMOKE=warp_tile TEST_TIMEOUT=60 BATCHES=1,16 bash tools/perf_run.sh
# The default methods end with the peers (cuDNN, FA2, and FlashInfer when its wheels are in .whl/):
# the table's "x best peer" divides against the fastest of them.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/perf
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
source tools/gpu_check.sh            # install_wheels, start_flashinfer_warm, wait_flashinfer_warm, peers
install_wheels
start_flashinfer_warm                # FlashInfer's JIT build overlaps the tests
SKIP_BENCH=1 bash tools/gpu_check.sh "${1:-}" 2>&1 | tail -12
wait_flashinfer_warm
# santa without a suffix is the default plan (short sequences run exact); -always times the estimator
M=${METHODS:-dense,santa-global-systematic-256,santa-global-systematic-256-always,santa-fixed-systematic-2048-always,$(peers)}
echo "bench kernels --methods $M"
timeout ${BENCH_TIMEOUT:-300} python3 bench.py kernels --shape ${SHAPES:-llama8b} --batch ${BATCHES:-1,4,16} --context ${CONTEXTS:-32k,128k} \
  --methods "$M" --json /tmp/perf/bench.json --markdown /tmp/perf/bench.md 2>/tmp/perf/bench.err | tail -40
tail -2 /tmp/perf/bench.err
SM=${STAGE_METHODS:-dense,santa-global-systematic-256-always,santa-fixed-systematic-2048-always}
timeout 60 python3 bench.py stages --batch 1 --context 32k --methods "$SM" 2>>/tmp/perf/bench.err | tee /tmp/perf/stages_b1.md
timeout 60 python3 bench.py stages --batch 16 --context 32k --methods "$SM" 2>>/tmp/perf/bench.err | tee /tmp/perf/stages_b16.md
if [ -z "${SKIP_E2E:-}" ]; then
  for B in 1 16; do
    timeout 150 python3 bench.py e2e --batch $B --context 32k --mem-gb 120 --markdown /tmp/perf/e2e_b$B.md 2>>/tmp/perf/bench.err | tail -8
  done
  # the step as it was before gemv.cu and programmatic launch, for the side-by-side
  timeout 150 python3 bench.py e2e --batch 1 --context 32k --mem-gb 120 --products cublas --no-pdl --markdown /tmp/perf/e2e_b1_plain.md 2>>/tmp/perf/bench.err | tail -4
  timeout 150 python3 bench.py products --markdown /tmp/perf/products.md 2>>/tmp/perf/bench.err | grep "^|"
fi
tar -czf "$OUT/perf.tgz" -C /tmp perf

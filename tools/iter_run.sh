#!/usr/bin/env bash
# One device call for a kernel iteration: warm the kernel cache, the GPU tests (all of them, no -x,
# or those of $TESTS), memcheck on the small case, the kernel bench grid and bench stages.
#   SANTA_CUPY_COMMIT=<hash> bash tools/iter_run.sh
# Settings: TESTS (pytest paths/-k), METHODS, BATCHES, CONTEXTS, SKIP_TESTS, SKIP_SANITIZER, STAGES.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
FI_WARM_JSON=/tmp/fi_warm.json
. tools/gpu_check.sh                      # install_wheels, start/wait_flashinfer_warm, peers
install_wheels
start_flashinfer_warm                     # FlashInfer's JIT build overlaps the tests
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
echo "commit ${SANTA_CUPY_COMMIT:-?}" | tee -a "$OUT/gpu.txt"
python3 tools/warm_kernel_cache.py 2>&1 | tail -1
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_BUDGET:-240} python3 -m pytest -m gpu -q -rfs --timeout=120 ${TESTS:-tests} > "$OUT/gpu_tests.log" 2>&1
  echo "tests: $(tail -1 "$OUT/gpu_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
fi
if [ -z "${SKIP_SANITIZER:-}" ]; then
  timeout ${SANITIZER_TIMEOUT:-120} compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitizer_case.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?: $(grep -c 'Invalid' "$OUT/memcheck.log") invalid"
  timeout ${SANITIZER_TIMEOUT:-120} compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/racecheck_case.py > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?: $(tail -2 "$OUT/racecheck.log" | tr '\n' ' ')"
fi
wait_flashinfer_warm
M=${METHODS:-dense,santa-global-systematic-256,santa-fixed-systematic-2048,$(peers)}
timeout ${BENCH_TIMEOUT:-240} python3 bench.py kernels --shape ${SHAPES:-llama8b} --batch ${BATCHES:-1,4,16} \
  --context ${CONTEXTS:-8k,32k,128k} --methods "$M" --json "$OUT/bench.json" --markdown "$OUT/bench.md" 2>"$OUT/bench.err" | tail -45
tail -3 "$OUT/bench.err"
for B in ${STAGES:-1 16}; do
  timeout 60 python3 bench.py stages --batch $B --context 32k \
    --methods ${STAGE_METHODS:-dense,santa-global-systematic-256,santa-fixed-systematic-2048} 2>>"$OUT/bench.err" | tee "$OUT/stages_b$B.md"
done
for B in ${E2E:-}; do
  timeout ${E2E_TIMEOUT:-120} python3 bench.py e2e --batch $B --context 32k --mem-gb 120 --markdown "$OUT/e2e_b$B.md" \
    2>>"$OUT/bench.err" | grep "^|"
done
# one archive back (the device returns at most 8 files)
(cd "$OUT" && tar czf /tmp/results.tgz ./* && rm -f ./* && mv /tmp/results.tgz .)

#!/usr/bin/env bash
# A short-budget device call after a kernel change: a smoke test of the changed kernel first (a hang
# costs 90 s, not the session), then every GPU test, memcheck, a reduced bench, stages and e2e.
# Every step writes under $OUT as it goes, so a call cut short still returns what finished.
#   SANTA_CUPY_COMMIT=<hash> SMOKE="pytest -k expr" bash tools/final_check.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
python3 tools/warm_kernel_cache.py 2>&1 | tail -1
timeout 90 python3 -m pytest -m gpu -q -x tests/test_gpu_kernels.py -k "${SMOKE:-warp_tile}" 2>&1 | tail -3
timeout 200 python3 -m pytest -m gpu -q -rf --timeout=60 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitizer_case.py > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?: $(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses"
timeout 90 python3 bench.py kernels --batch 1,16 --context 32k,128k \
  --methods dense,santa-global-systematic-256,santa-global-systematic-256-block,santa-fixed-systematic-2048,torch-cudnn \
  --markdown "$OUT/bench.md" --json "$OUT/bench.json" 2>/dev/null | grep "^| llama8b"
timeout 40 python3 bench.py stages --batch 16 --context 32k 2>/dev/null | tee "$OUT/stages.md" | grep -A6 "santa-global-systematic-256,\|santa-global-systematic-256-block,"
timeout 80 python3 bench.py e2e --batch 16 --context 32k --mem-gb 120 --markdown "$OUT/e2e.md" 2>/dev/null | grep "^| \(dense\|santa\)"

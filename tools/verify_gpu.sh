#!/usr/bin/env bash
# One device call that verifies a checkout whose GPU paths changed without a GPU run: the kernel
# module cache warmed, then the GPU suite in two halves (attention; decoder, eval and the rest),
# each under its own time limit so that one slow half cannot eat the other, then memcheck on the
# sanitizer case (tests/test_gpu_shared_memory.py, compute-sanitizer per case, is left out). Logs under $OUT (or ./out): gpu_attention.log, gpu_decoder.log, memcheck.log.
#   SANTA_CUPY_COMMIT=<hash> PART=attention bash tools/verify_gpu.sh    # then PART=decoder
# PART: attention | decoder | all (default; both halves and memcheck may exceed one 600 s call:
# ~530 attention tests, ~310 decoder ones, ~0.5 s each, plus ~50 s of module compiles);
# HALF_TIMEOUT (s, default 230) bounds each half; PYTEST_K adds a -k expression to both.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
echo "commit ${SANTA_CUPY_COMMIT:-unknown}"
python3 tools/warm_kernel_cache.py 2>&1 | tail -1
half() {   # name, test files...
  local name=$1; shift
  timeout "${HALF_TIMEOUT:-230}" python3 -m pytest -m gpu -q -rf --timeout=120 ${PYTEST_K:+-k "$PYTEST_K"} "$@" \
    > "$OUT/gpu_$name.log" 2>&1
  echo "$name (exit $?): $(grep -E '(passed|failed|error)' "$OUT/gpu_$name.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_$name.log" | head -20
}
P=${PART:-all}
[ "$P" = decoder ] || half attention tests/test_gpu_kernels.py tests/test_gpu_contracts.py tests/test_gpu_paged.py tests/test_gpu_jax.py \
  tests/test_fuzz_api.py tests/test_gpu_interop.py tests/test_gpu_one_pass.py tests/test_gpu_key_sampling.py \
  tests/test_gpu_blocked_keys.py
[ "$P" = attention ] || half decoder tests/test_gpu_decoder.py tests/test_gpu_gemv.py tests/test_gpu_sampling.py tests/test_model.py \
  tests/test_paged_cache.py tests/test_gpu_ruler.py tests/test_gpu_examples.py tests/test_evaluate.py tests/test_bench.py \
  tests/test_default_model.py tests/test_attention_hook.py
[ "$P" = attention ] && exit 0
timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitizer_case.py > "$OUT/memcheck.log" 2>&1
echo "memcheck exit $?: $(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses"

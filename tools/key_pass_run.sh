#!/usr/bin/env bash
# One device call for block key sampling's speed of record (docs/BENCHMARKS.md, "Block key
# sampling"): tools/key_bench.py at FB 32 and 16 (B=16 32k, rule "uniform": the K pass's share of
# the proportional saving, issue 17's >= 0.85), tools/key_class_probe.py at FB 32 (the score kernel
# on fixed read patterns), and bench kernels' key-sampling rows beside SANTA without key sampling
# and the dense peers (cuDNN, FA2, and FlashInfer where its wheels travel in .whl/: carry it), then
# tests/test_gpu_key_sampling.py. ~4 minutes on a fresh machine (the llama8b shape's modules
# and FlashInfer's decode kernels compile first, side by side).
#   bash tools/key_pass_run.sh            -> $OUT/key_pass.tgz (and the key_bench tables printed)
# REQUIRE_GPU=H200: stop at once (exit 3) unless the card's name holds it (a kind that may start
# either card then costs only the start).
# AB_TREES="DIR ...": other source trees, carried (e.g. `git archive REV bench.py cli.py cuda llama_min
# santa_cupy tools tests setup.cfg pyproject.toml | tar -x -C .ab_REV`, an ignored folder): the K
# pass at FB 32 in this tree and in each of them, interleaved twice -> ab/this1.txt, ab/DIR1.txt, ...
set -u
if [ -n "${REQUIRE_GPU:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$REQUIRE_GPU"; then
  echo "needs $REQUIRE_GPU, got: $(nvidia-smi --query-gpu=name --format=csv,noheader)"; exit 3
fi
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
. tools/gpu_check.sh            # install_wheels, start/wait_flashinfer_warm, peers
install_wheels
FI_WARM_TIMEOUT=${FI_WARM_TIMEOUT:-240} start_flashinfer_warm      # builds while our modules compile
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
echo "commit ${SANTA_CUPY_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" >> "$OUT/gpu.txt"
python3 tools/warm_kernel_cache.py --jobs 16 --config bfloat16,128,4 > "$OUT/warm.log" 2>&1
wait_flashinfer_warm > "$OUT/flashinfer.txt"       # nothing else runs while the timings run
for fb in 32 16; do
  timeout 150 python3 tools/key_bench.py --key-block $fb --kernels mma > "$OUT/key_bench_fb$fb.txt" 2>&1
done
timeout 100 python3 tools/key_class_probe.py 32 > "$OUT/key_class_fb32.txt" 2>&1
M=santa-global-systematic-256-always,santa-global-systematic-256-keys95,santa-global-systematic-256-keys50fb32
M=$M,santa-global-systematic-256-keys75fb32,santa-global-systematic-256-keys25fb32,$(peers)
timeout 150 python3 bench.py kernels --shape llama8b --batch 16 --context 32k --methods $M --no-ceiling \
  --json "$OUT/kernels_keys.json" --markdown "$OUT/kernels_keys.md" > /dev/null 2> "$OUT/kernels_keys.err"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_key_sampling.py > "$OUT/key_tests.txt" 2>&1
AB=()
if [ -n "${AB_TREES:-}" ]; then
  mkdir -p "$OUT/ab"; AB=(ab)
  for t in $AB_TREES; do
    (cd "$t" && python3 tools/warm_kernel_cache.py --jobs 16 --config bfloat16,128,4) > "$OUT/ab/warm_$(basename "$t").log" 2>&1
  done
  for i in 1 2; do
    timeout 60 python3 tools/key_bench.py --key-block 32 --kernels mma > "$OUT/ab/this$i.txt" 2>&1
    for t in $AB_TREES; do
      (cd "$t" && timeout 60 python3 tools/key_bench.py --key-block 32 --kernels mma) > "$OUT/ab/$(basename "$t")$i.txt" 2>&1
    done
  done
fi
tar -czf "$OUT/key_pass.tgz" -C "$OUT" gpu.txt key_bench_fb32.txt key_bench_fb16.txt key_class_fb32.txt \
  kernels_keys.json kernels_keys.md kernels_keys.err flashinfer.txt key_tests.txt "${AB[@]}"
cat "$OUT/gpu.txt" "$OUT/flashinfer.txt"; tail -1 "$OUT/key_tests.txt"
rm -rf "$OUT"/key_bench_fb*.txt "$OUT"/key_class_fb32.txt "$OUT"/kernels_keys.* "$OUT/warm.log" "$OUT"/key_tests.txt \
  "$OUT/flashinfer.txt" "$OUT/ab"
tar -xzOf "$OUT/key_pass.tgz" key_bench_fb32.txt key_bench_fb16.txt | grep "blocked\|standard: santa_score_mma"
tar -xzOf "$OUT/key_pass.tgz" kernels_keys.md | grep "^| llama"
[ ${#AB[@]} -eq 0 ] || for f in $(tar -tzf "$OUT/key_pass.tgz" | grep '^ab/.*[12]\.txt$'); do
  echo "$f"; tar -xzOf "$OUT/key_pass.tgz" "$f" | grep "blocked mma"
done

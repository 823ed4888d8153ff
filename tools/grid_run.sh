#!/usr/bin/env bash
# One device call for the grid of record (docs/BENCHMARKS.md's reference tables): a GPU sanity
# check, then bench kernels (llama8b, B 1 / 4 / 16 x 8k / 32k / 128k: our dense, SANTA's default,
# SANTA at every length, fixed S=2048 at every length, cuDNN, FA2 and FlashInfer when its wheels
# are in .whl/), bench e2e, bench stages and the key-sampling rows, in that order, each step only
# while the call's time lasts. Results go to $OUT/grid.tgz, rewritten after every step, so a call
# cut short still returns what it measured; tools/grid_tables.py makes BENCHMARKS.md's tables of them.
#   SANTA_CUPY_COMMIT=<hash> LIMIT=<seconds> bash tools/grid_run.sh
# LIMIT: the seconds this script may take (default 570; pass the device call's limit less ~20 s).
# Below 320 it keeps to the sanity tests and our kernels against cuDNN and FA2 (no FlashInfer: its
# JIT build takes a minute or more). The e2e batch is 16 on GPUs of more than 80 GB, else 8 (the
# 8B-shaped model at B=16, 32k needs 85 GB).
set -u
LIMIT=${LIMIT:-570}
export OUT=${OUT:-out} PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
R=/tmp/grid; rm -rf $R; mkdir -p $R "$OUT"
save() { tar -czf "$OUT/grid.tgz" -C /tmp grid; }
left() { echo $((LIMIT - SECONDS)); }
source tools/gpu_check.sh            # install_wheels, start_flashinfer_warm, wait_flashinfer_warm, peers
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
# the device machine's copy of .git can be stale: trust SANTA_CUPY_COMMIT when it is given
commit=${SANTA_CUPY_COMMIT:-}
[ -z "$commit" ] && commit="$(git rev-parse --short HEAD 2>/dev/null) (the device copy of .git; can be stale)"
echo "commit $commit" | tee -a $R/gpu.txt
MEM_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1 / 1024)}')
SMALL=0; [ "$LIMIT" -lt 320 ] && SMALL=1
install_wheels
# the bench shape's modules (bf16; fp16 for e2e) and the sanity tests' (G 8 and 16)
python3 tools/warm_kernel_cache.py --jobs 16 --config bfloat16,128,4 --config float16,128,4 \
  --config bfloat16,128,16 --config bfloat16,128,8 2>&1 | tail -1
if [ $SMALL = 0 ]; then start_flashinfer_warm; else FLASHINFER_OK=0; fi
# every route of a plan against the dense plan and its contracts (~20 s once warm)
timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m pytest -m gpu -q -rfs --timeout=60 -p no:cacheprovider \
  tests/test_gpu_contracts.py 2>&1 | tee $R/gpu_tests.log | tail -2
echo "tests done at ${SECONDS} s"; save
wait_flashinfer_warm
M=${METHODS:-dense,santa-global-systematic-256,santa-global-systematic-256-always,santa-fixed-systematic-2048-always,$(peers)}
run_kernels() {      # batch contexts [bench options] [file name]: one process, one file
  [ $(left) -gt 85 ] || { echo "skipped kernels B=$1 $2: out of time"; return 0; }
  local name=${4:-kernels_b$1_${2//,/_}}
  timeout $(left) python3 bench.py kernels --shape llama8b --batch $1 --context $2 ${3:-} --methods "$M" \
    --json $R/$name.json --markdown $R/$name.md 2>>$R/bench.err | grep "^| llama" | cut -c1-140
  echo "B=$1 done at ${SECONDS} s"; save
}
run_e2e() {          # batch
  [ $(left) -gt 95 ] || { echo "skipped e2e B=$1: out of time"; return 0; }
  timeout $(left) python3 bench.py e2e --batch $1 --context 32k --mem-gb $((MEM_GB - 4)) --steps 10 \
    --markdown $R/e2e_b$1.md 2>>$R/bench.err | grep "^|" | tail -2
  echo "e2e B=$1 done at ${SECONDS} s"; save
}
# issue 15's points first, then the rest of the grid
run_kernels 1 8k,32k,128k                 # with the streaming-read ceiling
run_kernels 16 32k,128k --no-ceiling
run_kernels 4 32k --no-ceiling
run_e2e 1
run_e2e $([ "$MEM_GB" -gt 90 ] && echo 16 || echo 8)
run_kernels 4 8k,128k --no-ceiling
run_kernels 16 8k --no-ceiling
SM=dense,santa-global-systematic-256-always,santa-fixed-systematic-2048-always
for B in 1 16; do
  [ $(left) -gt 45 ] && timeout 40 python3 bench.py stages --batch $B --context 32k --methods "$SM" \
    2>>$R/bench.err > $R/stages_b$B.md
done
save
M=santa-global-systematic-256-always,santa-global-systematic-256-keys95,santa-global-systematic-256-keys50fb32,santa-global-systematic-256-keys25fb32,torch-cudnn
run_kernels 16 32k --no-ceiling kernels_keys       # issue 17's rows
tail -3 $R/bench.err

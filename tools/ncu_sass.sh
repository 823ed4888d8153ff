#!/usr/bin/env bash
# Nsight Compute, full set with SASS source counters, on one SANTA kernel (default: pass 2) at a
# few batch sizes (8B shape, bf16, 32k), with line tables (SANTA_CUPY_LINEINFO=1). Reports: the
# details page and the SASS page (instructions executed and stall samples per instruction) as CSV.
#   bash tools/ncu_sass.sh [kernel_regex] ["B L extra-args" ...]
set -u
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/ncu
export PYTHONPATH=.
export SANTA_CUPY_LINEINFO=1
K=${1:-santa_tile_warp}; shift || true
[ $# -eq 0 ] && set -- "16 32768" "4 32768"
for case in "$@"; do
  tag=$(echo "$K $case" | tr -c 'a-zA-Z0-9\n' '_')
  timeout 240 ncu --clock-control none --set full --import-source yes --kernel-name regex:"$K" \
    --launch-skip 1 --launch-count 1 -o /tmp/ncu/$tag -f \
    python3 tools/profile_case.py santa-global-systematic-256 $case --runs 2 > /tmp/ncu/$tag.log 2>&1
  echo "== $K $case: exit $?"; tail -3 /tmp/ncu/$tag.log
  ncu --import /tmp/ncu/$tag.ncu-rep --page details > "$OUT/$tag.details.txt" 2>&1
  ncu --import /tmp/ncu/$tag.ncu-rep --page source --csv --print-source sass > /tmp/ncu/$tag.sass.csv 2>&1
  gzip -c /tmp/ncu/$tag.sass.csv > "$OUT/$tag.sass.csv.gz"
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Grid Size|Executed Instructions  " "$OUT/$tag.details.txt" | head -20
done

#!/usr/bin/env bash
# Nsight Compute on the 8B-shaped (bf16, 32k) dense and SANTA kernels, one plan run per case.
#   bash tools/ncu_profile.sh ["dense 1 32768" ...]     (cases: tools/profile_case.py arguments)
# Full reports go to $OUT/ncu.tgz; a summary of the key lines is printed.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/ncu
export PYTHONPATH=.
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
SEC="$SEC --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"
if [ $# -eq 0 ]; then
  set -- "dense 1 32768" "dense 16 32768" \
         "santa-global-systematic-256 1 32768" "santa-global-systematic-256 16 32768" \
         "santa-fixed-systematic-2048 16 32768" \
         "santa-fixed-systematic-2048 16 32768 --tile-kernel warp_mma"
fi
for case in "$@"; do
  tag=$(echo "$case" | tr ' ' '_' | tr -d '-')
  timeout 150 ncu --clock-control none $SEC --kernel-name regex:"decode_dense|santa" --launch-count 8 \
    python3 tools/profile_case.py $case --runs 1 > "/tmp/ncu/$tag.txt" 2>&1
  echo "== ncu $case: exit $?"
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Grid Size|Dynamic Shared" "/tmp/ncu/$tag.txt" | head -80
done
tar -czf "$OUT/ncu.tgz" -C /tmp ncu

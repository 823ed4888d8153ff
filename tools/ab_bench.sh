#!/usr/bin/env bash
# One device call for an A/B of kernel trees: bench kernels for this checkout and for every tree
# carried in .ab_*/ (each: `git archive <rev> bench.py cuda llama_min santa_cupy santa_tools tools |
# tar -x -C .ab_<name>`, git-ignored; name them in the device call's `carry`), one after another in
# the same call, so their numbers compare. Rows are printed prefixed by the tree's name.
#   METHODS=... BATCHES=1,16 CONTEXTS=32k bash tools/ab_bench.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
M=${METHODS:-dense,santa-global-systematic-256,santa-global-systematic-256-always,torch-cudnn}
for tree in . .ab_*; do
  [ -f "$tree/bench.py" ] || continue
  name=$( [ "$tree" = . ] && echo HEAD || echo "${tree#.ab_}" )
  (cd "$tree" && PYTHONPATH=.:/tmp/site timeout ${BENCH_TIMEOUT:-150} python3 bench.py kernels --batch "${BATCHES:-1,16}" \
     --context "${CONTEXTS:-32k}" --methods "$M" --no-ceiling --json "$OUT/ab_$name.json" 2>"$OUT/ab_$name.err") \
    | grep "^| llama" | sed "s/^/$name /"
  tail -1 "$OUT/ab_$name.err"
done

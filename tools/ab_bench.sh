#!/usr/bin/env bash
# One device call for an A/B of kernel trees: bench kernels for this checkout and for every tree
# carried in .ab_*/ (each: `git archive <rev> bench.py cuda llama_min santa_cupy tools |
# tar -x -C .ab_<name>`, git-ignored; name them in the device call's `carry`), one after another in
# the same call, so their numbers compare. Rows are printed prefixed by the tree's name. A revision
# from before issue #19 kept the CLI in a top-level package of its own: add that folder to its
# archive; the method check below finds the bench package through the tree's own bench.py.
#   METHODS=... EXTRA_METHODS=... BATCHES=1,16 CONTEXTS=32k bash tools/ab_bench.sh
# EXTRA_METHODS go to the trees whose bench knows them (e.g. santa-...-warpmma on a branch that adds
# it); a tree that rejects them runs METHODS alone.
# Each tree's JSON and log go into one tarball, $OUT/ab_results.tgz (the device returns at most 8
# files a call: two a tree did not come back from a call of four trees).
# First the trees' kernel modules for WARM (dtype,head_dim,group; default the llama8b shape's
# bfloat16,128,4: dense, santa64, santa128) compile in parallel, each tree's from its own kernels.py
# (a module takes ~40 s; the trees' sources differ, so nothing is shared): ~1 minute for four
# trees, where warming every CI configuration of four trees took ~5.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
RES=$(mktemp -d)
M=${METHODS:-dense,santa-global-systematic-256,santa-global-systematic-256-always,torch-cudnn}
run() {   # tree name methods
  (cd "$1" && PYTHONPATH=.:/tmp/site timeout ${BENCH_TIMEOUT:-150} python3 bench.py kernels --batch "${BATCHES:-1,16}" \
     --context "${CONTEXTS:-32k}" --methods "$3" --no-ceiling --json "$RES/ab_$2.json" 2>"$RES/ab_$2.err")
}
warm_tree() {   # tree: its modules of $WARM, by this checkout's warm script on the tree's kernels
  python3 tools/warm_kernel_cache.py --root "$1" --config "${WARM:-bfloat16,128,4}" --jobs 4 > /dev/null 2>&1
}
for tree in . .ab_*; do [ -f "$tree/bench.py" ] && warm_tree "$tree" & done
wait
for tree in . .ab_*; do
  [ -f "$tree/bench.py" ] || continue
  name=$( [ "$tree" = . ] && echo HEAD || echo "${tree#.ab_}" )
  if [ -n "${EXTRA_METHODS:-}" ] && (cd "$tree" && PYTHONPATH=. python3 -c "
import importlib, sys
import bench as entry   # the tree's bench.py: its bench package is santa_cupy.cli.bench, or the old path
parse_method = importlib.import_module(entry.bench.callback.__module__ + '.methods').parse_method
[parse_method(m) for m in sys.argv[1].split(',')]" "$EXTRA_METHODS") 2>/dev/null; then
    run "$tree" "$name" "$M,$EXTRA_METHODS"
  else
    run "$tree" "$name" "$M"
  fi | grep "^| llama" | sed "s/^/$name /"
  tail -1 "$RES/ab_$name.err"
done
tar -czf "$OUT/ab_results.tgz" -C "$RES" .

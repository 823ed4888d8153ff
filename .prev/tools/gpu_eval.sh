#!/usr/bin/env bash
# The accuracy evaluation on the GPU (default model), results packed into $OUT/eval.tgz.
#   bash tools/gpu_eval.sh kernel|model|retrieval [extra santa-cupy eval options]
set -u
OUT=${OUT:-out}; mkdir -p "$OUT" /tmp/eval
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
what=$1; shift
timeout ${EVAL_TIMEOUT:-400} python3 cli.py eval "$what" --device gpu --json "/tmp/eval/$what.json" \
  --markdown "/tmp/eval/$what.md" "$@" 2> "/tmp/eval/$what.err"
echo "eval $what exit $?"; tail -3 "/tmp/eval/$what.err"; cat "/tmp/eval/$what.md"
tar -czf "$OUT/eval_$what.tgz" -C /tmp eval

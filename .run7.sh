#!/usr/bin/env bash
# session-6 call 7: GraphDecoder defaults (gemv at batch 1, programmatic launch): model tests, e2e record grid
set -u
OUT=${OUT:-out}; mkdir -p $OUT; export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -m gpu -q -rs --timeout=120 tests/test_model.py tests/test_generate.py tests/test_cli_generate.py tests/test_gpu_decoder.py 2>&1 | tail -3
for BL in "1 32k" "4 32k" "16 32k" "1 128k" "4 128k"; do set -- $BL
  timeout 150 python3 bench.py e2e --batch $1 --context $2 --mem-gb 130 --json $OUT/e2e_b$1_$2.json --markdown $OUT/e2e_b$1_$2.md 2>>$OUT/e2e.err | grep "^| [ds]"
done
timeout 100 python3 bench.py e2e --batch 1 --context 32k --mem-gb 130 --no-pdl --products cublas --markdown $OUT/e2e_b1_32k_plain_cublas.md 2>>$OUT/e2e.err | grep "^| [ds]"
tail -2 $OUT/e2e.err

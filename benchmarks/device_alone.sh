#!/usr/bin/env bash
# One-launch plans on the seesaw kernel? (device tool, repo root; $OUT an output folder): bench_gluon's shipped
# mixed-tail rule against mixed-alone-tail (the seesaw kernel for a plan of one launch, split or not), H = 128.
set -u
OUT=${OUT:-/tmp/alone}
mkdir -p "$OUT" "$OUT/w512"
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
timeout ${BENCH_S:-300} python3 -u benchmarks/bench_gluon.py --out "$OUT" --only mixed-tail,mixed-alone-tail \
  --rows ${ROWS:-1,2,4,5,7,8,12,16,20,32,48,64,96} 2>&1 | grep -v Warning | grep -E "rows|rel|FAIL" | tee "$OUT/bench.log"
timeout 200 python3 -u benchmarks/bench_gluon.py --out "$OUT/w512" --width 512 --only mixed-tail,mixed-alone-tail \
  --rows 1,5,20,64 2>&1 | grep -v Warning | grep -E "rows|FAIL" | tee "$OUT/bench_w512.log"

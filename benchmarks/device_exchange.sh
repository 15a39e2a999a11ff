#!/usr/bin/env bash
# The consumers' hand-offs racecheck can follow (GluonParams.x_sync, SeesawParams.thread_arrives) on the H200 (the
# device tool, from the repo root, .carry/t38 in carry; $OUT an output folder): racecheck of each form on Triton 3.6
# and 3.8 (hazards counted by source-line pair), then the forms side by side in bench_gluon (3.6).
set -u
OUT=${OUT:-/tmp/exchange}
mkdir -p "$OUT" /tmp/t38
export PYTHONUNBUFFERED=1
source benchmarks/device_lib.sh
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || { echo "untar failed"; exit 3; }
for tv in t36 t38; do
  pp=$(pwd); [ $tv = t38 ] && pp=/tmp/t38:$(pwd)
  rc_one ${tv}_gluon_x0 "$pp" gluon x_sync=0
  rc_one ${tv}_gluon_x1 "$pp" gluon x_sync=1
  rc_one ${tv}_gluon_x2 "$pp" gluon x_sync=2
  rc_one ${tv}_seesaw_h0 "$pp" seesaw handoff=0
  rc_one ${tv}_seesaw_h1 "$pp" seesaw handoff=1
done
export PYTHONPATH=$(pwd)
timeout ${BENCH_S:-200} python3 -u benchmarks/bench_gluon.py --out "$OUT" --only gluon-tail,gluon-tail-x1,gluon-tail-x2 \
  --rows 5,8,20,64 2>&1 | grep -v Warning | grep -E "rows|rel|FAIL" | tee "$OUT/bench_gluon.log"
mv "$OUT/gluon_bench.json" "$OUT/gluon_bench_x.json" 2>/dev/null
timeout ${BENCH_S:-200} python3 -u benchmarks/bench_gluon.py --out "$OUT" --only seesaw-tail,seesaw-h1-tail,gluon-tail,gluon-tail-x2 \
  --rows 64,200,320 2>&1 | grep -v Warning | grep -E "rows|rel|FAIL" | tee "$OUT/bench_seesaw.log"

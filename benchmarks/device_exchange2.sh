#!/usr/bin/env bash
# Second round of the hand-off forms (device tool, repo root, .carry/t38 in carry; $OUT an output folder): GPU tests
# of every x_sync / handoff case (3.6), racecheck of the named-barrier forms on 3.6 and 3.8, then the forms side by
# side in bench_gluon (3.6).
set -u
OUT=${OUT:-/tmp/exchange2}
mkdir -p "$OUT" /tmp/t38
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
source benchmarks/device_lib.sh
tests "tests/test_gluon_decode.py tests/test_gluon_seesaw.py" handoffs 150 "matches_reference and (x1 or x2 or ho1 or ho2)"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || { echo "untar failed"; exit 3; }
for tv in t36 t38; do
  pp=$(pwd); [ $tv = t38 ] && pp=/tmp/t38:$(pwd)
  rc_one ${tv}_gluon_x2 "$pp" gluon x_sync=2
  rc_one ${tv}_seesaw_h2 "$pp" seesaw handoff=2
done
timeout ${BENCH_S:-240} python3 -u benchmarks/bench_gluon.py --out "$OUT" \
  --only gluon-tail,gluon-tail-x2,seesaw-tail,seesaw-h1-tail,seesaw-h2-tail --rows 5,8,20,64,200,320 2>&1 \
  | grep -v Warning | grep -E "rows|rel|FAIL" | tee "$OUT/bench.log"

#!/usr/bin/env bash
# The seesaw kernel for split tails and short whole rows, and racecheck's barrier forms (device tool, repo root; $OUT
# an output folder). (1) benchmarks/racecheck_barrier_probe.cu under racecheck, each barrier form; (2) bench_gluon,
# H = 128, two-launch plans: the shipped rule (mixed-tail) against every launch on the seesaw kernel (seesaw-tail:
# the split tail too) at widths 2048 / 1024 / 512, and at width 512 the rule before SEESAW_MIN_TILES 8 (mixed-min16-tail;
# run 2026-12-04 as mixed8-tail against the 16-tile rule, then shipped).
set -u
OUT=${OUT:-/tmp/tail}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
nvcc -arch=sm_90a -lineinfo -o /tmp/rbp benchmarks/racecheck_barrier_probe.cu || echo "nvcc failed"
for form in 0 1 2 3 4 5; do
  timeout 60 "$CS" --tool racecheck --racecheck-report all --print-limit 4 /tmp/rbp $form > "$OUT/barrier_form$form.log" 2>&1
  echo "barrier form $form rc=$?: $(grep -h values "$OUT/barrier_form$form.log") | $(grep -h 'RACECHECK SUMMARY' "$OUT/barrier_form$form.log")"
done
tar -czf "$OUT/barrier_logs.tgz" -C "$OUT" $(cd "$OUT" && ls barrier_form*.log) && rm -f "$OUT"/barrier_form*.log
ROWS=${ROWS:-72,80,96,140,160,200,280}
for w in 2048 1024 512; do
  only=mixed-tail,seesaw-tail; [ $w = 512 ] && only=mixed-tail,mixed-min16-tail,seesaw-tail
  mkdir -p "$OUT/w$w"
  timeout ${BENCH_S:-170} python3 -u benchmarks/bench_gluon.py --out "$OUT/w$w" --width $w --only $only --rows $ROWS \
    2>&1 | grep -v Warning | grep -E "rows|rel|FAIL|Error" | tee "$OUT/w$w/bench.log"
done

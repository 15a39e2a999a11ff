#!/usr/bin/env bash
# racecheck's view of Gluon warp specialization on the H200 (the device tool, from the repo root, .carry/t38 in
# carry; $OUT an output folder): benchmarks/racecheck_probe.py's four hand-offs on Triton 3.6 (the image's) and 3.8
# (vLLM 0.33's), then the tiny core run of run_h200.sh's racecheck step on 3.8. Each run's summary line goes to stdout.
set -u
OUT=${OUT:-/tmp/rc_probe}
mkdir -p "$OUT" /tmp/t38
export PYTHONUNBUFFERED=1
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
probe() {  # $1 = label, $2 = PYTHONPATH
  for mode in 0 1 2 3; do
    PYTHONPATH=$2 timeout 120 "$CS" --tool racecheck --racecheck-report all --print-limit 20 \
      python3 benchmarks/racecheck_probe.py $mode > "$OUT/probe_$1_mode$mode.log" 2>&1
    echo "$1 mode $mode rc=$?: $(grep -h 'values' "$OUT/probe_$1_mode$mode.log") | $(grep -h 'RACECHECK SUMMARY' "$OUT/probe_$1_mode$mode.log")"
  done
}
probe t36 "$(pwd)"
tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || { echo "untar failed"; exit 3; }
probe t38 "/tmp/t38:$(pwd)"
for k in gluon seesaw; do
  PYTHONPATH=/tmp/t38:$(pwd) timeout 150 "$CS" --tool racecheck --racecheck-report hazard --print-limit 40 \
    python3 benchmarks/racecheck_gluon.py $k > "$OUT/kernel_t38_$k.log" 2>&1
  echo "t38 $k rc=$?: $(grep -h 'RACECHECK SUMMARY' "$OUT/kernel_t38_$k.log")"
done

# Shared by the device-call scripts (device_stream.sh, device_seesaw.sh): source it with OUT set.
# tests FILES NAME TIMEOUT KEXPR: one pytest of FILES (space-separated) under `timeout` (a hang -- an mbarrier phase bug -- shows as rc
# 124), its log and junit in $OUT, the last line and any failures on stdout; returns pytest's rc.
tests() {
  timeout "$3" python3 -m pytest $1 -q -p no:cacheprovider -rs -k "$4" \
    --junitxml="$OUT/junit_$2.xml" > "$OUT/tests_$2.log" 2>&1
  local rc=$?
  echo "tests $2 rc=$rc: $(tail -1 "$OUT/tests_$2.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests_$2.log" | head -8
  return $rc
}

# rc_one LABEL PYTHONPATH ARGS...: racecheck (hazard report) of benchmarks/racecheck_gluon.py ARGS with CS set to
# compute-sanitizer; prints the accuracy and summary lines and the hazards counted by (write line, read line)
rc_one() {  # $1 = label, $2 = PYTHONPATH, rest: racecheck_gluon.py arguments
  local label=$1 pp=$2; shift 2
  PYTHONPATH=$pp timeout 150 "$CS" --tool racecheck --racecheck-report hazard --print-limit 100000 \
    python3 benchmarks/racecheck_gluon.py "$@" > "$OUT/rc_$label.log" 2>&1
  echo "$label rc=$?: $(grep -h 'rel L2' "$OUT/rc_$label.log") | $(grep -h 'RACECHECK SUMMARY' "$OUT/rc_$label.log")"
  grep -A2 "hazard detected" "$OUT/rc_$label.log" | grep -o "at [a-z_]*+0x[0-9a-f]* in [a-z_]*\.py:[0-9]*" \
    | sed 's/+0x[0-9a-f]*//' | paste -d' ' - - | sort | uniq -c | sort -rn | head -6
  gzip -f "$OUT/rc_$label.log"
}

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

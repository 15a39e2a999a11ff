# Short device call: the Gluon GPU tests in full, then racecheck's hazard report (shared offsets) on one launch.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/verify_out}; mkdir -p "$OUT"
timeout ${TEST_S:-150} python3 -m pytest tests/test_gluon_decode.py -q -p no:cacheprovider -rs \
  --junitxml="$OUT/junit_gluon.xml" > "$OUT/tests_gluon.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests_gluon.log"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${RACE_S:-120} "$CS" --tool racecheck --racecheck-report hazard python3 benchmarks/racecheck_gluon.py \
  > "$OUT/racecheck_hazards.log" 2>&1
echo "racecheck rc=$?"; grep -E "smem bytes|RACECHECK SUMMARY" "$OUT/racecheck_hazards.log"
grep -oE "hazard detected at __shared__ 0x[0-9a-f]+" "$OUT/racecheck_hazards.log" | awk '{print $NF}' | sort -u | tr '\n' ' '
echo

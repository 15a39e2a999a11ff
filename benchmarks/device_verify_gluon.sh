# Short device call: the Gluon GPU tests in full, a split-count probe (bench_gluon.py --splits), then racecheck's hazard
# report (shared offsets) on one launch.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/verify_out}; mkdir -p "$OUT"
timeout ${TEST_S:-150} python3 -m pytest tests/test_gluon_decode.py -q -p no:cacheprovider -rs \
  --junitxml="$OUT/junit_gluon.xml" > "$OUT/tests_gluon.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests_gluon.log"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout ${BENCH_S:-120} python3 -u benchmarks/bench_gluon.py --out "$OUT" --only gluon --rows 80 --splits "${PROBE:-80:1,2,3,4;20:2,3,4;5:8,11,16}" 2>&1 | grep -E "probe|rows|FAIL" | grep -v Warning
timeout ${RACE_S:-120} "$CS" --tool racecheck --racecheck-report hazard python3 benchmarks/racecheck_gluon.py \
  > "$OUT/racecheck_hazards.log" 2>&1
echo "racecheck rc=$?"; grep -E "smem bytes|RACECHECK SUMMARY" "$OUT/racecheck_hazards.log"
grep -oE "hazard detected at __shared__ 0x[0-9a-f]+" "$OUT/racecheck_hazards.log" | awk '{print $NF}' | sort -u | tr '\n' ' '
echo

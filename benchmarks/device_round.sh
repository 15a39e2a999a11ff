# One device call for a Gluon kernel change (the device tool; repo root; $OUT): its GPU tests and the variant
# timing (device_gluon.sh), an ncu stall profile (device_profile_gluon.sh), then the GPU suite and the sanitizers
# (run_h200.sh --skip-bench --skip-tune) with whatever is left of ~560 s. Everything lands in $OUT/round.tgz (one
# file) plus the key lines on stdout.
export PYTHONPATH=. PYTHONUNBUFFERED=1
ROOT_OUT=${OUT:-/tmp/round_out}
W=/tmp/round_work; rm -rf "$W"; mkdir -p "$W/gluon" "$W/ncu" "$W/suite"
T0=$(date +%s)
OUT=$W/gluon TEST_S=${TEST_S:-150} BENCH_S=${BENCH_S:-200} bash benchmarks/device_gluon.sh 2>&1 | tail -${GLUON_TAIL:-30}
OUT=$W/ncu NCU_S=60 bash benchmarks/device_profile_gluon.sh > "$W/ncu/profile.log" 2>&1
grep -A8 "samples," "$W/ncu/profile.log"; rm -f "$W/ncu/gluon.ncu-rep"; gzip -f "$W/ncu/sass_source.csv"
LEFT=$(( ${TOTAL_S:-560} - ($(date +%s) - T0) ))
echo "== suite + sanitizers with ${LEFT}s left"
OUT=$W/suite BUDGET=$LEFT bash benchmarks/run_h200.sh --skip-bench --skip-tune > "$W/suite/run.log" 2>&1
cat "$W/suite/summary.txt"; grep -E "passed|failed|error" "$W/suite/tests.log" | tail -3
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$W/suite/sanitizer.log" | head -6
tar czf "$ROOT_OUT/round.tgz" -C "$W" .

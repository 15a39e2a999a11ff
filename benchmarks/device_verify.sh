#!/usr/bin/env bash
# Short check of a kernel change on the H200: the kernel's GPU tests, compute-sanitizer (run_h200.sh's step),
# then the default configs timed (sweep_configs.py --defaults). From the repo root; files land in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/verify_out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest tests/test_triton_decode.py tests/test_gluon_decode.py tests/test_gluon_selection.py tests/test_graphs.py tests/test_dcp.py tests/test_core.py \
  -q -p no:cacheprovider --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
rc=$?
echo "tests rc=$rc"; tail -3 "$OUT/tests.log"
BUDGET=60 bash benchmarks/run_h200.sh --skip-tests --skip-bench --skip-tune 2>&1 | grep -E "^==|SUMMARY|worst"
PYTHONPATH=. timeout 60 python3 -u benchmarks/sweep_configs.py --defaults --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/sweep.log"
exit $rc

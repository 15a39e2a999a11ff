#!/usr/bin/env bash
# Final check of a kernel change on the H200: GPU tests + compute-sanitizer (run_h200.sh), then the default
# configs timed (sweep_configs.py --defaults). From the repo root; files land in $OUT.
BUDGET=${BUDGET:-300} bash benchmarks/run_h200.sh --skip-bench --skip-tune
rc=$?
PYTHONPATH=. timeout 120 python3 -u benchmarks/sweep_configs.py --defaults --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/sweep.log"
exit $rc

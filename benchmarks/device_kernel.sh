#!/bin/bash
# One device call: GPU tests, compute-sanitizer on a small case, then the benchmark sweep.
# Usage (on the device machine, repo root): bash benchmarks/device_kernel.sh [bench args]
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee $OUT/smi.txt
if [ -z "$SKIP_TESTS" ]; then
  timeout 240 python3 -m pytest -q -x tests/test_triton_decode.py 2>&1 | tee $OUT/pytest.log | tail -25
fi
if [ -z "$SKIP_SAN" ]; then
  timeout 100 compute-sanitizer --tool memcheck --print-limit 10 python3 benchmarks/sanitize_case.py 2>&1 | tee $OUT/memcheck.log | tail -6
  timeout 100 compute-sanitizer --tool racecheck --print-limit 10 python3 benchmarks/sanitize_case.py 2 2>&1 | tee $OUT/racecheck.log | tail -6
fi
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_decode.py --out $OUT "$@" 2>&1 | tee $OUT/bench.log | grep -v '^{' | tail -130

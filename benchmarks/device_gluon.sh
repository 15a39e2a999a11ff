# The Gluon decode on the H200 (the device tool; from the repo root, $OUT an output folder, no vllm needed):
# its GPU tests, then its timing against the Triton kernel's default config (H=128, K=2048, rows 5..320).
# ~5 minutes at most: each step under `timeout`.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gluon_out}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# SASS report with the device's Triton (REPORT=1; the same numbers come from any machine with triton 3.6)
if [ -n "${REPORT:-}" ]; then
  timeout ${REPORT_S:-45} python3 benchmarks/gluon_report.py > "$OUT/gluon_report.txt" 2>&1
  echo "report rc=$?"; head -30 "$OUT/gluon_report.txt"
fi
# tests: a hang (barrier phase bug) shows as the timeout's rc 124
timeout ${TEST_S:-120} python3 -m pytest tests/test_gluon_decode.py -x -q -p no:cacheprovider -rs \
  --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -25 "$OUT/tests.log"
# ONLY: the variants to time (bench_gluon.GLUON_VARIANTS; "all" for every one)
O=${ONLY:-triton,gluon,gluon-tail}; [ "$O" = all ] && O=""
timeout ${BENCH_S:-180} python3 -u benchmarks/bench_gluon.py --out "$OUT" ${O:+--only $O} 2>&1 | tee "$OUT/bench.log" | grep -v Warning
echo "bench rc=${PIPESTATUS[0]}"
# split-count probe of the default kernel when PROBE is given, e.g. PROBE='23:2,8;45:1,4' (measured in gluon-v8:
# both picks were the faster)
if [ -n "${PROBE:-}" ]; then
  timeout ${PROBE_S:-90} python3 -u benchmarks/bench_gluon.py --out "$OUT/probe" --only gluon --rows 45 \
    --splits "$PROBE" 2>&1 | grep -E "probe|FAIL" | grep -v Warning
fi

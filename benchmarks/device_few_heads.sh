# The few-heads Gluon decode on the H200 (the device tool; from the repo root, $OUT an output folder, no vllm needed):
# its GPU tests, then its timing against the Triton kernel's default config and the copy bandwidth (H=16/12,
# K=2048, fp8). Each step under `timeout`; a hang (barrier phase bug) shows as the timeout's rc 124.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/few_out}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TEST_S:-150} python3 -m pytest tests/test_gluon_few_heads.py -x -q -p no:cacheprovider -rs \
  --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -25 "$OUT/tests.log"
timeout ${BENCH_S:-240} python3 -u benchmarks/bench_few_heads.py --out "$OUT" ${ROWS:+--rows $ROWS} \
  --splits "${PROBE-320:1,2,3;80:1,2,4;5:8,16,32}" 2>&1 | tee "$OUT/bench.log" | grep -v Warning
echo "bench rc=${PIPESTATUS[0]}"

# The few-heads Gluon decode on the H200 (the device tool; from the repo root, $OUT an output folder, no vllm needed):
# its GPU tests (fp8, the L2-prefetch variant, nvfp4_ds_mla), then its timing against the Triton kernel's default
# configs and the copy bandwidth (H=16/12, K=2048, both formats). Each step under `timeout`; a hang (a barrier
# phase bug) shows as the timeout's rc 124. The first call of the next session (NOTES v8: l2_prefetch and nvfp4
# were prepared after the last device run).
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/few_out}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TEST_S:-240} python3 -m pytest tests/test_gluon_few_heads.py -x -q -p no:cacheprovider -rs \
  --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -25 "$OUT/tests.log"
timeout ${BENCH_S:-360} python3 -u benchmarks/bench_few_heads.py --out "$OUT" ${ROWS:+--rows $ROWS} --heads ${HEADS:-16,12,32} \
  --splits "${PROBE-320:1,2,3;80:1,2,4;5:8,16,32}" 2>&1 | tee "$OUT/bench.log" | grep -v Warning
echo "bench rc=${PIPESTATUS[0]}"

# The few-heads plan model's sweep on the H200 (the device tool, from the repo root; $OUT an output folder): both
# reg_v forms TritonDecode chooses between (one CTA an SM, two with pv_early) at 18 row counts, H = 12 / 16 / 32,
# K = 2048, the shipped (fp16) partials; then benchmarks/fit_plan_cost.py on the result (also runnable on a CPU
# afterwards). ROWS / HEADS / BENCH_S override.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/plan_sweep}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${BENCH_S:-420} python3 -u benchmarks/bench_few_heads.py --out "$OUT" --only few-tail-regv,few-tail-regv-2cta-early \
  --rows ${ROWS:-1,5,8,16,20,32,40,48,64,80,100,120,140,160,200,240,264,320} --heads ${HEADS:-12,16,32} --splits "" \
  2>&1 | tee "$OUT/bench.log" | grep -v Warning | tail -8
echo "bench rc=${PIPESTATUS[0]}"
python3 benchmarks/fit_plan_cost.py "$OUT/few_heads_bench.json" --out "$OUT" | tee "$OUT/fit.log"

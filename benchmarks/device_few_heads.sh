# The few-heads Gluon decode on the H200 (the device tool; from the repo root, $OUT an output folder, no vllm needed):
# its GPU tests by group (fp8, 17..32 heads, nvfp4_ds_mla), then its timing against the Triton kernel's default
# configs and the copy bandwidth (H=16/12, K=2048, both formats). Each step under `timeout`; a hang (a barrier
# phase bug) shows as the timeout's rc 124.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/few_out}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# One pytest a group, each under its own timeout, so that a hang or a failure in one path (17..32 heads,
# nvfp4_ds_mla) still leaves the others' results.
group() {  # name, -k expression
  timeout ${GROUP_S:-60} python3 -m pytest tests/test_gluon_few_heads.py -q -p no:cacheprovider -rs -k "$2" \
    --junitxml="$OUT/junit_$1.xml" > "$OUT/tests_$1.log" 2>&1
  echo "tests $1 rc=$?: $(tail -1 "$OUT/tests_$1.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests_$1.log" | head -8
}
group fp8 "not nvfp4 and not h20 and not h24 and not h32"
group multi_hb "not nvfp4 and (h20 or h24 or h32)"
group nvfp4 "nvfp4"
# ONLY: the variants to time (bench_few_heads.NAMES; "all" for every one)
O=${ONLY:-triton,few,few-tail,few-nvfp4,few-tail-nvfp4}; [ "$O" = all ] && O=""
timeout ${BENCH_S:-360} python3 -u benchmarks/bench_few_heads.py --out "$OUT" ${ROWS:+--rows $ROWS} ${O:+--only $O} --heads ${HEADS:-16,12,32} \
  --splits "${PROBE-320:1,2,3;80:1,2,4;5:8,16,32}" 2>&1 | tee "$OUT/bench.log" | grep -v Warning
echo "bench rc=${PIPESTATUS[0]}"

# One H200 call for the Gluon kernel's round (the device tool; repo root; $OUT an output folder):
# (1) its GPU tests (stop here if they fail), (2) bench_gluon.py: the Triton kernel and the Gluon variants side by
# side, (3) PINGPONG becomes the default if it is > 2% faster at 320 rows than the same shape without it (the
# device copy of gluon_decode.py is edited; the same edit is made in the repo afterwards), (4) run_h200.sh's GPU
# tests and compute-sanitizer with whatever default results. Files: gluon_tests.log, gluon_bench.json/log, and
# run_h200.sh's summary.txt, tests.log, junit.xml, sanitizer.log.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gluon_out}; mkdir -p "$OUT"
timeout 110 python3 -m pytest tests/test_gluon_decode.py -x -q -p no:cacheprovider > "$OUT/gluon_tests.log" 2>&1
rc=$?; echo "gluon tests rc=$rc"; tail -3 "$OUT/gluon_tests.log"
[ "$rc" = 0 ] || exit 1
timeout 110 python3 -u benchmarks/bench_gluon.py --out "$OUT" 2>&1 | grep -v Warning > "$OUT/gluon_bench.log"
tail -7 "$OUT/gluon_bench.log"
python3 - "$OUT/gluon_bench.json" <<'PY'
import json, re, sys
r = json.load(open(sys.argv[1]))["results"]
us = lambda n: r.get(n, {}).get("times", {}).get("320", {}).get("us")
base, pp = us("gluon-bn64-ks2-lz"), us("gluon-bn64-ks2-lz-pp")
print(f"320 rows: lazy {base} us, lazy+pingpong {pp} us")
if base and pp and pp < 0.98 * base:
    p = "vllm_kimi_dsa/kernels/gluon_decode.py"
    s = open(p).read()
    open(p, "w").write(re.sub(r"DEFAULT_PINGPONG = False", "DEFAULT_PINGPONG = True", s))
    print("ADOPTED pingpong as the default for the tests below")
PY
BUDGET=${BUDGET:-360} bash benchmarks/run_h200.sh --skip-bench --skip-tune 2>&1 | grep -E "^==|passed|failed|error" | tail -20

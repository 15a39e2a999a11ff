#!/usr/bin/env bash
# One device call for the seesaw 64-head kernel (kernels/gluon_seesaw.py; the device tool; repo root; $OUT;
# .carry/t38 in carry for the last step): (1) three quick GPU cases (one-tile rows, 96 heads, splits) under a short
# timeout (a hang -- an mbarrier phase bug -- shows as timeout's rc 124), (2) the rest of its GPU tests, (3) the
# tests shared with gluon_decode's kernel and TritonDecode's choice between them, (4) if (1)-(2) passed, bench_gluon's
# H = 128 timing of gluon_decode's kernel, the seesaw kernel and both in one plan (mixed) side by side, (5) with
# RACE=1, racecheck's hazard report over one seesaw launch, (6) its GPU tests on Triton 3.8 (vLLM 0.33's) when
# .carry/t38 is there. Each step under its own timeout.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seesaw_out}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
. benchmarks/device_lib.sh
QUICK="r2-h64 or r7-h96-k1024-sNone or r5-h128-k2048-s3-ks4"
OK=0
F=tests/test_gluon_seesaw.py
tests $F quick "${QUICK_S:-150}" "$QUICK" && tests $F rest "${REST_S:-200}" "not ($QUICK)" && OK=1
# test_gluon_decode's cases parametrized over both 64-head kernels (lse=None, graph replay, tail-split, rejection),
# the kernel choice (test_gluon_selection) and the few-heads kernel class (run_plan's callers)
[ "$OK" = 1 ] && tests "tests/test_gluon_decode.py tests/test_gluon_selection.py tests/test_gluon_few_heads.py" shared \
  "${SHARED_S:-150}" "seesaw or tail or graph or selection or kernel_choice or kernel_class or run_plan or env"
if [ "$OK" = 1 ]; then
  timeout "${BENCH_S:-240}" python3 -u benchmarks/bench_gluon.py --out "$OUT" \
    --only "${ONLY:-gluon-tail,seesaw-tail,mixed-tail,mixed16-tail}" \
    --rows "${ROWS:-5,8,20,32,48,64,80,96,140,160,200,240,280,320}" \
    ${SPLITS:+--probe "${PROBE:-seesaw}" --splits "$SPLITS"} 2>&1 | grep -v Warning > "$OUT/bench.log"
  echo "bench rc=${PIPESTATUS[0]}"; grep -A10 "^kernel " "$OUT/bench.log"; grep -E "FAILED|BAD" "$OUT/bench.log"
fi
if [ "${RACE:-0}" = 1 ]; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  timeout "${RACE_S:-150}" "$CS" --tool racecheck --racecheck-report hazard python3 benchmarks/racecheck_gluon.py \
    seesaw > "$OUT/racecheck_seesaw.log" 2>&1
  echo "racecheck rc=$?"; grep -E "smem bytes|RACECHECK SUMMARY" "$OUT/racecheck_seesaw.log"
  grep -oE "hazard detected at __shared__ 0x[0-9a-f]+" "$OUT/racecheck_seesaw.log" | awk '{print $NF}' | sort | uniq -c \
    | head -20 | tr '\n' ' '; echo
fi
if [ "$OK" = 1 ] && [ -f .carry/t38/t38.tar.xz ]; then
  mkdir -p /tmp/t38 && tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || exit 3
  export PYTHONPATH=/tmp/t38:$(pwd) VLLM_KIMI_DSA_GLUON=1
  python3 -c "import triton; print('triton', triton.__version__)"
  tests $F t38 "$(( ${TOTAL_S:-585} - SECONDS ))" "not nothing"
fi

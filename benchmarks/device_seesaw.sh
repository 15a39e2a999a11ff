#!/usr/bin/env bash
# One device call for the seesaw 64-head kernel (kernels/gluon_seesaw.py; the device tool; repo root; $OUT;
# .carry/t38 in carry for the last step): (1) three quick GPU cases (one-tile rows, 96 heads, splits) under a short
# timeout (a hang -- an mbarrier phase bug -- shows as timeout's rc 124), (2) the rest of its GPU tests, (3) if both
# passed, bench_gluon's H = 128 timing of gluon_decode's kernel and the seesaw variants side by side, (4) its GPU
# tests on Triton 3.8 (vLLM 0.33's). Each step under its own timeout.
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
if [ "$OK" = 1 ]; then
  timeout "${BENCH_S:-200}" python3 -u benchmarks/bench_gluon.py --out "$OUT" \
    --only "${ONLY:-gluon-tail,seesaw-tail,seesaw-early-tail,seesaw-early-o1-tail,seesaw-early-p40-tail}" \
    --rows "${ROWS:-5,20,64,80,160,200,240,320}" ${SPLITS:+--probe seesaw --splits "$SPLITS"} 2>&1 | grep -v Warning \
    > "$OUT/bench.log"
  echo "bench rc=${PIPESTATUS[0]}"; grep -B2 -A10 "^kernel " "$OUT/bench.log"; grep -E "FAILED|BAD" "$OUT/bench.log"
fi
if [ "$OK" = 1 ] && [ -f .carry/t38/t38.tar.xz ]; then
  mkdir -p /tmp/t38 && tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || exit 3
  export PYTHONPATH=/tmp/t38:$(pwd) VLLM_KIMI_DSA_GLUON=1
  python3 -c "import triton; print('triton', triton.__version__)"
  tests $F t38 "$(( ${TOTAL_S:-585} - SECONDS ))" "not nothing"
fi

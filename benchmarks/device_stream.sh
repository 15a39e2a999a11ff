#!/usr/bin/env bash
# One device call for the few-heads reg_v forms (the device tool; repo root; $OUT; .carry/t38 in carry for step 4):
# (1) the stream-K GPU tests (a hang shows as timeout's rc 124: suspect the ring counter across segments),
# (2) the two-CTA / pv_early / graph / tail-split / kernel-class cases on the image's Triton (3.6),
# (3) the tail-split forms against the stream-K grid, side by side in one run (bench_few_heads; stream only if (1)
#     passed), (4) the same GPU tests on Triton 3.8 (vLLM 0.33's). Each step under its own timeout.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/stream_out}
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
K_CASES="cta2 or early or graph or tail_split or kernel_class"
. benchmarks/device_lib.sh
F=tests/test_gluon_few_heads.py
tests $F stream "${STREAM_S:-120}" stream && STREAM_OK=1 || STREAM_OK=0
tests $F cases "${CASES_S:-150}" "$K_CASES"
B="few-tail-regv,few-tail-regv-2cta-early"; [ "$STREAM_OK" = 1 ] && B="$B,few-stream-2cta,few-stream-regv"
timeout "${BENCH_S:-200}" python3 -u benchmarks/bench_few_heads.py --out "$OUT" --only "$B" \
  --rows "${ROWS:-5,20,40,80,120,160,200,264,320}" --heads "${HEADS:-16,32}" 2>&1 | grep -v Warning \
  > "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}"; grep -A12 "^kernel " "$OUT/bench.log"
if [ -f .carry/t38/t38.tar.xz ]; then
  mkdir -p /tmp/t38 && tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || exit 3
  export PYTHONPATH=/tmp/t38:$(pwd) VLLM_KIMI_DSA_GLUON=1
  python3 -c "import triton; print('triton', triton.__version__)"
  tests $F t38 "$(( ${TOTAL_S:-585} - SECONDS ))" "$K_CASES or stream"
fi

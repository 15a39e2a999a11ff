#!/usr/bin/env bash
# The Gluon kernels (and the `tl` one) on Triton 3.8 (vLLM 0.33's) on the H200, whose image has 3.6: from the repo
# root with .carry/t38 (benchmarks/pack_triton38.sh) in carry. GPU tests with VLLM_KIMI_DSA_GLUON=1 (so the core
# picks the Gluon kernels on this unverified version too), then the H=128 and few-heads benches at a few row counts.
set -u
OUT=${OUT:-/tmp/t38_out}
mkdir -p "$OUT" /tmp/t38
tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || { echo "untar failed"; exit 3; }
export PYTHONPATH=/tmp/t38:$(pwd) PYTHONUNBUFFERED=1 VLLM_KIMI_DSA_GLUON=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, triton.__file__)" || exit 4
TO=""; python3 -c "import pytest_timeout" 2>/dev/null && TO="--timeout=120"
# shellcheck disable=SC2086
timeout ${TEST_S:-330} python3 -m pytest tests/test_gluon_decode.py tests/test_gluon_few_heads.py tests/test_gluon_selection.py \
  tests/test_triton_decode.py tests/test_graphs.py tests/test_core.py -q -p no:cacheprovider -rs $TO \
  --junitxml="$OUT/junit_t38.xml" > "$OUT/tests_t38.log" 2>&1
echo "tests rc=$?: $(tail -1 "$OUT/tests_t38.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests_t38.log" | head -20
timeout ${BENCH_S:-80} python3 -u benchmarks/bench_gluon.py --out "$OUT" --only triton,gluon --rows 5,80,320 2>&1 \
  | grep -v Warning | tail -6
timeout ${FEW_S:-110} python3 -u benchmarks/bench_few_heads.py --out "$OUT" --only triton,few,few-nvfp4,triton-nvfp4 \
  --heads 16,32 --rows 5,80,320 2>&1 | grep -v Warning | tail -10

#!/usr/bin/env bash
# H200 (device tool): the vLLM backend's per-step body and the DCP merge at K3.1 shapes (GPU tests), the CLI demo,
# and whether Hopper assembles vLLM's nvfp4 cache-writer instruction. Logs under $OUT.
set -uo pipefail
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$OUT/machine.txt"
python3 tools/e2m1_cvt_probe.py 2>&1 | tail -3 | tee "$OUT/e2m1_probe.txt"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest ${TESTS:-tests/test_serving.py tests/test_dcp.py} -q \
  -p no:cacheprovider --junitxml="$OUT/junit.xml" > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/pytest.txt"
tail -30 "$OUT/pytest.txt"
python3 -m vllm_kimi_dsa demo --layers 2 > "$OUT/demo.txt" 2>&1; echo "demo rc=$?" >> "$OUT/demo.txt"
tail -5 "$OUT/demo.txt"

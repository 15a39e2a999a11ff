#!/usr/bin/env bash
# The H200 session in one device call, from the repo root (no vllm, no flashinfer installed; python3 = torch 2.11 /
# triton 3.6), with .carry/fi (from /work/shared/device/flashinfer-sm90/prepare.sh) taken along:
#   bash benchmarks/run_h200.sh [--quick] [--skip-sanitizer] [--skip-tests] [--skip-bench] [--skip-tune]
# Steps: (a) GPU tests, (b) unpack the FlashInfer peer (in the background, during (a)), (c) bench_suite.py,
# (d) `python3 -m vllm_kimi_dsa tune`, (e) compute-sanitizer memcheck + racecheck on a tiny core run.
# Exactly these 8 files land in $OUT (the device tool returns at most 8): summary.txt, tests.log, junit.xml,
# bench.log, bench_suite.json, tune.log, kernel_table.json, sanitizer.log. The whole run keeps under BUDGET seconds
# (default 560): a step gets at most what is left.
set -u -o pipefail
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
QUICK=0; SAN=1; TESTS=1; BENCH=1; TUNE=1
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1;; --skip-sanitizer) SAN=0;; --skip-tests) TESTS=0;; --skip-bench) BENCH=0;; --skip-tune) TUNE=0;;
    *) echo "unknown argument $a"; exit 2;;
  esac
done
BUDGET=${BUDGET:-560}
T0=$(date +%s)
ROOT=$(pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# run_step NAME LOG MAX_S CMD...: tee'd to LOG, killed after min(MAX_S, time left), rc recorded.
run_step() {
  local name=$1 log=$2 max=$3; shift 3
  local l; l=$(left); local lim=$(( max < l ? max : l ))
  if [ "$lim" -lt 15 ]; then say "== $name SKIPPED (only ${l}s of the budget left)"; return 0; fi
  say "== $name (limit ${lim}s) at +$(( $(date +%s) - T0 ))s"
  local t=$(date +%s)
  timeout -k 10 "$lim" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "== $name rc=$rc in $(( $(date +%s) - t ))s"
  RCS="$RCS $name=$rc"
}
RCS=""

say "== host: $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>&1 | head -1)"
say "== python: $(python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)' 2>&1)"

# (b) FlashInfer peer: unpack in the background while the tests run (as flashinfer-sm90/run_device.sh does).
FI_DIR=$ROOT/.carry/fi
FI_OK=0
if [ "$BENCH" = 1 ] && [ -f "$FI_DIR/fi_site.tar.xz" ]; then
  mkdir -p /tmp/fi
  ( tar -xJf "$FI_DIR/fi_site.tar.xz" -C /tmp/fi && echo ok > /tmp/fi/.untar_ok ) > /tmp/fi/untar.log 2>&1 &
  UNTAR_PID=$!
else
  UNTAR_PID=""
  say "== peer: $FI_DIR/fi_site.tar.xz not here; the suite runs without the fa3 peer"
fi

# (a) GPU-relevant tests (FlashInfer not on the path: the H200 has none installed).
if [ "$TESTS" = 1 ]; then
  FILES=""
  for f in test_convert.py test_triton_decode.py test_gluon_decode.py test_gluon_seesaw.py test_gluon_few_heads.py test_gluon_partials.py test_gluon_selection.py test_core.py test_dcp.py \
           test_graphs.py test_bad_input.py; do
    [ -f "tests/$f" ] && FILES="$FILES tests/$f"
  done
  TO=""
  python3 -c "import pytest_timeout" 2>/dev/null && TO="--timeout=120"
  if [ -z "$FILES" ]; then say "== tests: none of the GPU test files exist"; else
  # shellcheck disable=SC2086
  run_step tests "$OUT/tests.log" ${TESTS_S:-400} python3 -m pytest $FILES -q -rs $TO --junitxml="$OUT/junit.xml"
  fi
fi

# (b, cont.) the JIT environment of the peer, for the suite only.
if [ -n "$UNTAR_PID" ]; then
  wait "$UNTAR_PID"
  if [ -f /tmp/fi/.untar_ok ]; then
    FI_OK=1
    say "== peer: unpacked $(du -sh /tmp/fi/site | cut -f1) to /tmp/fi/site at +$(( $(date +%s) - T0 ))s"
  else
    say "== peer: untar FAILED: $(tail -3 /tmp/fi/untar.log)"
  fi
fi
FI_ENV=()
if [ "$FI_OK" = 1 ]; then
  FI_ENV=(PYTHONPATH="/tmp/fi/site:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws MAX_JOBS=16
          FLASHINFER_CUDA_ARCH_LIST=9.0a)
  NVCC=$(command -v nvcc || true)
  CH=${NVCC:+$(dirname "$(dirname "$NVCC")")}
  # FlashInfer's JIT links -L$cuda_home/lib64/stubs -lcuda; give it the driver's libcuda when there is no stub.
  if [ -z "$CH" ] || { [ ! -e "$CH/lib64/stubs/libcuda.so" ] && [ ! -e "$CH/lib64/libcuda.so" ]; }; then
    L=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
    if [ -n "$L" ]; then
      mkdir -p /tmp/culink && ln -sf "$L" /tmp/culink/libcuda.so
      FI_ENV+=(FLASHINFER_EXTRA_LDFLAGS="-L/tmp/culink")
      say "== peer: libcuda link shim -> $L"
    fi
  fi
  say "== peer: nvcc=${NVCC:-none}; $(env "${FI_ENV[@]}" python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1)"
fi

# (c) the benchmark suite (one GPU, every kernel on the same data).
if [ "$BENCH" = 1 ]; then
  BARGS=(--out "$OUT"); [ "$QUICK" = 1 ] && BARGS+=(--quick); [ "$FI_OK" = 1 ] || BARGS+=(--no-peer)
  run_step bench "$OUT/bench.log" 270 env "${FI_ENV[@]}" python3 -u benchmarks/bench_suite.py "${BARGS[@]}"
fi

# (d) the kernel table (only "triton" runs on Hopper; this checks the whole tune path on a GPU).
if [ "$TUNE" = 1 ]; then
  TROWS=(); [ "$QUICK" = 1 ] && TROWS=(--rows 1,4,16,64,320)
  run_step tune "$OUT/tune.log" 90 python3 -m vllm_kimi_dsa tune --out "$OUT/kernel_table.json" "${TROWS[@]}"
  run_step tune_dcp "$OUT/tune.log" 45 python3 -m vllm_kimi_dsa tune --dcp 2 --rows 1,4,16,64,320 \
    --out "$OUT/kernel_table.json"
  [ -f "$OUT/kernel_table.json" ] && cat "$OUT/kernel_table.json" | head -c 600 && echo
fi

# (e) compute-sanitizer on a tiny core run: converter + triton decode (+ combine), both formats, 16 and 128 heads.
if [ "$SAN" = 1 ]; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
  if [ -z "$CS" ]; then
    say "== sanitizer: compute-sanitizer not found"; RCS="$RCS sanitizer=missing"
  else
    cat > /tmp/sanitize_decode.py <<'EOF'
import os

import torch
from vllm_kimi_dsa.core import FlashInferCore
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers, make_step

dev = torch.device("cuda")
worst = 0.0
# (fmt, heads, rows, width, batches): tiny batches of each path, then batches whose plan on 132 SMs is tail-split
# (H = 128, 80 rows at width 512: 66 whole rows + 14 split 4 ways; H = 32, 160 rows: two CTAs an SM, 132 whole rows + 28
# split 4 ways; H = 16, 160 rows: two CTAs an SM, unsplit; H = 128, 200 rows: the seesaw kernel)
CASES = [(fmt, heads, 3, 256, (1, 3)) for fmt in ("fp8", "nvfp4_ds_mla") for heads in (16, 32, 128)]
if not os.environ.get("SAN_TINY"):  # racecheck takes minutes on these (its hazard tables): memcheck only
    CASES += [("fp8", 128, 80, 512, (80,)), ("fp8", 128, 200, 256, (200,)), ("fp8", 16, 160, 512, (160,)),
              ("fp8", 32, 160, 512, (160,)),
              ("nvfp4_ds_mla", 16, 160, 512, (160,))]
for fmt, heads, rows, width, batches in CASES:
    buffers = make_buffers(rows, heads, width, dev)
    core = FlashInferCore(StandInImpl(kv_cache_dtype=fmt), StandInLayer(), heads, buffers,
                          {b: "triton" for b in (1, *batches)}, kv_cache_dtype=fmt)
    for r in batches:
        step = make_step(r, heads, width, fmt, device=dev, empty_rows=1 if r > 1 else 0, seed=heads + r)
        out, lse = core.run(step.query, step.cache, step.topk, step.metadata)
        torch.cuda.synchronize()
        kv, _ = core.rows(step.cache, step.metadata.block_size)
        ref, _ = reference_decode(step.query, kv, buffers[0][:r], buffers[1][:r], fmt=core.fmt,
                                  softmax_scale=core.softmax_scale, output_scale=core.output_scale)
        err = float((out.float() - ref).norm() / ref.norm().clamp(min=1e-30))
        worst = max(worst, err)
        print(f"{fmt} H={heads} rows={r}: rel L2 {err:.2e}", flush=True)
print(f"sanitize script done, worst rel L2 {worst:.2e}", flush=True)
EOF
    run_step memcheck "$OUT/sanitizer.log" ${MEMCHECK_S:-100} "$CS" --tool memcheck --error-exitcode 9 python3 /tmp/sanitize_decode.py
    run_step racecheck "$OUT/sanitizer.log" 75 env SAN_TINY=1 "$CS" --tool racecheck --error-exitcode 9 python3 /tmp/sanitize_decode.py
  fi
fi

say "== rcs:$RCS"
say "== total $(( $(date +%s) - T0 ))s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
case "$RCS" in *=[1-9]*) exit 1;; esac
exit 0

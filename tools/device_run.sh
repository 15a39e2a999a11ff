#!/usr/bin/env bash
# The device runner: GPU tests, the benchmark suite, profiles and sanitizer runs of the shipped kernels, as steps of
# one device call (the `run` tool: repo root, torch + Triton 3.6, no vLLM / FlashInfer; what lands in $OUT comes back).
#   bash tools/device_run.sh [--t38] [--vllm] [--budget S] STEP [ARGS...] [+ STEP [ARGS...]]...
# Steps (each under `timeout` with what is left of the budget, or STEP@S's S seconds when fewer: a hang, e.g. an
# mbarrier phase bug, shows as rc 124; `tests@240 ...` keeps what is left after 240 s for the steps after it; a step
# reached with under 15 s of the budget left is skipped, and a skipped step fails the run):
#   tests [PYTEST ARGS]        pytest -q -rs of ARGS; no ARGS: each part of the GPU test list in turn, part=NAME: that
#                              part (tools/gpu_gate.py's PARTS: smoke, triton, gluon, few-heads), each part its own
#                              pytest and record, $OUT/gpu_record-PART-*.json (commit it into tests/gpu_records/)
#   suite [BENCH ARGS]         python -m vllm_kimi_dsa bench --out $OUT; the fa3 peer from .carry/fi when carried
#                              (/work/shared/device/flashinfer-sm90/prepare.sh .carry/fi), else --no-peer
#   memcheck [SCRIPT] [ARGS]   compute-sanitizer memcheck of tools/sanitize_case.py ARGS (or of SCRIPT.py ARGS)
#   racecheck [SCRIPT] [ARGS]  racecheck the same way (default ARGS: --tiny); hazards counted by source line
#   ncu [PROFILE ARGS]         ncu of tools/profile_gluon.py ARGS (e.g. --kernel seesaw --rows 32 --splits 2): the
#                              main sections and the per-SASS stall samples by loop (tools/ncu_stalls.py)
#   py SCRIPT.py|-m MOD [ARGS] any Python, e.g. benchmarks/bench_gluon.py --out $OUT ... or -m vllm_kimi_dsa tune
# --t38: Triton 3.8 (vLLM 0.33's) from .carry/t38 ahead of the image's Triton, Gluon kernels forced
# (VLLM_KIMI_DSA_GLUON=1); pack it here first (not on the device): bash tools/device_run.sh pack-t38 [DEST].
# --vllm [DIR] (or --vllm=DIR, or $VLLM_PACK): vLLM 0.33's Python code from DIR (default .carry/vllm; bash
# tools/pack_vllm.sh here first; carry DIR), unpacked into /tmp/vllm_site once a machine (again only when the pack
# changed), ahead of site-packages; vllm_so.tar.xz, when carried, adds vLLM's compiled libraries cut to sm_90
# (.carry/vllm_flashmla, SO=flashmla FROM=.carry/vllm bash tools/pack_vllm.sh .carry/vllm_flashmla: FlashMLA's
# libraries alone, what the suite's FlashMLA peers run; small enough to carry with .carry/fi). Offline: HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, no usage stats,
# the engine in-process. A test calls tools/vllm_device_shims.py's install() first (what torch 2.11 cannot load).
# --fi: FlashInfer from .carry/fi unpacked, named by $KIMI_DSA_FI_SITE (not on PYTHONPATH): bench_engine.py's
# FLASHINFER_MLA_SPARSE_SM90 engine puts it on its own path.
# --budget S: seconds for all steps (default 560). $OUT gets summary.txt and one log a step (N_STEP.log); past 8 files
# (what the tool returns) all but summary.txt, bench_suite.json and the GPU records go into logs.tgz. DRY=1 prints
# the steps only.
set -u -o pipefail
ROOT=$(pwd)
OUT=${OUT:-/tmp/device_out}
BUDGET=560
T0=$(date +%s)

if [ "${1:-}" = pack-t38 ]; then  # Triton 3.8's cp312 wheel less what a compile and launch do not use: ~52 MB xz
  DEST=${2:-.carry/t38}; W=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$W/whl" triton==3.8.0 || exit 1
  mkdir -p "$W/site" "$DEST" && (cd "$W/site" && python3 -m zipfile -e "$W"/whl/triton-3.8.0-*.whl .)
  T=$W/site/triton
  rm -rf "$T/backends/nvidia/lib/cupti" "$T/backends/nvidia/lib/cupti-blackwell" \
    "$T/backends/nvidia/bin/ptxas-blackwell" "$T/_C/libproton.so" "$T/plugins" "$T/FileCheck" \
    "$T/instrumentation/libGPUInstrumentationTestLib.so"
  chmod +x "$T"/backends/nvidia/bin/* && strip --strip-unneeded "$T/_C/libtriton.so"
  tar -cf - -C "$W/site" . | xz -T0 -9e > "$DEST/t38.tar.xz" && rm -rf "$W" && ls -la "$DEST/t38.tar.xz"
  exit
fi

# --vllm: the pack (site, then the compiled libraries if carried) unpacked unless /tmp/vllm_site holds this very pack
VLLM_PACK=${VLLM_PACK:-.carry/vllm}
vllm_env() {
  local p=$VLLM_PACK id
  if [ -n "${DRY:-}" ]; then
    echo "unpack $p/vllm_site.tar.xz and $p/vllm_so.tar.xz (if carried) into /tmp/vllm_site unless already there;" \
      "write this package's dist-info (vLLM's plugin entry point) there"
  else
    [ -f $p/vllm_site.tar.xz ] || { echo "no $p/vllm_site.tar.xz: bash tools/pack_vllm.sh here, carry $p"; return 1; }
    id=$(cat $p/vllm_site.tar.xz $p/vllm_so.tar.xz 2>/dev/null | cksum)
    if [ "$(cat /tmp/vllm_site/.pack 2>/dev/null)" != "$id" ]; then
      rm -rf /tmp/vllm_site && mkdir -p /tmp/vllm_site && tar -xJf $p/vllm_site.tar.xz -C /tmp/vllm_site || return 1
      [ ! -f $p/vllm_so.tar.xz ] || tar -xJf $p/vllm_so.tar.xz -C /tmp/vllm_site || return 1
      echo "$id" > /tmp/vllm_site/.pack
    fi
    # this package's metadata as pip records it (name, version, vLLM's plugin entry point), so vLLM's plugin loader
    # finds the backend as in an install; the code itself is imported from $ROOT (PYTHONPATH)
    python3 tools/device_boot/dist_info.py "$ROOT/pyproject.toml" /tmp/vllm_site || return 1
  fi
  export PYTHONPATH=/tmp/vllm_site:$ROOT/tools/device_boot:$PYTHONPATH VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
  [ -z "${DRY:-}" ] || echo "PYTHONPATH=$PYTHONPATH (ahead of site-packages) VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1" \
    "TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0"
}

# fi_env: the FlashInfer tree prepare.sh packed, unpacked at /tmp/fi/site for its JIT (sm_90a, 16 jobs, a libcuda
# link shim), named by $KIMI_DSA_FI_SITE; peer_env puts it on PYTHONPATH too (the suite's fa3 peer), --fi does not
# (bench_engine.py gives it to vLLM's FLASHINFER_MLA_SPARSE_SM90 engine alone: the other engines run without it)
peer_env() { fi_env && export PYTHONPATH=/tmp/fi/site:$PYTHONPATH; }
fi_env() {
  [ -f .carry/fi/fi_site.tar.xz ] || return 1
  if [ -z "${DRY:-}" ] && [ ! -d /tmp/fi/site ]; then
    mkdir -p /tmp/fi && tar -xJf .carry/fi/fi_site.tar.xz -C /tmp/fi || return 1
  fi
  export KIMI_DSA_FI_SITE=/tmp/fi/site FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws MAX_JOBS=16 \
    FLASHINFER_CUDA_ARCH_LIST=9.0a
  local ch; ch=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
  if [ ! -e "$ch/lib64/stubs/libcuda.so" ] && [ ! -e "$ch/lib64/libcuda.so" ]; then
    [ -n "${DRY:-}" ] || { mkdir -p /tmp/culink &&
      ln -sf "$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')" /tmp/culink/libcuda.so; }
    export FLASHINFER_EXTRA_LDFLAGS=-L/tmp/culink
  fi
}

export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1
while [ $# -gt 0 ]; do
  case $1 in
    --t38) mkdir -p /tmp/t38 && tar -xJf .carry/t38/t38.tar.xz -C /tmp/t38 || { echo "no .carry/t38"; exit 3; }
           export PYTHONPATH=/tmp/t38:$PYTHONPATH VLLM_KIMI_DSA_GLUON=1; shift;;
    --vllm=*) VLLM_PACK=${1#--vllm=}; vllm_env || exit 3; shift;;
    --vllm) if [ -f "${2:-}/vllm_site.tar.xz" ]; then VLLM_PACK=$2; shift; fi
            vllm_env || exit 3; shift;;
    --fi) fi_env || { echo "no .carry/fi: ../shared/device/flashinfer-sm90/prepare.sh .carry/fi here, carry it"; exit 3; }
          [ -z "${DRY:-}" ] || echo "KIMI_DSA_FI_SITE=$KIMI_DSA_FI_SITE (FlashInfer for the SM90 engine alone)"; shift;;
    --budget) BUDGET=$2; shift 2;;
    *) break;;
  esac
done
[ $# -gt 0 ] || { awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 2; }
[ -n "${DRY:-}" ] || mkdir -p "$OUT"
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
gpu_name() {
  if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 |
    head -1; else echo "no nvidia-smi"; fi
}
[ -n "${DRY:-}" ] || say "== $(gpu_name);" \
  "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1 | tail -1)"

# run N STEP CMD...: CMD under timeout for what is left of the budget, or of its step's cap when less (the 15 s floor
# is the budget's: a step capped at 10 s runs 10 s), its output in $OUT/N_STEP.log
run() {
  local log="$OUT/$1_$2.log" now left limit; shift 2
  now=$(date +%s); left=$(( BUDGET - now + T0 )); limit=$left
  [ -z "${CAP_END:-}" ] || [ $(( CAP_END - now )) -ge "$left" ] || limit=$(( CAP_END - now ))
  if [ -n "${DRY:-}" ]; then echo "${CAP:+(at most ${CAP}s) }$*"; return 0; fi
  [ "$left" -ge 15 ] || { say "== $(basename "$log" .log) skipped: ${left}s of the budget left"; return 1; }
  [ "$limit" -ge 1 ] || { say "== $(basename "$log" .log) skipped: its step's ${CAP}s are spent"; return 1; }
  timeout -k 10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  say "== $(basename "$log" .log) rc=$rc at +$(( $(date +%s) - T0 ))s (limit ${limit}s):" \
    "$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
  return $rc
}
pytest_run() {  # N ARGS...: the tests step's pytest, its junit xml in $OUT/N_junit.xml
  local n=$1; shift
  run "$n" tests python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/${n}_junit.xml" "$@"
}
# gpu_part N PART: pytest of one part of the GPU test list (tools/gpu_gate.py), then the record of that run
gpu_part() {
  local n=$1 part=$2 files options rc out
  files=$(python3 tools/gpu_gate.py files "$part" 2>/dev/null) ||
    { echo "tests part=$part: no such part ($(python3 tools/gpu_gate.py parts | paste -sd ' '))"; exit 2; }
  options=$(python3 tools/gpu_gate.py options "$part")
  pytest_run "$n" $options $files
  rc=$?
  local record=(python3 tools/gpu_gate.py record --out "$OUT" --junit "$OUT/${n}_junit.xml" --part "$part")
  if [ -n "${DRY:-}" ]; then echo "${record[*]} --rc \$?"; return 0; fi
  [ -f "$OUT/${n}_tests.log" ] || return $rc  # skipped: nothing ran, nothing to record
  out=$("${record[@]}" --rc $rc 2>&1); rc=$?
  say "== ${n}_record rc=$rc: $(echo "$out" | tail -1)"
}
step() {  # N STEP[@SECONDS] ARGS...
  local n=$1 s=$2; shift 2
  CAP=""; CAP_END=""
  case $s in *@*) CAP=${s#*@}; s=${s%@*}
    [[ $CAP =~ ^[0-9]+$ ]] || { echo "step $s@$CAP: the cap must be whole seconds"; exit 2; }
    CAP_END=$(( $(date +%s) + CAP ));; esac
  case $s in
    tests) if [ $# -gt 0 ] && [[ $1 != part=* ]]; then
             pytest_run "$n" "$@"
           else  # the GPU list's parts: a record stands for a whole part, so nothing is added to its pytest
             [ $# -le 1 ] || { echo "tests $1 takes no more arguments (a record stands for the whole part)"; exit 2; }
             local part parts=${1:-}
             parts=${parts#part=}
             [ -n "$parts" ] || parts=$(python3 tools/gpu_gate.py parts) || exit 2
             for part in $parts; do gpu_part "$n-$part" "$part"; done
           fi;;
    suite) local peer=--no-peer; peer_env && peer=
           run "$n" suite python3 -m vllm_kimi_dsa bench --out "$OUT" $peer "$@";;
    memcheck|racecheck)
           local script=tools/sanitize_case.py opts=(--tool memcheck --error-exitcode 9)
           case ${1:-} in *.py) script=$1; shift;; esac
           if [ "$s" = racecheck ]; then
             opts=(--tool racecheck --racecheck-report hazard --print-limit 100000 --error-exitcode 9)
             [ $# -gt 0 ] || [ "$script" != tools/sanitize_case.py ] || set -- --tiny
           fi
           [ -n "$CS${DRY:-}" ] || { say "== ${n}_$s: no compute-sanitizer here"; return 1; }
           run "$n" "$s" "$CS" "${opts[@]}" python3 "$script" "$@"
           local site="(Read|Write)( Thread \([0-9,]+\)| access) at [A-Za-z0-9_]+\+0x[0-9a-f]+ in [A-Za-z0-9_.]+:[0-9]+"
           [ -n "${DRY:-}" ] || grep -oE "$site" "$OUT/${n}_$s.log" |  # hazards counted by source line
             sed -E 's/ Thread \([0-9,]+\)//; s/\+0x[0-9a-f]+//' | sort | uniq -c | sort -rn | head -6 |
             tee -a "$OUT/summary.txt"
           [ -n "${DRY:-}" ] || gzip -f "$OUT/${n}_$s.log";;
    ncu)   local rep=/tmp/ncu_$n
           run "$n" ncu "$NCU" --clock-control none -k "regex:decode_kernel|few_heads_kernel" -s 1 -c 1 \
             --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
             --section MemoryWorkloadAnalysis --section SourceCounters -o "$rep" -f python3 tools/profile_gluon.py "$@"
           [ -n "${DRY:-}" ] || { "$NCU" -i "$rep.ncu-rep" >> "$OUT/${n}_ncu.log" 2>&1
             "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.csv" 2>&1
             python3 tools/ncu_stalls.py "$rep.csv" --top 20 >> "$OUT/${n}_ncu.log" 2>&1
             grep -E "Duration|DRAM Throughput|Registers Per|Warp Cycles Per Issued" "$OUT/${n}_ncu.log" | head -8; };;
    py)    run "$n" py python3 "$@";;
    *)     echo "unknown step '$s' (tests, suite, memcheck, racecheck, ncu, py)"; exit 2;;
  esac
}

n=0; args=()
for a in "$@" +; do
  if [ "$a" = + ]; then
    [ ${#args[@]} -gt 0 ] && { n=$((n + 1)); step "$n" "${args[@]}"; }
    args=()
  else args+=("$a"); fi
done
[ -n "${DRY:-}" ] && exit 0
files=$(cd "$OUT" && find . -type f | wc -l)
if [ "$files" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/device_logs.tgz --exclude=./summary.txt --exclude=./bench_suite.json \
    --exclude='./gpu_record-*.json' . && find . -type f ! -name summary.txt ! -name bench_suite.json \
    ! -name 'gpu_record-*.json' -delete && find . -mindepth 1 -type d -empty -delete &&
    mv /tmp/device_logs.tgz logs.tgz)
fi
say "== total $(( $(date +%s) - T0 ))s; in \$OUT: $(cd "$OUT" && find . -type f | sed 's#^\./##' | tr '\n' ' ')"
! grep -qE "rc=[1-9]|^== [^ ]+ skipped:" "$OUT/summary.txt"

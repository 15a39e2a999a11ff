#!/usr/bin/env bash
# Make the prefill peer's harness (git-ignored) from the project root:
#   bash benchmarks/peers/flashmla_prefill/prepare.sh [DEST] [JOBS]      (DEST default .carry)
# 1. DEST/flashmla: FlashMLA 9241ae3 + CUTLASS headers, from /work/shared/device/flashmla-sm90/prepare.sh (kept if
#    there already);
# 2. DEST/flashmla_prefill/objs: FlashMLA's SM90 sparse prefill kernels (d_qk 576, with / without topk_length)
#    compiled for sm_90a with nvcc (build_objs.sh; 7 min 40 s on a 2-core CPU machine, no GPU; kept if built);
# 3. DEST/flashmla_prefill/api_prefill.cpp: FlashMLA's sparse_fwd.h reduced to that path (make_api.py), and
#    build_ext.py beside it (the suite's peer links the extension with it, on the device);
# 4. DEST/flashmla_prefill/vllm_flashmla_C.abi3.so: vLLM's own FlashMLA build, when this Python has vLLM.
# On the device (carry DEST/flashmla and DEST/flashmla_prefill) build_ext.py links the extension in ~30-60 s;
# the bench's prefill section does that itself, in the background (peer.py --build).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${1:-.carry}
JOBS=${2:-$(nproc)}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
SHARED=${FLASHMLA_SHARED:-/work/shared/device/flashmla-sm90}
H=$DEST/flashmla_prefill
mkdir -p "$H/objs"
[ -d "$DEST/flashmla/csrc" ] || bash "$SHARED/prepare.sh" "$DEST"
if [ -s "$H/objs/phase1_k576_topklen.o" ] && [ -s "$H/objs/phase1_k576.o" ]; then
  echo "objects already built: $H/objs"
else
  bash "$HERE/build_objs.sh" "$DEST/flashmla" "$H/objs" "$JOBS"
fi
"$PY" "$HERE/make_api.py" "$DEST/flashmla" "$H/api_prefill.cpp"
cp "$HERE/build_ext.py" "$H/build_ext.py"  # the suite's peer (vllm_kimi_dsa.bench.peers.flashmla_prefill) runs it there
VSO=$("$PY" -c 'import importlib.util as u, os; s = u.find_spec("vllm"); print(os.path.join(os.path.dirname(s.origin), "_flashmla_C.abi3.so") if s else "")' 2>/dev/null || true)
if [ -n "$VSO" ] && [ -f "$VSO" ]; then cp "$VSO" "$H/vllm_flashmla_C.abi3.so"; else echo "no vLLM here: vLLM's own build not copied"; fi
du -sh "$DEST/flashmla" "$H" && ls -la "$H" "$H/objs"

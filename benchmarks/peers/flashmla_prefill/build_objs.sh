#!/usr/bin/env bash
# Compile FlashMLA's SM90 sparse prefill kernels (flash_mla_sparse_fwd, d_qk = 576: with and without topk_length)
# into sm_90a objects with FlashMLA's own nvcc flags (its setup.py, less --source-in-ptx). Needs no GPU and no torch.
#   build_objs.sh FLASHMLA_ROOT OUT_DIR [JOBS]      (FLASHMLA_ROOT: the tree prepare.sh of flashmla-sm90 unpacks)
# Writes OUT_DIR/<name>.o and OUT_DIR/<name>.o.log (ptxas's register / spill report) per source.
set -eu
ROOT=$(cd "${1:?FLASHMLA_ROOT}" && pwd)
OUTD=${2:?OUT_DIR}
JOBS=${3:-$(nproc)}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
NVCC=${NVCC:-nvcc}
FLAGS="-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations \
 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ \
 --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math \
 --ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage \
 -lineinfo -Xcompiler -fPIC \
 -gencode arch=compute_90a,code=sm_90a \
 -I$ROOT/csrc -I$ROOT/csrc/kerutils/include -I$ROOT/csrc/sm90 -I$ROOT/csrc/cutlass/include -I$ROOT/csrc/cutlass/tools/util/include"
# The d_qk = 576 instantiations only (DeepSeek-V3.2 / K3 rows); the topk_length one first (vLLM always passes it).
SRCS="csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu
csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu"
T0=$(date +%s)
export NVCC FLAGS ROOT OUTD
echo "$SRCS" | xargs -P "$JOBS" -I{} bash -c 'f={}; o=$OUTD/$(basename $f .cu).o; s=$(date +%s);
  if $NVCC $FLAGS -c $ROOT/$f -o $o > $o.log 2>&1; then echo "ok $f $(( $(date +%s)-s ))s";
  else echo "FAIL $f"; tail -30 $o.log; exit 255; fi'
echo "objects built in $(( $(date +%s)-T0 ))s with $JOBS jobs on $(nproc) cores"

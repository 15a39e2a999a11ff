#!/usr/bin/env bash
# Pack Triton 3.8.0 (vLLM 0.33's) for the H200, whose image has 3.6 and python 3.12, under the device tool's 64 MiB
# carry: the cp312 wheel's files less what a kernel compile and launch do not use (the CUPTI profiler libraries,
# libproton, the Blackwell ptxas) with libtriton.so's debug sections stripped, xz-compressed: 248 MB -> ~56 MB.
#   bash benchmarks/pack_triton38.sh [.carry/t38]   (then: benchmarks/device_triton38.sh with that folder in carry)
set -euo pipefail
DEST=${1:-.carry/t38}
WORK=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$WORK/whl" triton==3.8.0
mkdir -p "$WORK/site" && (cd "$WORK/site" && python3 -m zipfile -e "$WORK"/whl/triton-3.8.0-*.whl .)
T="$WORK/site/triton"
rm -rf "$T/backends/nvidia/lib/cupti" "$T/backends/nvidia/lib/cupti-blackwell" "$T/backends/nvidia/bin/ptxas-blackwell" \
  "$T/_C/libproton.so"
chmod +x "$T"/backends/nvidia/bin/*
strip --strip-unneeded "$T/_C/libtriton.so"
mkdir -p "$DEST"
tar -cf - -C "$WORK/site" . | xz -T0 -6 > "$DEST/t38.tar.xz"
rm -rf "$WORK"
ls -la "$DEST/t38.tar.xz"

#!/usr/bin/env bash
# One device call: the config sweep (benchmarks/sweep_configs.py), then ncu stall profiles of the round's
# baselines. From the repo root on the H200; everything lands in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/sweep_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 -u benchmarks/sweep_configs.py --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | grep -v Warning
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for spec in ${PROFILES:-fp8,12,2,320}; do
  echo "== ncu $spec" | tee -a "$OUT/ncu.txt"
  timeout 90 "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section MemoryWorkloadAnalysis -k regex:_decode_kernel -s 1 -c 1 \
    python3 benchmarks/sweep_configs.py --profile "$spec" >> "$OUT/ncu.txt" 2>&1
  echo "rc=$?" >> "$OUT/ncu.txt"
done
grep -E "^== ncu|Duration|Registers Per|Achieved Occupancy|Memory Throughput|Compute \(SM\) Throughput|Stall|Warp Cycles Per Issued|Issue Slots Busy|L1/TEX Hit|L2 Hit|DRAM Throughput|Theoretical Occ|rc=" "$OUT/ncu.txt" | head -80

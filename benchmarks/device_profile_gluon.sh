# ncu of the Gluon decode on the H200 (the device tool; repo root; $OUT): stall reasons, issue rates, memory.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout ${NCU_S:-150} "$NCU" --clock-control none -k regex:gluon_decode_kernel -s 1 -c 1 --section LaunchStats --section Occupancy \
  --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SpeedOfLight --section InstructionStats --section SourceCounters \
  python3 benchmarks/profile_gluon.py > "$OUT/ncu_gluon.txt" 2>&1
echo "ncu rc=$?"; grep -E "Duration|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued|Compute \(SM\)|Memory Throughput|DRAM Throughput|Registers|Executed Ipc|Eligible Warps|Active Warps" "$OUT/ncu_gluon.txt" | head -40

# ncu of the Gluon decode on the H200 (the device tool; repo root; $OUT): stall reasons, issue rates, memory,
# and per-SASS-instruction stall samples (sass_source.csv) to see which warp role waits where. The few-heads
# kernel: KREGEX=few_heads_kernel PROFILE_ARGS='--kernel few'.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ncu_out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout ${NCU_S:-200} "$NCU" --clock-control none -k regex:${KREGEX:-gluon_decode_kernel} -s 1 -c 1 --section LaunchStats --section Occupancy \
  --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SpeedOfLight --section InstructionStats --section SourceCounters \
  -o "$OUT/gluon" -f python3 benchmarks/profile_gluon.py ${PROFILE_ARGS:-} > "$OUT/ncu_run.txt" 2>&1
echo "ncu rc=$?"; tail -3 "$OUT/ncu_run.txt"
"$NCU" -i "$OUT/gluon.ncu-rep" > "$OUT/ncu_gluon.txt" 2>&1
"$NCU" -i "$OUT/gluon.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_source.csv" 2>&1
wc -c "$OUT"/*
grep -E "Duration|Issued Ipc|No Eligible|Stall|Warp Cycles Per Issued|Compute \(SM\)|Memory Throughput|DRAM Throughput|Registers|Executed Ipc|Eligible Warps|Active Warps" "$OUT/ncu_gluon.txt" | head -40
python3 benchmarks/ncu_stalls.py "$OUT/sass_source.csv" --top 30

# Why the seesaw kernel's split path costs more than gluon_decode's (NOTES v17): ncu of the main kernel and the
# combine, each kernel on the same 128 CTAs x 16 tiles, split 2 ways (32 rows, width 2048) or not (64 rows, width
# 1024); then per-SASS stall samples of the seesaw main kernel in both forms. Device tool, repo root, $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ncu_split}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
CASES=${CASES:-"seesaw:--rows=32:--splits=2 seesaw:--rows=64:--width=1024 gluon:--rows=32:--splits=2 gluon:--rows=64:--width=1024"}
for c in $CASES; do
  [ "$CASES" = none ] && break
  k=${c%%:*}; args=$(echo "${c#*:}" | tr ':' ' '); name=$(echo "$c" | tr -c 'a-z0-9\n' '_')
  timeout ${NCU_S:-120} "$NCU" --clock-control none -k regex:"decode_kernel|combine" -c 4 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section LaunchStats --section WarpStateStats \
    python3 benchmarks/profile_gluon.py --kernel "$k" $args > "$OUT/light_$name.txt" 2>&1
  echo "== $c rc=$?"
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Registers Per|Warp Cycles Per Issued" \
    "$OUT/light_$name.txt" | grep -v "^    ---" | head -40
done
SASS_CASES=${SASS_CASES:-"seesaw:--rows=32:--splits=2 seesaw:--rows=64:--width=1024"}
for c in $SASS_CASES; do
  k=${c%%:*}; args=$(echo "${c#*:}" | tr ':' ' '); name=$(echo "$c" | tr -c 'a-z0-9\n' '_')
  timeout ${NCU_S:-120} "$NCU" --clock-control none -k regex:decode_kernel -s 1 -c 1 --section WarpStateStats \
    --section SourceCounters -o "$OUT/src_$name" -f python3 benchmarks/profile_gluon.py --kernel "$k" $args \
    > "$OUT/src_run_$name.txt" 2>&1
  "$NCU" -i "$OUT/src_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$name.csv" 2>&1
  echo "== stalls $c"; python3 benchmarks/ncu_stalls.py "$OUT/sass_$name.csv" --top 12
  gzip -f "$OUT/sass_$name.csv"; rm -f "$OUT/src_$name.ncu-rep"
done

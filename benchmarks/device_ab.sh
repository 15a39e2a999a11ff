# A / B on the H200 (the device tool; repo root; $OUT): the working tree's Gluon kernels against a committed
# revision's, timed in the same run (METHOD.md: side by side), after the working tree's GPU tests.
#   local:  bash benchmarks/prepare_ab.sh REV      # copies REV's package + benchmarks to .carry/base
#   device: bash benchmarks/device_ab.sh           # with .carry/base in carry
# Runs the bench as B (working tree), A (.carry/base), B again, so drift within the run shows. Everything goes
# into $OUT/ab.tgz (the device returns few files) plus a printed table.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ab_out}; W=$(mktemp -d); mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "${NO_TESTS:-}" ]; then
  for t in ${TESTS:-gluon_few_heads gluon_decode}; do
    PYTHONPATH=. timeout ${TEST_S:-150} python3 -m pytest tests/test_$t.py -q -p no:cacheprovider -rs \
      --junitxml="$W/junit_$t.xml" > "$W/tests_$t.log" 2>&1
    echo "tests $t rc=$?: $(tail -1 "$W/tests_$t.log")"; grep -E "^(FAILED|ERROR)" "$W/tests_$t.log" | head -5
  done
fi
FEW=${FEW-few-tail,few-tail-nvfp4}; GLUON=${GLUON-gluon-tail}; ROWS=${ROWS:-5,20,80,160,320}  # "" skips one
for side in B A B2; do
  root=.; [ $side = A ] && root=.carry/base
  : > "$W/few_$side.log"; : > "$W/gluon_$side.log"
  [ -n "$FEW" ] && { timeout ${BENCH_S:-100} python3 -u $root/benchmarks/bench_few_heads.py --out "$W/$side/few" \
    --rows $ROWS --only $FEW --heads ${HEADS:-16,12,32} > "$W/few_$side.log" 2>&1; echo "few $side rc=$?"; }
  [ -n "$GLUON" ] && { timeout ${BENCH_S:-100} python3 -u $root/benchmarks/bench_gluon.py --out "$W/$side/gluon" \
    --rows $ROWS --only $GLUON > "$W/gluon_$side.log" 2>&1; echo "gluon $side rc=$?"; }
  grep -hE "^(few|gluon)[^ ]* +rows" "$W/few_$side.log" "$W/gluon_$side.log" | sed "s/^/$side /" > "$W/table_$side.txt"
  grep -hE "ok|BAD|FAIL" "$W/few_$side.log" "$W/gluon_$side.log" | grep -v Warning | sed "s/^/$side /" | head -12
done
paste -d'\n' "$W/table_B.txt" "$W/table_A.txt" "$W/table_B2.txt" | grep -v "^$"
if [ -n "${NCU:-}" ]; then  # shared-memory wavefronts of the few-heads kernel, B then A (e.g. NCU=1)
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for side in B A; do
    root=.; [ $side = A ] && root=.carry/base
    (cd $root && timeout 120 "$ncu" --clock-control none -k regex:few_heads_kernel -s 1 -c 1 \
      --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,gpu__time_duration.sum,smsp__cycles_elapsed.avg \
      python3 benchmarks/profile_gluon.py --kernel few) > "$W/ncu_$side.txt" 2>&1
    echo "ncu $side:"; grep -E "wavefronts|conflicts|duration|cycles_elapsed" "$W/ncu_$side.txt"
  done
fi
tar czf "$OUT/ab.tgz" -C "$W" .

# One sweep round on the H200 (the device tool): the kernel's GPU tests, then sweep_configs.py's CANDIDATES.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout ${TEST_S:-200} python3 -m pytest tests/test_triton_decode.py -q -x -p no:cacheprovider \
  --junitxml=$OUT/junit.xml > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
timeout ${SWEEP_S:-300} python3 -u benchmarks/sweep_configs.py --out $OUT 2>&1 | tee $OUT/sweep.log | grep -v Warning

export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -u benchmarks/sweep_configs.py --out $OUT 2>&1 | tee $OUT/sweep.log | grep -v Warning

. benchmarks/gpu_env.sh; ls -la /dev/nvidiactl; mkdir -p $OUT
PAIRS=new1 bash benchmarks/first_run.sh pairs 2>&1 | tail -3 | cut -c1-600
timeout 420 python3 -m pytest -m gpu -p no:cacheprovider --continue-on-collection-errors -rf tests/ > $OUT/gpu_tests.log 2>&1
tail -8 $OUT/gpu_tests.log | cut -c1-300

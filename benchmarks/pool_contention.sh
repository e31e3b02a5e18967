#!/usr/bin/env bash
# How much a compile pool beside it slows a job's own GPU start-up (issue 46's cold first run: the job's initial
# model took 2.1-2.5 s on fresh caches against 0.37 s warm, most of it in its first cuFFT plan). The probe
# (driver_jit_probe.py: the initial low-pass, the noise spectra, a prepared reference, sorts, products) runs on caches
# it filled itself, alone and beside a pool compiling other modules (the shipped list of every kind into a fresh
# CuPy cache, three copies of each told apart by a comment: ~10 s of compiles), the pool's workers at their own
# priority (nice 5) or reniced to 19. Run from the repository root on the GPU machine; $OUT gets one JSON per
# probe and times.txt.
set -u; . benchmarks/gpu_env.sh; mkdir -p $OUT/contention
C=$(mktemp -d); J=$(mktemp -d)
CUPY_CACHE_DIR=$C CUDA_CACHE_PATH=$J python3 benchmarks/driver_jit_probe.py --label fill --out /tmp/fill.json \
  > /dev/null
pool() {  # $1 workers: a pool compiling every shipped module into a fresh cache, in the background
  CUPY_CACHE_DIR=$(mktemp -d) python3 -c "
from pathlib import Path; import os
from napari_gpu_relion.runtime import cupy_kernels
entries = [dict(e, source=e['source'] + f'\\n// copy {k}\\n') for k in range(3)
           for e in cupy_kernels.shipped_entries(None)]
print(cupy_kernels.compile_ahead(entries, 0, Path(os.environ['CUPY_CACHE_DIR']), workers=$1))" > /tmp/pool.log 2>&1 &
  echo $!
}
for round in 1 2; do
  for cfg in alone w12 w6 w12nice19 w3; do
    P=""
    case $cfg in alone) ;; w12|w12nice19) P=$(pool 12) ;; w6) P=$(pool 6) ;; w3) P=$(pool 3) ;; esac
    if [ -n "$P" ]; then
      sleep 2.5  # the workers started, made their contexts and compile
      [ $cfg = w12nice19 ] && for c in $(pgrep -P $P); do renice -n 19 -p $c > /dev/null; done
    fi
    CUPY_CACHE_DIR=$C CUDA_CACHE_PATH=$J python3 benchmarks/driver_jit_probe.py --label ${cfg}_$round \
      --out $OUT/contention/${cfg}_$round.json | tee -a $OUT/contention/times.txt
    [ -n "$P" ] && { kill -- $P 2>/dev/null; pkill -P $P 2>/dev/null; wait $P 2>/dev/null; sleep 0.5; }
  done
done

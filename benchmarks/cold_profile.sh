#!/usr/bin/env bash
# Where a new machine's first class3d spends its time (issue 46's cold target), on one GPU. Run from the repository
# root on the GPU machine, carrying .whl and .pyspy (a py-spy wheel: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .pyspy py-spy`); $OUT gets one tar.
# 1. The caches apart, each job a fresh process, ROUNDS times: both caches filled by a first run ("filled"), then
#    "cold" (a fresh CuPy cache and a fresh driver cache, CUDA_CACHE_PATH), "cupy_cold" (a fresh CuPy cache, the
#    driver's filled), "driver_cold" (CuPy's filled, a fresh driver cache: what the driver compiles, cuFFT's kernels
#    among them) and "warm" (both filled).
# 2. The job's process sampled by py-spy (every thread, idle included, speedscope format: each thread's samples in
#    time order), cold and warm; benchmarks/speedscope_summary.py reads them.
set -u; . benchmarks/gpu_env.sh; mkdir -p $OUT /root/cp_out
[ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .pyspy/*.whl
sim_box128
C3=$CLASS3D_BOX128
job() {  # name cupy_cache driver_cache [py-spy]
  local t0; t0=$(date +%s.%N)
  if [ -n "${4:-}" ]; then
    CUPY_CACHE_DIR=$2 CUDA_CACHE_PATH=$3 /tmp/pyspy/bin/py-spy record --idle --threads --rate 250 --format speedscope \
      -o /root/cp_out/profile_$1.json -- python3 -m napari_gpu_relion.cli $C3 --o /root/cp_w/$1/run > /root/cp_out/$1.log 2>&1
  else
    CUPY_CACHE_DIR=$2 CUDA_CACHE_PATH=$3 python3 -m napari_gpu_relion.cli $C3 --o /root/cp_w/$1/run > /root/cp_out/$1.log 2>&1
  fi
  echo "$1 $(python3 -c "import time; print(round(time.time() - $t0, 2))")" | tee -a /root/cp_out/times.txt
  rm -rf /root/cp_w/$1
}
rm -rf /root/cp_c* /root/cp_j* /root/cp_w; : > /root/cp_out/times.txt
for r in $(seq ${ROUNDS:-2}); do
  rm -rf /root/cp_cf /root/cp_jf; job filled$r /root/cp_cf /root/cp_jf
  rm -rf /root/cp_c0 /root/cp_j0; job cold$r /root/cp_c0 /root/cp_j0
  rm -rf /root/cp_c0 /root/cp_j1; cp -r /root/cp_jf /root/cp_j1; job cupy_cold$r /root/cp_c0 /root/cp_j1
  rm -rf /root/cp_c1 /root/cp_j0; cp -r /root/cp_cf /root/cp_c1; job driver_cold$r /root/cp_c1 /root/cp_j0
  job warm$r /root/cp_cf /root/cp_jf
done
rm -rf /root/cp_c0 /root/cp_j0; job profiled_cold /root/cp_c0 /root/cp_j0 spy
job profiled_warm /root/cp_c0 /root/cp_j0 spy
du -sk /root/cp_jf /root/cp_cf | tee -a /root/cp_out/times.txt
tar -czf $OUT/cold_profile.tgz -C /root cp_out

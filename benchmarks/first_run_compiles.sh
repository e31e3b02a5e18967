#!/usr/bin/env bash
# What a first class3d and refine3d still compile after `warmup` (issue 46), with the call sites
# (benchmarks/kernel_compiles.py), then the GPU tests of the E-step, the jobs and the registry. $OUT gets the files.
set -u; . benchmarks/gpu_env.sh; nvidia-smi --query-gpu=name --format=csv,noheader
D=/root/d128; mkdir -p $OUT; export CUPY_CACHE_DIR=/root/c_warm
ngr simulate --o $D --n_particles 5000 --box 128 --angpix 2.54 --snr 0.05 --conformations 2 --n_micrographs 0 --particle_diameter 250 > $OUT/sim.log 2>&1
ngr warmup --gpu 0 > $OUT/warmup.log 2>&1; tail -2 $OUT/warmup.log
O="--ctf --particle_diameter 250 --ini_high 60 --gpu 0 --i $D/particles.star --ref $D/reference.mrc"
python3 benchmarks/kernel_compiles.py --out $OUT/compiles_class3d.json -- class3d $O --o /root/w/c3/run --K 4 --iter 5 --random_seed 1 > $OUT/c3.log 2>&1; tail -3 $OUT/c3.log
python3 benchmarks/kernel_compiles.py --out $OUT/compiles_refine3d.json -- refine3d $O --o /root/w/r3/run > $OUT/r3.log 2>&1; tail -3 $OUT/r3.log
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_kernel_registry.py -k "estep or memory or class3d or refine or posterior or segment" > $OUT/gpu_tests.log 2>&1; tail -4 $OUT/gpu_tests.log

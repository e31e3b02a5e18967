#!/usr/bin/env bash
# The first-run measurement of issue 46 on one GPU (run from the repository root on the GPU machine; $OUT gets the JSON).
set -u; . benchmarks/gpu_env.sh; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import cupy; print('cupy', cupy.__version__)"
D=/root/d128; mkdir -p $OUT
ngr simulate --o $D --n_particles 5000 --box 128 --angpix 2.54 --snr 0.05 --conformations 2 --n_micrographs 0 --particle_diameter 250 > $OUT/sim.log 2>&1; tail -1 $OUT/sim.log
C3="class3d --i {data}/particles.star --ref {data}/reference.mrc --o {out}/run --K 4 --iter 5 --ctf --particle_diameter 250 --ini_high 60 --random_seed 1 --gpu 0"
R3="refine3d --i {data}/particles.star --ref {data}/reference.mrc --o {out}/run --ctf --particle_diameter 250 --ini_high 60 --gpu 0"
CUPY_CACHE_DIR=/root/c_cold python3 benchmarks/first_run.py --data $D --work /root/w1 --out $OUT/first_run_cold.json --step "cold_class3d=$C3" --step "second_class3d=$C3"
export CUPY_CACHE_DIR=/root/c_warm
python3 benchmarks/first_run.py --data $D --work /root/w2 --out $OUT/first_run_warmup.json --step "warmup=warmup --gpu 0" --step "first_class3d=$C3" --step "second_class3d=$C3" --step "first_refine3d=$R3" --step "second_refine3d=$R3"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_registry.py tests/test_gpu.py -k "registry or preload or finish or any_over or every_fused" > $OUT/gpu_tests.log 2>&1; tail -5 $OUT/gpu_tests.log

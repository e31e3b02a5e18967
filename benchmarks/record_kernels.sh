#!/usr/bin/env bash
# Record the CuPy kernel modules the EM jobs load at the sizes users run (issue 46): each job kind's preload
# manifest (runtime/kernel_preload.py) after runs at box 128, 256 and 360, with an empty kernel cache. $OUT gets
# the manifests; `python benchmarks/ship_kernels.py` merges them into the package's shipped list.
set -u; . benchmarks/gpu_env.sh; nvidia-smi --query-gpu=name --format=csv,noheader; mkdir -p $OUT
export CUPY_CACHE_DIR=/root/c_rec NAPARI_GPU_RELION_KERNEL_PRELOAD=0
S="--n_micrographs 0 --particle_diameter 250 --snr 0.05"
ngr simulate --o /root/d128 --n_particles 5000 --box 128 --angpix 2.54 --conformations 2 $S > $OUT/sim.log 2>&1 &
ngr simulate --o /root/d256 --n_particles 3000 --box 256 --angpix 1.27 --conformations 2 $S >> $OUT/sim.log 2>&1 &
ngr simulate --o /root/d360 --n_particles 1500 --box 360 --angpix 0.903 $S >> $OUT/sim.log 2>&1 &
wait; tail -3 $OUT/sim.log
c() { d=$1; shift; echo "$*" | cut -c1-60; t0=$SECONDS; python3 -m napari_gpu_relion.cli "$@" --i $d/particles.star --ctf --particle_diameter 250 --gpu 0 > $OUT/$(echo $3 | tr / _).log 2>&1; echo "  rc $? $((SECONDS - t0)) s"; grep "GPU kernels" $OUT/$(echo $3 | tr / _).log | cut -c1-200; }
c /root/d128 class3d --o /root/w/c3_128/run --ref /root/d128/reference.mrc --ini_high 60 --K 4 --iter 5 --random_seed 1
c /root/d128 refine3d --o /root/w/r3_128/run --ref /root/d128/reference.mrc --ini_high 60
c /root/d128 class2d --o /root/w/c2_128/run --K 200 --iter 3
c /root/d256 class3d --o /root/w/c3_256/run --ref /root/d256/reference.mrc --ini_high 60 --K 6 --iter 3 --random_seed 1
c /root/d360 refine3d --o /root/w/r3_360/run --ref /root/d360/reference.mrc --ini_high 60 --healpix_order 1 --auto_local_healpix_order 2 --auto_iter_max 4
ls -la $CUPY_CACHE_DIR/napari_gpu_relion_preload/; cp $CUPY_CACHE_DIR/napari_gpu_relion_preload/*.json $OUT/

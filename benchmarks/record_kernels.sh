#!/usr/bin/env bash
# Record the CuPy kernel modules the EM jobs compile at the sizes users run (issue 46): each run with an empty
# kernel cache of its job kind (the preload off, CuPy saving each module's source), then record_kernels.py lists the
# modules with their options. $OUT gets one list per job kind; `python benchmarks/ship_kernels.py` merges them into
# the package's shipped list.
set -u; . benchmarks/gpu_env.sh; nvidia-smi --query-gpu=name --format=csv,noheader; mkdir -p $OUT
export NAPARI_GPU_RELION_KERNEL_PRELOAD=0 CUPY_CACHE_SAVE_CUDA_SOURCE=1
S="--n_micrographs 0 --particle_diameter 250 --snr 0.05"
ngr simulate --o /root/d128 --n_particles 5000 --box 128 --angpix 2.54 --conformations 2 $S > $OUT/sim.log 2>&1 &
ngr simulate --o /root/d256 --n_particles 3000 --box 256 --angpix 1.27 --conformations 2 $S >> $OUT/sim.log 2>&1 &
ngr simulate --o /root/d360 --n_particles 1500 --box 360 --angpix 0.903 $S >> $OUT/sim.log 2>&1 &
wait; tail -3 $OUT/sim.log
c() { d=$1; shift; export CUPY_CACHE_DIR=/root/c_rec_$1; echo "$*" | cut -c1-60; t0=$SECONDS; python3 -m napari_gpu_relion.cli "$@" --i $d/particles.star --ctf --particle_diameter 250 --gpu 0 > $OUT/$(echo $3 | tr / _).log 2>&1; echo "  rc $? $((SECONDS - t0)) s"; grep "GPU kernels" $OUT/$(echo $3 | tr / _).log | cut -c1-200; }
c /root/d128 class3d --o /root/w/c3_128/run --ref /root/d128/reference.mrc --ini_high 60 --K 4 --iter 5 --random_seed 1
c /root/d128 refine3d --o /root/w/r3_128/run --ref /root/d128/reference.mrc --ini_high 60
c /root/d128 class2d --o /root/w/c2_128/run --K 200 --iter 3
c /root/d256 class3d --o /root/w/c3_256/run --ref /root/d256/reference.mrc --ini_high 60 --K 6 --iter 3 --random_seed 1
c /root/d360 refine3d --o /root/w/r3_360/run --ref /root/d360/reference.mrc --ini_high 60 --healpix_order 1 --auto_local_healpix_order 2 --auto_iter_max 4
# the ranks' path (forty-first session: a 2-GPU job compiled 2 modules the single-GPU runs never did): class3d on 2
# MPI ranks, on GPUs 0 and 1 where there are two (NCCL), else both on GPU 0 (CUDA IPC), into class3d's cache
G=$(nvidia-smi -L | wc -l); GPUS=0:0; [ "$G" -ge 2 ] && GPUS=0:1
if command -v mpiexec > /dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 CUPY_CACHE_DIR=/root/c_rec_class3d
  echo "class3d on 2 ranks, --gpu $GPUS"; t0=$SECONDS
  mpiexec --bind-to none -n 2 python3 -m napari_gpu_relion.cli class3d --i /root/d128/particles.star --ctf \
      --particle_diameter 250 --gpu $GPUS --o /root/w/c3_128_ranks2/run --ref /root/d128/reference.mrc --ini_high 60 \
      --K 4 --iter 3 --random_seed 1 > $OUT/class3d_ranks2.log 2>&1
  echo "  rc $? $((SECONDS - t0)) s"; grep "GPU kernels" $OUT/class3d_ranks2.log | cut -c1-200
fi
for job in class3d refine3d class2d; do
  # a kind's runs at several boxes share its cache: the list holds every module of them
  python3 benchmarks/record_kernels.py --cache /root/c_rec_$job --out $OUT/$job.json
done

#!/usr/bin/env bash
# The first-run measurement of issue 46 on one GPU (run from the repository root on the GPU machine; $OUT gets the
# JSON): a fresh machine's first class3d without any warm-up, then `warmup` and the first and second run of five
# jobs, each a fresh process (benchmarks/first_run.py). With the argument `cub` or `nocub`: the cold class3d with and
# without CuPy's CUB block reductions instead, on the box-128 data only (not run yet).
# With `pairs` (forty-first session): the cold class3d and its second run, each pair on fresh caches (CuPy's and the
# driver's: CUDA_CACHE_PATH), for this code ("new") and, where .old_src/src holds an older copy (`git archive REV src |
# tar -x -C .old_src`, carried), for that ("old"), alternated on one machine: PAIRS="new1 old1 new2" by default. The
# first "new" pair keeps its whole logs. NEW_ENV="NAME=value ..." is added to the "new" runs' environment (forty-ninth
# session: CUPY_NVRTC_USE_PCH=1 against the same code without it, .old_src a copy of src). A third copy, "mid*" runs,
# in .mid_src/src (carried).
M=${1:-}
# With `large` (forty-eighth session): after `warmup`, the box-256 class3d and the box-360 auto-refine three times each,
# whole logs kept (one tar) and the driver's JIT cache measured after each run: what a first job at a large box still
# pays with no module compiled (1.11x and 1.12x the second run in that session's plain run).
case $M in ""|cub|nocub|pairs|large) ;; *) echo "first_run.sh: unknown mode '$M' (none, cub, nocub, pairs, large)"; exit 2 ;; esac
set -u; . benchmarks/gpu_env.sh; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy; print('cupy', cupy.__version__)"; mkdir -p $OUT
S="--n_micrographs 0 --particle_diameter 250 --snr 0.05"
sim_box128 &
BIG=1; case $M in cub|nocub|pairs) BIG="" ;; esac
[ -f /root/d256/particles.star ] || [ -z "$BIG" ] || ngr simulate --o /root/d256 --n_particles 3000 --box 256 --angpix 1.27 --conformations 2 $S > /tmp/s2.log 2>&1 &
[ -f /root/d360/particles.star ] || [ -z "$BIG" ] || ngr simulate --o /root/d360 --n_particles 1500 --box 360 --angpix 0.903 $S > /tmp/s3.log 2>&1 &
wait
J="--ctf --particle_diameter 250 --gpu 0 --o {out}/run"
C3="$CLASS3D_BOX128 --o {out}/run"
R3="refine3d --i /root/d128/particles.star --ref /root/d128/reference.mrc --ini_high 60 $J"
C2="class2d --i /root/d128/particles.star --K 200 --iter 3 $J"
C6="class3d --i /root/d256/particles.star --ref /root/d256/reference.mrc --ini_high 60 --K 6 --iter 3 --random_seed 1 $J"
# class2d K=200 at box 360 with the standard 2D options (the forty-seventh session's whole job compiled 5 modules
# after `warmup`; shipped since)
C2B="class2d --i /root/d360/particles.star --K 200 --iter 3 --psi_step 6 --offset_range 5 --offset_step 2 --tau2_fudge 2 $J"
R6="refine3d --i /root/d360/particles.star --ref /root/d360/reference.mrc --ini_high 60 --healpix_order 1 --auto_local_healpix_order 2 --auto_iter_max 4 $J"
if [ "$M" = large ]; then
  NV=$HOME/.nv/ComputeCache; jit() { echo "driver JIT cache after $1: $(du -sk $NV 2>/dev/null | cut -f1) kB"; }
  jit start
  CUPY_CACHE_DIR=/root/c_large python3 benchmarks/first_run.py --data x --work /root/wl --logs /root/logs_large \
    --out $OUT/first_run_large.json --step "warmup=warmup --gpu 0" | cut -c1-200; jit warmup
  for i in 1 2 3; do
    for j in class3d_K6_box256 refine3d_box360; do
      A=$C6; [ $j = refine3d_box360 ] && A=$R6
      CUPY_CACHE_DIR=/root/c_large python3 benchmarks/first_run.py --data x --work /root/wl --logs /root/logs_large \
        --out /root/logs_large/first_run_large_${j}_$i.json --step "run${i}_$j=$A" | cut -c1-120; jit run${i}_$j
    done
  done
  tar -czf $OUT/first_run_large_logs.tgz -C /root logs_large
  exit 0
fi
if [ "$M" = pairs ]; then
  for v in ${PAIRS:-new1 old1 new2}; do
    P=$PWD/src; case $v in old*) P=$PWD/.old_src/src ;; mid*) P=$PWD/.mid_src/src ;; esac
    rm -rf /root/c_$v /root/j_$v /root/w_$v
    # the first pair saves the modules' sources: its JSON lists each module written, by name and time
    SAVE=0; [ $v = new1 ] && SAVE=1
    E=""; case $v in new*) E=${NEW_ENV:-} ;; esac  # NEW_ENV="NAME=value ...": the "new" runs' environment
    env $E CUPY_CACHE_SAVE_CUDA_SOURCE=$SAVE PYTHONPATH=$P:/tmp/site CUPY_CACHE_DIR=/root/c_$v CUDA_CACHE_PATH=/root/j_$v \
      python3 benchmarks/first_run.py \
      --data x --work /root/w_$v $( [ $v = new1 ] && echo --logs $OUT/logs_$v ) --out $OUT/first_run_cold_$v.json \
      --step "cold_class3d=$C3" --step "second_class3d=$C3" | cut -c1-400
  done
  exit 0
fi
if [ -n "$M" ]; then  # the cold class3d with CuPy's CUB block reductions (its default) and without them
  # (CUPY_ACCELERATORS empty: CuPy's own reduction kernels), each on a fresh cache: CUB's 25 modules are 65 % of
  # NVRTC's time on the class3d list (nvrtc_costs.py). `cub`: three runs each; `nocub` (a short call): two, without
  # CUB first
  ORDER="cub none"; STEPS=(--step "cold_class3d=$C3" --step "second_class3d=$C3")
  if [ "$M" = nocub ]; then ORDER="none cub"; else STEPS+=(--step "third_class3d=$C3"); fi
  for acc in $ORDER; do
    A=""; [ $acc = cub ] && A=cub
    CUPY_ACCELERATORS=$A CUPY_CACHE_DIR=/root/c_$acc python3 benchmarks/first_run.py --data x --work /root/w_$acc \
      --out $OUT/first_run_cold_accelerators_${acc}.json "${STEPS[@]}"
  done
  exit 0
fi
CUPY_CACHE_DIR=/root/c_cold python3 benchmarks/first_run.py --data x --work /root/w1 --out $OUT/first_run_cold.json --step "cold_class3d=$C3" --step "second_class3d=$C3"
CUPY_CACHE_DIR=/root/c_warm python3 benchmarks/first_run.py --data x --work /root/w2 --out $OUT/first_run_warmup.json --step "warmup=warmup --gpu 0" \
  --step "first_class3d=$C3" --step "second_class3d=$C3" --step "first_refine3d=$R3" --step "second_refine3d=$R3" \
  --step "first_class2d_K200=$C2" --step "second_class2d_K200=$C2" --step "first_class3d_K6_box256=$C6" --step "second_class3d_K6_box256=$C6" \
  --step "first_refine3d_box360=$R6" --step "second_refine3d_box360=$R6" \
  --step "first_class2d_K200_box360=$C2B" --step "second_class2d_K200_box360=$C2B"
# the code before the public-API preload (carry .old_src: `git archive 67951f0 src | tar -x -C .old_src`), for
# what the in-process hand-over of CuPy's modules saved: its second class3d against this code's, same cache
if [ -d .old_src/src ]; then
  PYTHONPATH=$PWD/.old_src/src:/tmp/site CUPY_CACHE_DIR=/root/c_warm python3 benchmarks/first_run.py --data x \
    --work /root/w3 --out $OUT/first_run_old_preload.json --step "old_class3d_1=$C3" --step "old_class3d_2=$C3" \
    --step "old_class3d_3=$C3"
  CUPY_CACHE_DIR=/root/c_warm python3 benchmarks/first_run.py --data x --work /root/w4 \
    --out $OUT/first_run_new_again.json --step "new_class3d_3=$C3" --step "new_class3d_4=$C3"
fi

# Issue 47 on a machine of several H200s (nvidia-h200-x2 or -x4; carry .whl and .relion_kit; chain calls within 30 s
# so that /root stays on the machine). Ranks take the GPUs in turn (--gpu 0:1[:2:3]); NVLink multicast stays off.
#   bash benchmarks/scaling_calls.sh tests            the GPU tests of the images a rank keeps on its GPU
#   bash benchmarks/scaling_calls.sh small GPUS      10,000 particles of our simulator at box 128, class3d K=4, 5
#       iterations, on 1 and GPUS ranks (the "never slower on more GPUs")
#   bash benchmarks/scaling_calls.sh fastexit GPUS   small's class3d on GPUS ranks, the command line's os._exit after
#       the job against the interpreter's own exit (NAPARI_GPU_RELION_FAST_EXIT=0), alternated twice after a first run
#   bash benchmarks/scaling_calls.sh data N          RELION built; N EMD-11007 particles of two states at box 256
#       (1.05 Å/px, SNR 0.05) by relion_project in 32 processes, kept in /root/s256_N; then `warmup`
#   bash benchmarks/scaling_calls.sh class3d N GPUS [ITER]  class3d K=6, ITER iterations (5; the standard benchmark
#       runs 25), the standard benchmark's options, on the N particles, 1 and GPUS ranks
#   bash benchmarks/scaling_calls.sh relion N GPUS RANKS LIMIT   RELION's class3d (the same options) on the N
#       particles with RANKS MPI ranks over GPUS GPUs (mpirun -n 5 and -n 9 on 4), stopped after LIMIT s
#   bash benchmarks/scaling_calls.sh refine3d N GPUS ITER   auto-refine (ITER-1 iterations at most) on them, 1 and GPUS
#   bash benchmarks/scaling_calls.sh accelerators N  class3d K=6 (as above) on one GPU with CuPy's reductions
#       without CUB (the package's default) and with CUB (CUPY_ACCELERATORS=cub), alternated twice on the same
#       machine: whether CUB's reductions pay at this size (compare iterations 2-5; iteration 1 compiles)
#   bash benchmarks/scaling_calls.sh cubprofile N    which kernels CuPy's reductions with CUB speed up: class3d K=6
#       (2 iterations) on N particles of our simulator at box 256 under profile_job.py --kernel_trace 2, without and
#       with CUB (thirty-eighth session: the M-step 0.49 s per iteration without, 0.32 s with, the E-step the same)
#   bash benchmarks/scaling_calls.sh fixedwork N     issue 47's work every rank repeats, on one GPU: class3d K=6 (3
#       iterations, the options above) on the N particles of `data N` and on their first half (a subset STAR), then
#       the half under profile_job.py --kernel_trace 3; a rank's fixed work per iteration is E(N/2) - E(N)/2
# RANKS=2 bash benchmarks/scaling_calls.sh class3d N 2    only the given rank counts (default 1,GPUS)
# TAG=_x bash benchmarks/scaling_calls.sh class3d N 2    _x added to the JSON's and logs' names (several runs in a call;
#       e.g. NAPARI_GPU_RELION_NCCL=0 NAPARI_GPU_RELION_IPC=0 TAG=_host: issue 47's stand-in for ranks on other nodes)
# RANKS=1,1,2 bash benchmarks/scaling_calls.sh class3d 100000 2 25   the 1-GPU run twice: how far two runs of one
#       layout agree after 25 iterations (the GPU's atomic sums), beside how far 1 and 2 GPUs do
# Results (scaling.py's JSON, which names the GPU) in $OUT.
. benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T0=$(date +%s)
el() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
NG=${3:-2}
GPUS=$(seq -s: 0 $(( NG - 1 )))
MPI="$(command -v mpiexec) --bind-to none"
# the options standard_class3d.py gives both programs (vs_relion.common_options), so that RELION's run compares
STD="--particle_diameter 180 --flatten_solvent --zero_mask --offset_range 5 --offset_step 2 --pad 2 --ini_high 60 \
--norm --scale"
python3 -c "import mpi4py, cupy; from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
case "$1" in
  tests)  # the GPU tests of the images kept on the GPU (one process, and two ranks on GPU 0)
    timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/test_mpi.py::test_ranks_keep_their_own_images_on_the_gpu_and_equal_one_process \
        tests/test_mpi.py::test_ranks_sharing_a_gpu_sum_on_it_through_cuda_ipc \
        tests/test_gpu.py::test_images_kept_on_the_gpu_give_the_same_refinement_as_images_read_from_the_disk \
        2>&1 | tail -4
    el "tests" ;;
  small)
    GPUS=$(seq -s: 0 $(( $2 - 1 )))
    python3 benchmarks/scaling.py --job class3d --ranks 1,$2 --gpu $GPUS --n_particles 10000 --box 128 --K 4 \
        --iter 5 --work /root/sc128 --mpiexec "$MPI" --out $OUT/scaling_class3d_box128_n10000_h200x$2${TAG:-}.json \
        | grep '^{"ranks' | cut -c1-600
    el "small" ;;
  fastexit)  # the command line's exit by os._exit after main against the interpreter's own exit
    # (NAPARI_GPU_RELION_FAST_EXIT=0): small's class3d on GPUS ranks (1: one rank), a first run that compiles, then
    # the two alternated twice; the JSONs' wall_s minus job_s and process_before_job_s is the time around the job
    GPUS=$(seq -s: 0 $(( $2 - 1 )))
    for run in 1_warm 0_a 1_a 0_b 1_b; do
      NAPARI_GPU_RELION_FAST_EXIT=${run%_*} python3 benchmarks/scaling.py --job class3d --ranks $2 --gpu $GPUS \
          --n_particles 10000 --box 128 --K 4 --iter 5 --work /root/sc128 --mpiexec "$MPI" \
          --out $OUT/fastexit_class3d_box128_n10000_ranks$2${TAG:-}_exit$run.json | grep '^{"ranks' | cut -c1-300
      el "class3d, NAPARI_GPU_RELION_FAST_EXIT=${run%_*} ($run)"
    done ;;
  data)
    start_relion; wait_relion; el "RELION built"
    python3 benchmarks/standard_class3d.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
        --angpix 1.05 --box 256 --n $2 --states 2 --snr 0.05 --jobs 32 --out /root/s256_$2 | cut -c1-400
    df -h /root | tail -1; el "data"
    # the kernels compiled before the runs: otherwise the first (1-GPU) run compiles them and the ratio flatters more
    # GPUs (thirty-seventh session: the 1-GPU class3d compiled 313 modules, its start-up 8.27 s against 3.6 s)
    python3 -m napari_gpu_relion.cli warmup --gpu 0 2>&1 | tail -1 | cut -c1-300; el "warmup" ;;
  class3d)
    python3 benchmarks/scaling.py --job class3d --ranks ${RANKS:-1,$NG} --gpu $GPUS --data /root/s256_$2 --K 6 \
        --iter ${4:-5} --work /root/w256_$2 --extra "$STD --tau2_fudge 4" --mpiexec "$MPI" \
        --out $OUT/scaling_class3d_K6_box256_n$2_it${4:-5}_h200x$NG${TAG:-}.json | grep '^{"ranks' | cut -c1-900
    for d in /root/w256_$2/class3d_n*; do cp $d/log.txt $OUT/log_class3d_n$2_$(basename $d)${TAG:-}.txt; done
    el "class3d" ;;
  accelerators)
    for run in none_1 cub_1 none_2 cub_2; do
      A=""; [ ${run%_*} = cub ] && A=cub
      CUPY_ACCELERATORS=$A python3 benchmarks/scaling.py --job class3d --ranks 1 --gpu 0 --data /root/s256_$2 --K 6 \
          --iter 5 --work /root/wa_$run --extra "$STD --tau2_fudge 4" \
          --out $OUT/accelerators_class3d_K6_box256_n$2_${run}.json | grep '^{"ranks' | cut -c1-300
    done
    el "accelerators" ;;
  cubprofile)
    [ -f /root/acc/data/particles.star ] || python3 benchmarks/scaling.py --job class3d --ranks 1 --gpu 0 \
        --n_particles $2 --box 256 --K 6 --iter 1 --work /root/acc --extra "$STD" > /dev/null
    REPO=$PWD
    for A in none cub; do
      X=""; [ $A = cub ] && X=cub
      (cd /root/acc && CUPY_ACCELERATORS=$X timeout 280 python3 $REPO/benchmarks/profile_job.py --kernel_trace 2 \
          --out $OUT/profile_class3d_K6_box256_n$2_accelerators_$A.json -- class3d --i data/particles.star \
          --ref data/reference.mrc --K 6 --iter 2 --ctf --healpix_order 2 --ini_high 40 $STD --tau2_fudge 4 \
          --o prof_$A/run > $OUT/profile_accelerators_$A.log 2>&1; echo "profile ($A) rc $?")
      grep -E "timing" $OUT/profile_accelerators_$A.log | cut -c1-200
    done
    el "cubprofile" ;;
  fixedwork)
    python3 -c "
import starfile
d = starfile.read('/root/s256_$2/particles.star', always_dict=True)
d['particles'] = d['particles'].iloc[: len(d['particles']) // 2]
starfile.write(d, '/root/s256_$2/half.star', overwrite=True)"
    for n in particles half; do
      python3 -m napari_gpu_relion.cli class3d --i /root/s256_$2/$n.star --ref /root/s256_$2/ref.mrc --K 6 \
          --iter 3 --random_seed 1 --ctf $STD --tau2_fudge 4 --gpu 0 --o /root/wf_$n/run > $OUT/fixedwork_$n.log 2>&1
      echo "$n rc $?"; grep -E "start-up|timing: E" $OUT/fixedwork_$n.log | cut -c1-200
    done
    REPO=$PWD
    (cd /root/s256_$2 && timeout 300 python3 $REPO/benchmarks/profile_job.py --kernel_trace 3 \
        --out $OUT/profile_class3d_K6_box256_n$(( $2 / 2 ))_fixedwork.json -- class3d --i half.star \
        --ref ref.mrc --K 6 --iter 3 --random_seed 1 --ctf $STD --tau2_fudge 4 --gpu 0 --o prof/run \
        > $OUT/profile_fixedwork.log 2>&1; echo "profile rc $?")
    el "fixedwork" ;;
  relion)  # RELION 5's class3d on the same set and GPUs: $4 ranks (5 and 9 on 4 GPUs), stopped after $5 s
    wait_relion
    python3 benchmarks/standard_class3d.py run --data /root/s256_$2 --sides relion --iters 5 --limits $5 \
        --relion_ranks $4 --relion_gpu $GPUS --tag n$4_g$NG \
        --out $OUT/relion_class3d_K6_box256_n$2_h200x${NG}_ranks$4.json 2>&1 | tail -1 | cut -c1-600
    el "RELION" ;;
  refine3d)
    python3 benchmarks/scaling.py --job refine3d --ranks ${RANKS:-1,$NG} --gpu $GPUS --data /root/s256_$2 --iter $4 \
        --work /root/w256_$2 --extra "$STD --low_resol_join_halves 40" --mpiexec "$MPI" \
        --out $OUT/scaling_refine3d_box256_n$2_h200x$NG.json | grep '^{"ranks' | cut -c1-900
    for d in /root/w256_$2/refine3d_n*; do cp $d/log.txt $OUT/log_refine3d_n$2_$(basename $d).txt; done
    el "refine3d" ;;
esac

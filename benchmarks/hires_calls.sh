# Issue 51's "next refinement" and ctf_refine at scale, and issue 48 item 2 (auto-refine to high resolution on
# EMD-11007, ours and RELION 5 to convergence, judged against the truth), in chained device calls on one H200 (carry
# .whl and .relion_kit; chain within 30 s so that /root stays on the machine):
#   bash benchmarks/hires_calls.sh ctf M   RELION's build in the background; meanwhile ctf_refine_next.py on the
#       GPU and M particles for ctf_refine_bench.py; then relion_ctf_refine's build, ctf_refine on the M particles:
#       ours on the GPU (twice, then with --batch 16384) and relion_ctf_refine --j 16 --bf0 on the CPU cores, one
#       after the other, judged against the truth and compared (the particles are made in 16 processes since the
#       twenty-ninth session: the noise-free images rounded to float32 before the noise is added, not after)
#   bash benchmarks/hires_calls.sh hr N SNR LIMIT [UNTIL]   N EMD-11007 particles at box 192 (1.4 Å/px, Nyquist
#       2.8 Å) by relion_project, our auto-refine, the true-pose halves, then RELION's auto-refine started in its
#       own session (stopped after LIMIT s); the call waits for it until UNTIL s (560) after its start, then does
#       what b does if RELION finished
#   bash benchmarks/hires_calls.sh hrlocal N SNR LIMIT [UNTIL]   (thirty-fifth session) RELION's build beside the GPU
#       tests of the fused kernels and local searches (that session's one-pass coarse scores, since reverted), then
#       hr (files tagged thirtyfifth; b with HR_TAG=realistic_emd11007_box192_h200_thirtyfifth)
#   bash benchmarks/hires_calls.sh hrprof N TAG   (thirty-fifth session) the GPU tests of the fused kernels while
#       RELION builds, N particles as hr, our auto-refine under profile_job.py (not with NOPROF=1) and then alone
#       (files tagged TAG)
#   bash benchmarks/hires_calls.sh hrconv N SNR LIMIT [UNTIL]   (thirty-eighth session, nvidia-h200-x2) RELION's
#       build beside bench_image_read.py --gpu on GPU 1, then hr with RELION's run on GPU 0 (files tagged
#       thirtyeighth); while it refines, GPU 1 compares CuPy's reductions without and with CUB (our simulator's
#       20,000 particles at box 256, class3d K=6, 3 iterations, alternated twice) and runs the GPU tests
#   bash benchmarks/hires_calls.sh hr256 N SNR LIMIT [UNTIL]   (forty-fourth session, one H200) the GPU tests while
#       RELION builds, then hr at box 256 and 1.05 Å/px (the same 269 Å box; Nyquist 2.1 Å), files tagged fortyfourth
#       (b with HR_TAG=realistic_emd11007_box256_h200_fortyfourth). HR_SKIP_TESTS=1 leaves the tests out: e.g.
#       `HR_SKIP_TESTS=1 hr256 3000 0.1 520 585`, then b, compares both sides' frame-aligned errors through
#       RELION's iteration ~15 (order 7) within one session's device time (its whole run does not fit); HR_TAG names
#       the files (default ..._fortyfourth); HR_WARM=1 makes b run our auto-refine once more (the warm run's time)
#   bash benchmarks/hires_calls.sh hrseeds N SNR [UNTIL]   (forty-fifth session, one H200) hr256's data, our
#       auto-refine with --random_seed 2, 3, 4 (HR_SEEDS) while the call is younger than UNTIL s (400; each seed ~120 s with its judging): how far each
#       seed turns each half's frame (files tagged HR_TAG, default realistic_emd11007_box256_h200_fortyfifth)
#   bash benchmarks/hires_calls.sh beside   what hrconv runs on GPU 1 while RELION refines (when call 1 ran out)
#   bash benchmarks/hires_calls.sh progress   RELION's finished iterations so far (realistic.py progress)
#   bash benchmarks/hires_calls.sh b       waits for RELION's run, merges both sides into one JSON, plots the FSCs
#   bash benchmarks/hires_calls.sh c N LIMIT   issue 48 item 3 at box 360 (0.75 Å/px): N EMD-11007 particles of two
#       states by relion_project, class3d K=6 with the standard benchmark's options, ours 5 iterations, then RELION
#       2 iterations (stopped after LIMIT s); builds RELION first where it is not built (not run yet)
#   bash benchmarks/hires_calls.sh prof N     N EMD-11007 particles at box 192 (as hr, SNR 0.1) and our auto-refine of
#       them under benchmarks/profile_job.py (synchronised timers per step; iteration 12, a local search, under the
#       kernel trace); RELION's build first (relion_project), relion_ctf_refine's after it
#   bash benchmarks/hires_calls.sh ctfdata M   M particles for ctf_refine_bench.py (16 processes), RELION and
#       relion_ctf_refine built; then `ctfrun M` does the ctf part of `ctf` on them
#   bash benchmarks/hires_calls.sh local N   the GPU tests of the fused local-search kernels, then N particles as hr
#       and our auto-refine of them alone (realistic.py science --sides ours)
#   bash benchmarks/hires_calls.sh sub N   the GPU tests of the images a rank keeps on its GPU while RELION builds;
#       N particles as hr; our auto-refine with the default offsets and with --subpixel_offsets (thirtieth session)
#   bash benchmarks/hires_calls.sh lrmpi   local resolution at box 192 and 256, ours against relion_postprocess_mpi
#       on 16 ranks (RELION's best layout on the 16 cores)
#   bash benchmarks/hires_calls.sh c2d N LIMIT   the local-resolution job profiled at box 256 while RELION builds;
#       then class2d K=200 (--psi_step 6, the standard benchmark's 2D) on N EMD-11007 particles at box 360: ours 3
#       iterations, RELION 2 (mpirun -n 3, two workers on the GPU, --j 4; stopped after LIMIT s)
#   bash benchmarks/hires_calls.sh c2dprof N   class2d K=200 at box 360 (N particles as c2d) under profile_job.py:
#       the start-up (initialisation_s) and iteration 2 under the kernel trace
#   bash benchmarks/hires_calls.sh ctfwarm M   ctf_refine's CuPy modules recorded (box 96 and 160) and added to the
#       shipped list (written back to $OUT), then on a fresh kernel cache `warmup` and ctf_refine's first run on M
#       particles as ctfdata makes them
#   bash benchmarks/hires_calls.sh lrreal   (thirty-fourth session) a fresh machine's warmup while RELION builds, the
#       warmed-scans GPU test, then local resolution at box 256 on EMD-11007 at 1.05 Å/px (padded to the box: the
#       pixel size of the box-256 refinements), ours against relion_postprocess_mpi on 16 ranks
#   bash benchmarks/hires_calls.sh c2dwarm N LIMIT   after lrreal on the same machine: class2d K=200 at box 360 as c2d
#   bash benchmarks/hires_calls.sh gputests   every test marked gpu (`pytest -m gpu`), the whole output kept in
#       $OUT/gpu_tests.log (its last lines printed)
#   bash benchmarks/hires_calls.sh c2dprep N   (forty-seventh session, one H200, a fresh machine) issue 46's cold
#       pairs first, alone (first_run.sh pairs; PAIRS, default "new1 old1 new2 old2 new3 old3": carry .old_src),
#       then the GPU tests while RELION builds, then N EMD-11007 particles at box 360 for class2d K=200 as c2d
#   bash benchmarks/hires_calls.sh c2dwhole N   after c2dprep (chained): `warmup`, our class2d K=200 whole job (25
#       iterations), then RELION's whole job (25 iterations, mpirun -n 3) started in its own session, on its own on
#       the GPU; `c2dwait` waits for it
#   bash benchmarks/hires_calls.sh c2dlayout N   (forty-eighth session, a fresh machine) RELION's class2d K=200 layouts at
#       box 360 (LAYOUTS="ranks:j ...", 2 iterations each on N EMD-11007 particles), then ours (3 iterations)
#   bash benchmarks/hires_calls.sh c2dwait N [UNTIL]   waits for c2dwhole's RELION run (until UNTIL s, 580), then
#       merges both sides into one JSON with the ratio per iteration
# Results in $OUT.
. benchmarks/gpu_env.sh
T0=$(date +%s)
el() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
R=${HR_TAG:-realistic_emd11007_box192_h200_twentyeighth}
emd_data() {  # $1 Å/px, $2 box, $3 particles, $4 states, $5 SNR, $6 folder: EMD-11007 particles by relion_project
  python3 benchmarks/standard_class3d.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
      --angpix $1 --box $2 --n "$3" --states $4 --snr $5 --jobs 16 --out $6 2>&1 | tail -1 | cut -c1-300
}
fused_tests() {  # $1 tag: the GPU tests of the fused kernels and the local searches (log in $OUT)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_registry.py tests/test_gpu.py \
      -k "local or twin or build or fused" > $OUT/gpu_tests_$1.log 2>&1; echo "pytest rc $?"
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests_$1.log | tail -8 | cut -c1-300
}
ctf_data() {  # $1 particles for ctf_refine_bench.py (16 processes); RELION and relion_ctf_refine built
  start_relion
  python3 benchmarks/ctf_refine_bench.py make --out /root/ctf$1 --n $1 --seed 2 --jobs 16 | cut -c1-300
  el "ctf_refine data ($1 particles)"
  wait_relion
  [ -x /root/rb/build/bin/relion_ctf_refine ] || (cd /root/rb/build && ninja -j 16 relion_ctf_refine > /root/ctf_build.log 2>&1)
  tail -1 /root/ctf_build.log; el "relion_ctf_refine built"
}
ctf_run() {  # ours twice (and with --batch 16384 when $3 is set), then relion_ctf_refine --j 16 --bf0, compared
  CT=ctf_refine_h200_$2_n$1
  python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf$1 --tag gpu --repeat 2 --json $OUT/${CT}_gpu.json \
      | cut -c1-500
  [ -n "${3:-}" ] && python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf$1 --tag gpu_batch16384 \
      --extra="--batch 16384" --json $OUT/${CT}_gpu_batch16384.json | cut -c1-500
  el "ours"
  RB=/root/rb python3 benchmarks/ctf_refine_bench.py relion --data /root/ctf$1 --tag relion_bf0_j16 --j 16 \
      --extra=--bf0 --json $OUT/${CT}_relion_bf0_j16.json | cut -c1-500
  el "relion_ctf_refine"
  python3 benchmarks/ctf_refine_bench.py compare $OUT/${CT}_gpu.json $OUT/${CT}_relion_bf0_j16.json \
      --out $OUT/${CT}_compare.json | cut -c1-800
}
beside_relion() {  # GPU 1 of an x2 host while RELION refines on GPU 0: CUB or not, then the GPU tests
  (export CUDA_VISIBLE_DEVICES=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
   STD="--particle_diameter 180 --flatten_solvent --zero_mask --offset_range 5 --offset_step 2 --pad 2 --norm --scale"
   for run in none_1 cub_1 none_2 cub_2; do
     A=""; [ ${run%_*} = cub ] && A=cub
     CUPY_ACCELERATORS=$A timeout 200 python3 benchmarks/scaling.py --job class3d --ranks 1 --gpu 0 --n_particles 20000 \
         --box 256 --K 6 --iter 3 --work /root/acc --extra "$STD --tau2_fudge 4" \
         --out $OUT/accelerators_class3d_K6_box256_n20000_h200x2_thirtyeighth_${run}.json | grep '^{"ranks' | cut -c1-400
     el "class3d, CUPY_ACCELERATORS='$A' ($run)"
   done
   timeout 400 python3 -m pytest -m gpu -p no:cacheprovider --continue-on-collection-errors -rf tests/ > $OUT/gpu_tests.log 2>&1
   echo "pytest rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -15 | cut -c1-300
   el "GPU tests on GPU 1")
}
if [ "$1" = hrconv ]; then  # thirty-eighth session, nvidia-h200-x2: the reading bench while RELION builds, then hr
  start_relion
  CUDA_VISIBLE_DEVICES=1 timeout 240 python3 benchmarks/bench_image_read.py --n 20000 --box 256 --threads 1,2,4 --gpu \
      --dir /root/ir --out $OUT/image_read_h200x2_thirtyeighth.json > $OUT/image_read.log 2>&1; echo "bench rc $?"
  tail -12 $OUT/image_read.log | cut -c1-300; rm -rf /root/ir
  el "bench_image_read (RELION building beside it)"
  wait_relion
  export HR_TAG=realistic_emd11007_box192_h200x2_thirtyeighth HR_BESIDE=beside_relion; R=$HR_TAG
  set -- hr "$2" "$3" "$4" "${5:-560}"
fi
if [ "$1" = hr256 ]; then  # forty-fourth session, one H200: the GPU tests while RELION builds, then hr at box 256
  start_relion
  [ -n "${HR_SKIP_TESTS:-}" ] || CUPY_CACHE_DIR=/root/c_tests timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/test_io_star.py \
      --continue-on-collection-errors -rf > $OUT/gpu_tests.log 2>&1
  echo "pytest rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -15 | cut -c1-300
  el "GPU tests (RELION building beside them)"
  wait_relion
  export HR_TAG=${HR_TAG:-realistic_emd11007_box256_h200_fortyfourth} HR_BOX=256 HR_ANGPIX=1.05; R=$HR_TAG
  set -- hr "$2" "$3" "$4" "${5:-585}"
fi
if [ "$1" = hrseeds ]; then  # forty-fifth session, one H200: hr256's data (N particles, SNR S), our auto-refine with
  wait_relion               # other random seeds (HR_SEEDS, default 2 3 4) while the call's time allows (UNTIL s)
  { grep -q "\"box\": 256," /root/hr/data.json && grep -q "\"n\": $2," /root/hr/data.json; } 2>/dev/null \
      || emd_data 1.05 256 "$2" 1 "$3" /root/hr  # hr256's data when this machine made them (a chained call)
  el "data"
  R=${HR_TAG:-realistic_emd11007_box256_h200_fortyfifth}
  for s in ${HR_SEEDS:-2 3 4}; do
    [ $(( $(date +%s) - T0 )) -lt ${4:-400} ] || break
    timeout 150 python3 benchmarks/realistic.py science --data /root/hr --sides ours --diameter 180 --tag seed$s \
        --no_true_poses --ours_extra="--random_seed $s" --out $OUT/${R}_ours_seed$s.json 2>&1 | tail -1 | cut -c1-200
    el "ours, --random_seed $s"
  done
fi
if [ "$1" = beside ]; then
  beside_relion
fi
if [ "$1" = progress ]; then
  python3 benchmarks/realistic.py progress --data /root/hr --side relion | cut -c1-300
fi
if [ "$1" = hrlocal ]; then  # thirty-fifth session: the GPU tests of the fused kernels, then hr
  start_relion
  fused_tests thirtyfifth
  el "GPU tests (RELION building beside them)"
  wait_relion
  export HR_TAG=realistic_emd11007_box192_h200_thirtyfifth; R=$HR_TAG
  set -- hr "$2" "$3" "$4" "${5:-560}"
fi
if [ "$1" = hrprof ]; then  # thirty-fifth session: the GPU tests, then N particles as hr, our auto-refine profiled
  start_relion              # (iteration 12 under the kernel trace) and run alone (realistic.py, no true poses)
  fused_tests "$3"
  el "GPU tests (RELION building beside them)"
  wait_relion
  emd_data 1.4 192 "$2" 1 0.1 /root/hr
  el "data"
  P=profile_refine3d_emd11007_box192_n$2_h200_$3
  [ -n "${NOPROF:-}" ] || (REPO=$PWD; cd /root/hr && timeout 200 python3 $REPO/benchmarks/profile_job.py \
      --out $OUT/$P.json --kernel_trace 12 -- refine3d --i particles.star --particle_diameter 180.0 --ctf \
      --flatten_solvent --zero_mask --offset_range 5.0 --offset_step 2.0 --pad 2 --random_seed 1 --ref ref.mrc \
      --ini_high 30.0 --sym C1 --healpix_order 2 --auto_local_healpix_order 4 --low_resol_join_halves 40 --norm --scale --o prof_refine3d/run \
      > $OUT/$P.log 2>&1; echo "profile rc $?"; rm -f $OUT/$P.trace.json)
  el "profile (skipped with NOPROF=1)"
  timeout 150 python3 benchmarks/realistic.py science --data /root/hr --sides ours --diameter 180 --no_true_poses \
      --out $OUT/realistic_emd11007_box192_h200_$3_ours.json 2>&1 | tail -2 | cut -c1-700
  el "ours alone"
fi
if [ "$1" = lrreal ]; then  # thirty-fourth session, one H200: a fresh machine's warmup, then local resolution
  start_relion
  python3 -m napari_gpu_relion.cli warmup > $OUT/warmup.log 2>&1; echo "warmup rc $?"
  tail -2 $OUT/warmup.log | cut -c1-300; el "warmup (RELION building beside it)"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_preload.py 2>&1 | tail -4 | cut -c1-2500
  el "the warmed-scans test"
  wait_relion  # EMD-11007 at 1.05 Å/px (the pixel size of the box-256 refinements) padded to box 256
  python3 benchmarks/local_resolution.py --make_halves --box 256 --angpix_target 1.05 --relion_mpi 16 \
      --out /root/lr256a --json $OUT/local_resolution_h200_box256_1.05A_relion_mpi16_thirtyfourth.json \
      2>&1 | tail -2 | cut -c1-600
  el "local resolution box 256 at 1.05 Å/px"
  python3 benchmarks/local_resolution.py --make_halves --box 256 --skip_relion --out /root/lr256 \
      --json $OUT/local_resolution_h200_box256_ours_thirtyfourth.json 2>&1 | tail -1 | cut -c1-300
  el "ours at box 256, 0.6255 Å/px (the thirtieth session's maps)"
elif [ "$1" = c2dlayout ]; then  # (forty-eighth session) RELION's layouts for class2d K=200 at box 360 on one GPU:
  # LAYOUTS="ranks:j ..." (default 3:4 5:4 7:2), 2 iterations each on N EMD-11007 particles, then ours (3 iterations)
  D=standard_class2d_K200_box360_n$2_h200_fortyeighth
  start_relion; wait_relion
  el "RELION built"
  emd_data 0.75 360 "$2" 1 0.05 /root/c360
  el "box-360 data"
  for L in ${LAYOUTS:-3:4 5:4 7:2}; do
    python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
        --sides relion --iters 2 --limits 200 --relion_ranks ${L%:*} --relion_j ${L#*:} --tag n${L%:*}j${L#*:} \
        --out $OUT/${D}_relion_n${L%:*}j${L#*:}.json 2>&1 | tail -1 | cut -c1-400
    el "RELION $L"
  done
  python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
      --sides ours --iters 3 --limits 200 --out $OUT/${D}_ours.json 2>&1 | tail -1 | cut -c1-400
  el "ours"
elif [ "$1" = c2dwarm ]; then  # after lrreal on the same machine (warmup done, RELION built)
  D=standard_class2d_K200_box360_n$2_h200_thirtyfourth
  emd_data 0.75 360 "$2" 1 0.05 /root/c360
  el "box-360 data"
  python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
      --sides ours --iters 3 --limits 200 --out $OUT/${D}_ours.json 2>&1 | tail -1 | cut -c1-600
  grep -E "start-up|timing|done in" /root/c360/ours_class2d/log.txt 2>/dev/null | cut -c1-300
  el "ours"
  wait_relion
  python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
      --sides relion --iters 2 --limits "$3" --relion_ranks 3 --out $OUT/${D}_relion.json 2>&1 | tail -1 | cut -c1-600
  el "RELION"
elif [ "$1" = c2dprep ]; then
  if [ -z "${NO_PAIRS:-}" ]; then
    PAIRS=${PAIRS:-new1 old1 new2 old2 new3 old3} bash benchmarks/first_run.sh pairs 2>&1 | tail -12 | cut -c1-300
    el "cold pairs"
  fi
  start_relion
  # (the GPU machine has no dask: test_io_star is not collected there, the other modules run)
  timeout 400 python3 -m pytest -m gpu -p no:cacheprovider -rf --continue-on-collection-errors tests/ \
      > $OUT/gpu_tests.log 2>&1
  echo "pytest rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -15 | cut -c1-300
  el "GPU tests"
  wait_relion
  el "RELION built"
  emd_data 0.75 360 "$2" 1 0.05 /root/c360
  el "box-360 data"
elif [ "$1" = c2dwhole ]; then
  D=standard_class2d_K200_box360_n$2_h200_fortyseventh
  ngr warmup --gpu 0 2>&1 | tail -2 | cut -c1-300
  el "warmup"
  python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
      --sides ours --iters 25 --limits 300 --tag whole --out $OUT/${D}_ours.json 2>&1 | tail -1 | cut -c1-900
  cp $OUT/${D}_ours.json /root/
  grep -E "start-up|GPU kernels|done in" /root/c360/ours_class2d_whole/log.txt 2>/dev/null | cut -c1-300
  el "ours"
  . /root/rb/env.sh
  (setsid nohup python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 \
      --data /root/c360 --sides relion --iters 25 --limits 1500 --relion_ranks 3 --tag whole \
      --out /root/${D}_relion.json > /root/c2d_relion.log 2>&1 < /dev/null &)
  sleep 20; ls /root/c360/relion_class2d_whole/ | tail -3
elif [ "$1" = c2drelion ]; then  # RELION's half of c2dwhole alone (started in its own session; c2dwait waits)
  D=standard_class2d_K200_box360_n$2_h200_fortyseventh
  . /root/rb/env.sh
  (setsid nohup python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 \
      --data /root/c360 --sides relion --iters 25 --limits 1500 --relion_ranks 3 --tag whole \
      --out /root/${D}_relion.json > /root/c2d_relion.log 2>&1 < /dev/null &)
  sleep 15; ls /root/c360/relion_class2d_whole/ | tail -3
elif [ "$1" = c2dwait ]; then
  D=standard_class2d_K200_box360_n$2_h200_fortyseventh
  until [ -f /root/${D}_relion.json ] && ! pgrep -f "sides relion" > /dev/null; do
    [ $(( $(date +%s) - T0 )) -ge ${3:-580} ] && break; sleep 5; done
  ls /root/c360/relion_class2d_whole/ | grep -c "_model.star"; tail -2 /root/c2d_relion.log | cut -c1-900
  # each finished iteration's file times (the iteration times of a run not finished yet)
  (cd /root/c360/relion_class2d_whole && stat -c '%Y %n' log.txt run_it*_optimiser.star) > $OUT/${D}_relion_times.txt
  if [ -f /root/${D}_relion.json ] && ! pgrep -f "sides relion" > /dev/null; then
    cp /root/${D}_relion.json /root/${D}_ours.json $OUT/
    python3 benchmarks/standard_class3d.py merge $OUT/${D}_ours.json $OUT/${D}_relion.json --out $OUT/$D.json | cut -c1-900
    cp /root/c360/ours_class2d_whole/log.txt $OUT/${D}_ours.log
    tail -40 /root/c360/relion_class2d_whole/log.txt > $OUT/${D}_relion_log_tail.txt
  fi
  el "waited"
elif [ "$1" = gputests ]; then
  timeout 540 python3 -m pytest -m gpu -p no:cacheprovider -rf tests/ > $OUT/gpu_tests.log 2>&1
  echo "pytest rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -15 | cut -c1-300
  el "GPU tests"
elif [ "$1" = prof ]; then
  start_relion
  wait_relion
  el "RELION built"
  (cd /root/rb/build && setsid nohup ninja -j 8 relion_ctf_refine > /root/ctf_build.log 2>&1 < /dev/null &)
  emd_data 1.4 192 "$2" 1 0.1 /root/hr
  el "data"
  P=profile_refine3d_emd11007_box192_n$2_h200_twentyninth
  REPO=$PWD; (cd /root/hr && python3 $REPO/benchmarks/profile_job.py --out $OUT/$P.json --kernel_trace 12 -- \
      refine3d --i particles.star --particle_diameter 180.0 --ctf --flatten_solvent --zero_mask --offset_range 5.0 \
      --offset_step 2.0 --pad 2 --random_seed 1 --ref ref.mrc --ini_high 30.0 --sym C1 --healpix_order 2 \
      --auto_local_healpix_order 4 --low_resol_join_halves 40 --norm --scale --o prof_refine3d/run) \
      > $OUT/$P.log 2>&1; echo "profile rc $?"; tail -5 $OUT/$P.log | cut -c1-300
  el "profile"
  tail -1 /root/ctf_build.log
elif [ "$1" = local ]; then
  start_relion
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_registry.py tests/test_gpu.py \
      -k "local or fused or registry or fine_pass or refine3d_cupy or build or class3d_global" 2>&1 | tail -4
  el "GPU tests"
  wait_relion
  emd_data 1.4 192 "$2" 1 0.1 /root/hr
  md5sum /root/hr/*.mrcs 2>/dev/null | head -2; ls /root/hr | head
  el "data"
  python3 benchmarks/realistic.py science --data /root/hr --sides ours --diameter 180 \
      --out $OUT/realistic_emd11007_box192_h200_twentyninth_ours.json 2>&1 | tail -3 | cut -c1-900
  grep "timing\|out of memory\|memory plan:" /root/hr/ours_refine3d/log.txt | cut -c1-220 | tail -30
  el "ours"
elif [ "$1" = sub ]; then
  start_relion
  bash benchmarks/scaling_calls.sh tests 2>&1 | tail -3
  wait_relion
  emd_data 1.4 192 "$2" 1 0.1 /root/hr
  el "data"
  for cfg in default subpixel_offsets; do
    X=""; [ $cfg = subpixel_offsets ] && X="--ours_extra=--subpixel_offsets"
    python3 benchmarks/realistic.py science --data /root/hr --sides ours --diameter 180 --tag $cfg --no_true_poses $X \
        --out $OUT/realistic_emd11007_box192_h200_thirtieth_$cfg.json 2>&1 | tail -2 | cut -c1-700
    el "ours $cfg"
  done
elif [ "$1" = lrmpi ]; then
  wait_relion
  for b in 192 256; do
    python3 benchmarks/local_resolution.py --make_halves --box $b --relion_mpi 16 --out /root/lr$b \
        --json $OUT/local_resolution_h200_box${b}_relion_mpi16_thirtieth.json 2>&1 | tail -2 | cut -c1-600
    el "local resolution box $b"
  done
elif [ "$1" = c2d ]; then
  start_relion
  python3 benchmarks/local_resolution.py --make_halves --box 256 --out /root/lr256 --skip_relion > /dev/null 2>&1
  python3 benchmarks/profile_locres.py --out $OUT/profile_locres_box256_h200_thirtieth.json -- local_resolution \
      --locres --i /root/lr256/half1.mrc --i2 /root/lr256/half2.mrc --o /root/lr256/prof/relion \
      --mask /root/lr256/mask.mrc 2>&1 | tr -d '\n ' | cut -c1-1500; echo
  el "local resolution profile (RELION building beside it)"
  wait_relion
  D=standard_class2d_K200_box360_n$2_h200_thirtieth
  emd_data 0.75 360 "$2" 1 0.05 /root/c360
  el "box-360 data"
  python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
      --sides ours --iters 3 --limits 200 --out $OUT/${D}_ours.json 2>&1 | tail -1 | cut -c1-600
  el "ours"
  python3 benchmarks/standard_class3d.py run --job class2d --K 200 --tau2_fudge 2 --diameter 220 --data /root/c360 \
      --sides relion --iters 2 --limits "$3" --relion_ranks 3 --out $OUT/${D}_relion.json 2>&1 | tail -1 | cut -c1-600
  tail -5 /root/c360/relion_class2d/log.txt | cut -c1-300
  el "RELION"
elif [ "$1" = c2dprof ]; then
  start_relion; wait_relion
  emd_data 0.75 360 "$2" 1 0.05 /root/c360
  el "box-360 data"
  P=profile_class2d_K200_box360_n$2_h200_thirtieth
  REPO=$PWD; (cd /root/c360 && python3 $REPO/benchmarks/profile_job.py --out $OUT/$P.json --kernel_trace 2 -- \
      class2d --i particles.star --particle_diameter 220.0 --ctf --flatten_solvent --zero_mask --offset_range 5.0 \
      --offset_step 2.0 --pad 2 --random_seed 1 --K 200 --iter 2 --tau2_fudge 2.0 --psi_step 6.0 --norm --scale \
      --center_classes --o prof_class2d/run) > $OUT/$P.log 2>&1; echo "profile rc $?"
  grep "timing\|initialis\|done in" $OUT/$P.log | cut -c1-200
  el "profile"
elif [ "$1" = ctfwarm ]; then
  F="--fit_defocus --fit_mode fpfff --fit_beamtilt --odd_aberr_max_n 3 --fit_aberr"
  (export CUPY_CACHE_DIR=/root/c_rec_ctf CUPY_CACHE_SAVE_CUDA_SOURCE=1 NAPARI_GPU_RELION_KERNEL_PRELOAD=0
   python3 benchmarks/ctf_refine_bench.py make --out /root/ctfr96 --n 2000 --seed 3 --jobs 16 > /dev/null
   python3 benchmarks/ctf_refine_bench.py make --out /root/ctfr160 --n 600 --box 160 --seed 3 --jobs 16 > /dev/null
   for d in /root/ctfr96 /root/ctfr160; do (cd $d && python3 -m napari_gpu_relion.cli ctf_refine --i particles.star \
       --m1 half1.mrc --m2 half2.mrc --f postprocess.star $F --o CtfRefine/ > log.txt 2>&1; echo "$d rc $?"); done
   python3 benchmarks/record_kernels.py --cache /root/c_rec_ctf --out $OUT/ctf_refine.json 2>&1 | tail -2)
  python3 benchmarks/ship_kernels.py --cupy "$(python3 -c 'import cupy; print(cupy.__version__)')" --add \
      $OUT/ctf_refine.json
  cp src/napari_gpu_relion/runtime/cupy_kernels.json.gz $OUT/
  el "ctf_refine's kernels recorded and added to the shipped list"
  export CUPY_CACHE_DIR=/root/c_fresh
  python3 -m napari_gpu_relion.cli warmup > $OUT/warmup.log 2>&1; echo "warmup rc $?"; tail -2 $OUT/warmup.log | cut -c1-300
  el "warmup"
  python3 benchmarks/ctf_refine_bench.py make --out /root/ctf$2 --n $2 --seed 2 --jobs 16 | cut -c1-400
  el "data"
  N0=$(ls $CUPY_CACHE_DIR/*.cubin | wc -l)
  python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf$2 --tag gpu_after_warmup \
      --json $OUT/ctf_refine_h200_twentyninth_n$2_gpu_after_warmup.json | cut -c1-300
  echo "modules compiled by the run: $(( $(ls $CUPY_CACHE_DIR/*.cubin | wc -l) - N0 ))"
  el "ours after warmup"
elif [ "$1" = ctfdata ]; then
  ctf_data $2
elif [ "$1" = ctfrun ]; then
  ctf_run $2 twentyninth
elif [ "$1" = ctf ]; then
  start_relion
  timeout 300 python3 benchmarks/ctf_refine_next.py --work /root/next --out $OUT/ctf_refine_next_h200_twentyeighth.json \
      > $OUT/ctf_refine_next.log 2>&1; echo "ctf_refine_next rc $?"; tail -8 $OUT/ctf_refine_next.log | cut -c1-400
  el "issue 51 next refinement"
  ctf_data $2
  ctf_run $2 twentyeighth batch
elif [ "$1" = c ]; then
  wait_relion
  D=standard_class3d_K6_box360_n$2_h200_$(date +%Y%m%d)
  emd_data 0.75 360 "$2" 2 0.05 /root/s360
  el "box-360 data"; df -h /root | tail -1
  python3 benchmarks/standard_class3d.py run --data /root/s360 --sides ours --iters 5 --limits 150 \
      --out $OUT/${D}_ours.json 2>&1 | tail -2 | cut -c1-600
  el "ours"
  python3 benchmarks/standard_class3d.py run --data /root/s360 --sides relion --iters 2 --limits "$3" \
      --out $OUT/${D}_relion.json 2>&1 | tail -2 | cut -c1-600
  tail -20 /root/s360/relion_class3d/log.txt > $OUT/relion_class3d_box360_log_tail.txt
  el "done"
elif [ "$1" = hr ]; then
  . /root/rb/env.sh
  emd_data ${HR_ANGPIX:-1.4} ${HR_BOX:-192} "$2" 1 "$3" /root/hr
  el "data"
  python3 benchmarks/realistic.py science --data /root/hr --sides ours --diameter 180 --out $OUT/${R}_ours.json \
      2>&1 | tail -3 | cut -c1-900
  cp $OUT/${R}_ours.json /root/
  tail -4 /root/hr/ours_refine3d/log.txt | cut -c1-300
  cp /root/hr/ours_refine3d/log.txt $OUT/${R}_ours_log.txt  # its sampling per iteration, for comparing schedules
  el "ours"
  rm -rf /root/repo; mkdir -p /root/repo; cp -r benchmarks src .whl /root/repo/
  (cd /root/repo && setsid nohup bash -c ". benchmarks/gpu_env.sh && python3 benchmarks/realistic.py science \
      --data /root/hr --sides relion --no_true_poses --diameter 180 --limit_s $4 --out /root/${R}_relion.json" \
      > /root/relion_refine.log 2>&1 < /dev/null &)
  sleep 2; pgrep -f "sides relion" >/dev/null && el "RELION started in the background"
  [ -n "${HR_BESIDE:-}" ] && $HR_BESIDE
  while pgrep -f "sides relion" >/dev/null && [ $(( $(date +%s) - T0 )) -lt ${5:-560} ]; do sleep 5; done
  pgrep -f "sides relion" >/dev/null && el "RELION still running: call b next" || { el "RELION finished"; B_NOW=1; }
fi
if [ "$1" = b ] || [ "${B_NOW:-0}" = 1 ]; then
  while pgrep -f "sides relion" >/dev/null; do sleep 5; done
  el "RELION finished"
  tail -3 /root/relion_refine.log | cut -c1-900
  cp /root/${R}_relion.json $OUT/ 2>/dev/null
  tail -30 /root/hr/relion_refine3d/log.txt > $OUT/relion_refine3d_log_tail.txt 2>/dev/null
  # the truth and each side's last data STAR in one file, for judging the poses again later (the device returns
  # at most 8 files: hr + b in one call writes 9 others)
  SL=""; [ -f /root/hr/truth.star ] && SL="truth.star"
  for s in ours relion; do
    L=$(cd /root/hr && { ls ${s}_refine3d/run_data.star 2>/dev/null || ls ${s}_refine3d/run_it*_data.star 2>/dev/null \
        | tail -1; })
    [ -n "$L" ] && SL="$SL $L"
  done
  [ -n "$SL" ] && (cd /root/hr && tar czf $OUT/${R}_stars.tgz $SL)
  python3 - "$OUT" "$R" <<'PY'
import json, sys
from pathlib import Path
out, r = Path(sys.argv[1]), sys.argv[2]
ours = json.loads(Path(f"/root/{r}_ours.json").read_text())
rel = out / f"{r}_relion.json"
if rel.exists():
    ours["relion"] = json.loads(rel.read_text())["relion"]
(out / f"{r}.json").write_text(json.dumps(ours, indent=1))
for side in ("true_poses", "ours", "relion"):
    d = ours.get(side, {})
    m = d if side == "true_poses" else d.get("maps", {})
    last = (d.get("iterations") or [{}])[-1] if side != "true_poses" else {}
    print(side, {k: v for k, v in m.items() if not isinstance(v, list)}, "wall", d.get("wall_s"),
          "iterations", len(d.get("iterations", [])), "last", last)
PY
  python3 benchmarks/realistic.py plot $OUT/$R.json $OUT/$R.png
  el "done"
  if [ -n "${HR_WARM:-}" ]; then  # our auto-refine once more on the same machine: the warm (second) run's time
    timeout 200 python3 benchmarks/realistic.py science --data /root/hr --sides ours --diameter 180 --tag warm \
        --no_true_poses --out $OUT/${R}_ours_warm.json 2>&1 | tail -1 | cut -c1-400
    grep "GPU kernels:" /root/hr/ours_refine3d_warm/log.txt | tail -1 | cut -c1-300
    el "ours again (warm)"
  fi
fi

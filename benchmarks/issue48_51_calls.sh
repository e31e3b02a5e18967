# The twenty-seventh session's two device calls (one H200; carry .whl and .relion_kit; chain them within 30 s so
# that /root/rb, /root/s256, /root/ctf* stay on the machine):
#   bash benchmarks/issue48_51_calls.sh one    RELION's build in the background; meanwhile issue 51's ctf_refine on
#       the GPU (and the CPU, 200 particles) on ctf_refine_bench.py's data; then issue 48 item 3: 20,000 EMD-11007
#       particles (two states) at box 256 by relion_project, class3d K=6 ours (25 iterations asked, stopped at a
#       limit), then RELION 5 (3 iterations asked, stopped at the call's end)
#   bash benchmarks/issue48_51_calls.sh two    ctf_refine on the GPU again (machine quiet) and RELION's
#       relion_ctf_refine (--bf0, --j 16) on the same files; issue 48 item 2: 8,000 particles at box 256
#       (realistic.sh's data, SNR 0.1, made in parallel chunks), auto-refine ours with the default options,
#       --pad 1, --coarse_float32, each stopped after the same limit (the call's time left, shared)
# Results in $OUT (JSON and logs; no commas in names).
. benchmarks/gpu_env.sh
T0=$(date +%s)
el() { echo "== $1 at +$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
D=standard_class3d_K6_box256_n20000_h200_twentyseventh
CT=ctf_refine_h200_twentyseventh
if [ "$1" = one ]; then
  start_relion
  python3 benchmarks/ctf_refine_bench.py make --out /root/ctf200 --n 200 --seed 0 | cut -c1-300
  python3 benchmarks/ctf_refine_bench.py make --out /root/ctf4000 --n 4000 --seed 1 | cut -c1-300
  el "ctf data"
  python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf200 --tag gpu --repeat 2 --json $OUT/${CT}_n200_gpu.json | cut -c1-400
  python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf4000 --tag gpu --repeat 2 --json $OUT/${CT}_n4000_gpu.json | cut -c1-400
  python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf200 --tag cpu --cpu --json $OUT/${CT}_n200_cpu.json | cut -c1-400
  el "ctf_refine"
  wait_relion
  el "RELION built"
  python3 benchmarks/standard_class3d.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
      --angpix 1.05 --box 256 --n 20000 --states 2 --snr 0.05 --jobs 16 --out /root/s256 2>&1 | tail -2
  el "class3d data"; df -h /root | tail -1
  python3 benchmarks/standard_class3d.py run --data /root/s256 --sides ours --iters 25 --limits ${2:-180} \
      --out $OUT/${D}_ours.json 2>&1 | tail -3
  el "ours"
  L=$(( 583 - ($(date +%s) - T0) ))
  python3 benchmarks/standard_class3d.py run --data /root/s256 --sides relion --iters 3 --limits $L \
      --out $OUT/${D}_relion.json 2>&1 | tail -3
  tail -25 /root/s256/relion_class3d/log.txt > $OUT/relion_class3d_log_tail.txt
  grep -h "iteration\|E-step" /root/s256/ours_class3d/log.txt | tail -40 > $OUT/ours_class3d_log_lines.txt
  el "done"
else
  . /root/rb/env.sh
  (cd /root/rb/build && ninja -j 4 relion_ctf_refine > /root/ctf_build.log 2>&1) &
  python3 benchmarks/ctf_refine_bench.py ours --data /root/ctf4000 --tag gpuquiet --repeat 2 \
      --json $OUT/${CT}_n4000_gpu_quiet.json | cut -c1-400
  el "ctf_refine quiet"
  python3 benchmarks/standard_class3d.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
      --angpix 1.05 --box 256 --n 8000 --states 1 --snr 0.1 --jobs 16 --out /root/hr 2>&1 | tail -1 | cut -c1-300
  el "refine data"
  wait; tail -1 /root/ctf_build.log
  for n in 200 4000; do
    RB=/root/rb python3 benchmarks/ctf_refine_bench.py relion --data /root/ctf$n --tag relion_bf0_j16 --j 16 \
        --extra=--bf0 --json $OUT/${CT}_n${n}_relion_bf0_j16.json | cut -c1-400
  done
  el "relion_ctf_refine"
  L=$(( (${2:-572} - ($(date +%s) - T0)) / 3 - 25 ))
  echo "limit per configuration: $L s"
  R=realistic_emd11007_box256_n8000_h200_twentyseventh
  for cfg in default pad1 coarse_float32; do
    case $cfg in default) X="";; pad1) X="--pad 1";; coarse_float32) X="--coarse_float32";; esac
    python3 benchmarks/realistic.py science --data /root/hr --sides ours --tag $cfg "--ours_extra=$X" \
        --limit_s $L --no_true_poses --diameter 180 --out $OUT/${R}_$cfg.json 2>&1 | tail -2 | cut -c1-600
    el "$cfg"
  done
fi

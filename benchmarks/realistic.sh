# Issue 48 on one GPU machine (the device tool; carry .whl and .relion_kit, which holds emd_11007_centred192.mrc):
#   bash benchmarks/realistic.sh data N SNR     RELION's build, then EMD-11007 particles by relion_project in /root/hr
#   bash benchmarks/realistic.sh SIDES LIMITS [--no_true_poses]   auto-refine of each side (ours,relion) stopped after
#       its limit (s, comma-separated), judged by realistic.py science
# Results in $OUT (JSON, logs). Chain the calls within 30 s so /root/rb and /root/hr stay on the machine.
. benchmarks/gpu_env.sh
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$1" = data ]; then
  wait_relion
  echo "RELION ready at +$(( $(date +%s) - T0 )) s"
  python3 benchmarks/vs_relion.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
      --angpix 1.05 --box 256 --n "$2" --snr "$3" --defocus_min_A 8000 --defocus_max_A 25000 --out /root/hr \
      2>&1 | tail -2
  echo "data at +$(( $(date +%s) - T0 )) s"; df -h /root | tail -1
else
  . /root/rb/env.sh
  python3 benchmarks/realistic.py science --data /root/hr --sides "$1" --limit_s "$2" --diameter 180 ${3:-} \
      --out "$OUT/realistic_${1//,/_}.json" 2>&1 | tail -5
  for s in ${1//,/ }; do tail -30 /root/hr/${s}_refine3d/log.txt > "$OUT/${s}_log_tail.txt"; done
fi
echo "done at +$(( $(date +%s) - T0 )) s"

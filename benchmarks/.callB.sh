. benchmarks/gpu_env.sh; mkdir -p $OUT; T0=$SECONDS
STD="--particle_diameter 250 --flatten_solvent --zero_mask --offset_range 5 --offset_step 2 --pad 2 --ini_high 60 --norm --scale --tau2_fudge 4"
[ -f /root/s50/particles.star ] || timeout 200 python3 -m napari_gpu_relion.cli simulate --o /root/s50 --n_particles 50000 --box 256 --angpix 1.27 --conformations 2 --n_micrographs 0 --particle_diameter 250 --snr 0.05 > $OUT/sim.log 2>&1
echo "data $((SECONDS-T0)) s"; tail -2 $OUT/sim.log | cut -c1-200
python3 - <<'PY'
import starfile
d = starfile.read("/root/s50/particles.star", always_dict=True)
p = d["particles"]; d["particles"] = p.iloc[: len(p) // 2]
starfile.write(d, "/root/s50/half.star", overwrite=True)
print(len(p), len(d["particles"]))
PY
for n in particles half; do
  timeout 150 python3 -m napari_gpu_relion.cli class3d --i /root/s50/$n.star --ref /root/s50/reference.mrc --K 6 --iter 3 --random_seed 1 --ctf $STD --gpu 0 --o /root/w50_$n/run > $OUT/class3d_$n.log 2>&1
  echo "$n $((SECONDS-T0)) s"; grep -E "start-up|timing: E|done in" $OUT/class3d_$n.log | cut -c1-200
done
(cd /root/s50 && timeout 150 python3 $OLDPWD/benchmarks/profile_job.py --kernel_trace 3 --out $OUT/profile_class3d_K6_box256_n25000_h200_fortyfirst.json -- class3d --i half.star --ref reference.mrc --K 6 --iter 3 --random_seed 1 --ctf $STD --gpu 0 --o prof/run > $OUT/profile.log 2>&1; echo "profile rc $?")
echo "all $((SECONDS-T0)) s"

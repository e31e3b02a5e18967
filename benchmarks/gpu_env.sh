# Source this at the start of every command on the GPU machine (the device tool), from the repository root:
#   . benchmarks/gpu_env.sh
# The call carries `.whl` (starfile and mrcfile wheels: `pip download --no-deps --only-binary=:all: --python-version
# 3.12 --platform manylinux2014_x86_64 -d .whl starfile mrcfile`) and `.relion_kit` (a copy of ../shared/relion_gpu
# with ../shared/data/real/emd_11007_centred192.mrc beside it, packed by `benchmarks/kit_map.py pack` into
# emd_11007_centred192.mrc.planes.gz). The machine's python3 has CuPy, NumPy, SciPy and pandas.
# It installs the wheels once per machine and puts src/ on PYTHONPATH; `start_relion` starts RELION's build in the
# background (/root/rb, ~2.5 min on 16 cores) unless it is built or building, `wait_relion` waits for it.
set -u
export PYTHONUNBUFFERED=1
[ -d /tmp/site/starfile ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:/tmp/site
# the kit's maps travel packed (the call's 64 MiB limit): unpacked beside them on every call
for f in .relion_kit/*.mrc.gz; do [ -f "$f" ] && [ ! -f "${f%.gz}" ] && gunzip -k "$f"; done
for f in .relion_kit/*.mrc.planes.gz; do
  [ -f "$f" ] && [ ! -f "${f%.planes.gz}" ] && python3 benchmarks/kit_map.py unpack "$f" "${f%.planes.gz}"
done
ngr() { python3 -m napari_gpu_relion.cli "$@"; }
start_relion() {
  if [ ! -x /root/rb/build/bin/relion_refine_mpi ] && ! pgrep -f build_relion.sh >/dev/null; then
    rm -rf /root/kit; cp -r .relion_kit /root/kit
    setsid nohup bash /root/kit/build_relion.sh /root/kit /root/rb 16 > /root/build.log 2>&1 < /dev/null &
  fi
}
wait_relion() {
  start_relion
  for _ in $(seq 120); do [ -x /root/rb/build/bin/relion_refine_mpi ] && break; sleep 5; done
  tail -2 /root/build.log; . /root/rb/env.sh
}
# The box-128 set of the first-run measurements (first_run.sh, cold_profile.sh): 5,000 particles of our simulator,
# made once per machine, and the class3d both time on it (K=4, 5 iterations; the caller adds --o)
sim_box128() {
  [ -f /root/d128/particles.star ] || ngr simulate --o /root/d128 --n_particles 5000 --box 128 --angpix 2.54 \
    --conformations 2 --n_micrographs 0 --particle_diameter 250 --snr 0.05 > /tmp/s1.log 2>&1
}
CLASS3D_BOX128="class3d --i /root/d128/particles.star --ref /root/d128/reference.mrc --ini_high 60 --K 4 --iter 5"
CLASS3D_BOX128="$CLASS3D_BOX128 --random_seed 1 --ctf --particle_diameter 250 --gpu 0"

#!/usr/bin/env bash
# The same jobs on the CPU at two commits, same data and seed (issue 46: the runtime refactor changes no result).
# Usage: bash benchmarks/cpu_equivalence.sh OLD_COMMIT [WORK]   (from the repository root; takes ~25 min on 2 cores)
set -eu
OLD=$1; W=${2:-/tmp/eq}; ROOT=$PWD; PY=${PY:-$ROOT/.venv/bin/python}
rm -rf "$W"; mkdir -p "$W"; git worktree add -f "$W/old_src" "$OLD" >/dev/null
PYTHONPATH=$ROOT/src $PY -m napari_gpu_relion.cli simulate --o "$W/data" --n_particles 400 --box 64 --angpix 3.0 \
  --conformations 2 --n_micrographs 0 > "$W/sim.log"
for side in old new; do
  src=$ROOT/src; [ $side = old ] && src=$W/old_src/src
  PYTHONPATH=$src $PY -m napari_gpu_relion.cli class3d --i "$W/data/particles.star" --ref "$W/data/reference.mrc" \
    --o "$W/$side/c3/run" --K 2 --iter 4 --ctf --particle_diameter 150 --ini_high 40 --random_seed 3 --cpu > "$W/$side.log" 2>&1
  PYTHONPATH=$src $PY -m napari_gpu_relion.cli refine3d --i "$W/data/particles.star" --ref "$W/data/reference.mrc" \
    --o "$W/$side/r3/run" --ctf --particle_diameter 150 --ini_high 40 --random_seed 3 --cpu >> "$W/$side.log" 2>&1
done
git worktree remove --force "$W/old_src"
$PY - "$W" <<'PY'
import json, sys
import numpy as np, starfile
w = sys.argv[1]; out = {}
for job, name in (("class3d", "c3/run_it004_data.star"), ("refine3d", "r3/run_data.star")):
    a, b = (starfile.read(f"{w}/{s}/{name}")["particles"] for s in ("old", "new"))
    ang = ["rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi"]
    d = np.abs((a[ang].to_numpy() - b[ang].to_numpy() + 180) % 360 - 180).max(axis=1)
    out[job] = {"particles": len(a), "same_class": float(np.mean(a.rlnClassNumber.to_numpy() == b.rlnClassNumber.to_numpy())),
                "same_angles_within_0.01_deg": float(np.mean(d < 0.01)), "max_angle_diff_deg": float(d.max())}
print(json.dumps(out))
PY

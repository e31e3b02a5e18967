"""Does --tf32 (or the coarse pass's TF32, the default since 2026-11-28) change what the E-step decides?
(issue 15, item 5: TF32 only where it changes nothing that matters)

From iteration k of a finished float32 class3d run of ours (``vs_relion.py run --job class3d --sides ours
--ours_extra=--coarse_float32``), iteration k+1 is computed again by ``class3d --continue
run_itk_optimiser.star --iter k+1`` in a copy of the run's folder: with the flag (--tf32 by default;
--flag=coarse: the default, TF32 in the coarse pass only), and (for the first k) in float32 (--coarse_float32)
as the control, which must repeat the float32 run exactly (--continue is deterministic). Per particle,
iteration k+1 is compared with the float32 run's: the same class, the same orientation (< 0.01°, i.e. the
same fine sample), the angle between them, the same offsets (< 0.01 Å) and the Pmax.
The same state goes into both, so every difference is the products' rounding.

Run (GPU machine; D made by vs_relion.py make-data, the run by vs_relion.py run ... --sides ours --tag fp32):
  python benchmarks/tf32_agreement.py --data D --run ours_class3d_fp32/run --its 1,2,3,4 --out results/x.json
  python benchmarks/tf32_agreement.py --flag=coarse --data D --run ours_class3d_k4s1/run --out results/y.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion  # noqa: E402


def copy_until(run: Path, k: int, dst: Path) -> None:
    """``run``'s folder copied to ``dst`` without the files of iterations after k."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in run.parent.iterdir():
        m = re.search(r"_it(\d{3})_", f.name)
        if f.is_file() and (m is None or int(m.group(1)) <= k):
            shutil.copy2(f, dst / f.name)


def compare(a: Path, b: Path) -> dict:
    """Per-particle agreement of two data STARs of the same particles."""
    pa, pb = (vs_relion.particles_of(p).set_index("rlnImageName") for p in (a, b))
    pb = pb.loc[pa.index]
    ang, doff = vs_relion.pose_differences(pa, pb)
    out = {"n": len(pa), "same_orientation": float((ang < 0.01).mean()), "within_1deg": float((ang < 1.0).mean()),
           "median_angle_deg": float(np.median(ang)), "p99_angle_deg": float(np.percentile(ang, 99)),
           "same_offsets": float((doff < 0.01).mean()),
           "same_pose": float(((ang < 0.01) & (doff < 0.01)).mean())}
    if "rlnClassNumber" in pa:
        out["same_class"] = float((pa["rlnClassNumber"].to_numpy() == pb["rlnClassNumber"].to_numpy()).mean())
    if "rlnMaxValueProbDistribution" in pa:
        x, y = pa["rlnMaxValueProbDistribution"].to_numpy(), pb["rlnMaxValueProbDistribution"].to_numpy()
        out["pmax_mean"] = [float(x.mean()), float(y.mean())]
        out["pmax_max_abs_diff"] = float(np.abs(x - y).max())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the data folder (our runs' working directory)")
    ap.add_argument("--run", required=True, help="the float32 run's rootname under --data")
    ap.add_argument("--its", default="1,2,3,4", help="iterations k to continue from")
    ap.add_argument("--flag", default="--tf32", choices=("--tf32", "coarse"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    data = Path(a.data).resolve()
    run = data / a.run
    res = {"run": a.run, "flag": a.flag, "results": []}
    its = [int(x) for x in a.its.split(",")]
    for k in its:
        for mode in (("fp32", "tf32") if k == its[0] else ("tf32",)):
            dst = data / f"{run.parent.name}_{mode}_from{k:03d}"
            copy_until(run, k, dst)
            cmd = [sys.executable, "-m", "napari_gpu_relion.cli", "class3d", "--continue",
                   str(dst / f"{run.name}_it{k:03d}_optimiser.star"), "--iter", str(k + 1)]
            if mode == "fp32":
                cmd += ["--coarse_float32"]
            elif a.flag == "--tf32":
                cmd += ["--tf32"]
            t0 = time.time()
            with open(dst / "log.txt", "w") as fh:
                rc = subprocess.run(cmd, cwd=data, stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc:
                sys.exit(f"continue failed (rc {rc})\n" + (dst / "log.txt").read_text()[-3000:])
            r = {"from_iteration": k, "mode": mode, "wall_s": time.time() - t0,
                 **compare(Path(f"{run}_it{k + 1:03d}_data.star"), dst / f"{run.name}_it{k + 1:03d}_data.star")}
            res["results"].append(r)
            print(json.dumps(r), flush=True)
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Several class3d runs of one seed against a reference run, at one iteration (issue 16: where do the runs part?).

For each run: the RMS difference of every class map from the reference run's (relative to the reference map), the
same for the difference of classes 1 and 2 (what decides the next split), and per particle the same class, the
best angle (median difference, fraction within 5°) and the mean <Pmax>. Runs are rootnames (``.../run``); any
program's files (RELION's GPU or CPU build, ours).

Run:
  python benchmarks/compare_runs_at_iteration.py --it 1 --ref relion_gpu=/tmp/p60/relion_class3d_k2s1/run \
      --runs relion_cpu=/tmp/p60/relion_cpu_k2s1/run,ours=/tmp/s15it1/k2s1/run --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mrcfile
import numpy as np
import starfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion  # noqa: E402


def _load(root: str, it: int):
    stem = f"{root}_it{it:03d}"
    maps = [mrcfile.read(p).astype(np.float64) for p in sorted(Path(stem).parent.glob(Path(stem).name +
                                                                                       "_class*.mrc"))]
    parts = starfile.read(stem + "_data.star")["particles"].set_index("rlnImageName")
    return maps, parts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--it", type=int, required=True)
    ap.add_argument("--ref", required=True, help="name=rootname of the reference run")
    ap.add_argument("--runs", required=True, help="name=rootname,...")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    ref_name, ref_root = a.ref.split("=", 1)
    g, gp = _load(ref_root, a.it)
    norm = np.linalg.norm
    res: dict = {"iteration": a.it, "reference": a.ref, "runs": {}}
    for item in a.runs.split(","):
        name, root = item.split("=", 1)
        m, mp = _load(root, a.it)
        mp = mp.loc[gp.index]
        d, _ = vs_relion.pose_differences(mp, gp)
        row = {"map_rms_difference": [float(norm(x - y) / norm(y)) for x, y in zip(m, g, strict=True)],
               "class_difference_map_rms_difference":
                   float(norm((m[0] - m[1]) - (g[0] - g[1])) / norm(g[0] - g[1])) if len(g) > 1 else None,
               "same_class": float((mp.rlnClassNumber.to_numpy() == gp.rlnClassNumber.to_numpy()).mean()),
               "median_best_angle_difference_deg": float(np.median(d)), "within_5deg": float((d < 5).mean()),
               "class_sizes": {int(k): int(v) for k, v in mp.rlnClassNumber.value_counts().items()},
               "pmax_mean": float(mp.rlnMaxValueProbDistribution.mean()),
               "reference_pmax_mean": float(gp.rlnMaxValueProbDistribution.mean())}
        res["runs"][name] = row
        print(name, json.dumps(row))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

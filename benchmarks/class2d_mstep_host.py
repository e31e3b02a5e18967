"""The host part of class2d's M-step at K classes of box N: the class maps to float64, the solvent flattened
(--flatten_solvent), centred (--center_classes) and rounded to float32 as written, on K random maps. The job's
own code (``compute.references2d.references_from_maps``) against the same steps as written before the thirty-fourth
session (a copy for each step), timed alternately; both must give the same array.

Run: python benchmarks/class2d_mstep_host.py [--K 200 --box 360 --repeats 5] --out benchmarks/results/R.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from napari_gpu_relion.compute.masks import soft_spherical_mask
from napari_gpu_relion.compute.references2d import center_of_mass, references_from_maps, shift_images


def before(maps, circle, offset_range):
    r = np.stack(maps).astype(np.float64)
    r = r * circle[None]
    r = shift_images(r, -center_of_mass(r.astype(np.float64), offset_range))  # (it copied float64 images too)
    return r.astype(np.float32).astype(np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--K", type=int, default=200)
    ap.add_argument("--box", type=int, default=360)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    maps = np.random.default_rng(0).normal(size=(a.K, a.box, a.box)).astype(np.float32)
    circle = soft_spherical_mask(a.box, 0.4 * a.box, 5.0, 2).astype(np.float64)
    times = {"before": [], "now": []}
    for _ in range(a.repeats):
        t = time.perf_counter()
        b = before(maps, circle, 5.0)
        times["before"].append(time.perf_counter() - t)
        t = time.perf_counter()
        n = references_from_maps(maps, circle, 5.0, True, True)
        times["now"].append(time.perf_counter() - t)
    res = {"hardware": f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()})", "K": a.K,
           "box": a.box, "identical": bool(np.array_equal(b, n)),
           "seconds": {k: [round(v, 4) for v in vs] for k, vs in times.items()},
           "median_s": {k: round(float(np.median(vs)), 4) for k, vs in times.items()}}
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

"""Benchmark: how many iterations 3D auto-refine takes, at which HEALPix orders, and what it reaches (issue 15).

Simulates a small particle set (or uses --data), runs refine3d with the demo's options and records every
iteration's HEALPix order, image size and the schedule's messages, then the final resolution (gold-standard FSC
0.143) and the median angular error against the true angles. Run it with two checkouts (PYTHONPATH) to compare
schedule rules; the JSON names the git commit of the code that ran.

Run: python benchmarks/refine_iterations.py [--n 600 --box 32 --angpix 6 --snr 0.1] [--cpu] --out results/x.json

Issue 15's CPU case (RELION 5's CPU build took 53.7 min on 2 cores for a 2,000-particle box-64 auto-refine with
its GUI defaults): ``--map ../shared/data/real/ribosome70S_65px.mrc --n 2000 --box 64 --angpix 5 --snr 0.05
--healpix_order 2 --auto_local_healpix_order 4 --offset_step 1 --diameter 280 --cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import starfile

import napari_gpu_relion
from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.events import Finished, Message
from napari_gpu_relion.jobs import refine3d
from napari_gpu_relion.jobs.simulate import make_sample_data

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="", help="a folder made by make_sample_data (default: simulate one)")
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--box", type=int, default=32)
    ap.add_argument("--angpix", type=float, default=6.0)
    ap.add_argument("--snr", type=float, default=0.1)
    ap.add_argument("--healpix_order", type=int, default=1)
    ap.add_argument("--auto_local_healpix_order", type=int, default=3)
    ap.add_argument("--map", default="", help="phantom map (default: the pseudo-atomic phantom)")
    ap.add_argument("--diameter", type=float, default=0.0, help="mask diameter (Å); 0 = 0.8 box angpix")
    ap.add_argument("--offset_range", type=float, default=5.0)
    ap.add_argument("--offset_step", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    load0 = os.getloadavg()
    data = Path(a.data) if a.data else Path(tempfile.mkdtemp(prefix="refine_iterations_"))
    if not (data / "particles.star").is_file():
        make_sample_data(data, box=a.box, angpix=a.angpix, n_particles=a.n, snr=a.snr, diameter=0.7 * a.box * a.angpix,
                         ini_high=60.0, n_micrographs=0, seed=a.seed, **({"map": Path(a.map)} if a.map else {}))
    out = Path(tempfile.mkdtemp(prefix="refine_iterations_run_")) / "run"
    src = Path(napari_gpu_relion.__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    iterations, schedule, t0, summary, backend = [], [], time.time(), "", ""
    for ev in refine3d.run(refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=out, ctf=True,
                                           particle_diameter=a.diameter or 0.8 * a.box * a.angpix,
                                           healpix_order=a.healpix_order, offset_range=a.offset_range,
                                           offset_step=a.offset_step,
                                           auto_local_healpix_order=a.auto_local_healpix_order,
                                           flatten_solvent=True, cpu=a.cpu)):
        if type(ev).__name__ == "Started":
            backend = ev.backend
        if isinstance(ev, Message):
            m = re.match(r"iteration (\d+): image size (\d+) .*HEALPix order (\d+)", ev.text)
            if m:
                iterations.append({"iteration": int(m[1]), "image_size": int(m[2]), "order": int(m[3]),
                                   "local": "local" in ev.text, "final": "final" in ev.text})
            elif ev.text.startswith(("sampling:", "angular sampling fine enough")):
                schedule.append(ev.text)
        if isinstance(ev, Finished):
            summary = ev.summary
    d = starfile.read(out.parent / "run_data.star")["particles"]
    truth = starfile.read(data / "particles.star")["particles"]
    err = angular_distance_deg(*(euler_to_matrix(*(t[c].to_numpy() for c in ANG)) for t in (d, truth)))
    res = re.search(r"final resolution ([\d.]+) Å", summary)
    orders = [it["order"] for it in iterations]
    result = {"commit": commit, "backend": backend, "host": platform.node(),
              "cpu": platform.processor() or platform.machine(), "os_cpu_count": os.cpu_count(),
              "load_average_start": load0, "load_average_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d"),
              "args": vars(a), "iterations": len(iterations), "iterations_per_order":
              {str(o): orders.count(o) for o in sorted(set(orders))}, "resolution_A": float(res[1]) if res else None,
              "median_angular_error_deg": float(np.median(err)), "wall_s": round(time.time() - t0, 1),
              "per_iteration": iterations, "schedule": schedule}
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

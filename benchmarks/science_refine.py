"""Science check of 3D auto-refine on simulated data with ground truth (issue: "done when", full size).

Simulates particles (pseudo-atomic phantom, CTF, offsets, random halves), refines them from the truth
low-passed to 60 Å, and compares with the reconstruction from the true angles: gold-standard resolution of both
(FSC 0.143 of the half maps), the median angular error of the refined angles and the final angular step, the
median offset error, and the wall time. Writes JSON naming the hardware.

Run: python benchmarks/science_refine.py --n 3000 --box 64 --angpix 3.0 --snr 0.05 [--out results/x.json] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import starfile

from napari_gpu_relion.compute.fsc import fsc, resolution_A
from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.events import Message
from napari_gpu_relion.io.jobdir import RunFiles
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import reconstruct, refine3d
from napari_gpu_relion.jobs.em import read_optimiser_star
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime.device import select_backend

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


def _matrices(df):
    return euler_to_matrix(*(df[c].to_numpy() for c in ANG))


def half_map_resolution(h1: Path, h2: Path) -> float:
    a = read_mrc(h1)
    m1, m2 = np.asarray(a.data, np.float64), np.asarray(read_mrc(h2).data, np.float64)
    return float(resolution_A(fsc(m1, m2), m1.shape[0], float(a.pixel_size), 0.143))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--box", type=int, default=64)
    ap.add_argument("--angpix", type=float, default=3.0)
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--diameter", type=float, default=150.0)
    ap.add_argument("--healpix_order", type=int, default=2)
    ap.add_argument("--work", default="science_refine_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    work = Path(a.work)
    data = make_sample_data(work / "data", box=a.box, angpix=a.angpix, n_particles=a.n, snr=a.snr,
                            diameter=a.diameter, ini_high=60.0, n_micrographs=0)
    truth = starfile.read(data / "particles.star")["particles"]
    for k in (1, 2):
        for _ in reconstruct.run(reconstruct.Params(i=data / "particles.star", o=work / f"truth_half{k}.mrc", ctf=True,
                                                    subset=k, cpu=a.cpu)):
            pass
    res_truth = half_map_resolution(work / "truth_half1.mrc", work / "truth_half2.mrc")
    out = RunFiles(work / "refine" / "run")
    t0 = time.perf_counter()
    last = ""
    for ev in refine3d.run(refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=out.root, ctf=True,
                                           particle_diameter=a.diameter + 10.0, healpix_order=a.healpix_order,
                                           flatten_solvent=True, cpu=a.cpu)):
        if isinstance(ev, Message):
            last = ev.text
            print(f"{time.perf_counter() - t0:8.1f} s  {ev.text}", flush=True)
    wall = time.perf_counter() - t0
    res_refined = half_map_resolution(out.unfiltered_half_map(1), out.unfiltered_half_map(2))
    d = starfile.read(out.data())["particles"]
    err = angular_distance_deg(_matrices(d), _matrices(truth))
    off = np.hypot(d["rlnOriginXAngst"].to_numpy() - truth["rlnOriginXAngst"].to_numpy(),
                   d["rlnOriginYAngst"].to_numpy() - truth["rlnOriginYAngst"].to_numpy())
    gen = read_optimiser_star(out.optimiser())
    order = int(gen.get("rlnGpuRelion_order", a.healpix_order))
    final_step = 60.0 / 2**order / 2.0  # fine (oversampled) angular step of the last iteration
    r = {"hardware": be.name, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
         "n_particles": a.n, "box": a.box, "angpix": a.angpix, "snr": a.snr,
         "resolution_true_angles_A": res_truth, "resolution_refined_A": res_refined,
         "resolution_ratio": res_refined / res_truth,
         "median_angular_error_deg": float(np.median(err)), "final_fine_angular_step_deg": final_step,
         "median_offset_error_A": float(np.median(off)), "wall_s": wall, "last_message": last}
    print(json.dumps(r, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()

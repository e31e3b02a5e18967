"""Science check of 3D classification on a simulated two-state mixture (issue #5 "done when", full size).

Simulates particles from two conformations (the pseudo-atomic phantom and the same without one domain, 50/50,
one noise level, CTF, offsets), classifies them with K classes from the state-1 truth low-passed to ini_high,
and reports, per iteration, the class sizes and the assignment accuracy (each class labelled by its majority
state), the empty and split classes, and the wall time. Writes JSON naming the hardware.

Run: python benchmarks/science_class3d.py --n 2000 --box 32 --angpix 6 --snr 0.05 --K 2 [--out results/x.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import starfile

from napari_gpu_relion.compute.ground_truth import class_assignment_report
from napari_gpu_relion.events import IterationFinished, Message
from napari_gpu_relion.io.jobdir import RunFiles
from napari_gpu_relion.jobs import class3d
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime.device import select_backend


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--box", type=int, default=32)
    ap.add_argument("--angpix", type=float, default=6.0)
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--diameter", type=float, default=150.0)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--iter", type=int, default=25)
    ap.add_argument("--healpix_order", type=int, default=2)
    ap.add_argument("--sigma_ang", type=float, default=-1.0)
    ap.add_argument("--tau2_fudge", type=float, default=4.0)
    ap.add_argument("--ini_high", type=float, default=60.0)
    ap.add_argument("--no_flatten", action="store_true")
    ap.add_argument("--skip_align", action="store_true")
    ap.add_argument("--then_local", type=int, default=0,
                    help="then this many iterations of local searches (--sigma_ang, --local_order) from the result")
    ap.add_argument("--local_sigma", type=float, default=3.0)
    ap.add_argument("--local_order", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="science_class3d_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    work = Path(a.work)
    data = make_sample_data(work / "data", box=a.box, angpix=a.angpix, n_particles=a.n, snr=a.snr,
                            diameter=a.diameter, ini_high=a.ini_high, n_micrographs=0, conformations=2,
                            seed=a.seed)
    truth = starfile.read(data / "particles_truth.star")["particles"]
    states = truth["rlnClassNumber"].to_numpy() - 1
    out = data / f"Class3D_K{a.K}"  # inside the data folder (RELION's project layout: image paths resolve)
    params = class3d.Params(i=data / "particles.star", ref=data / "truth.mrc", o=out / "run", K=a.K, iter=a.iter,
                            tau2_fudge=a.tau2_fudge, healpix_order=a.healpix_order, sigma_ang=a.sigma_ang,
                            skip_align=a.skip_align, ini_high=a.ini_high, particle_diameter=a.diameter + 10.0, ctf=True,
                            flatten_solvent=not a.no_flatten, zero_mask=True, random_seed=a.seed, cpu=a.cpu)
    per_iter: list = []
    t0 = time.perf_counter()
    d = _run(params, out, truth, states, a.K, per_iter, t0)
    if a.then_local:
        first = RunFiles(out / "run")
        out = data / f"Class3D_K{a.K}_local"
        local = class3d.Params(i=first.data(a.iter), ref=first.model(a.iter), o=out / "run", K=a.K,
                               iter=a.then_local,
                               tau2_fudge=a.tau2_fudge, healpix_order=a.local_order, sigma_ang=a.local_sigma,
                               ini_high=-1.0, particle_diameter=a.diameter + 10.0, ctf=True,
                               flatten_solvent=not a.no_flatten, zero_mask=True, random_seed=a.seed, cpu=a.cpu)
        d = _run(local, out, truth, states, a.K, per_iter, t0, offset=a.iter)
    wall = time.perf_counter() - t0
    rep = class_assignment_report(d["rlnClassNumber"].to_numpy() - 1, states, a.K)
    r = {"hardware": be.name, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
         "n_particles": a.n, "box": a.box, "angpix": a.angpix, "snr": a.snr, "K": a.K, "iter": a.iter,
         "healpix_order": a.healpix_order, "sigma_ang": a.sigma_ang, "skip_align": a.skip_align,
         "then_local_iterations": a.then_local, "local_sigma_ang": a.local_sigma, "local_order": a.local_order,
         "tau2_fudge": a.tau2_fudge, "flatten_solvent": not a.no_flatten, "accuracy": rep.accuracy,
         "class_sizes": rep.sizes.tolist(), "class_label_state": rep.label.tolist(),
         "empty_classes": rep.empty_classes, "split_states": rep.split_states, "wall_s": wall,
         "particle_iterations_per_s": a.n * (a.iter + a.then_local) / wall, "per_iteration": per_iter}
    print(json.dumps({k: v for k, v in r.items() if k != "per_iteration"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1))


def _run(params, out, truth, states, K, per_iter, t0, offset=0):
    """Run one class3d job, scoring every iteration against the truth; returns the last data table."""
    d = None
    for ev in class3d.run(params):
        if isinstance(ev, Message):
            print(f"{time.perf_counter() - t0:8.1f} s  {ev.text}", flush=True)
        if isinstance(ev, IterationFinished):
            d = starfile.read(RunFiles(out / "run").data(ev.iteration))["particles"]
            assert (d["rlnImageName"].to_numpy() == truth["rlnImageName"].to_numpy()).all()
            rep = class_assignment_report(d["rlnClassNumber"].to_numpy() - 1, states, K)
            per_iter.append({"iteration": offset + ev.iteration, "accuracy": rep.accuracy, "sizes": rep.sizes.tolist(),
                             "purity": rep.purity.round(3).tolist(), "resolution_A": ev.resolution_A,
                             "t_s": time.perf_counter() - t0})
            print(f"          accuracy {rep.accuracy:.3f} sizes {rep.sizes.tolist()} "
                  f"purity {rep.purity.round(3).tolist()}", flush=True)
    return d


if __name__ == "__main__":
    main()

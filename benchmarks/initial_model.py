"""Science and speed check of the 3D initial model from the particles alone (issue #22 "done when", full size).

Simulates particles of the pseudo-atomic phantom (CTF, offsets, SNR), runs initial_model with no reference for
each seed, and reports per seed the wall time, the time per iteration and the correlation with the truth after the
best rotation, shift and hand (compute/initial_model.aligned_map_correlation) at 30 Å and 20 Å. Writes JSON naming
the hardware.

Run (the issue's case, on a GPU): python benchmarks/initial_model.py --n 5000 --box 64 --angpix 3 --snr 0.05
    --iter 200 --seeds 1 2 3 --out benchmarks/results/initial_model_h100.json
Small CPU variant: python benchmarks/initial_model.py --n 300 --box 24 --angpix 8 --snr 0.2 --iter 30 --cpu
    --ini_subset 100 --fin_subset 300 --ini_resol 40 --fin_resol 24 --seeds 1
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute.backend import select_backend
from napari_gpu_relion.compute.initial_model import aligned_map_correlation
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import initial_model
from napari_gpu_relion.jobs.events import Finished
from napari_gpu_relion.jobs.simulate import make_sample_data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--box", type=int, default=64)
    ap.add_argument("--angpix", type=float, default=3.0)
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--diameter", type=float, default=150.0)
    ap.add_argument("--iter", type=int, default=200)
    ap.add_argument("--K", type=int, default=1)
    ap.add_argument("--ini_subset", type=int, default=-1)
    ap.add_argument("--fin_subset", type=int, default=-1)
    ap.add_argument("--ini_resol", type=float, default=35.0)
    ap.add_argument("--fin_resol", type=float, default=15.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_initial_model"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    data = a.work / "data"
    make_sample_data(data, box=a.box, angpix=a.angpix, n_particles=a.n, snr=a.snr, diameter=a.diameter,
                     n_micrographs=0)
    truth = np.asarray(read_mrc(data / "truth.mrc").data, np.float64)
    be = select_backend(cpu=a.cpu)
    runs = []
    for seed in a.seeds:
        out = a.work / f"seed{seed}"
        shutil.rmtree(out, ignore_errors=True)
        p = initial_model.Params(i=data / "particles.star", o=out / "run", iter=a.iter, K=a.K, ctf=True,
                                 particle_diameter=a.diameter + 15, flatten_solvent=True, zero_mask=True, cpu=a.cpu,
                                 random_seed=seed, grad_ini_subset=a.ini_subset, grad_fin_subset=a.fin_subset,
                                 grad_ini_resol=a.ini_resol, grad_fin_resol=a.fin_resol)
        t0 = time.time()
        fin = [e for e in initial_model.run(p) if isinstance(e, Finished)][-1]
        wall = time.time() - t0
        got = np.asarray(read_mrc(out / "run_class001.mrc").data, np.float64)
        cc = {f"{res:g}A": aligned_map_correlation(got, truth, a.angpix, res)["cc"] for res in (30.0, 20.0)}
        runs.append({"seed": seed, "wall_s": wall, "s_per_iteration": wall / a.iter, "cc_best_aligned": cc,
                     "summary": fin.summary})
        print(json.dumps(runs[-1]))
    result = {"benchmark": "initial_model", "args": {k: str(v) for k, v in vars(a).items()},
              "backend": be.name, "host": platform.node(), "machine": platform.machine(), "runs": runs}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Science and speed check of the 3D initial model from the particles alone (issue #22 "done when", full size).

Simulates particles of the pseudo-atomic phantom (CTF, offsets, SNR), runs initial_model with no reference for
each seed, and reports per seed the wall time, the time per iteration and the correlation with the truth after the
best rotation, shift and hand (compute/initial_model.aligned_map_correlation) at 30 Å and 20 Å. Writes JSON naming
the hardware.

Run (the issue's case, on a GPU): python benchmarks/initial_model.py --n 5000 --box 64 --angpix 3 --snr 0.05
    --iter 200 --seeds 1 2 3 --out benchmarks/results/initial_model_h100.json
Small CPU variant: python benchmarks/initial_model.py --n 300 --box 24 --angpix 8 --snr 0.2 --iter 30 --cpu
    --ini_subset 100 --fin_subset 300 --ini_resol 40 --fin_resol 24 --seeds 1
Junk (the issue's K=2 case): --K 2 --junk 0.2 adds images of pure noise at the particles' noise level (20 % of
the set) and reports, per seed, where the junk went (the class holding most of it: its share of all junk and its
purity) and the correlation of every class with the truth.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import starfile

from napari_gpu_relion.compute.backend import select_backend
from napari_gpu_relion.compute.initial_model import aligned_map_correlation
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.jobs import initial_model
from napari_gpu_relion.jobs.events import Finished
from napari_gpu_relion.jobs.simulate import make_sample_data


def add_junk(data: Path, fraction: float, snr: float, seed: int) -> tuple[Path, np.ndarray]:
    """particles_junk.star in ``data``: the particles and pure-noise images (a ``fraction`` of the whole, noise
    as strong as the particles' own: image variance x 1/(1 + snr)), shuffled; returns it and a flag per row
    (True = junk)."""
    star = starfile.read(data / "particles.star", always_dict=True)
    parts = star["particles"]
    n = len(parts)
    m = int(round(fraction * n / (1.0 - fraction)))
    first = parts["rlnImageName"].iloc[0].split("@")[1]
    stack = read_mrc(data / first).data
    sd = float(np.std(stack)) * np.sqrt(1.0 / (1.0 + snr))
    rng = np.random.default_rng(seed)
    junk_name = str(Path(first).with_name("junk.mrcs"))
    write_mrc(data / junk_name, rng.normal(0.0, sd, (m,) + stack.shape[1:]).astype(np.float32),
              float(star["optics"]["rlnImagePixelSize"].iloc[0]))
    rows = parts.sample(m, replace=True, random_state=seed).copy()  # CTF and optics of real rows
    rows["rlnImageName"] = [f"{i + 1:06d}@{junk_name}" for i in range(m)]
    both = pd.concat([parts, rows], ignore_index=True)
    flag = np.r_[np.zeros(n, bool), np.ones(m, bool)]
    order = rng.permutation(n + m)
    star["particles"] = both.iloc[order].reset_index(drop=True)
    out = data / "particles_junk.star"
    starfile.write(star, out, overwrite=True)
    return out, flag[order]


def junk_report(out: Path, flag: np.ndarray, K: int) -> dict:
    """Where the junk went: per class its share of the particles and of the junk; the class with most junk."""
    cls = starfile.read(out / "run_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    per = [{"class": k + 1, "particles": int((cls == k).sum()), "junk": int((flag & (cls == k)).sum())}
           for k in range(K)]
    j = max(per, key=lambda c: c["junk"])
    return {"classes": per, "junk_class": j["class"], "junk_in_junk_class": j["junk"] / max(1, int(flag.sum())),
            "junk_class_purity": j["junk"] / max(1, j["particles"])}


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
    ap.add_argument("--junk", type=float, default=0.0, help="fraction of pure-noise images added (0: none)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_initial_model"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    data = a.work / "data"
    make_sample_data(data, box=a.box, angpix=a.angpix, n_particles=a.n, snr=a.snr, diameter=a.diameter,
                     n_micrographs=0)
    truth = np.asarray(read_mrc(data / "truth.mrc").data, np.float64)
    star, flag = (add_junk(data, a.junk, a.snr, 0) if a.junk > 0 else (data / "particles.star", None))
    be = select_backend(cpu=a.cpu)
    runs = []
    for seed in a.seeds:
        out = a.work / f"seed{seed}"
        shutil.rmtree(out, ignore_errors=True)
        p = initial_model.Params(i=star, o=out / "run", iter=a.iter, K=a.K, ctf=True,
                                 particle_diameter=a.diameter + 15, flatten_solvent=True, zero_mask=True, cpu=a.cpu,
                                 random_seed=seed, grad_ini_subset=a.ini_subset, grad_fin_subset=a.fin_subset,
                                 grad_ini_resol=a.ini_resol, grad_fin_resol=a.fin_resol)
        t0 = time.time()
        fin = [e for e in initial_model.run(p) if isinstance(e, Finished)][-1]
        wall = time.time() - t0
        cc = {}
        for k in range(1, a.K + 1):
            name = "run_class001.mrc" if a.K == 1 else f"run_class{k:03d}.mrc"
            got = np.asarray(read_mrc(out / name).data, np.float64)
            cc[f"class{k}"] = {f"{res:g}A": aligned_map_correlation(got, truth, a.angpix, res)["cc"]
                               for res in (30.0, 20.0)}
        run = {"seed": seed, "wall_s": wall, "s_per_iteration": wall / a.iter, "cc_best_aligned": cc,
               "summary": fin.summary}
        if flag is not None:
            run["junk"] = junk_report(out, flag, a.K)
        runs.append(run)
        print(json.dumps(runs[-1]))
    result = {"benchmark": "initial_model", "args": {k: str(v) for k, v in vars(a).items()},
              "backend": be.name, "host": platform.node(), "machine": platform.machine(), "runs": runs}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

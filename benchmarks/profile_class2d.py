"""Where a 2D classification iteration spends its time (whole job, not only the E-step): wraps the steps that
jobs/class2d.py and jobs/em.py call with synchronised timers and runs a few iterations on the science_class2d data
set. Timers nest (expectation_batch includes _project_rows etc.); "iterations_s" is the wall time per iteration.

Run: python benchmarks/profile_class2d.py --per_view 4000 --junk 5000 --box 128 --angpix 1.5 --K 100 --iter 3
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute import backprojector, estep
from napari_gpu_relion.events import IterationFinished
from napari_gpu_relion.jobs import class2d, em
from napari_gpu_relion.jobs.simulate import make_views_and_junk
from napari_gpu_relion.runtime.device import select_backend

TIMES: dict = defaultdict(float)
COUNTS: dict = defaultdict(int)
VIEWS = np.array([[0, 90, 0], [90, 90, 0], [0, 0, 0], [45, 45, 0], [135, 60, 0]], dtype=float)


def wrap(owner, name, be, label=None):
    fn = getattr(owner, name)
    key = label or f"{getattr(owner, '__name__', owner)}.{name}".split(".")[-2] + "." + name

    def timed(*a, **k):
        be.synchronize()
        t = time.perf_counter()
        r = fn(*a, **k)
        be.synchronize()
        TIMES[key] += time.perf_counter() - t
        COUNTS[key] += 1
        return r

    setattr(owner, name, timed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per_view", type=int, default=4000)
    ap.add_argument("--junk", type=int, default=5000)
    ap.add_argument("--box", type=int, default=128)
    ap.add_argument("--angpix", type=float, default=1.5)
    ap.add_argument("--K", type=int, default=100)
    ap.add_argument("--iter", type=int, default=3)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--work", default="profile_class2d_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    data = make_views_and_junk(Path(a.work), VIEWS, a.per_view, a.junk, a.box, a.angpix, 0.1, 0)
    wrap(em.ParticleSet, "images", be, "ParticleSet.images (disk)")
    wrap(em, "prepare_batch", be, "prepare_batch")
    wrap(em, "expectation_batch", be, "expectation_batch")
    for name in ("scores_shared", "scores_gathered", "posterior_weights", "fine_sums", "_project_rows",
                 "insert_by_class", "particle_terms"):
        wrap(estep, name, be, f"  {name}")
    wrap(backprojector.BackProjector, "reconstruct", be, "BackProjector.reconstruct")
    wrap(backprojector.BackProjector, "enforce_hermitian", be, "BackProjector.enforce_hermitian")
    wrap(class2d, "ssnr_map", be, "ssnr_map")
    wrap(class2d, "prepare_reference", be, "prepare_reference")
    wrap(class2d, "reference_tau2", be, "reference_tau2")
    wrap(class2d, "write_mrc", be, "write_mrc")
    wrap(em, "write_data_star", be, "write_data_star")
    wrap(em, "write_classification_model", be, "write_classification_model")
    wrap(em, "write_optimiser_star", be, "write_optimiser_star")
    t0 = time.time()
    marks = []
    for ev in class2d.run(class2d.Params(i=data / "particles.star", o=data / "prof" / "run", K=a.K, iter=a.iter,
                                         ctf=True,
                                         particle_diameter=150.0, flatten_solvent=True, zero_mask=True,
                                         center_classes=True, batch=a.batch, cpu=a.cpu)):
        if isinstance(ev, IterationFinished):
            marks.append(time.time() - t0)
            print(ev.summary, flush=True)
    res = {"hardware": be.name, "args": vars(a), "iterations_s": np.diff([0.0] + marks).tolist(),
           "steps_s": dict(sorted(TIMES.items(), key=lambda kv: -kv[1])), "calls": dict(COUNTS)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Science and speed check of 2D classification at a realistic size (issue #5 "done when", on a GPU).

Simulates views of the L-shaped phantom (random psi, CTF, SNR) plus pure-noise junk images at the same noise
level (jobs.simulate.make_views_and_junk), classifies them with RELION's GUI settings (--ctf --flatten_solvent
--zero_mask --center_classes, T=2, psi 12° coarse / 6° fine, offsets range 5 step 2) and reports the fraction of
junk in classes holding < 5 % of the true particles, each view's best class-average correlation with its
noise-free projection, and the wall time per iteration. Writes JSON naming the hardware.

Run: python benchmarks/science_class2d.py --per_view 1000 --junk 1250 --box 64 --angpix 3 --K 50 [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import starfile

from napari_gpu_relion.compute.ground_truth import aligned_correlation
from napari_gpu_relion.events import IterationFinished, Message
from napari_gpu_relion.io.jobdir import RunFiles
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import class2d
from napari_gpu_relion.jobs.simulate import make_views_and_junk
from napari_gpu_relion.runtime.device import select_backend

VIEWS = np.array([[0, 90, 0], [90, 90, 0], [0, 0, 0], [45, 45, 0], [135, 60, 0]], dtype=float)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per_view", type=int, default=1000)
    ap.add_argument("--junk", type=int, default=1250)
    ap.add_argument("--box", type=int, default=64)
    ap.add_argument("--angpix", type=float, default=3.0)
    ap.add_argument("--snr", type=float, default=0.1)
    ap.add_argument("--K", type=int, default=50)
    ap.add_argument("--iter", type=int, default=25)
    ap.add_argument("--diameter", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="science_class2d_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    data = make_views_and_junk(Path(a.work), VIEWS, a.per_view, a.junk, a.box, a.angpix, a.snr, a.seed)
    out = data / f"Class2D_K{a.K}"
    params = class2d.Params(i=data / "particles.star", o=out / "run", K=a.K, iter=a.iter, ctf=True,
                            particle_diameter=a.diameter, flatten_solvent=True, zero_mask=True, center_classes=True,
                            random_seed=a.seed, cpu=a.cpu)
    t0 = time.time()
    its = []
    for ev in class2d.run(params):
        if isinstance(ev, IterationFinished):
            its.append({"iteration": ev.iteration, "t_s": time.time() - t0, "summary": ev.summary})
            if be.is_gpu:
                pool = be.xp.get_default_memory_pool()
                its[-1]["gpu_pool_bytes"] = int(pool.total_bytes())
                its[-1]["gpu_used_bytes"] = int(pool.used_bytes())
            print(f"it {ev.iteration}: {ev.summary} pool {its[-1].get('gpu_pool_bytes', '')} used "
                  f"{its[-1].get('gpu_used_bytes', '')}", flush=True)
        elif isinstance(ev, Message) and "memory" in ev.text:
            print(ev.text, flush=True)
    wall = time.time() - t0
    label = np.load(data / "label.npy")
    cls = starfile.read(RunFiles(out / "run").data(a.iter))["particles"]["rlnClassNumber"].to_numpy() - 1
    true_in = np.bincount(cls[label >= 0], minlength=a.K)
    junk_classes = true_in < 0.05 * (label >= 0).sum()
    avgs = np.asarray(read_mrc(RunFiles(out / "run").classes_stack(a.iter)).data, np.float64)
    views = np.load(data / "views.npy").astype(np.float64)
    corr = []
    for v in range(len(VIEWS)):
        k = int(np.bincount(cls[label == v], minlength=a.K).argmax())
        corr.append({"view": v, "class": k + 1, "fraction_in_class": float((cls[label == v] == k).mean()),
                     "correlation": aligned_correlation(avgs[k], views[v])})
    res = {"hardware": be.name, "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "args": vars(a),
           "n_particles": int(label.size), "junk_in_junk_classes": float(junk_classes[cls[label < 0]].mean()),
           "views": corr, "wall_s": wall,
           "s_per_iteration_after_first": (its[-1]["t_s"] - its[0]["t_s"]) / max(1, len(its) - 1),
           "particle_iterations_per_s": label.size * a.iter / wall, "iterations": its}
    if be.is_gpu:  # the memory pool keeps what the run needed at most (CuPy frees blocks to the pool, not the GPU)
        res["gpu_pool_bytes"] = int(be.xp.get_default_memory_pool().total_bytes())
    print(json.dumps({k: v for k, v in res.items() if k != "iterations"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

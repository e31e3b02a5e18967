"""Benchmark: autopicking throughput (micrographs per second) at 4096 x 4096, LoG and templates.

Micrographs: white noise plus dark Gaussian blobs (particle-like), float32 in host memory (file reading is not
timed: it is a memory map plus one host-to-device copy). Parameters: 1.0 Å/px, --lowpass 20 --shrink 0 (the
RELION GUI setting; working grid 410 px); LoG with diameters 150-200 Å; templates: 50 references of 200 px x
36 psi (--ang 10) with --ctf. Times include the device transfer, FFTs, FOMs and the host peak search, with a
device synchronisation before each clock read.

Run: python benchmarks/bench_picking.py [--out benchmarks/results/picking_<gpu>.json] [--cpu] [--quick]
(--quick: 1024 px, 5 references, for a CPU check that the script works).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute.ctf import CtfParams
from napari_gpu_relion.jobs import autopick as ap
from napari_gpu_relion.runtime.device import select_backend
from napari_gpu_relion.runtime.memory import free_cached_memory, template_pick_batch


def micrographs(n: int, size: int, apix: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    yy, xx = np.mgrid[0:size, 0:size]
    for _ in range(n):
        img = rng.normal(0, 1, (size, size)).astype(np.float32)
        sig = 75.0 / apix / 2
        for cx, cy in rng.uniform(100, size - 100, (50 if size >= 2048 else 10, 2)):
            x0, x1, y0, y1 = int(cx - 3 * sig), int(cx + 3 * sig), int(cy - 3 * sig), int(cy + 3 * sig)
            img[y0:y1, x0:x1] -= 0.5 * np.exp(-((xx[y0:y1, x0:x1] - cx) ** 2 + (yy[y0:y1, x0:x1] - cy) ** 2)
                                              / (2 * sig**2))
        out.append(img)
    return out


def main():
    ap_ = argparse.ArgumentParser()
    ap_.add_argument("--out", default=None)
    ap_.add_argument("--cpu", action="store_true")
    ap_.add_argument("--quick", action="store_true")
    ap_.add_argument("--n", type=int, default=8, help="micrographs per timing")
    args = ap_.parse_args()
    be = select_backend(cpu=args.cpu)
    xp = be.xp
    size = 1024 if args.quick else 4096
    n_refs = 5 if args.quick else 50
    ref_box = 64 if args.quick else 200
    apix = 1.0
    n = 2 if args.quick else args.n
    mics = micrographs(n, size, apix)
    results = {"device": be.name, "host": platform.node(), "micrograph_px": size, "pixel_size_A": apix,
               "lowpass_A": 20.0, "n_micrographs": n}

    # LoG
    p = ap.Params(i=Path("x.star"), odir=Path("/tmp"), LoG=True, LoG_diam_min=150.0, LoG_diam_max=200.0,
                  cpu=args.cpu)
    st = ap._setup((size, size), p, apix, xp, None, be)
    ap._log_batch(mics[:1], st, p, apix, xp, 0)  # warm-up (FFT plans)
    for batch in (1, 4):
        if batch > n:
            continue
        be.synchronize()
        t = time.perf_counter()
        npick = 0
        for i in range(0, n, batch):
            res = ap._log_batch(mics[i:i + batch], st, p, apix, xp, i)
            npick += sum(len(r[0]) for r in res)
        be.synchronize()
        dt = time.perf_counter() - t
        results[f"log_batch{batch}_s_per_micrograph"] = dt / n
        results[f"log_batch{batch}_micrographs_per_s"] = n / dt
        results["log_picks_per_micrograph"] = npick / n
    results["working_grid_px"] = st.grid.w

    # templates
    rng = np.random.default_rng(1)
    c = np.arange(ref_box) - ref_box // 2
    r2 = c[:, None] ** 2 + c[None, :] ** 2
    refs = np.stack([np.exp(-r2 / (2 * (ref_box / 6) ** 2)) * (1 + 0.3 * rng.normal(size=(ref_box, ref_box)))
                     for _ in range(n_refs)]).astype(np.float32)
    refs = ap.References(refs * (r2 < (ref_box / 2 - 4) ** 2), r2 < (ref_box / 2 - 4) ** 2, ref_box // 2 - 4,
                         float(ref_box * apix * 0.8), None)
    pt = ap.Params(i=Path("x.star"), odir=Path("/tmp"), ref=Path(__file__), ctf=True, particle_diameter=ref_box * 0.8,
                   ang=10.0, cpu=args.cpu)
    st = ap._setup((size, size), pt, apix, xp, refs, be)
    ctf = CtfParams(np.array([15000.0]), np.array([14500.0]), np.array([30.0]))
    n_t = len(refs.refs) * len(st.extra["psi"])
    tb = template_pick_batch(be.free_bytes(), st.grid.w, n_t)
    t0 = time.perf_counter()
    ap._template_one(mics[0], st, refs, pt, apix, ctf, xp, 0, tb)  # warm-up; fills the rotated-template cache
    be.synchronize()
    results["template_first_micrograph_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    for i in range(n):
        ap._template_one(mics[i], st, refs, pt, apix, ctf, xp, i, tb)
    be.synchronize()
    dt = time.perf_counter() - t
    results.update(template_refs=n_refs, template_psi=len(st.extra["psi"]), template_box_px=ref_box,
                   template_batch=tb, template_cache=st.extra["cache"] is not None,
                   template_s_per_micrograph=dt / n, template_micrographs_per_s=n / dt,
                   template_correlations_per_s=n * n_t / dt)
    free_cached_memory(be)
    print(json.dumps(results, indent=1))
    if args.out or not args.quick:
        out = Path(args.out or f"benchmarks/results/picking_{'cpu' if not be.is_gpu else 'gpu'}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Benchmark: central slices extracted per second, images inserted per second, and a full reconstruction of
100k particles (FFT, offset phase shift, CTF, insertion, reconstruction) at box 128 and 256 on one GPU.

Run: python benchmarks/bench_reconstruction.py [--out benchmarks/results/reconstruction_<gpu>.json]
Images are generated on the device (random), so file reading is not timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from napari_gpu_relion.compute import gpu_kernels
from napari_gpu_relion.compute.backprojector import BackProjector
from napari_gpu_relion.compute.ctf import CtfParams, ctf_half_grid
from napari_gpu_relion.compute.fourier import phase_shift_2d, rfft_centered
from napari_gpu_relion.compute.geometry import euler_to_matrix
from napari_gpu_relion.compute.projector import prepare_reference, project
from napari_gpu_relion.runtime.device import select_backend


def timed(be, fn, reps=3):
    fn()
    be.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    be.synchronize()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--n_full", type=int, default=100_000)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--array_code", action="store_true",
                    help="CuPy's array code instead of the fused projection and insertion kernels (to compare)")
    ap.add_argument("--boxes", default="128,256")
    args = ap.parse_args()
    gpu_kernels.ENABLED = not args.array_code
    be = select_backend(cpu=args.cpu)
    xp = be.xp
    rng = np.random.default_rng(0)
    res = {"hardware": be.name, "host": platform.node(), "fused_kernels": gpu_kernels.ENABLED, "results": []}
    for N, R, B in [c for c in ((128, 4608, 2000), (256, 4608, 1000)) if str(c[0]) in args.boxes.split(",")]:
        vol = xp.asarray(rng.normal(size=(N, N, N)).astype(np.float32))
        ref = prepare_reference(vol)
        ang = rng.uniform([-180, 0, -180], [180, 180, 180], (R, 3))
        A = xp.asarray(euler_to_matrix(*ang.T))
        t_proj = timed(be, lambda ref=ref, A=A: project(ref, A))
        imgs = xp.asarray(rng.normal(size=(B, N, N)).astype(np.float32))
        F = rfft_centered(imgs, 2)
        bp = BackProjector(N, 2, xp=xp)
        Ab = A[:B]
        ones = xp.ones(F.shape, np.float32)
        t_ins = timed(be, lambda bp=bp, Ab=Ab, F=F, ones=ones: bp.insert_images(Ab, F, ones))
        row = {"box": N, "slices_per_s": R / t_proj, "images_inserted_per_s": B / t_ins,
               "project_batch": R, "insert_batch": B}
        # full reconstruct of n_full particles: FFT + shift + CTF + insert + reconstruct
        n = args.n_full
        ctf = CtfParams(rng.uniform(1e4, 3e4, n), rng.uniform(1e4, 3e4, n), rng.uniform(-180, 180, n))
        angs = rng.uniform([-180, 0, -180], [180, 180, 180], (n, 3))
        sh = rng.uniform(-3, 3, (n, 2))
        bp = BackProjector(N, 2, xp=xp)
        be.synchronize()
        t0 = time.perf_counter()
        for i0 in range(0, n, B):
            i1 = min(n, i0 + B)
            x = xp.asarray(rng.normal(size=(i1 - i0, N, N)).astype(np.float32)) if i0 == 0 else imgs[: i1 - i0]
            Fx = phase_shift_2d(rfft_centered(x, 2), xp.asarray(sh[i0:i1]), N)
            c = ctf_half_grid(ctf.subset(slice(i0, i1)), N, 1.0, xp=xp)
            bp.insert_images(xp.asarray(euler_to_matrix(*angs[i0:i1].T)), Fx * c, c * c)
        bp.enforce_hermitian()
        bp.reconstruct()
        be.synchronize()
        row["full_reconstruct_s"] = time.perf_counter() - t0
        row["full_reconstruct_particles"] = n
        print(json.dumps(row), flush=True)
        res["results"].append(row)
        del bp, ref, vol, imgs, F
        if be.is_gpu:
            xp.get_default_memory_pool().free_all_blocks()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

"""Where the E-step's time goes: wraps the steps that expectation_batch calls with synchronised timers and runs
one batch of bench_estep's simulated case (box, HEALPix order, batch from --case).

Run: python benchmarks/profile_estep.py --case 128:2:1024 [--out results/x.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import numpy as np

from napari_gpu_relion.compute import estep
from napari_gpu_relion.compute.backend import select_backend
from napari_gpu_relion.compute.backprojector import BackProjector
from napari_gpu_relion.compute.estep import EStepSetup, EStepSums, PreparedBatch, Sampling, expectation_batch
from napari_gpu_relion.compute.expectation import pixel_set
from napari_gpu_relion.compute.masks import soft_spherical_mask
from napari_gpu_relion.compute.projector import prepare_reference

TIMES: dict = defaultdict(float)


def wrap(module, name, be):
    fn = getattr(module, name)

    def timed(*a, **k):
        be.synchronize()
        t = time.perf_counter()
        r = fn(*a, **k)
        be.synchronize()
        TIMES[name] += time.perf_counter() - t
        return r

    setattr(module, name, timed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="128:2:1024")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    xp = be.xp
    N, order, I = (int(v) for v in a.case.split(":"))
    from bench_estep import simulated_batch  # noqa: PLC0415

    rng = np.random.default_rng(1)
    vol = rng.standard_normal((N, N, N)).astype(np.float32) * soft_spherical_mask(N, 0.35 * N, 3, 3)
    ref = prepare_reference(xp.asarray(vol), 2, N / 2)
    smp = Sampling(order=order, offset_range=5.0, offset_step=2.0)
    pix = pixel_set(N, N, xp)
    F, ctf, noise_var = simulated_batch(be, ref, pix, N, 1.0, I, rng)
    setup = EStepSetup([ref], smp, pix, pix, 1.0, xp.full((1, N // 2 + 1), noise_var / 2.0))
    setup.coarse_slices()
    prep = PreparedBatch(F, F, np.zeros((I, 2)))

    def once():
        sums = EStepSums([BackProjector(N, 2, xp=xp)], N // 2 + 1, 1, smp.n_dirs)
        expectation_batch(setup, prep, ctf, np.zeros(I, np.int64), np.ones(I), sums)

    once()  # warm-up (kernel compilation, plans)
    for name in ("particle_terms", "scores_shared", "scores_gathered", "posterior_weights", "fine_sums",
                 "segment_sum", "_project_rows", "translation_ramps", "shell_power"):
        wrap(estep, name, be)
    wrap(BackProjector, "insert_pixels", be)
    be.synchronize()
    t = time.perf_counter()
    once()
    be.synchronize()
    total = time.perf_counter() - t
    res = {"hardware": be.name, "case": a.case, "total_s": total, "steps_s": dict(TIMES),
           "other_s": total - sum(TIMES.values())}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

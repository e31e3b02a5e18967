"""Where the E-step's time goes: wraps the steps that expectation_batch calls with synchronised timers and runs
one batch of bench_estep's simulated case: 3D (--case box:healpix_order:batch) or 2D classification
(--case_2d box:classes:batch, psi step 12°, K random classes).

Run: python benchmarks/profile_estep.py --case 128:2:1024 [--case_2d 128:100:1024] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute import estep
from napari_gpu_relion.compute.backprojector import BackProjectorStack
from napari_gpu_relion.compute.estep import (
    EStepSetup,
    EStepSums,
    InPlaneSampling,
    PreparedBatch,
    Sampling,
    expectation_batch,
)
from napari_gpu_relion.compute.expectation import pixel_set
from napari_gpu_relion.compute.masks import soft_spherical_mask
from napari_gpu_relion.compute.projector import prepare_reference
from napari_gpu_relion.runtime.device import select_backend
from napari_gpu_relion.runtime.memory import CHUNK_BYTES

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
    ap.add_argument("--case_2d", default="", help="2D classification box:classes:batch (replaces --case)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--host_profile", type=int, default=0,
                    help="also run this many batches under cProfile (no synchronising timers) and keep the 25 "
                         "functions with the most own host time per batch")
    ap.add_argument("--fine_chunk_mib", type=int, default=CHUNK_BYTES >> 20,
                    help="fine chunk budget (default EStepSetup's; a job plans up to 8192, 6 %% of the free memory)")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    xp = be.xp
    from bench_estep import simulated_batch  # noqa: PLC0415

    rng = np.random.default_rng(1)
    if a.case_2d:
        N, K, I = (int(v) for v in a.case_2d.split(":"))
        ndim, smp = 2, InPlaneSampling(12.0, 5.0, 2.0)
    else:
        N, order, I = (int(v) for v in a.case.split(":"))
        K, ndim, smp = 1, 3, Sampling(order=order, offset_range=5.0, offset_step=2.0)
    m = soft_spherical_mask(N, 0.35 * N, 3, ndim)
    refs = [prepare_reference(xp.asarray(rng.standard_normal((N,) * ndim).astype(np.float32) * m), 2, N / 2)
            for _ in range(K)]
    pix = pixel_set(N, N, xp)
    F, ctf, noise_var = simulated_batch(be, refs[0], pix, N, 1.0, I, rng, in_plane=ndim == 2)
    with np.errstate(divide="ignore"):
        lp = xp.asarray(np.full((K, 1), -np.log(K))) if ndim == 2 else None
    setup = EStepSetup(refs, smp, pix, pix, 1.0, xp.full((1, N // 2 + 1), noise_var / 2.0), log_pdf_direction=lp,
                       max_fine_bytes=a.fine_chunk_mib << 20)
    setup.coarse_slices()
    prep = PreparedBatch(F, F, np.zeros((I, 2)))

    def once():
        sums = EStepSums(BackProjectorStack(K, N, 2, ndim=ndim, xp=xp).members, N // 2 + 1, 1, smp.n_dirs)
        expectation_batch(setup, prep, ctf, np.zeros(I, np.int64), np.ones(I), sums)

    once()  # warm-up (kernel compilation, plans)
    host = []
    if a.host_profile > 0:  # where the host's time goes between the kernels (issue 15: the "other" share)
        prof = cProfile.Profile()
        be.synchronize()
        t = time.perf_counter()
        prof.enable()
        for _ in range(a.host_profile):
            once()
        be.synchronize()
        prof.disable()
        wall = (time.perf_counter() - t) / a.host_profile
        stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
        host = [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "own_ms_per_batch": 1e3 * v[2] / a.host_profile,
                 "calls_per_batch": v[1] / a.host_profile} for k, v in top]
        print(f"host profile: {wall * 1e3:.1f} ms per batch under cProfile")
        for h in host:
            print(f"  {h['own_ms_per_batch']:8.2f} ms {h['calls_per_batch']:8.1f} calls  {h['function']}")
    for name in ("particle_terms", "scores_shared", "scores_gathered", "posterior_weights", "fine_sums",
                 "segment_sum", "_project_rows", "translation_ramps", "shell_power", "insert_by_class"):
        wrap(estep, name, be)
    be.synchronize()
    t = time.perf_counter()
    once()
    be.synchronize()
    total = time.perf_counter() - t
    res = {"hardware": be.name, "case": a.case_2d or a.case, "kind": "class2d" if a.case_2d else "refine",
           "fine_chunk_mib": a.fine_chunk_mib,
           "total_s": total, "steps_s": dict(TIMES),
           "other_s": total - sum(TIMES.values()), "host_profile": host}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

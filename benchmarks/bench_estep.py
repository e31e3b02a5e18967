"""Benchmark: the E-step on one GPU, against the measured float32 GEMM rate of the same GPU.

For box 128 and 256, HEALPix order 2 and 3 (C1) and 21 translations (range 5, step 2), with 1 class
(refinement) or K classes (3D classification, e.g. case 128:2:64:4), on particles simulated from a random-phase
map at SNR 0.05 with CTF:
  * the coarse-pass score GEMMs alone (scores_shared: cross term + |CP|^2 term), FLOPs counted exactly;
  * the coarse pass (particle terms, score GEMMs, log-domain weights and significance sort);
  * the whole E-step of a batch (compute/estep.expectation_batch: coarse pass, fine pass over the significant
    samples, weighted sums, insertion into the 3D accumulators), with the GEMM FLOPs it executed;
  * the measured SGEMM rate (cuBLAS, 8192^3, float32, no TF32); with --tf32 the E-step's GEMMs run in TF32 and
    the TF32 rate of the same product is recorded too.
Particle-iterations per second = batch / time. Fractions are achieved GEMM FLOP/s over the measured rate.

Run: python benchmarks/bench_estep.py [--cases_2d 128:100:256] [--out benchmarks/results/estep_<gpu>.json] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from bench_reconstruction import timed  # the same timer (benchmarks/ is the script folder)

from napari_gpu_relion.compute.backprojector import BackProjectorStack
from napari_gpu_relion.compute.ctf import CtfParams, ctf_from_frequencies
from napari_gpu_relion.compute.estep import EStepSetup, EStepSums, PreparedBatch, expectation_batch
from napari_gpu_relion.compute.expectation import (
    particle_terms,
    pixel_set,
    posterior_weights,
    scores_shared,
    translation_ramps,
)
from napari_gpu_relion.compute.geometry import euler_to_matrix
from napari_gpu_relion.compute.projector import prepare_reference, project_pixels
from napari_gpu_relion.compute.sampling import Sampling
from napari_gpu_relion.runtime.device import select_backend, set_matmul_tf32
from napari_gpu_relion.runtime.memory import CHUNK_BYTES


def sgemm_rate(be, n=8192):
    xp = be.xp
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    b = a.T.copy()
    t = timed(be, lambda: a @ b, reps=5)
    return 2.0 * n**3 / t


def simulated_batch(be, ref, pix_full, N, apix, I, rng, in_plane=False):
    """Noisy CTF-affected projections (SNR 0.05 in Fourier power) as half-grid FTs, plus their CTFs
    (``in_plane``: a 2D reference rotated by random psi only)."""
    xp = be.xp
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (I, 3))
    if in_plane:
        ang[:, :2] = 0.0
    A = xp.asarray(euler_to_matrix(*ang.T))
    P = project_pixels(ref, A, pix_full.kx, pix_full.ky)  # (I, K)
    du = rng.uniform(8000, 25000, I)
    ctf = CtfParams(du, du - 200.0, rng.uniform(-180, 180, I), 300.0, 2.7, 0.1)
    c = ctf_from_frequencies(ctf, pix_full.kx / (N * apix), pix_full.ky / (N * apix), xp)
    S = c * P
    sig = float(xp.mean(xp.abs(S) ** 2))
    noise_var = sig / 0.05
    noise = (xp.asarray(rng.standard_normal(S.shape)) + 1j * xp.asarray(rng.standard_normal(S.shape)))
    X = (S + noise * np.sqrt(noise_var / 2)).astype(np.complex64)
    F = xp.zeros((I, N * (N // 2 + 1)), dtype=np.complex64)
    F[:, pix_full.flat] = X
    F = F.reshape(I, N, N // 2 + 1)
    return F, ctf, noise_var


def run_case(be, N, order, I, reps, n_classes=1, fine_bytes=CHUNK_BYTES):
    """One case; ``n_classes`` > 1 is 3D classification: independent random maps, rows = class x orientation,
    particles simulated from class 1."""
    xp = be.xp
    rng = np.random.default_rng(N + order)
    apix = 1.0
    from napari_gpu_relion.compute.masks import soft_spherical_mask  # noqa: PLC0415

    m = soft_spherical_mask(N, 0.35 * N, 3, 3)
    refs = [prepare_reference(xp.asarray(rng.standard_normal((N, N, N)).astype(np.float32) * m), 2, N / 2)
            for _ in range(n_classes)]
    ref = refs[0]
    smp = Sampling(order=order, offset_range=5.0, offset_step=2.0)
    T = smp.translations.shape[0]
    pix = pixel_set(N, N, xp)
    K, R = pix.npix, smp.n_orient * n_classes
    F, ctf, noise_var = simulated_batch(be, ref, pix, N, apix, I, rng)
    sigma2 = xp.full((1, N // 2 + 1), noise_var / 2.0)  # per complex component -> RELION's sigma2 per pixel
    setup = EStepSetup(refs, smp, pix, pix, apix, sigma2, sigma_offset_A=10.0,
                       max_fine_bytes=fine_bytes)
    t_proj = timed(be, lambda: (setattr(setup, "P_coarse", None), setup.coarse_slices()), reps=1)
    Sl = setup.coarse_slices()
    c = ctf_from_frequencies(ctf, pix.kx / N, pix.ky / N, xp).astype(np.float32)
    w = xp.broadcast_to(xp.where(pix.shell >= 1, 0.5 / (noise_var / 2.0), 0.0).astype(np.float32), (I, K))
    ramps = translation_ramps(pix, smp.translations)
    X = F.reshape(I, -1)[:, pix.flat]
    terms = particle_terms(X, c, w, ramps)
    t_gemm = timed(be, lambda: scores_shared(Sl, terms), reps)
    gemm_flops = 2.0 * I * T * (2 * K) * R + 2.0 * I * K * R

    def coarse():
        tt = particle_terms(X, c, w, ramps)
        d2 = scores_shared(Sl, tt)
        return posterior_weights(d2, xp.zeros((1, 1, 1)), 0.999)

    t_coarse = timed(be, coarse, reps)
    prep = PreparedBatch(F, F, np.zeros((I, 2)))
    groups = np.zeros(I, dtype=np.int64)
    scale = np.ones(I)
    stats = {}

    def estep():
        sums = EStepSums(BackProjectorStack(len(refs), N, 2, xp=xp).members, N // 2 + 1, 1, smp.n_dirs)
        res = expectation_batch(setup, prep, ctf, groups, scale, sums)
        stats["nr_significant"] = float(np.median(res.nr_significant))
        stats["pmax"] = float(np.median(res.pmax))
        return res

    t_estep = timed(be, estep, max(1, reps // 2))
    # GEMM FLOPs of the whole E-step: coarse scores + fine scores and sums over each particle's significant
    # rows x 8 children x T x 4 translations (3 GEMMs of the same shape: scores, slices, U)
    nsig_rows = stats["nr_significant"]  # upper bound on significant rows per particle (samples >= rows)
    fine_flops = 3 * 2.0 * I * (T * 4) * (2 * K) * (8 * min(nsig_rows, R))
    return {
        "box": N, "healpix_order": order, "classes": n_classes, "rows": R, "translations": T, "pixels": K, "batch": I,
        "projection_s": t_proj, "coarse_gemm_flops": gemm_flops,
        "score_gemm_s": t_gemm, "score_gemm_tflops": gemm_flops / t_gemm / 1e12,
        "coarse_pass_s": t_coarse, "coarse_particle_iterations_per_s": I / t_coarse,
        "coarse_pass_tflops": gemm_flops / t_coarse / 1e12,
        "estep_s": t_estep, "estep_particle_iterations_per_s": I / t_estep,
        "estep_gemm_flops_upper_bound": gemm_flops + fine_flops,
        "median_nr_significant": stats["nr_significant"], "median_pmax": stats["pmax"],
    }


def run_case_2d(be, N, n_classes, I, reps, psi_step=12.0, fine_bytes=CHUNK_BYTES):
    """2D classification E-step: K random 2D classes, rows = class x psi (coarse psi step 12° = RELION's GUI
    6° fine), 21 translations (range 5, step 2), particles from class 1 at random psi."""
    from napari_gpu_relion.compute.masks import soft_spherical_mask  # noqa: PLC0415
    from napari_gpu_relion.compute.sampling import InPlaneSampling  # noqa: PLC0415

    xp = be.xp
    rng = np.random.default_rng(N + n_classes)
    m = soft_spherical_mask(N, 0.35 * N, 3, 2)
    refs = [prepare_reference(xp.asarray(rng.standard_normal((N, N)).astype(np.float32) * m), 2, N / 2)
            for _ in range(n_classes)]
    smp = InPlaneSampling(psi_step, 5.0, 2.0)
    T = smp.translations.shape[0]
    pix = pixel_set(N, N, xp)
    K, R = pix.npix, smp.n_orient * n_classes
    F, ctf, noise_var = simulated_batch(be, refs[0], pix, N, 1.0, I, rng, in_plane=True)
    sigma2 = xp.full((1, N // 2 + 1), noise_var / 2.0)
    with np.errstate(divide="ignore"):
        lp = xp.asarray(np.full((n_classes, 1), -np.log(n_classes)))
    setup = EStepSetup(refs, smp, pix, pix, 1.0, sigma2, log_pdf_direction=lp, sigma_offset_A=10.0,
                       max_fine_bytes=fine_bytes)
    setup.coarse_slices()
    prep = PreparedBatch(F, F, np.zeros((I, 2)))
    groups, scale = np.zeros(I, dtype=np.int64), np.ones(I)
    stats = {}

    def estep():
        sums = EStepSums(BackProjectorStack(len(refs), N, 2, ndim=2, xp=xp).members, N // 2 + 1, 1, 1)
        res = expectation_batch(setup, prep, ctf, groups, scale, sums)
        stats["pmax"] = float(np.median(res.pmax))
        return res

    t_estep = timed(be, estep, reps)
    gemm_flops = 2.0 * I * T * (2 * K) * R + 2.0 * I * K * R
    return {"kind": "class2d", "box": N, "classes": n_classes, "psi": smp.n_psi, "rows": R, "translations": T,
            "pixels": K, "batch": I, "coarse_gemm_flops": gemm_flops, "estep_s": t_estep,
            "estep_particle_iterations_per_s": I / t_estep, "median_pmax": stats["pmax"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--cases", default="128:2:256,128:3:64,256:2:64,256:3:16,128:2:64:4",
                    help="box:healpix_order:batch[:classes], comma-separated")
    ap.add_argument("--cases_2d", default="", help="2D classification cases box:classes:batch, e.g. 128:100:256")
    ap.add_argument("--fine_chunk_mib", type=int, default=CHUNK_BYTES >> 20,
                    help="fine-pass chunk budget (default EStepSetup's; a job plans 6 %% of the memory left after "
                         "references and accumulators, up to 8192: backend.FINE_CHUNK_FRACTION)")
    ap.add_argument("--tf32", action="store_true", help="the GEMMs in TF32 (the jobs' --tf32); fractions stay "
                    "relative to the float32 rate, and the TF32 rate of the same product is recorded beside it")
    args = ap.parse_args()
    fine = args.fine_chunk_mib << 20
    be = select_backend(cpu=args.cpu)
    res = {"hardware": be.name, "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "results": [],
           "fine_chunk_mib": args.fine_chunk_mib}
    rate = sgemm_rate(be, 8192 if be.is_gpu else 2048)
    res["sgemm_tflops"] = rate / 1e12
    print(f"{be.name}: measured SGEMM {rate / 1e12:.1f} TFLOP/s", flush=True)
    res["tf32"] = set_matmul_tf32(be, args.tf32)
    if res["tf32"]:
        res["tf32_gemm_tflops"] = sgemm_rate(be, 8192) / 1e12
        print(f"TF32 GEMM {res['tf32_gemm_tflops']:.1f} TFLOP/s", flush=True)
    for case in filter(None, args.cases_2d.split(",")):
        N, K, I = (int(x) for x in case.split(":"))
        r = run_case_2d(be, N, K, I, reps=3 if be.is_gpu else 1, fine_bytes=fine)
        r["estep_coarse_gemm_fraction"] = r["coarse_gemm_flops"] / r["estep_s"] / rate
        res["results"].append(r)
        print(json.dumps(r), flush=True)
    for case in filter(None, args.cases.split(",")):
        v = [int(x) for x in case.split(":")]
        r = run_case(be, v[0], v[1], v[2], reps=3 if be.is_gpu else 1, n_classes=v[3] if len(v) > 3 else 1,
                     fine_bytes=fine)
        r["score_gemm_fraction"] = r["score_gemm_tflops"] * 1e12 / rate
        r["coarse_pass_fraction"] = r["coarse_pass_tflops"] * 1e12 / rate
        r["estep_coarse_gemm_fraction"] = r["coarse_gemm_flops"] / r["estep_s"] / rate
        res["results"].append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

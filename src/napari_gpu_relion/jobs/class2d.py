"""2D classification (relion_refine with 2D references, EM variant; relion_algorithm.md 7).

On 5 simulated views + 20 % noise junk (tests/test_class2d.py) the junk goes to its own classes and every
view's class averages to > 0.9 correlation with its true projection; similar views can share a class.

K class averages from random-subset averages with RELION's blob initialisation; each iteration one E-step on the
shared engine (compute/estep.py with InPlaneSampling: rows are (class, psi) pairs, one GEMM for all classes and
in-plane angles, translations as phase ramps), then per class a MAP reconstruction of the 2D average with tau2
from the class's power spectrum times tau2_fudge (default 2), optional soft masking and centring of the classes.
Files follow RELION: run_itNNN_classes.mrcs, run_itNNN_model.star (class distribution and resolution),
run_itNNN_data.star (rlnClassNumber, rlnAnglePsi, offsets).

--continue run_itNNN_optimiser.star goes on from that iteration (to --iter) and repeats the uninterrupted run.

The translation prior of each class is centred on its particles' mean offset (rlnClassPriorOffsetX/Y in the
model STAR, Å), as RELION does for 2D. Not yet: VDAM (--grad).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute.backend import to_host
from ..compute.backprojector import BackProjectorStack
from ..compute.ctf import ctf_half_grid
from ..compute.estep import EStepSetup, EStepSums, InPlaneSampling
from ..compute.expectation import pixel_set
from ..compute.fourier import lowpass_map, phase_shift_2d, rfft_centered
from ..compute.fsc import shell_to_angstrom
from ..compute.geometry import euler_to_matrix
from ..compute.masks import soft_spherical_mask
from ..compute.maximization import (
    coarse_image_size,
    reference_tau2,
    resolution_shell_from_ssnr,
    update_sigma2,
    update_sigma_offset,
)
from ..compute.projector import pixel_list, prepare_reference
from ..compute.references2d import blob_references, center_of_mass, shift_images
from ..errors import InputError
from ..io.atomic import ensure_not_input
from ..io.mrc import read_mrc, write_mrc
from ..io.star import read_star
from . import em
from .common import backend_for, param, require_file, write_note
from .events import ClassAveragesUpdated, Finished, IterationFinished, Message, Started
from .refine3d import MASK_EDGE, _batch_size

JOB_NAME = "class2d"


@dataclass(frozen=True)
class Params:
    i: Path | None = param(None, "--i", "Particles STAR file")
    o: Path | None = param(None, "--o", "Output folder (files run_it*)")
    K: int = param(50, "--K", "Number of classes")
    iter: int = param(25, "--iter", "Number of iterations")
    tau2_fudge: float = param(2.0, "--tau2_fudge", "Regularisation parameter T")
    psi_step: float = param(12.0, "--psi_step", "Coarse in-plane step (degrees); the fine step is half")
    offset_range: float = param(5.0, "--offset_range", "Translation search range (pixels)")
    offset_step: float = param(2.0, "--offset_step", "Coarse translation step (pixels)")
    ini_high: float = param(-1.0, "--ini_high", "Low-pass of the initial classes (Å); -1 = 0.07 digital frequency")
    particle_diameter: float = param(-1.0, "--particle_diameter", "Mask diameter (Å); -1 = (box - 5) x pixel size")
    center_classes: bool = param(False, "--center_classes", "Centre the class averages on their mass each iteration")
    sort_classes: bool = param(False, "--sort_classes", "Number the classes by decreasing class distribution")
    ctf: bool = param(False, "--ctf", "Do CTF correction")
    flatten_solvent: bool = param(False, "--flatten_solvent", "Mask the class averages with a soft circle")
    zero_mask: bool = param(False, "--zero_mask", "Fill outside the particle mask with zeros (else noise)")
    pad: int = param(2, "--pad", "Padding factor of the Fourier grids")
    offset: float = param(10.0, "--offset", "Initial sigma of the offset prior (Å)")
    random_seed: int = param(0, "--random_seed", "Random seed (initial classes, perturbation, noise)")
    continue_from: Path | None = param(None, "--continue", "Continue from a run_itNNN_optimiser.star (to --iter)")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: int | None = param(None, "--gpu", "GPU index to use")

    def __post_init__(self):
        if self.continue_from is not None:
            require_file(self.continue_from, "--continue optimiser STAR", (".star",))
            return
        require_file(self.i, "--i particles STAR", (".star",))
        if self.o is None:
            raise InputError("--o (output folder) is required")
        ensure_not_input(Path(self.o) / "run_it001_data.star", self.i)
        if self.K < 1:
            raise InputError(f"--K must be at least 1, got {self.K}")
        if self.iter < 1:
            raise InputError(f"--iter must be at least 1, got {self.iter}")
        if not 0 < self.psi_step <= 180:
            raise InputError(f"--psi_step must be in (0, 180] degrees, got {self.psi_step}")
        em.check_search(0, self.offset_range, self.offset_step)
        if self.tau2_fudge <= 0:
            raise InputError(f"--tau2_fudge must be > 0, got {self.tau2_fudge}")


def initial_classes(ps: em.ParticleSet, K: int, be, diameter_px: float, mask_r: float, lowpass_A: float,
                    seed: int, pad: int = 2, max_particles: int = 1000) -> np.ndarray:
    """(K, N, N) starting classes: up to ``max_particles`` particles in random order, each with a random psi and
    class (index mod K), CTF-weighted and averaged per class without regularisation, then RELION's blobs,
    the low-pass and the soft mask."""
    xp = be.xp
    N, apix = ps.box, ps.pixel_size
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.permutation(len(ps))[:max_particles])
    psi = rng.uniform(0.0, 360.0, rows.size)
    cls = np.arange(rows.size) % K
    A = euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)
    F = phase_shift_2d(rfft_centered(be.asarray(ps.images(rows)), 2), xp.asarray(ps.offsets_px[rows]), N)
    ctf = ps.ctf_rows(rows)
    c = xp.ones(F.shape, dtype=np.float32) if ctf is None else xp.asarray(ctf_half_grid(ctf, N, apix))
    stack = BackProjectorStack(K, N, pad, ndim=2, xp=xp, dtype=np.float64)
    ky, kx, flat = pixel_list(N, N / 2, xp, unique=True)
    n = rows.size
    stack.insert_pixels(cls, A, kx, ky, (F * c).reshape(n, -1)[:, flat], (c * c).reshape(n, -1)[:, flat])
    avgs = np.zeros((K, N, N))
    for k, bp in enumerate(stack.members):  # K unregularised reconstructions (once per run)
        if np.any(cls == k):
            bp.enforce_hermitian()
            avgs[k] = to_host(bp.reconstruct(None, 1.0))
    refs = blob_references(avgs, diameter_px, rng)
    refs = lowpass_map(refs, apix, lowpass_A, ndim=2)
    return refs * soft_spherical_mask(N, mask_r, MASK_EDGE, 2)[None]


def class_offset_priors(offset_sum_A: np.ndarray, class_weight: np.ndarray) -> np.ndarray:
    """(K, 2) prior means of the offsets per class (Å): the weighted mean offset of the class's particles,
    0 for empty classes (RELION's maximizationOtherParameters divides by the class's own weight)."""
    w = np.asarray(class_weight, float)[:, None]
    return np.where(w > 0, np.asarray(offset_sum_A) / np.where(w > 0, w, 1.0), 0.0)


SAVED = ("K", "iter", "tau2_fudge", "psi_step", "offset_range", "offset_step", "ini_high", "particle_diameter",
         "center_classes", "sort_classes", "ctf", "flatten_solvent", "zero_mask", "pad", "offset", "random_seed")


def run(p: Params) -> Iterator:
    t_start = time.time()
    opt = None
    if p.continue_from is not None:  # the options, particles, classes and state of that iteration
        opt = em.read_optimiser_star(p.continue_from)
        base = Path(p.continue_from).parent
        given = {"i": base / str(opt["rlnExperimentalDataStarFile"]), "o": base, "continue_from": p.continue_from,
                 "cpu": p.cpu, "gpu": p.gpu, "batch": p.batch}
        if p.iter != Params.__dataclass_fields__["iter"].default:
            given["iter"] = p.iter
        p = em.params_from_optimiser(Params, opt, **given)
    ps = em.load_particle_set(Path(p.i), p.ctf, seed=p.random_seed, halves=False)
    N, apix, K = ps.box, ps.pixel_size, p.K
    if K > len(ps):
        raise InputError(f"--K {K} is larger than the number of particles ({len(ps)})", path=str(p.i))
    diameter, mask_r = em.particle_mask(ps, p.particle_diameter, MASK_EDGE)
    be = backend_for(p)
    xp = be.xp
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)
    write_note(out, JOB_NAME, p)
    ini_high = p.ini_high if p.ini_high > 0 else apix / 0.07
    yield Started(JOB_NAME, out, be.name, f"classifying {len(ps)} particles into {K} 2D classes"
                  + (f", continuing after iteration {int(opt['rlnCurrentIteration'])}" if opt is not None else ""))
    scales = np.ones(len(ps.scale_group_names))
    if opt is None:
        refs = initial_classes(ps, K, be, diameter / apix, mask_r, ini_high, p.random_seed + 11, p.pad)
        sigma2 = em.initial_noise_spectra(ps, be, mask_r, p.zero_mask)
        pdf_class = np.full(K, 1.0 / K)
        sigma_offset_A = p.offset
        res_shell = int(round(N * apix / ini_high))
        prior_offsets = np.zeros((K, 2))
        perturb, first_it = 0.0, 1
    else:
        model = base / str(opt["rlnModelStarFile"])
        refs = np.asarray(read_mrc(base / str(opt["rlnGpuRelion_classes"])).data, np.float64)
        sigma2 = em.read_model_sigma2(model)
        saved_scales, _ = em.read_model_state(model)
        scales = saved_scales if saved_scales is not None else scales
        class_table = read_star(model)["model_classes"]
        pdf_class = np.asarray(class_table["rlnClassDistribution"], float)
        prior_offsets = np.column_stack([np.asarray(class_table.get(f"rlnClassPriorOffset{a}", np.zeros(K)), float)
                                         for a in "XY"])
        sigma_offset_A = float(opt["rlnGpuRelion_sigma_offset"])
        res_shell, perturb = int(opt["rlnGpuRelion_res_shell"]), float(opt["rlnGpuRelion_perturb"])
        first_it = int(opt["rlnCurrentIteration"]) + 1
        ps.classes[:] = ps.table.particles["rlnClassNumber"].to_numpy(int) - 1
    everyone = np.arange(len(ps))
    circle = soft_spherical_mask(N, mask_r, MASK_EDGE, 2).astype(np.float64)
    outputs: dict[str, Path] = {}
    for it in range(first_it, p.iter + 1):
        t_it = time.time()
        current_size = int(min(N, 2 * (res_shell + 10)))
        frefs = [prepare_reference(be.asarray(v), p.pad, r_max=current_size / 2) for v in refs]
        tau2 = [reference_tau2(f) for f in frefs]
        perturb = em.next_perturbation(perturb, p.random_seed, it)
        smp = InPlaneSampling(p.psi_step, p.offset_range, p.offset_step, perturb=perturb)
        coarse = coarse_image_size(N, apix, smp.psi_step_actual, diameter, current_size, kappa=1.5)
        pix_c, pix_f = pixel_set(N, coarse, xp), pixel_set(N, current_size, xp)
        yield Message(f"iteration {it}: image size {current_size} (coarse {coarse}), {K} classes x {smp.n_psi} psi "
                      f"x {smp.translations.shape[0]} translations")
        old_classes = ps.classes.copy()
        stack = BackProjectorStack(K, N, p.pad, current_size / 2, ndim=2, xp=xp, dtype=np.float64)
        sums = EStepSums(stack.members, N // 2 + 1, ps.n_optics_groups, 1, n_scale_groups=len(scales))
        with np.errstate(divide="ignore"):
            log_prior = np.log(pdf_class)[:, None]  # (K, 1): the class prior
        setup = EStepSetup(frefs, smp, pix_c, pix_f, apix, be.asarray(sigma2), log_pdf_direction=be.asarray(log_prior),
                           sigma_offset_A=sigma_offset_A, class_offset_prior_A=prior_offsets)
        batch = _batch_size(p, be, N, K * smp.n_orient, smp.translations.shape[0], pix_c.npix, cap=1024)
        t_e = time.time()
        yield from em.run_estep(ps, everyone, setup, sums, be, mask_radius_px=mask_r, zero_mask=p.zero_mask,
                                do_norm=False, norm_average=1.0, scales=scales, batch=batch, stage=f"it {it:03d}",
                                seed=p.random_seed + it)
        # 2D: the in-plane angle is rot + psi of the Euler triple (tilt 0)
        ps.angles[:, 2] = (ps.angles[:, 0] + ps.angles[:, 2] + 180.0) % 360.0 - 180.0
        ps.angles[:, :2] = 0.0
        t_e = time.time() - t_e
        # ---- M-step ----
        new_refs, ssnr_all = em.reconstruct_classes(stack, tau2, p.tau2_fudge, sums.pdf_class, refs)
        sigma2 = update_sigma2(sums.sigma2, sums.sumw_group, N)
        sigma_offset_A = update_sigma_offset(sums.sigma_offset, sums.sum_weight)
        pdf_class = sums.pdf_class / max(sums.pdf_class.sum(), 1e-300)
        prior_offsets = class_offset_priors(sums.offset_sum, sums.pdf_class)
        if p.flatten_solvent:
            new_refs = new_refs * circle[None]
        if p.center_classes:
            new_refs = shift_images(new_refs, -center_of_mass(new_refs, p.offset_range))
        refs = new_refs.astype(np.float32).astype(np.float64)
        res_shells = [min(resolution_shell_from_ssnr(s, gold_standard=False), N // 2) for s in ssnr_all]
        res_shell = max(res_shells)
        if p.sort_classes:
            order = np.argsort(-pdf_class, kind="stable")
            rank = np.empty(K, dtype=np.int64)
            rank[order] = np.arange(K)
            refs, pdf_class, prior_offsets = refs[order], pdf_class[order], prior_offsets[order]
            ssnr_all, res_shells = [ssnr_all[k] for k in order], [res_shells[k] for k in order]
            ps.classes[:] = rank[ps.classes]
            old_classes = rank[old_classes] if it > 1 else old_classes
        changed = float((ps.classes != old_classes).mean()) if it > 1 else 1.0
        # ---- files and events ----
        tag = f"_it{it:03d}"
        res_A = [shell_to_angstrom(max(r, 1), N, apix) for r in res_shells]
        stack = write_mrc(out / f"run{tag}_classes.mrcs", refs.astype(np.float32), apix, stack=True)
        em.write_classification_model(out / f"run{tag}_model.star", 2, [f"{k + 1:06d}@{stack.name}" for k in range(K)],
                                      pdf_class, res_A, ssnr_all, sigma2, scales, [np.array([d]) for d in pdf_class],
                                      ps, p.pad, p.tau2_fudge, current_size, sigma_offset_A, prior_offsets)
        em.write_data_star(out / f"run{tag}_data.star", ps)
        state = {"rlnCurrentIteration": it, "rlnExperimentalDataStarFile": f"run{tag}_data.star",
                 "rlnModelStarFile": f"run{tag}_model.star", "rlnGpuRelion_classes": stack.name,
                 "rlnGpuRelion_res_shell": res_shell, "rlnGpuRelion_perturb": perturb,
                 "rlnGpuRelion_sigma_offset": sigma_offset_A}
        em.write_optimiser_star(out / f"run{tag}_optimiser.star", state | em.params_to_optimiser(p, SAVED))
        outputs = {"classes": stack, "model": out / f"run{tag}_model.star", "data": out / f"run{tag}_data.star"}
        n_empty = int((pdf_class < 1e-6).sum())
        summary = (f"largest classes {', '.join(f'{100 * d:.1f}%' for d in np.sort(pdf_class)[::-1][:5])}; "
                   f"resolution {min(res_A):.1f} Å; {100 * changed:.1f}% of particles changed class; <Pmax> "
                   f"{ps.pmax.mean():.3f}; {time.time() - t_it:.1f} s "
                   f"(E-step {t_e:.1f} s, batch {batch})" + (f"; {n_empty} empty" if n_empty else ""))
        yield ClassAveragesUpdated("classes", refs.astype(np.float32), pdf_class.copy(), np.asarray(res_A), apix,
                                   stack)
        yield IterationFinished(it, {"classes": refs.astype(np.float32)}, pdf_class.copy(), float(min(res_A)), None,
                                summary)
        yield Message(f"  iteration {it}: {summary}")
    yield Finished(outputs, f"{p.iter} iterations in {time.time() - t_start:.0f} s; "
                   f"{int((pdf_class >= 1e-6).sum())} of {K} classes hold particles")



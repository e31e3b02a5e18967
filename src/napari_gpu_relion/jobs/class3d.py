"""3D classification (relion_refine without --split_random_halves; relion_algorithm.md 7).

Plain EM over K classes started from one reference: in the first iteration each particle searches only one random
class (RELION's seeding, so each class is rebuilt from a random 1/K of the data); tau2 of each class from its
reference's power spectrum times tau2_fudge (default 4); class and direction priors; fixed HEALPix order (global
searches) or local searches with --sigma_ang. The E-step is the shared engine (compute/estep.py through
jobs/em.py) with K references: rows are (class, orientation) pairs, one GEMM for all of them. Files follow
RELION's names: run_itNNN_classNNN.mrc, run_itNNN_model.star (class distributions and resolutions),
run_itNNN_data.star (rlnClassNumber).

--skip_align keeps the input angles and offsets: each particle is compared with every class at its own
orientation and exact offset (GivenOrientations in the shared E-step).

--continue run_itNNN_optimiser.star goes on from that iteration (to --iter) and repeats the uninterrupted run.

--firstiter_cc: iteration 1 aligns with cross-correlation against class 1 only (no noise or offset-sigma update,
the initial low-pass re-applied), its reconstruction is copied to every class and the random seeding happens in
iteration 2, as RELION does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute.backprojector import BackProjectorStack
from ..compute.estep import EStepSetup, EStepSums, GivenOrientations, Sampling
from ..compute.expectation import pixel_set
from ..compute.fourier import lowpass_map
from ..compute.fsc import shell_to_angstrom
from ..compute.geometry import euler_to_matrix, symmetry_group
from ..compute.masks import soft_spherical_mask
from ..compute.maximization import (
    coarse_image_size,
    reference_tau2,
    resolution_shell_from_ssnr,
    update_sigma2,
    update_sigma_offset,
)
from ..compute.projector import prepare_reference
from ..errors import InputError
from ..io.atomic import ensure_not_input
from ..io.mrc import write_mrc
from ..io.star import read_star
from . import em
from .common import backend_for, param, require_file, write_note
from .events import Finished, IterationFinished, MapUpdated, Message, Started
from .refine3d import MASK_EDGE, _batch_size, _load_reference

JOB_NAME = "class3d"


@dataclass(frozen=True)
class Params:
    i: Path | None = param(None, "--i", "Particles STAR file")
    ref: Path | None = param(None, "--ref", "Initial reference map (.mrc), or a STAR listing one map per class "
                             "(rlnReferenceImage, e.g. a previous run's _model.star; then K = their number)")
    o: Path | None = param(None, "--o", "Output folder (files run_it*)")
    K: int = param(2, "--K", "Number of classes")
    iter: int = param(25, "--iter", "Number of iterations")
    tau2_fudge: float = param(4.0, "--tau2_fudge", "Regularisation parameter T")
    healpix_order: int = param(2, "--healpix_order", "HEALPix order (2 = 15° coarse, 7.5° fine)")
    offset_range: float = param(5.0, "--offset_range", "Translation search range (pixels)")
    offset_step: float = param(2.0, "--offset_step", "Coarse translation step (pixels)")
    sym: str = param("C1", "--sym", "Point-group symmetry")
    ini_high: float = param(60.0, "--ini_high", "Low-pass filter of the initial reference(s) (Å); -1 = none, "
                            "start at full size (e.g. going on from a previous run's classes)")
    particle_diameter: float = param(-1.0, "--particle_diameter", "Mask diameter (Å); -1 = (box - 5) x pixel size")
    sigma_ang: float = param(-1.0, "--sigma_ang", "Local searches with this angular sigma (degrees); -1 = global")
    skip_align: bool = param(False, "--skip_align", "Keep the input angles and offsets; classify only")
    firstiter_cc: bool = param(False, "--firstiter_cc", "Cross-correlation against class 1 in the first iteration")
    ctf: bool = param(False, "--ctf", "Do CTF correction")
    flatten_solvent: bool = param(False, "--flatten_solvent", "Mask the references with a soft sphere")
    zero_mask: bool = param(False, "--zero_mask", "Fill outside the particle mask with zeros (else noise)")
    pad: int = param(2, "--pad", "Padding factor of the Fourier grids")
    offset: float = param(10.0, "--offset", "Initial sigma of the offset prior (Å)")
    trust_ref_size: bool = param(False, "--trust_ref_size", "Rescale a reference of another box/pixel size")
    random_seed: int = param(0, "--random_seed", "Random seed (class seeding, perturbation, noise)")
    continue_from: Path | None = param(None, "--continue", "Continue from a run_itNNN_optimiser.star (to --iter)")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: int | None = param(None, "--gpu", "GPU index to use")

    def __post_init__(self):
        if self.continue_from is not None:
            require_file(self.continue_from, "--continue optimiser STAR", (".star",))
            return
        require_file(self.i, "--i particles STAR", (".star",))
        require_file(self.ref, "--ref reference map", (".mrc", ".map", ".star"))
        if self.o is None:
            raise InputError("--o (output folder) is required")
        ensure_not_input(Path(self.o) / "run_it001_data.star", self.i)
        symmetry_group(self.sym)
        if self.K < 1:
            raise InputError(f"--K must be at least 1, got {self.K}")
        if self.iter < 1:
            raise InputError(f"--iter must be at least 1, got {self.iter}")
        em.check_search(self.healpix_order, self.offset_range, self.offset_step)
        if self.tau2_fudge <= 0:
            raise InputError(f"--tau2_fudge must be > 0, got {self.tau2_fudge}")


SAVED = ("K", "iter", "tau2_fudge", "healpix_order", "offset_range", "offset_step", "sym", "ini_high",
         "particle_diameter", "sigma_ang", "skip_align", "firstiter_cc", "ctf", "flatten_solvent", "zero_mask", "pad",
         "offset", "random_seed")


def run(p: Params) -> Iterator:
    t_start = time.time()
    opt = None
    if p.continue_from is not None:  # the options, particles, classes and state of that iteration
        opt = em.read_optimiser_star(p.continue_from)
        base = Path(p.continue_from).parent
        given = {"i": base / str(opt["rlnExperimentalDataStarFile"]), "ref": base / str(opt["rlnModelStarFile"]),
                 "o": base, "continue_from": p.continue_from, "cpu": p.cpu, "gpu": p.gpu, "batch": p.batch}
        if p.iter != Params.__dataclass_fields__["iter"].default:
            given["iter"] = p.iter
        p = em.params_from_optimiser(Params, opt, **given)
    ps = em.load_particle_set(Path(p.i), p.ctf, seed=p.random_seed, halves=False)
    N, apix = ps.box, ps.pixel_size
    ref_paths = reference_paths(Path(p.ref))
    K = len(ref_paths) if len(ref_paths) > 1 else p.K
    if K > len(ps):
        raise InputError(f"--K {K} is larger than the number of particles ({len(ps)})", path=str(p.i))
    diameter, mask_r = em.particle_mask(ps, p.particle_diameter, MASK_EDGE)

    be = backend_for(p)
    xp = be.xp
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)
    write_note(out, JOB_NAME, p)
    sym = symmetry_group(p.sym)
    refs = [_load_reference(p, N, apix, q) for q in ref_paths]
    if p.ini_high > 0 and opt is None:
        refs = [lowpass_map(v, apix, p.ini_high) for v in refs]
    seeding = len(refs) == 1 and K > 1
    refs = refs * K if len(refs) == 1 else refs
    sigma2 = em.initial_noise_spectra(ps, be, mask_r, p.zero_mask) if opt is None else None
    scales = np.ones(len(ps.scale_group_names))
    pdf_class = np.full(K, 1.0 / K)
    sigma_offset_A = p.offset
    res_shell = int(round(N * apix / p.ini_high)) if p.ini_high > 0 else N // 2 - 10
    perturb = 0.0
    first_it = 1
    pdf_dir = None
    if opt is not None:
        first_it = int(opt["rlnCurrentIteration"]) + 1
        res_shell, perturb = int(opt["rlnGpuRelion_res_shell"]), float(opt["rlnGpuRelion_perturb"])
        sigma_offset_A = float(opt["rlnGpuRelion_sigma_offset"])
        sigma2 = em.read_model_sigma2(Path(p.ref))
        saved_scales, saved_pdf = em.read_model_state(Path(p.ref))
        scales = saved_scales if saved_scales is not None else scales
        pdf_class = np.asarray(read_star(Path(p.ref))["model_classes"]["rlnClassDistribution"], float)
        pdf_dir = np.stack(saved_pdf) if saved_pdf and not p.skip_align else None
        if "rlnClassNumber" in ps.table.particles:
            ps.classes[:] = ps.table.particles["rlnClassNumber"].to_numpy(int) - 1
    everyone = np.arange(len(ps))
    # RELION's seeding: in iteration 1 (2 after a CC iteration 1) each particle searches one random class
    seed_it = 2 if p.firstiter_cc else 1
    seed_class = np.random.default_rng(p.random_seed + 1).integers(0, K, len(ps))
    seed_prior = np.where(np.arange(K)[None, :] == seed_class[:, None], 0.0, -np.inf)
    local = em.LocalSearchSpec(p.sigma_ang, p.sym) if p.sigma_ang > 0 and not p.skip_align else None
    input_angles, input_offsets = ps.angles.copy(), ps.offsets_px.copy()
    yield Started(JOB_NAME, out, be.name, f"classifying {len(ps)} particles into {K} classes"
                  + (f", continuing after iteration {first_it - 1}" if opt is not None else ""))
    outputs: dict[str, Path] = {}
    for it in range(first_it, p.iter + 1):
        t_it = time.time()
        cc = p.firstiter_cc and it == 1
        current_size = int(min(N, 2 * (res_shell + 10)))
        frefs = [prepare_reference(be.asarray(v), p.pad, r_max=current_size / 2) for v in refs]
        tau2 = [reference_tau2(f) for f in frefs]
        perturb = em.next_perturbation(perturb, p.random_seed, it)
        if p.skip_align:
            smp = GivenOrientations(euler_to_matrix(*input_angles.T))
            pdf_dir = np.ones((K, 1))
            coarse = current_size
        else:
            smp = Sampling(p.healpix_order, p.sym, None, p.offset_range, p.offset_step, perturb=perturb)
            if pdf_dir is None:
                pdf_dir = np.full((K, smp.n_dirs), 1.0 / smp.n_dirs)
            coarse = coarse_image_size(N, apix, smp.angular_step, diameter, current_size)
        pix_c, pix_f = pixel_set(N, coarse, xp), pixel_set(N, current_size, xp)
        search = ("own orientation and offset (--skip_align)" if p.skip_align else
                  f"{smp.n_orient} orientations{' (local)' if local else ''}, {smp.translations.shape[0]} translations")
        yield Message(f"iteration {it}: image size {current_size} (coarse {coarse}), {K} classes x {search}"
                      f"{', random class seeding' if it == seed_it and seeding else ''}{', CC' if cc else ''}")
        old_classes = ps.classes.copy()
        stack = BackProjectorStack(K, N, p.pad, current_size / 2, ndim=3, xp=xp, dtype=np.float64)
        sums = EStepSums(stack.members, N // 2 + 1, ps.n_optics_groups, smp.n_dirs, n_scale_groups=len(scales))
        if cc and seeding:  # class 1 only
            class_prior = np.where(np.arange(K)[None, :] == 0, 0.0, -np.inf) * np.ones((len(ps), 1))
        elif it == seed_it and seeding:
            class_prior = seed_prior
        elif p.skip_align:  # the class prior (with global searches it is part of the direction prior)
            with np.errstate(divide="ignore"):
                class_prior = np.broadcast_to(np.log(pdf_class), (len(ps), K))
        else:
            class_prior = None
        with np.errstate(divide="ignore"):
            log_prior = np.log(pdf_class)[:, None] + np.log(pdf_dir)  # (K, n_dirs): class x direction prior
        setup = EStepSetup(frefs, smp, pix_c, pix_f, apix, be.asarray(sigma2),
                           log_pdf_direction=None if local or p.skip_align else be.asarray(log_prior),
                           sigma_offset_A=sigma_offset_A, cc=cc)
        rows_per_particle = K * (1 if p.skip_align else smp.n_orient if local is None else 200)
        batch = _batch_size(p, be, N, rows_per_particle, smp.translations.shape[0], pix_c.npix)
        yield from em.run_estep(ps, everyone, setup, sums, be, mask_radius_px=mask_r, zero_mask=p.zero_mask,
                                do_norm=False, norm_average=1.0, scales=scales, batch=batch, local=local,
                                stage=f"it {it:03d}", seed=p.random_seed + it,
                                class_log_prior=class_prior, own_orientation=p.skip_align)
        if p.skip_align:  # the input angles and offsets, exactly (not their round trip through matrices)
            ps.angles[:], ps.offsets_px[:] = input_angles, input_offsets
        # ---- M-step ----
        new_refs, ssnr_all = em.reconstruct_classes(stack, tau2, p.tau2_fudge, sums.pdf_class, refs, sym.matrices)
        new_refs = list(new_refs)
        if not cc:
            sigma2 = update_sigma2(sums.sigma2, sums.sumw_group, N)
            sigma_offset_A = update_sigma_offset(sums.sigma_offset, sums.sum_weight)
        pdf_class = sums.pdf_class / max(sums.pdf_class.sum(), 1e-300)
        if not p.skip_align:
            tot = sums.pdf_direction.sum(axis=1, keepdims=True)
            pdf_dir = np.where(tot > 0, sums.pdf_direction / np.maximum(tot, 1e-300), 1.0 / smp.n_dirs)
        if p.flatten_solvent:
            m = soft_spherical_mask(N, mask_r, MASK_EDGE, 3).astype(np.float64)
            new_refs = [v * m for v in new_refs]
        if cc:  # RELION re-applies the initial low-pass after a CC iteration and copies class 1 to every class
            new_refs = [lowpass_map(v, apix, p.ini_high) if p.ini_high > 0 else v for v in new_refs]
            if seeding:
                new_refs, pdf_class, ssnr_all = [new_refs[0]] * K, np.full(K, 1.0 / K), [ssnr_all[0]] * K
                pdf_dir = np.broadcast_to(pdf_dir[:1], pdf_dir.shape).copy()
        refs = [np.asarray(v, np.float32).astype(np.float64) for v in new_refs]
        res_shells = [min(resolution_shell_from_ssnr(s, gold_standard=False), N // 2) for s in ssnr_all]
        res_shell = res_shell if cc else max(res_shells)
        changed = float((ps.classes != old_classes).mean()) if it > 1 else 1.0
        # ---- files and events ----
        tag = f"_it{it:03d}"
        res_A = [shell_to_angstrom(max(r, 1), N, apix) for r in res_shells]
        paths = [write_mrc(out / f"run{tag}_class{k + 1:03d}.mrc", refs[k].astype(np.float32), apix)
                 for k in range(K)]
        em.write_classification_model(out / f"run{tag}_model.star", 3, [q.name for q in paths], pdf_class, res_A,
                                      ssnr_all, sigma2, scales, list(pdf_dir), ps, p.pad, p.tau2_fudge, current_size,
                                      sigma_offset_A)
        em.write_data_star(out / f"run{tag}_data.star", ps)
        state = {"rlnCurrentIteration": it, "rlnExperimentalDataStarFile": f"run{tag}_data.star",
                 "rlnModelStarFile": f"run{tag}_model.star", "rlnGpuRelion_res_shell": res_shell,
                 "rlnGpuRelion_perturb": perturb, "rlnGpuRelion_sigma_offset": sigma_offset_A}
        em.write_optimiser_star(out / f"run{tag}_optimiser.star", state | em.params_to_optimiser(p, SAVED))
        outputs = {f"class{k + 1:03d}": paths[k] for k in range(K)}
        outputs.update(model=out / f"run{tag}_model.star", data=out / f"run{tag}_data.star")
        empty = [k + 1 for k in range(K) if pdf_class[k] < 1e-6]
        dist = ", ".join(f"{100 * d:.1f}%" for d in pdf_class)
        summary = (f"class distribution {dist}; resolution {min(res_A):.1f} Å; {100 * changed:.1f}% of particles "
                   f"changed class; <Pmax> {ps.pmax.mean():.3f}; {time.time() - t_it:.1f} s"
                   + (f"; empty class(es): {empty}" if empty else ""))
        for k in range(K):
            yield MapUpdated(f"class{k + 1:03d}", refs[k].astype(np.float32), apix, paths[k])
        yield IterationFinished(it, {f"class{k + 1:03d}": refs[k].astype(np.float32) for k in range(K)},
                                pdf_class.copy(), float(min(res_A)), None, summary)
        yield Message(f"  iteration {it}: {summary}")
    final_dist = ", ".join(f"class {k + 1}: {100 * d:.1f}%" for k, d in enumerate(pdf_class))
    report = class_report(refs, pdf_class, soft_spherical_mask(N, mask_r, MASK_EDGE, 3))
    yield Message(report)
    yield Finished(outputs, f"{p.iter} iterations in {time.time() - t_start:.0f} s; {final_dist}. {report}")


def reference_paths(ref: Path) -> list[Path]:
    """The reference map(s): --ref itself, or the rlnReferenceImage entries of a STAR file (names relative to
    the working folder or, failing that, to the STAR file's folder)."""
    if ref.suffix != ".star":
        return [ref]
    table = next((b for b in read_star(ref).values() if isinstance(b, pd.DataFrame)
                  and "rlnReferenceImage" in b.columns), None)
    if table is None or not len(table):
        raise InputError("no rlnReferenceImage entries (expected a list of maps, e.g. a _model.star)",
                         path=str(ref), column="rlnReferenceImage")
    out = []
    for name in table["rlnReferenceImage"].astype(str):
        q = Path(name)
        q = q if q.is_file() else ref.parent / q
        require_file(q, f"reference map listed in {ref}", (".mrc", ".map"))
        out.append(q)
    return out


def class_report(refs: list[np.ndarray], pdf_class: np.ndarray, mask: np.ndarray, empty_below: float = 0.01) -> str:
    """What a user needs to judge K: empty classes (< 1 % of the particles) and the most alike pair of the
    others by real-space correlation inside the particle mask (a state split over two classes gives a pair
    that correlates better than any two different states)."""
    K = len(refs)
    empty = [k + 1 for k in range(K) if pdf_class[k] < empty_below]
    live = [k for k in range(K) if pdf_class[k] >= empty_below]
    parts = [f"empty class(es): {', '.join(map(str, empty))}" if empty else "no empty class"]
    if len(live) >= 2:
        v = np.stack([(refs[k] * mask)[mask > 0].astype(np.float64) for k in live])
        v -= v.mean(axis=1, keepdims=True)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
        c = v @ v.T
        pairs = [(c[a, b], live[a] + 1, live[b] + 1) for a in range(len(live)) for b in range(a + 1, len(live))]
        cc, a, b = max(pairs)
        parts.append(f"most alike: classes {a} and {b} (map correlation {cc:.3f}"
                     + (f"; the least alike pair {min(pairs)[0]:.3f})" if len(pairs) > 1 else ")"))
    return "; ".join(parts)



"""3D auto-refine (relion_refine --auto_refine --split_random_halves; relion_algorithm.md 6).

Gold-standard: the particles are split into two random halves, each refined against its own reference.
Each iteration: image sizes from the current resolution, accuracy estimates, the automatic sampling schedule
(HEALPix order up, translations finer, local searches from --auto_local_healpix_order), the E-step of both
halves (compute/estep.py), symmetrisation, joining below 40 Å, the FSC from the accumulators, tau2 from the
FSC, MAP reconstruction, noise, offset, norm and scale updates, solvent flattening, convergence. The final
iteration uses all frequencies and joins the halves. Files follow RELION's names (run_itNNN_*, run_class001.mrc,
run_half{1,2}_class001_unfil.mrc, run_model.star, run_data.star).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute.backend import free_cached_memory, to_host
from ..compute.backprojector import BackProjector
from ..compute.estep import EStepSetup, EStepSums, Sampling
from ..compute.expectation import pixel_set
from ..compute.fourier import fourier_resize, lowpass_map
from ..compute.fsc import resolution_shell, shell_to_angstrom
from ..compute.geometry import angular_distance_deg, euler_to_matrix, symmetry_group
from ..compute.masks import soft_spherical_mask
from ..compute.maximization import (
    coarse_image_size,
    fsc_from_backprojectors,
    join_low_resolution,
    reference_sigma2,
    resolution_shell_from_ssnr,
    tau2_from_fsc,
    update_norm,
    update_scales,
    update_sigma2,
    update_sigma_offset,
)
from ..compute.projector import prepare_reference
from ..compute.sampling import angular_step
from ..errors import InputError
from ..io.atomic import ensure_not_input
from ..io.mrc import read_mrc, write_mrc
from . import em
from .common import backend_for, param, require_file, write_note
from .events import Finished, FscUpdated, IterationFinished, MapUpdated, Message, Started

JOB_NAME = "refine3d"
MASK_EDGE = 5.0


@dataclass(frozen=True)
class Params:
    i: Path | None = param(None, "--i", "Particles STAR file")
    ref: Path | None = param(None, "--ref", "Initial reference map (.mrc)")
    o: Path | None = param(None, "--o", "Output folder (files run_it*, run_class001.mrc, ...)")
    ini_high: float = param(60.0, "--ini_high", "Low-pass filter of the initial reference (Å)")
    particle_diameter: float = param(-1.0, "--particle_diameter", "Mask diameter (Å); -1 = (box - 5) x pixel size")
    healpix_order: int = param(2, "--healpix_order", "Initial HEALPix order (2 = 15° coarse, 7.5° fine)")
    auto_local_healpix_order: int = param(4, "--auto_local_healpix_order",
                                          "Switch to local searches from this HEALPix order")
    offset_range: float = param(5.0, "--offset_range", "Initial translation search range (pixels)")
    offset_step: float = param(2.0, "--offset_step", "Initial coarse translation step (pixels)")
    sym: str = param("C1", "--sym", "Point-group symmetry")
    ctf: bool = param(False, "--ctf", "Do CTF correction")
    firstiter_cc: bool = param(False, "--firstiter_cc", "Cross-correlation in the first iteration")
    flatten_solvent: bool = param(False, "--flatten_solvent", "Mask the references with a soft sphere")
    zero_mask: bool = param(False, "--zero_mask", "Fill outside the particle mask with zeros (else noise)")
    norm: bool = param(False, "--norm", "Per-particle norm correction")
    scale: bool = param(False, "--scale", "Per-group intensity-scale correction")
    pad: int = param(2, "--pad", "Padding factor of the Fourier grids")
    tau2_fudge: float = param(1.0, "--tau2_fudge", "Regularisation parameter T")
    low_resol_join_halves: float = param(40.0, "--low_resol_join_halves", "Join the halves below this (Å)")
    auto_iter_max: int = param(999, "--auto_iter_max", "Stop after this many iterations at most")
    trust_ref_size: bool = param(False, "--trust_ref_size", "Rescale a reference of another box/pixel size")
    offset: float = param(10.0, "--offset", "Initial sigma of the offset prior (Å)")
    random_seed: int = param(0, "--random_seed", "Random seed (halves, perturbation, noise)")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    continue_from: Path | None = param(None, "--continue", "Continue from a run_itNNN_optimiser.star")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: int | None = param(None, "--gpu", "GPU index to use")

    def __post_init__(self):
        if self.continue_from is not None:
            require_file(self.continue_from, "--continue optimiser STAR", (".star",))
            return
        require_file(self.i, "--i particles STAR", (".star",))
        require_file(self.ref, "--ref reference map", (".mrc", ".map"))
        if self.o is None:
            raise InputError("--o (output folder) is required")
        ensure_not_input(Path(self.o) / "run_data.star", self.i)
        symmetry_group(self.sym)
        em.check_search(self.healpix_order, self.offset_range, self.offset_step)
        if self.pad < 1:
            raise InputError(f"--pad must be >= 1, got {self.pad}")
        if self.ini_high <= 0:
            raise InputError(f"--ini_high must be > 0 (Å), got {self.ini_high}")


# ----------------------------------------------------------------------------------------------------------


@dataclass
class State:
    """The driver's state between iterations (saved in run_itNNN_optimiser.star)."""

    iteration: int = 0
    order: int = 2
    offset_range: float = 5.0  # pixels
    offset_step: float = 2.0  # pixels
    sigma_offset_A: float = 10.0
    local: bool = False
    sigma_ang: float = 0.0
    res_shell: int = 5
    incr_size: int = 10
    has_high_fsc_at_limit: bool = False
    nr_iter_wo_resol_gain: int = 0
    nr_iter_wo_large_changes: int = 0
    best_res_shell: int = 0
    fine_enough: bool = False
    converged: bool = False
    acc_rot: float = 999.0
    acc_trans_A: float = 999.0
    norm_average: float = 1.0
    perturb: float = 0.0
    ave_pmax: float = 0.0
    smallest_angle_change: float = 999.0
    smallest_offset_change: float = 999.0
    last_offset_change_A: float = 0.0

    def to_star(self) -> dict:
        return {f"rlnGpuRelion_{k}": (int(v) if isinstance(v, bool) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_star(cls, d: dict) -> State:
        s = cls()
        for k, v in d.items():
            if k.startswith("rlnGpuRelion_"):
                name = k[len("rlnGpuRelion_"):]
                if hasattr(s, name):
                    cur = getattr(s, name)
                    setattr(s, name, bool(int(v)) if isinstance(cur, bool) else type(cur)(v))
        return s


def _load_reference(p: Params, box: int, apix: float, path: Path | None = None) -> np.ndarray:
    """The reference map ``path`` (default --ref) at the particles' box and pixel size (--trust_ref_size)."""
    path = Path(p.ref if path is None else path)
    m = read_mrc(path)
    vol = np.asarray(m.data, np.float64)
    if vol.ndim != 3 or len(set(vol.shape)) != 1:
        raise InputError(f"the reference must be a cubic 3D map, got shape {vol.shape}", path=str(path))
    ref_apix = float(m.pixel_size) if m.pixel_size else apix
    same_size = vol.shape[0] == box
    same_apix = abs(ref_apix - apix) <= 1e-3 * apix
    if same_size and same_apix:
        return vol
    if not p.trust_ref_size:
        raise InputError(f"the reference has box {vol.shape[0]} at {ref_apix:.4f} Å/px but the particles have box "
                         f"{box} at {apix:.4f} Å/px; give --trust_ref_size to rescale it, or a matching map",
                         path=str(path))
    # rescale: Fourier-resample to the particles' pixel size, then crop/pad to the box
    from ..compute.simulate import fit_box  # noqa: PLC0415

    n_new = int(round(vol.shape[0] * ref_apix / apix / 2)) * 2
    vol = fourier_resize(vol, n_new, 3) if n_new != vol.shape[0] else vol
    return fit_box(vol.astype(np.float32), box).astype(np.float64)


def _batch_size(p: Params, be, box: int, n_orient_rows: int, ntrans: int, kc: int, cap: int = 512) -> int:
    """Particles per E-step batch: --batch, else what 15 % of free memory holds (score arrays, images, particle
    terms per particle), at most ``cap`` (2D classification measured faster at 1024 than at 512 on the H100)."""
    if p.batch:
        return p.batch
    per = 4 * (n_orient_rows * ntrans * 3 + 8 * box * box) + 8 * ntrans * kc * 2
    return int(max(1, min(cap, 0.15 * be.free_bytes() // max(per, 1))))


def run(p: Params) -> Iterator:
    t_start = time.time()
    cont = p.continue_from is not None
    if cont:
        opt = em.read_optimiser_star(p.continue_from)
        base = Path(p.continue_from).parent
        state = State.from_star(opt)
        data_star = base / str(opt["rlnExperimentalDataStarFile"])
        prm = _params_from_optimiser(opt, p)
    else:
        prm = p
        data_star = Path(p.i)
        state = State(order=p.healpix_order, offset_range=p.offset_range, offset_step=p.offset_step,
                      sigma_offset_A=p.offset)
    ps = em.load_particle_set(data_star, prm.ctf, seed=prm.random_seed)
    N, apix = ps.box, ps.pixel_size
    diameter, mask_r = em.particle_mask(ps, prm.particle_diameter, MASK_EDGE)
    out = Path(prm.o)
    be = backend_for(p)
    xp = be.xp
    sym = symmetry_group(prm.sym)
    halves = [np.flatnonzero(ps.subset == h) for h in (1, 2)]
    if cont:
        refs = [np.asarray(read_mrc(base / str(opt[f"rlnGpuRelion_half{h}"])).data, np.float64) for h in (1, 2)]
        sigma2 = [em.read_model_sigma2(base / str(opt[f"rlnGpuRelion_model{h}"])) for h in (1, 2)]
        saved = [em.read_model_state(base / str(opt[f"rlnGpuRelion_model{h}"])) for h in (1, 2)]
        scales = saved[0][0] if saved[0][0] is not None else np.ones(len(ps.scale_group_names))
        pdf_saved = [sv[1][0] if sv[1] else None for sv in saved]
    else:
        ref0 = lowpass_map(_load_reference(prm, N, apix), apix, prm.ini_high)
        refs = [ref0.copy(), ref0.copy()]
        s2 = em.initial_noise_spectra(ps, be, mask_r, prm.zero_mask)
        sigma2 = [s2.copy(), s2.copy()]
        scales = np.ones(len(ps.scale_group_names))
        state.res_shell = int(round(N * apix / prm.ini_high))
        state.norm_average = float(ps.norm.mean())
    yield Started(JOB_NAME, out, be.name, f"auto-refining {len(ps)} particles ({halves[0].size} + {halves[1].size}), "
                                          f"box {N}, {apix:.3f} Å/px, {sym.name}")
    out.mkdir(parents=True, exist_ok=True)
    write_note(out, JOB_NAME, p)
    monitor = em.ChangeMonitor(state.smallest_angle_change, state.smallest_offset_change)
    n_dirs_pdf = None
    pdf_dir = [None, None]
    if cont and pdf_saved[0] is not None and pdf_saved[1] is not None:  # the direction priors learned so far
        pdf_dir, n_dirs_pdf = pdf_saved, pdf_saved[0].size
    fsc = np.zeros(N // 2 + 1)
    final = False
    outputs: dict[str, Path] = {}
    while True:
        state.iteration += 1
        it = state.iteration
        t_it = time.time()
        # ---- convergence and sizes ----
        final = state.converged or it > prm.auto_iter_max
        cc = prm.firstiter_cc and it == 1 and not cont
        if final:
            current_size = N
        else:
            current_size = int(min(N, 2 * (state.res_shell + state.incr_size)))
        # ---- references on the device, accuracy estimates, sampling schedule ----
        frefs = [prepare_reference(be.asarray(v), prm.pad, r_max=current_size / 2) for v in refs]
        pix_f = pixel_set(N, current_size, xp)
        if it > 1 and not final:
            acc_rows = halves[0][:100]
            s2r = sigma2[0][ps.optics_group[acc_rows]][:, to_host(pix_f.shell)]
            state.acc_rot, state.acc_trans_A = em.estimate_accuracy(frefs[0], pix_f, ps.angles[acc_rows],
                                                                    ps.ctf_rows(acc_rows), s2r, apix,
                                                                    seed=prm.random_seed)
            msg = _update_sampling(state, prm, apix)
            if msg:
                yield Message(msg)
        state.perturb = em.next_perturbation(state.perturb, prm.random_seed, it)
        smp = Sampling(state.order, prm.sym, None, state.offset_range, state.offset_step, perturb=state.perturb)
        if n_dirs_pdf != smp.n_dirs:  # new HEALPix order: uniform direction priors
            n_dirs_pdf = smp.n_dirs
            pdf_dir = [np.full(smp.n_dirs, 1.0 / smp.n_dirs), np.full(smp.n_dirs, 1.0 / smp.n_dirs)]
        coarse = coarse_image_size(N, apix, smp.angular_step, diameter, current_size)
        pix_c = pixel_set(N, coarse, xp)
        local = em.LocalSearchSpec(state.sigma_ang, prm.sym) if state.local else None
        yield Message(f"iteration {it}: image size {current_size} (coarse {coarse}), HEALPix order {state.order} "
                      f"({smp.angular_step:g}°, fine {smp.fine_angular_step:g}°), {smp.n_orient} orientations"
                      f"{f' (local, sigma {state.sigma_ang:.2f}°)' if local else ''}, {smp.translations.shape[0]} "
                      f"translations (range {state.offset_range:g}, step {state.offset_step:g} px)"
                      f"{', CC' if cc else ''}{', final joined iteration' if final else ''}")
        # ---- E-step for both halves ----
        old_angles = ps.angles.copy()
        old_offsets = ps.offsets_px.copy()
        bps, all_sums = [], []
        rows_ct = smp.n_orient if local is None else 200
        batch = _batch_size(prm, be, N, rows_ct, smp.translations.shape[0], pix_c.npix)
        for h in range(2):
            bp = BackProjector(N, prm.pad, current_size / 2, ndim=3, xp=xp, dtype=np.float64)
            sums = EStepSums([bp], N // 2 + 1, ps.n_optics_groups, smp.n_dirs, n_scale_groups=len(scales))
            setup = EStepSetup([frefs[h]], smp, pix_c, pix_f, apix, be.asarray(sigma2[h]),
                               log_pdf_direction=None if local else
                               be.asarray(np.log(np.maximum(pdf_dir[h], 1e-300))[None, :]),
                               sigma_offset_A=state.sigma_offset_A, cc=cc, scale_shells=None)
            yield from em.run_estep(ps, halves[h], setup, sums, be, mask_radius_px=mask_r, zero_mask=prm.zero_mask,
                                    do_norm=prm.norm, norm_average=state.norm_average, scales=scales, batch=batch,
                                    local=local, stage=f"it {it:03d} half {h + 1}", seed=prm.random_seed + it)
            bp.enforce_hermitian()
            if sym.order > 1:
                bp.symmetrise(sym.matrices)
            bps.append(bp)
            all_sums.append(sums)
        # ---- gold-standard FSC, tau2 and reconstruction ----
        if not final and prm.low_resol_join_halves > 0:
            res_A = max(prm.low_resol_join_halves, shell_to_angstrom(max(state.res_shell, 1), N, apix))
            join_low_resolution(bps[0], bps[1], float(np.ceil(N * apix / res_A)))
        fsc = fsc_from_backprojectors(bps[0], bps[1])
        if final:
            unfil = [to_host(bp.reconstruct(None)) for bp in bps]
            joined_bp = bps[0]
            joined_bp.add(bps[1])
            tau2, ssnr = tau2_from_fsc(fsc, reference_sigma2(joined_bp), prm.tau2_fudge, joined=True)
            vol = to_host(joined_bp.reconstruct(tau2, prm.tau2_fudge))
            new_refs = [vol, vol]
        else:
            new_refs = []
            for bp in bps:
                tau2, ssnr = tau2_from_fsc(fsc, reference_sigma2(bp), prm.tau2_fudge)
                new_refs.append(to_host(bp.reconstruct(tau2, prm.tau2_fudge)).astype(np.float64))
        # ---- other parameters ----
        sw = sum(s.sum_weight for s in all_sums)
        if not cc:
            for h in range(2):
                sigma2[h] = update_sigma2(all_sums[h].sigma2, all_sums[h].sumw_group, N)
            state.sigma_offset_A = update_sigma_offset(sum(s.sigma_offset for s in all_sums), sw)
            if prm.norm:
                ps.norm = update_norm(ps.norm, state.norm_average, ps.residual_power)
                state.norm_average = float(ps.norm.mean())
            if prm.scale and len(scales) > 1:
                counts = np.bincount(ps.scale_group, minlength=len(scales)).astype(float)
                scales = update_scales(sum(s.xa for s in all_sums), sum(s.aa for s in all_sums), counts, scales)
        for h in range(2):
            tot = all_sums[h].pdf_direction[0]
            pdf_dir[h] = tot / max(tot.sum(), 1e-300)
        if prm.flatten_solvent and not final:
            m = soft_spherical_mask(N, mask_r, MASK_EDGE, 3).astype(np.float64)
            new_refs = [v * m for v in new_refs]
        if cc:  # RELION re-applies the initial low-pass after a CC iteration
            new_refs = [lowpass_map(v, apix, prm.ini_high) for v in new_refs]
        refs = [np.asarray(v, np.float32).astype(np.float64) for v in new_refs]  # as written: --continue reads these
        # ---- resolution, image size increments, hidden-variable changes ----
        state.ave_pmax = float(ps.pmax.mean())
        old_shell = state.res_shell
        if not cc:
            state.res_shell = min(resolution_shell_from_ssnr(ssnr), N // 2)
        gain = state.res_shell > state.best_res_shell
        state.best_res_shell = max(state.best_res_shell, state.res_shell)
        state.nr_iter_wo_resol_gain = 0 if (gain and state.res_shell > old_shell) else state.nr_iter_wo_resol_gain + 1
        s143, s05 = resolution_shell(fsc, 0.143), resolution_shell(fsc, 0.5)
        state.incr_size = max(10, s143 - s05 + 5)
        if fsc[min(current_size // 2 - 1, fsc.size - 1)] > 0.2:
            state.has_high_fsc_at_limit = True
        if state.ave_pmax > 0.1 and state.has_high_fsc_at_limit:
            state.incr_size = int(round(0.25 * N / 2))
        A_old = euler_to_matrix(old_angles[:, 0], old_angles[:, 1], old_angles[:, 2])
        A_new = euler_to_matrix(ps.angles[:, 0], ps.angles[:, 1], ps.angles[:, 2])
        dang = float(np.mean(angular_distance_deg(A_old, A_new, prm.sym)))
        doff = float(np.sqrt(((ps.offsets_px - old_offsets) ** 2).sum() / (2 * len(ps)))) * apix
        if it > 1 and not cc:
            no_large = monitor.update(dang, doff, smp.fine_angular_step, smp.fine_offset_step * apix)
            state.nr_iter_wo_large_changes = state.nr_iter_wo_large_changes + 1 if no_large else 0
        state.smallest_angle_change, state.smallest_offset_change = monitor.smallest_angle, monitor.smallest_offset
        state.last_offset_change_A = doff
        res_A = _fsc_resolution(fsc, N, apix)
        # ---- files ----
        tag = "" if final else f"_it{it:03d}"
        paths = _write_iteration(out, tag, it, refs, fsc, ssnr, ps, sigma2, scales, pdf_dir, state, prm, apix,
                                 current_size, final)
        if final:
            for h in range(2):
                write_mrc(out / f"run_half{h + 1}_class001_unfil.mrc", unfil[h].astype(np.float32), apix)
            outputs = {"map": out / "run_class001.mrc", "half1": out / "run_half1_class001_unfil.mrc",
                       "half2": out / "run_half2_class001_unfil.mrc", "model": out / "run_model.star",
                       "data": out / "run_data.star"}
        dt = time.time() - t_it
        summary = (f"resolution {res_A:.2f} Å (FSC 0.143), image size {current_size}, angular change {dang:.2f}°, "
                   f"offset change {doff:.2f} Å, <Pmax> {state.ave_pmax:.3f}, {dt:.1f} s")
        for h, name in enumerate(["class001"] if final else ["half1", "half2"]):
            yield MapUpdated(name, refs[h].astype(np.float32), apix, paths[f"map{h + 1}"])
        inv_res = np.arange(N // 2 + 1) / (N * apix)
        yield FscUpdated(inv_res, {"gold-standard FSC": fsc}, res_A)
        yield IterationFinished(it, {}, None, res_A, fsc, summary)
        if final:
            break
        # convergence test for the next iteration (RELION checkConvergence)
        state.converged = (state.fine_enough and state.nr_iter_wo_resol_gain >= 1
                           and state.nr_iter_wo_large_changes >= 1)
    free_cached_memory(be)
    yield Finished(outputs, f"final resolution {res_A:.2f} Å (gold-standard FSC 0.143) after {state.iteration} "
                            f"iterations in {time.time() - t_start:.0f} s; map {outputs['map']}")


def _fsc_resolution(fsc: np.ndarray, N: int, apix: float) -> float:
    s = resolution_shell(fsc, 0.143)
    return shell_to_angstrom(max(s, 1), N, apix)


def _update_sampling(state: State, p: Params, apix: float) -> str:
    """RELION updateAngularSampling (auto-refine): finer HEALPix order and translations once the resolution
    and the hidden variables have stalled; local searches from --auto_local_healpix_order."""
    if state.fine_enough or state.nr_iter_wo_resol_gain < 1 or state.nr_iter_wo_large_changes < 1:
        return ""
    fine_step = angular_step(state.order) / 2
    if fine_step < 0.75 * state.acc_rot:
        state.fine_enough = True
        return (f"angular sampling fine enough ({fine_step:g}° < 0.75 x accuracy {state.acc_rot:.2f}°): "
                "no further increase")
    state.order += 1
    new_fine_step = angular_step(state.order) / 2
    acc_trans_px = state.acc_trans_A / apix
    step = 2 * min(1.5 / apix, 0.75 * acc_trans_px)
    rng = min(5.0 * state.last_offset_change_A / apix, 1.3 * state.offset_range)
    rng = max(rng, 1.5 * step)
    if rng > 4 * step:
        rng /= 2
    if rng > 4 * step:
        step = rng / 4
    if step <= state.offset_step:
        state.offset_step, state.offset_range = step, rng
    state.nr_iter_wo_resol_gain = 0
    state.nr_iter_wo_large_changes = 0
    msg = (f"sampling: HEALPix order {state.order} ({angular_step(state.order):g}°, fine {new_fine_step:g}°), "
           f"translations range {state.offset_range:.2f} step {state.offset_step:.2f} px "
           f"(accuracy {state.acc_rot:.2f}°, {state.acc_trans_A:.2f} Å)")
    if state.order >= p.auto_local_healpix_order and not state.local:
        state.local = True
    if state.local:
        state.sigma_ang = 2.0 * new_fine_step
        msg += f"; local searches, sigma {state.sigma_ang:.2f}°"
    return msg


def _write_iteration(out: Path, tag: str, it: int, refs, fsc, ssnr, ps, sigma2, scales, pdf_dir, state: State,
                     p: Params, apix: float, current_size: int, final: bool) -> dict:
    N = ps.box
    paths = {}
    sh = np.arange(N // 2 + 1)
    res_A = _fsc_resolution(fsc, N, apix)
    names = ["run_class001.mrc"] if final else [f"run{tag}_half{h}_class001.mrc" for h in (1, 2)]
    for h, name in enumerate(names):
        paths[f"map{h + 1}"] = write_mrc(out / name, refs[h].astype(np.float32), apix)
    models = ["run_model.star"] if final else [f"run{tag}_half{h}_model.star" for h in (1, 2)]
    for h, name in enumerate(models):
        general = {"rlnReferenceDimensionality": 3, "rlnDataDimensionality": 2, "rlnOriginalImageSize": N,
                   "rlnCurrentResolution": res_A, "rlnCurrentImageSize": current_size, "rlnPaddingFactor": p.pad,
                   "rlnIsHelix": 0, "rlnFourierSpaceInterpolator": 1, "rlnMinRadiusNnInterpolation": 10,
                   "rlnPixelSize": apix, "rlnNrClasses": 1, "rlnNrBodies": 1, "rlnNrGroups": len(scales),
                   "rlnTau2FudgeFactor": p.tau2_fudge, "rlnNormCorrectionAverage": state.norm_average,
                   "rlnSigmaOffsetsAngst": state.sigma_offset_A,
                   "rlnOrientationalPriorMode": 1 if state.local else 0,
                   "rlnSigmaPriorRotAngle": state.sigma_ang, "rlnSigmaPriorTiltAngle": state.sigma_ang,
                   "rlnSigmaPriorPsiAngle": state.sigma_ang,
                   "rlnLogLikelihood": float(ps.log_likelihood.sum()), "rlnAveragePmax": state.ave_pmax}
        classes = pd.DataFrame({"rlnReferenceImage": [paths[f"map{h + 1}"].name], "rlnClassDistribution": [1.0],
                                "rlnAccuracyRotations": [state.acc_rot],
                                "rlnAccuracyTranslationsAngst": [state.acc_trans_A],
                                "rlnEstimatedResolution": [res_A],
                                "rlnOverallFourierCompleteness": [1.0]})
        with np.errstate(divide="ignore"):
            res_col = np.where(sh > 0, N * apix / np.maximum(sh, 1), 999.0)
        curve = pd.DataFrame({"rlnSpectralIndex": sh, "rlnResolution": sh / (N * apix),
                              "rlnAngstromResolution": res_col, "rlnSsnrMap": ssnr[: sh.size],
                              "rlnGoldStandardFsc": fsc})
        em.write_model_star(out / name, general, classes, [curve], sigma2[h], scales, ps.scale_group_names,
                            [pdf_dir[h]], N, apix)
    data = out / f"run{tag}_data.star"
    em.write_data_star(data, ps)
    opt = {"rlnOutputRootName": str(out / "run"), "rlnModelStarFile": models[0],
           "rlnModelStarFile2": models[-1], "rlnExperimentalDataStarFile": data.name,
           "rlnCurrentIteration": it,
           "rlnHasConverged": int(final), "rlnNumberOfIterWithoutResolutionGain": state.nr_iter_wo_resol_gain,
           "rlnNumberOfIterWithoutChangingAssignments": state.nr_iter_wo_large_changes,
           "rlnGpuRelion_half1": names[0], "rlnGpuRelion_half2": names[-1],
           "rlnGpuRelion_model1": models[0], "rlnGpuRelion_model2": models[-1]}
    opt.update(em.params_to_optimiser(p, ("ini_high", "particle_diameter", "auto_local_healpix_order", "sym", "ctf",
                                          "firstiter_cc", "flatten_solvent", "zero_mask", "norm", "scale", "pad",
                                          "tau2_fudge", "low_resol_join_halves", "auto_iter_max", "random_seed")))
    opt.update(state.to_star())
    em.write_optimiser_star(out / f"run{tag}_optimiser.star", opt)
    return paths


def _params_from_optimiser(opt: dict, p: Params) -> Params:
    return em.params_from_optimiser(Params, opt, i=None, ref=None, o=Path(p.continue_from).parent,
                                    continue_from=p.continue_from, cpu=p.cpu, gpu=p.gpu, batch=p.batch)

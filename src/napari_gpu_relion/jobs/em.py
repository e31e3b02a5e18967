"""The EM machinery shared by refine3d (and, later, class3d and class2d): the particle set with its per-particle
state, the E-step over a set of particles in memory-sized batches (halving on out-of-memory), accuracy
estimates, and RELION's output files (run_itNNN_data.star, _model.star, _optimiser.star).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute.backend import Backend, to_host
from ..compute.ctf import CtfParams, ctf_from_frequencies
from ..compute.estep import EStepSetup, EStepSums, expectation_batch, prepare_batch
from ..compute.expectation import PixelSet
from ..compute.fourier import rfft_centered
from ..compute.geometry import euler_to_matrix, matrix_to_euler
from ..compute.projector import FourierReference, project_pixels
from ..compute.sampling import local_search
from ..errors import InputError
from ..io.star import (
    ParticleTable,
    image_names_for,
    load_images,
    read_particles,
    read_star,
    write_particles,
    write_star_blocks,
)
from .common import batched_with_oom_retry
from .events import Message, Progress

ANGLES = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
CTF_COLUMNS = ("rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle", "rlnVoltage", "rlnSphericalAberration",
               "rlnAmplitudeContrast")


# ----------------------------------------------------------------------------------------------------------
# Particles and their state
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ParticleSet:
    """A particles STAR with the per-particle hidden-variable state the EM iterations update."""

    table: ParticleTable
    pixel_size: float
    box: int
    angles: np.ndarray  # (n, 3) rot, tilt, psi (degrees)
    offsets_px: np.ndarray  # (n, 2) origin offsets (pixels)
    norm: np.ndarray  # (n,) rlnNormCorrection
    subset: np.ndarray  # (n,) 1 or 2
    optics_group: np.ndarray  # (n,) 0-based
    scale_group: np.ndarray  # (n,) 0-based index into scale_group_names
    scale_group_names: list
    ctf: CtfParams | None
    classes: np.ndarray = None  # (n,) 0-based
    pmax: np.ndarray = None
    nr_significant: np.ndarray = None
    log_likelihood: np.ndarray = None
    residual_power: np.ndarray = None

    def __post_init__(self):
        n = len(self.table)
        for name, dt in (("classes", np.int64), ("pmax", float), ("nr_significant", np.int64),
                         ("log_likelihood", float), ("residual_power", float)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, dtype=dt))

    def __len__(self) -> int:
        return len(self.table)

    @property
    def n_optics_groups(self) -> int:
        return int(self.optics_group.max()) + 1

    def images(self, rows) -> np.ndarray:
        return load_images(self.table, rows=np.asarray(rows)).astype(np.float32)

    def ctf_rows(self, rows) -> CtfParams | None:
        return None if self.ctf is None else self.ctf.subset(np.asarray(rows))


def load_particle_set(path: Path, ctf: bool, seed: int = 0, halves: bool = True) -> ParticleSet:
    """Read a particles STAR for refinement; clear errors (file, column) for what is missing. Particles
    without rlnRandomSubset are split into random halves (kept when present, as RELION does)."""
    table = read_particles(path, require=("rlnImageName",))
    df = table.particles
    n = len(df)
    if ctf:
        missing = [c for c in CTF_COLUMNS if c not in df.columns]
        if missing:
            raise InputError(f"--ctf needs the CTF column(s) {', '.join(missing)} (in the particles or optics "
                             "table)", path=str(path), column=", ".join(missing))
    apix = table.pixel_size
    box = table.box_size
    ang = np.zeros((n, 3))
    for j, c in enumerate(ANGLES):
        if c in df:
            ang[:, j] = df[c].to_numpy(float)
    if "rlnOriginXAngst" in df and "rlnOriginYAngst" in df:
        off = np.stack([df["rlnOriginXAngst"].to_numpy(float), df["rlnOriginYAngst"].to_numpy(float)], 1) / apix
    elif "rlnOriginX" in df and "rlnOriginY" in df:
        off = np.stack([df["rlnOriginX"].to_numpy(float), df["rlnOriginY"].to_numpy(float)], 1)
    else:
        off = np.zeros((n, 2))
    norm = df["rlnNormCorrection"].to_numpy(float) if "rlnNormCorrection" in df else np.ones(n)
    if "rlnRandomSubset" in df:
        subset = df["rlnRandomSubset"].to_numpy(int)
        bad = ~np.isin(subset, (1, 2))
        if bad.any():
            row = int(np.argmax(bad))
            raise InputError(f"rlnRandomSubset must be 1 or 2; row {row + 1} has {subset[row]}", path=str(path),
                             column="rlnRandomSubset", line=table.line_of(df.index[row]))
    else:
        subset = np.random.default_rng(seed).permutation(np.arange(n) % 2) + 1
    for h in (1, 2) if halves else ():
        if (subset == h).sum() < 2:
            raise InputError(f"too few particles for two gold-standard halves: half {h} has {(subset == h).sum()} "
                             f"of {n} particles (need at least 2 in each)", path=str(path), column="rlnRandomSubset")
    og = df["rlnOpticsGroup"].to_numpy(int) if "rlnOpticsGroup" in df else np.ones(n, int)
    _, og0 = np.unique(og, return_inverse=True)
    key = "rlnGroupNumber" if "rlnGroupNumber" in df else ("rlnMicrographName" if "rlnMicrographName" in df else None)
    if key is None:
        names, sg = ["1"], np.zeros(n, int)
    else:
        u, sg = np.unique(df[key].astype(str).to_numpy(), return_inverse=True)
        names = list(u)
    return ParticleSet(table, apix, box, ang, off, norm, subset, og0, sg, names,
                       CtfParams.from_table(df) if ctf else None)


def check_search(healpix_order: int, offset_range: float, offset_step: float) -> None:
    """The search options every EM job shares: clear errors before any work."""
    if healpix_order < 0 or healpix_order > 8:
        raise InputError(f"--healpix_order must be in 0..8, got {healpix_order}")
    if offset_step <= 0 or offset_range < 0:
        raise InputError(f"--offset_step must be > 0 and --offset_range >= 0 (pixels), got "
                         f"{offset_step}, {offset_range}")


def particle_mask(ps: ParticleSet, particle_diameter: float, edge_px: float) -> tuple[float, float]:
    """(diameter in Å, mask radius in pixels): --particle_diameter, or (box - edge) x pixel size when it is
    not positive; an error when it is larger than the box."""
    N, apix = ps.box, ps.pixel_size
    diameter = particle_diameter if particle_diameter > 0 else (N - edge_px) * apix
    if diameter > N * apix:
        raise InputError(f"--particle_diameter {diameter:g} Å is larger than the box ({N} px x {apix:.3f} Å = "
                         f"{N * apix:.1f} Å)")
    return diameter, diameter / (2 * apix)


# ----------------------------------------------------------------------------------------------------------
# Initial noise spectra
# ----------------------------------------------------------------------------------------------------------


def initial_noise_spectra(ps: ParticleSet, be: Backend, mask_radius_px: float, zero_mask: bool,
                          max_per_group: int = 1000) -> np.ndarray:
    """(G, N/2+1) initial sigma2 per optics group from up to 1000 particles each (zero-masked first with
    --zero_mask): (mean image power - power of the mean image) / 2 (relion_algorithm.md 6, setup)."""
    from ..compute.masks import soft_mask_outside  # noqa: PLC0415
    from ..compute.maximization import initial_sigma2  # noqa: PLC0415

    N = ps.box
    out = np.zeros((ps.n_optics_groups, N // 2 + 1))
    for g in range(ps.n_optics_groups):
        rows = np.flatnonzero(ps.optics_group == g)[:max_per_group]
        x = be.asarray(ps.images(rows))
        if zero_mask:
            x = soft_mask_outside(x, mask_radius_px, 5.0, 2)
        F = rfft_centered(x, 2)
        from ..compute.fourier import radial_average  # noqa: PLC0415

        each = to_host(radial_average((F.real**2 + F.imag**2).astype(np.float64), N, 2).mean(axis=0))
        Fm = F.mean(axis=0)
        mean_pow = to_host(radial_average((Fm.real**2 + Fm.imag**2).astype(np.float64), N, 2))
        out[g] = initial_sigma2(each, mean_pow)
    return out


# ----------------------------------------------------------------------------------------------------------
# The E-step over a set of particles
# ----------------------------------------------------------------------------------------------------------


@dataclass
class LocalSearchSpec:
    sigma_deg: float
    sym: str


def local_candidates(ps: ParticleSet, rows: np.ndarray, setup: EStepSetup, spec: LocalSearchSpec):
    """Per-particle coarse candidate rows and log priors (I, n) around each particle's current angles
    (RELION local searches, sigma = ``spec.sigma_deg``, 3 sigma cut-off), in every class; -1 pads."""
    smp = setup.sampling
    a = ps.angles[rows]
    ls = local_search(a[:, 0], a[:, 1], a[:, 2], spec.sigma_deg, smp.order, spec.sym, smp.psi_step)
    n_psi = ls.psi_mask.shape[1]
    d_idx, d_ok = _kept_first(ls.dir_mask)  # (I, nd), few directions per particle
    p_idx, p_ok = _kept_first(ls.psi_mask)  # (I, np)
    ok = (d_ok[:, :, None] & p_ok[:, None, :]).reshape(len(rows), -1)
    cand = np.where(ok, (d_idx[:, :, None] * n_psi + p_idx[:, None, :]).reshape(len(rows), -1), -1)
    lp = (np.take_along_axis(ls.dir_log_prior, d_idx, axis=1)[:, :, None]
          + np.take_along_axis(ls.psi_log_prior, p_idx, axis=1)[:, None, :]).reshape(len(rows), -1)
    lpc = np.where(ok, lp, -np.inf)
    K, R = len(setup.refs), smp.n_orient
    if K > 1:  # the same window in every class (rows are class-major)
        cand = np.concatenate([np.where(cand >= 0, cand + k * R, -1) for k in range(K)], axis=1)
        lpc = np.concatenate([lpc] * K, axis=1)
    return cand, lpc


def _kept_first(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the True entries of each row of ``mask`` (I, M), first and in order, padded to the largest
    count: (I, n) indices and (I, n) validity."""
    n = max(1, int(mask.sum(axis=1).max()))
    idx = np.argsort(~mask, axis=1, kind="stable")[:, :n]
    return idx, np.take_along_axis(mask, idx, axis=1)


def run_estep(ps: ParticleSet, rows: np.ndarray, setup: EStepSetup, sums: EStepSums, be: Backend, *,
              mask_radius_px: float, zero_mask: bool, do_norm: bool, norm_average: float, scales: np.ndarray,
              batch: int, local: LocalSearchSpec | None = None, stage: str = "E-step", seed: int = 0,
              class_log_prior: np.ndarray | None = None, own_orientation: bool = False) -> Iterator:
    """E-step over ``rows`` of the particle set in batches (halving on out-of-memory); updates the particle
    state (angles, offsets, classes, pmax, ...) and ``sums``. Yields Progress / Message events.

    ``own_orientation`` (--skip_align): the setup's sampling is GivenOrientations with one row per particle of
    the set; each particle is compared, in every class, only at its own orientation and exact offset."""
    n = rows.size
    sig2_host = to_host(setup.sigma2)

    def work(i0: int, i1: int) -> None:
        r = rows[i0:i1]
        imgs = be.asarray(ps.images(r))
        nf = (norm_average / ps.norm[r]) if do_norm else np.ones(r.size)
        noise = None if zero_mask else sig2_host[ps.optics_group[r][0]]
        prep = prepare_batch(imgs, nf, ps.offsets_px[r], mask_radius_px, 5.0, noise_sigma2=noise,
                             seed=seed + int(r[0]), subpixel=own_orientation)
        cand = lpc = None
        if local is not None:
            cand, lpc = local_candidates(ps, r, setup, local)
        elif own_orientation:
            R = setup.sampling.n_orient
            cand = r[:, None] + R * np.arange(len(setup.refs))[None, :]
            lpc = np.zeros(cand.shape)
        res = expectation_batch(setup, prep, ps.ctf_rows(r), ps.optics_group[r], scales[ps.scale_group[r]], sums,
                                candidates=cand, candidate_log_prior=lpc, scale_group_index=ps.scale_group[r],
                                class_log_prior=None if class_log_prior is None else class_log_prior[r])
        rot, tilt, psi = matrix_to_euler(res.matrices)
        ps.angles[r] = np.stack([rot, tilt, psi], axis=1)
        ps.offsets_px[r] = res.offsets_px
        ps.classes[r] = res.classes
        ps.pmax[r] = res.pmax
        ps.nr_significant[r] = res.nr_significant
        ps.log_likelihood[r] = res.log_likelihood
        ps.residual_power[r] = res.residual_power

    for item in batched_with_oom_retry(n, batch, work, be):
        if isinstance(item, Message):
            yield item
        else:
            yield Progress(item[0], item[1], stage)
    be.release_cached()


# ----------------------------------------------------------------------------------------------------------
# Accuracy of rotations and translations (RELION calculateExpectedAngularErrors)
# ----------------------------------------------------------------------------------------------------------

_ANGLE_ERRORS = np.concatenate([np.arange(0.05, 1.0, 0.05), np.arange(1.0, 5.0, 0.25), np.arange(5.0, 30.01, 1.0)])
_SHIFT_ERRORS = np.concatenate([np.arange(0.05, 1.0, 0.05), np.arange(1.0, 10.01, 0.25)])


def estimate_accuracy(ref: FourierReference, pix: PixelSet, angles: np.ndarray, ctf: CtfParams | None,
                      sigma2_rows: np.ndarray, pixel_size: float, seed: int = 0) -> tuple[float, float]:
    """Mean angular (degrees) and translational (Å) error at which the weighted squared difference between
    a particle's projection and a perturbed one first exceeds ln(100) (4.60517), for the given particles
    (RELION uses the first 100). Each particle is perturbed along one of rot/tilt/psi (x or y for shifts)
    chosen at random; all error steps are evaluated at once. Caps: 30 degrees, 10 pixels."""
    xp = _xp_of(ref)
    n = angles.shape[0]
    rng = np.random.default_rng(seed)
    axis = rng.integers(0, 3, n)
    N = pix.box
    ne = _ANGLE_ERRORS.size
    w = np.where(np.asarray(to_host(pix.shell))[None, :] >= 1, 0.5 / np.maximum(sigma2_rows, 1e-30), 0.0)
    if ctf is None:
        c = np.ones((n, pix.npix))
    else:
        c = to_host(ctf_from_frequencies(ctf, pix.kx / (N * pixel_size), pix.ky / (N * pixel_size), xp))
    A0 = euler_to_matrix(angles[:, 0], angles[:, 1], angles[:, 2])
    P0 = to_host(project_pixels(ref, xp.asarray(A0), pix.kx, pix.ky))  # (n, K)
    pert = np.repeat(angles[:, None, :], ne, axis=1).copy()
    pert[np.arange(n), :, axis] += _ANGLE_ERRORS[None, :]
    A1 = euler_to_matrix(pert[..., 0], pert[..., 1], pert[..., 2]).reshape(-1, 3, 3)
    P1 = to_host(project_pixels(ref, xp.asarray(A1), pix.kx, pix.ky)).reshape(n, ne, -1)
    d = ((c[:, None, :] ** 2) * np.abs(P1 - P0[:, None, :]) ** 2 * w[:, None, :]).sum(-1)
    acc_rot = _first_above(d, _ANGLE_ERRORS, 30.0)
    # translations: |C P|^2 |1 - e_t|^2
    sax = rng.integers(0, 2, n)
    kx = np.asarray(to_host(pix.kx))
    ky = np.asarray(to_host(pix.ky))
    k = np.where(sax[:, None] == 0, kx[None, :], ky[None, :])  # (n, K)
    ph = 2 * np.pi * _SHIFT_ERRORS[None, :, None] * k[:, None, :] / N
    dt = ((c**2 * np.abs(P0) ** 2 * w)[:, None, :] * (2.0 - 2.0 * np.cos(ph))).sum(-1)
    acc_trans_px = _first_above(dt, _SHIFT_ERRORS, 10.0)
    return float(acc_rot), float(acc_trans_px * pixel_size)


def _first_above(d: np.ndarray, steps: np.ndarray, cap: float) -> float:
    above = d > 4.60517
    first = np.where(above.any(axis=1), np.argmax(above, axis=1), -1)
    vals = np.where(first >= 0, steps[np.maximum(first, 0)], cap)
    return float(vals.mean())


def _xp_of(ref: FourierReference):
    from ..compute.backend import get_array_module  # noqa: PLC0415

    return get_array_module(ref.data)


# ----------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------


def data_table(ps: ParticleSet) -> pd.DataFrame:
    """The particles with the refined hidden variables in RELION's columns."""
    df = ps.table.particles.copy()
    df["rlnAngleRot"], df["rlnAngleTilt"], df["rlnAnglePsi"] = ps.angles[:, 0], ps.angles[:, 1], ps.angles[:, 2]
    df["rlnOriginXAngst"] = ps.offsets_px[:, 0] * ps.pixel_size
    df["rlnOriginYAngst"] = ps.offsets_px[:, 1] * ps.pixel_size
    for c in ("rlnOriginX", "rlnOriginY"):
        if c in df:
            del df[c]
    df["rlnClassNumber"] = ps.classes + 1
    df["rlnNormCorrection"] = ps.norm
    df["rlnLogLikeliContribution"] = ps.log_likelihood
    df["rlnMaxValueProbDistribution"] = ps.pmax
    df["rlnNrOfSignificantSamples"] = ps.nr_significant
    df["rlnRandomSubset"] = ps.subset
    return df


def write_data_star(path: Path, ps: ParticleSet) -> Path:
    df = data_table(ps)
    df["rlnImageName"] = image_names_for(ps.table, path).to_numpy()
    return write_particles(path, df, ps.table.optics)


def write_model_star(path: Path, general: dict, classes: pd.DataFrame, class_curves: list[pd.DataFrame],
                     sigma2: np.ndarray, scales: np.ndarray, group_names: list, pdf_orient: list[np.ndarray],
                     box: int, pixel_size: float) -> Path:
    blocks: dict = {"model_general": general, "model_classes": classes}
    for k, curve in enumerate(class_curves):
        blocks[f"model_class_{k + 1}"] = curve
    blocks["model_groups"] = pd.DataFrame({"rlnGroupNumber": np.arange(1, len(scales) + 1),
                                           "rlnGroupName": [str(g) for g in group_names],
                                           "rlnGroupScaleCorrection": scales})
    sh = np.arange(box // 2 + 1)
    for g in range(sigma2.shape[0]):
        blocks[f"model_optics_group_{g + 1}"] = pd.DataFrame({
            "rlnSpectralIndex": sh, "rlnResolution": sh / (box * pixel_size), "rlnSigma2Noise": sigma2[g]})
    for k, pdf in enumerate(pdf_orient):
        blocks[f"model_pdf_orient_class_{k + 1}"] = pd.DataFrame({"rlnOrientationDistribution": pdf})
    return write_star_blocks(path, blocks)


def write_classification_model(path: Path, ref_dim: int, reference_names: list[str], pdf_class: np.ndarray,
                               res_A: list[float], ssnr_all: list[np.ndarray], sigma2: np.ndarray, scales: np.ndarray,
                               pdf_orient: list[np.ndarray], ps: ParticleSet, pad: int, tau2_fudge: float,
                               current_size: int, sigma_offset_A: float,
                               prior_offsets_A: np.ndarray | None = None) -> Path:
    """run_itNNN_model.star of a 2D or 3D classification: general block, class table (reference, distribution,
    resolution and, for 2D, the class offset priors rlnClassPriorOffsetX/Y in Å), SSNR_MAP per class, noise
    spectra, group scales, orientation distributions."""
    N, apix = ps.box, ps.pixel_size
    general = {"rlnReferenceDimensionality": ref_dim, "rlnDataDimensionality": 2, "rlnOriginalImageSize": N,
               "rlnCurrentResolution": float(min(res_A)), "rlnCurrentImageSize": current_size,
               "rlnPaddingFactor": pad, "rlnPixelSize": apix, "rlnNrClasses": len(pdf_class), "rlnNrBodies": 1,
               "rlnNrGroups": len(scales), "rlnTau2FudgeFactor": tau2_fudge, "rlnSigmaOffsetsAngst": sigma_offset_A,
               "rlnLogLikelihood": float(ps.log_likelihood.sum()), "rlnAveragePmax": float(ps.pmax.mean())}
    classes = pd.DataFrame({"rlnReferenceImage": list(reference_names), "rlnClassDistribution": pdf_class,
                            "rlnEstimatedResolution": res_A})
    if prior_offsets_A is not None:
        classes["rlnClassPriorOffsetX"] = np.asarray(prior_offsets_A)[:, 0]
        classes["rlnClassPriorOffsetY"] = np.asarray(prior_offsets_A)[:, 1]
    sh = np.arange(N // 2 + 1)
    curves = [pd.DataFrame({"rlnSpectralIndex": sh, "rlnResolution": sh / (N * apix), "rlnSsnrMap": s[: sh.size]})
              for s in ssnr_all]
    return write_model_star(path, general, classes, curves, sigma2, scales, ps.scale_group_names, pdf_orient, N,
                            apix)


def reconstruct_classes(stack, tau2: list, tau2_fudge: float, class_weight: np.ndarray, old_refs,
                        sym_matrices: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """The classification M-step of the class maps: Hermitian pairing of every class, point-group symmetrisation
    (``sym_matrices``, 3D), SSNR_MAP per class and one batched MAP reconstruction with each class's tau2.
    Returns the new maps (K, N, ...) float64 (an empty class keeps ``old_refs[k]``, as RELION does) and the
    SSNR_MAP curves."""
    from ..compute.maximization import ssnr_map  # noqa: PLC0415

    stack.enforce_hermitian()
    ssnr_all = []
    for k, bp in enumerate(stack.members):  # K classes (symmetrisation and the SSNR are per class)
        if sym_matrices is not None and len(sym_matrices) > 1:
            bp.symmetrise(sym_matrices)
        ssnr_all.append(ssnr_map(bp, tau2[k], tau2_fudge))
    maps = to_host(stack.reconstruct(np.stack([to_host(t) for t in tau2]), tau2_fudge)).astype(np.float64)
    keep = (np.asarray(class_weight) > 0).reshape((-1,) + (1,) * (maps.ndim - 1))
    return np.where(keep, maps, np.asarray(old_refs, dtype=np.float64)), ssnr_all


def next_perturbation(previous: float, seed: int, iteration: int) -> float:
    """RELION's random perturbation of the sampling for this iteration, in [-0.5, 0.5): one generator per
    iteration (seed + 7919 x iteration), so a continued run draws what the uninterrupted run drew."""
    rng = np.random.default_rng(seed + 7919 * iteration)
    return float(((previous + rng.uniform(0.25, 0.5)) + 0.5) % 1.0 - 0.5)


def read_model_sigma2(path: Path) -> np.ndarray:
    blocks = read_star(path)
    names = sorted((k for k in blocks if k.startswith("model_optics_group_")), key=lambda s: int(s.rsplit("_", 1)[1]))
    if not names:
        raise InputError("no model_optics_group_N block with rlnSigma2Noise", path=str(path))
    return np.stack([np.asarray(pd.DataFrame(blocks[k])["rlnSigma2Noise"], float) for k in names])


def read_model_state(path: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    """Group scale corrections (G,) and the orientation distributions of each class from a model STAR, for
    --continue."""
    blocks = read_star(path)
    groups = blocks.get("model_groups")
    scales = np.asarray(pd.DataFrame(groups)["rlnGroupScaleCorrection"], float) if groups is not None else None
    names = sorted((k for k in blocks if k.startswith("model_pdf_orient_class_")),
                   key=lambda s: int(s.rsplit("_", 1)[1]))
    pdfs = [np.asarray(pd.DataFrame(blocks[k])["rlnOrientationDistribution"], float) for k in names]
    return scales, pdfs


def write_optimiser_star(path: Path, state: dict) -> Path:
    return write_star_blocks(path, {"optimiser_general": state})


def read_optimiser_star(path: Path) -> dict:
    blocks = read_star(path)
    if "optimiser_general" not in blocks:
        raise InputError("not an optimiser STAR file (no data_optimiser_general block)", path=str(path))
    blk = blocks["optimiser_general"]
    return dict(blk) if not isinstance(blk, pd.DataFrame) else blk.iloc[0].to_dict()


def params_to_optimiser(params, names) -> dict:
    """The job options ``names`` as rlnGpuRelionParam_<name> entries of an optimiser STAR (for --continue)."""
    out = {}
    for k in names:
        v = getattr(params, k)
        out[f"rlnGpuRelionParam_{k}"] = int(v) if isinstance(v, bool) else v
    return out


def params_from_optimiser(params_cls, opt: dict, **given):
    """A job's Params from the rlnGpuRelionParam_<name> entries of an optimiser STAR (types from the field
    defaults), with ``given`` on top (e.g. --continue, --cpu, --gpu, the output folder)."""
    kw = {}
    for f, fld in params_cls.__dataclass_fields__.items():
        key = f"rlnGpuRelionParam_{f}"
        if key not in opt or f in given:
            continue
        v, default = opt[key], fld.default
        if isinstance(default, bool):
            v = bool(int(v))
        elif isinstance(default, int):
            v = int(v)
        elif isinstance(default, float):
            v = float(v)
        else:
            v = str(v)
        kw[f] = v
    return params_cls(**kw, **given)


@dataclass
class ChangeMonitor:
    """RELION's hidden-variable change monitor: an iteration has no large changes when neither the mean
    angular change nor the rms offset change beats 1/1.03 of its smallest value so far (changes below
    0.4 x the fine sampling step count as small)."""

    smallest_angle: float = 999.0
    smallest_offset: float = 999.0
    history: list = field(default_factory=list)

    def update(self, dangle: float, doffset: float, fine_angle: float, fine_offset: float) -> bool:
        small_a = dangle / max(fine_angle, 1e-9) < 0.40
        small_o = doffset / max(fine_offset, 1e-9) < 0.40
        no_large = (small_a or 1.03 * dangle >= self.smallest_angle) and \
                   (small_o or 1.03 * doffset >= self.smallest_offset)
        self.smallest_angle = min(self.smallest_angle, dangle)
        self.smallest_offset = min(self.smallest_offset, doffset)
        self.history.append((dangle, doffset))
        return bool(no_large)

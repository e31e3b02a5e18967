"""RELION's estimates of the accuracy of rotations and translations (MlOptimiser::calculateExpectedAngularErrors):
how far a particle's projection must be rotated or shifted before its weighted squared difference to the
unperturbed one exceeds ln(100), i.e. before the two would differ at P = 0.01. Auto-refine's sampling schedule
(compute/schedule.py, updateAngularSampling) is driven by these numbers.

RELION's rules, as implemented here:
* particles: the first 100 (at most the number of particles) of RELION's once-per-run random order
  (Experiment::randomiseParticlesOrder): half 1 shuffled, then half 2 shuffled, each stably sorted by optics
  group; all are compared against half 1's reference and noise spectra (the first follower does it);
* image size: this iteration's current size (all shells 1 .. size/2 of the unique half grid, DC excluded);
* weight of a pixel: CTF^2 / (2 sigma2(shell)) of the particle's optics group;
* per particle, one uniform number u chooses the perturbed angle (rot if u < 0.3333, tilt if u < 0.6667, else
  psi) and shift (x if u < 0.5, else y): RELION re-seeds its generator per particle before each draw, so the
  choice is the same at every step and both modes share it;
* errors grow on RELION's ladder (angles: steps of 0.05° below 0.2°, 0.1° below 1°, 0.2° below 2°, 0.5° below
  5°, 1° below 10°, 2° below 20°, then 5°; shifts: 0.1 px below 1, 0.2 below 2, 0.5 below 5, 1 below 10, then
  2), summed in floating point as RELION does (0.05 x 4 then 0.1 steps give 0.3, ..., 1.0, 1.1, 1.3, ... 2.1,
  2.6, ...); the first error whose difference exceeds ln(100) counts, and a particle that never gets there
  by 30° (10 px) counts the first value past the cap (30.1°, 10.1 px);
* the results are the means over the particles (translations in Å).
"""

from __future__ import annotations

import numpy as np

from .backend import get_array_module, to_host
from .ctf import CtfParams, ctf_from_frequencies
from .expectation import PixelSet
from .geometry import euler_to_matrix
from .projector import FourierReference, project_pixels

#: ln(100): the difference at which a perturbation counts as resolved (RELION's pvalue 4.60517).
LN100 = 4.60517
#: RELION's caps: 30 degrees, 10 pixels.
ANGLE_CAP = 30.0
SHIFT_CAP = 10.0
#: How many particles RELION uses for 3D references and 2D images.
N_TRIALS = 100


def _angle_step(error: float) -> float:
    """RELION's increment of the angular error at the current error (degrees)."""
    for below, step in ((0.2, 0.05), (1.0, 0.1), (2.0, 0.2), (5.0, 0.5), (10.0, 1.0), (20.0, 2.0)):
        if error < below:
            return step
    return 5.0


def _shift_step(error: float) -> float:
    """RELION's increment of the translational error at the current error (pixels)."""
    for below, step in ((1.0, 0.1), (2.0, 0.2), (5.0, 0.5), (10.0, 1.0)):
        if error < below:
            return step
    return 2.0


def error_ladder(step_rule, cap: float) -> tuple[np.ndarray, float]:
    """(errors tried, value counted when none resolves): the running sum of ``step_rule`` increments (in
    float64, as RELION accumulates them) up to ``cap``, and the first sum beyond it."""
    tried, e = [], 0.0
    while True:
        e += step_rule(e)
        if e > cap:
            return np.array(tried), e
        tried.append(e)


ANGLE_ERRORS, ANGLE_UNRESOLVED = error_ladder(_angle_step, ANGLE_CAP)
SHIFT_ERRORS, SHIFT_UNRESOLVED = error_ladder(_shift_step, SHIFT_CAP)


def accuracy_particles(subset: np.ndarray, optics_group: np.ndarray, seed: int, n: int = N_TRIALS) -> np.ndarray:
    """Rows of the particles RELION's accuracy estimate uses: the first ``n`` (at most all) of half 1 in random
    order then half 2 in random order, each stably sorted by optics group (randomiseParticlesOrder); fixed for
    the run by ``seed``. ``subset`` (particles,) holds 1 or 2."""
    rng = np.random.default_rng(seed)
    subset, optics_group = np.asarray(subset), np.asarray(optics_group)
    order = []
    for h in (1, 2):
        rows = rng.permutation(np.flatnonzero(subset == h))
        order.append(rows[np.argsort(optics_group[rows], kind="stable")])
    return np.concatenate(order)[:min(n, subset.size)]


def perturbation_draws(particle_ids: np.ndarray, seed: int) -> np.ndarray:
    """One uniform number in [0, 1) per particle, from a generator seeded with seed + particle id (RELION
    re-seeds with random_seed + part_id): it picks the perturbed angle and shift (module docstring)."""
    return np.array([np.random.default_rng(seed + int(i)).random() for i in np.asarray(particle_ids)])


def estimate_accuracy(ref: FourierReference, pix: PixelSet, angles: np.ndarray, ctf: CtfParams | None,
                      sigma2_rows: np.ndarray, pixel_size: float, seed: int = 0,
                      particle_ids: np.ndarray | None = None, max_values: int = 1 << 22) -> tuple[float, float]:
    """Mean angular (degrees) and translational (Å) error at which the weighted squared difference between
    each particle's projection and a perturbed one first exceeds ln(100) (module docstring for the rules).
    ``angles`` (n, 3) rot, tilt, psi of the particles (degrees); ``pix`` the pixels of the current image size;
    ``sigma2_rows`` (n, pixels) the noise of each particle at ``pix``; ``particle_ids`` (n,) seed the choice of
    perturbed angle and shift (default 0 .. n-1). Works in chunks of at most ``max_values`` projected values."""
    xp = get_array_module(ref.data)
    angles = np.asarray(angles, np.float64).reshape(-1, 3)
    n = angles.shape[0]
    ids = np.arange(n) if particle_ids is None else np.asarray(particle_ids)
    u = perturbation_draws(ids, seed)
    rot_axis = np.where(u < 0.3333, 0, np.where(u < 0.6667, 1, 2))
    shift_axis = np.where(u < 0.5, 0, 1)
    N, K, ne = pix.box, pix.npix, ANGLE_ERRORS.size
    shell = xp.asarray(pix.shell)
    w = xp.where(shell[None, :] >= 1, 0.5 / xp.maximum(xp.asarray(sigma2_rows, np.float64), 1e-30), 0.0)
    if ctf is None:
        c2 = xp.ones((n, K))
    else:
        c = ctf_from_frequencies(ctf, pix.kx / (N * pixel_size), pix.ky / (N * pixel_size), xp)
        c2 = xp.asarray(c, np.float64) ** 2
    wc = w * c2  # (n, K)
    kx, ky = xp.asarray(pix.kx, np.float64), xp.asarray(pix.ky, np.float64)
    rows_per_chunk = max(1, max_values // max(1, (ne + 1) * K))
    d_rot = np.empty((n, ne))
    d_shift = np.empty((n, SHIFT_ERRORS.size))
    for i0 in range(0, n, rows_per_chunk):
        sl = slice(i0, min(n, i0 + rows_per_chunk))
        m = sl.stop - sl.start
        a0 = angles[sl]
        P0 = project_pixels(ref, xp.asarray(euler_to_matrix(*a0.T)), pix.kx, pix.ky).astype(np.complex128)
        pert = np.repeat(a0[:, None, :], ne, axis=1)
        pert[np.arange(m), :, rot_axis[sl]] += ANGLE_ERRORS[None, :]
        A1 = euler_to_matrix(pert[..., 0], pert[..., 1], pert[..., 2]).reshape(-1, 3, 3)
        P1 = project_pixels(ref, xp.asarray(A1), pix.kx, pix.ky).reshape(m, ne, K)
        diff2 = xp.abs(P1.astype(np.complex128) - P0[:, None, :]) ** 2
        d_rot[sl] = to_host((diff2 * wc[sl][:, None, :]).sum(-1))
        # a shift by t multiplies the projection by exp(-2 pi i k t / N): |P0|^2 |1 - e|^2 = |P0|^2 (2 - 2 cos)
        k = xp.where(xp.asarray(shift_axis[sl])[:, None] == 0, kx[None, :], ky[None, :])  # (m, K)
        phase = (2.0 * np.pi / N) * xp.asarray(SHIFT_ERRORS)[None, :, None] * k[:, None, :]
        d_shift[sl] = to_host(((xp.abs(P0) ** 2 * wc[sl])[:, None, :] * (2.0 - 2.0 * xp.cos(phase))).sum(-1))
    acc_rot = _first_resolved(d_rot, ANGLE_ERRORS, ANGLE_UNRESOLVED)
    acc_trans_px = _first_resolved(d_shift, SHIFT_ERRORS, SHIFT_UNRESOLVED)
    return float(acc_rot), float(acc_trans_px * pixel_size)


def _first_resolved(d: np.ndarray, steps: np.ndarray, unresolved: float) -> float:
    """Mean over particles of the first error whose difference exceeds ln(100) (``unresolved`` where none
    does)."""
    above = d > LN100
    first = np.argmax(above, axis=1)
    vals = np.where(above.any(axis=1), steps[first], unresolved)
    return float(vals.mean())

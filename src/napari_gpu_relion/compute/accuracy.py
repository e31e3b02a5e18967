"""RELION's estimates of the accuracy of rotations and translations (calculateExpectedAngularErrors): how far a
projection must be rotated or shifted before its weighted squared difference to the unperturbed one exceeds
ln(100). Auto-refine uses them to decide how fine the sampling needs to be."""

from __future__ import annotations

import numpy as np

from .backend import get_array_module, to_host
from .ctf import CtfParams, ctf_from_frequencies
from .expectation import PixelSet
from .geometry import euler_to_matrix
from .projector import FourierReference, project_pixels

#: Rotation errors tried (degrees) and translation errors tried (pixels), RELION's steps and caps.
ANGLE_ERRORS = np.concatenate([np.arange(0.05, 1.0, 0.05), np.arange(1.0, 5.0, 0.25), np.arange(5.0, 30.01, 1.0)])
SHIFT_ERRORS = np.concatenate([np.arange(0.05, 1.0, 0.05), np.arange(1.0, 10.01, 0.25)])
#: ln(100): the difference at which a perturbation counts as resolved.
LN100 = 4.60517


def estimate_accuracy(ref: FourierReference, pix: PixelSet, angles: np.ndarray, ctf: CtfParams | None,
                      sigma2_rows: np.ndarray, pixel_size: float, seed: int = 0) -> tuple[float, float]:
    """Mean angular (degrees) and translational (Å) error at which the weighted squared difference between
    a particle's projection and a perturbed one first exceeds ln(100), for the given particles (RELION uses
    the first 100). ``angles`` (n, 3) rot, tilt, psi; ``sigma2_rows`` (n, pixels) the noise of each particle at
    ``pix``. Each particle is perturbed along one of rot/tilt/psi (x or y for shifts) chosen at random; all
    error steps are evaluated at once. Caps: 30 degrees, 10 pixels."""
    xp = get_array_module(ref.data)
    n = angles.shape[0]
    rng = np.random.default_rng(seed)
    axis = rng.integers(0, 3, n)
    N = pix.box
    ne = ANGLE_ERRORS.size
    w = np.where(np.asarray(to_host(pix.shell))[None, :] >= 1, 0.5 / np.maximum(sigma2_rows, 1e-30), 0.0)
    if ctf is None:
        c = np.ones((n, pix.npix))
    else:
        c = to_host(ctf_from_frequencies(ctf, pix.kx / (N * pixel_size), pix.ky / (N * pixel_size), xp))
    A0 = euler_to_matrix(angles[:, 0], angles[:, 1], angles[:, 2])
    P0 = to_host(project_pixels(ref, xp.asarray(A0), pix.kx, pix.ky))  # (n, K)
    pert = np.repeat(angles[:, None, :], ne, axis=1).copy()
    pert[np.arange(n), :, axis] += ANGLE_ERRORS[None, :]
    A1 = euler_to_matrix(pert[..., 0], pert[..., 1], pert[..., 2]).reshape(-1, 3, 3)
    P1 = to_host(project_pixels(ref, xp.asarray(A1), pix.kx, pix.ky)).reshape(n, ne, -1)
    d = ((c[:, None, :] ** 2) * np.abs(P1 - P0[:, None, :]) ** 2 * w[:, None, :]).sum(-1)
    acc_rot = _first_above(d, ANGLE_ERRORS, 30.0)
    # translations: |C P|^2 |1 - e_t|^2
    sax = rng.integers(0, 2, n)
    kx = np.asarray(to_host(pix.kx))
    ky = np.asarray(to_host(pix.ky))
    k = np.where(sax[:, None] == 0, kx[None, :], ky[None, :])  # (n, K)
    ph = 2 * np.pi * SHIFT_ERRORS[None, :, None] * k[:, None, :] / N
    dt = ((c**2 * np.abs(P0) ** 2 * w)[:, None, :] * (2.0 - 2.0 * np.cos(ph))).sum(-1)
    acc_trans_px = _first_above(dt, SHIFT_ERRORS, 10.0)
    return float(acc_rot), float(acc_trans_px * pixel_size)


def _first_above(d: np.ndarray, steps: np.ndarray, cap: float) -> float:
    """Mean over particles of the first step whose difference exceeds ln(100) (``cap`` where none does)."""
    above = d > LN100
    first = np.where(above.any(axis=1), np.argmax(above, axis=1), -1)
    vals = np.where(first >= 0, steps[np.maximum(first, 0)], cap)
    return float(vals.mean())

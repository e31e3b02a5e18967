"""Picking references from a map or an image stack (pure array functions, NumPy in and out): projections of a
3D reference, Fourier rescaling to the micrograph pixel size, the particle disc radius and the in-plane angles.

Units: pixel sizes and diameters in Å, radii and box edges in pixels, angles in degrees.
"""

from __future__ import annotations

import numpy as np

from .fourier import fourier_resize, irfft_centered, round_half_away
from .geometry import euler_to_matrix
from .projector import prepare_reference, project


def projection_radius(size: int, pixel_size: float, lowpass_A: float) -> float:
    """Fourier radius (pixels of a ``size`` box at ``pixel_size`` Å/px) of a low-pass at ``lowpass_A`` Å, at most
    Nyquist (size / 2); ``lowpass_A`` <= 0 means no low-pass."""
    return size / 2 if lowpass_A <= 0 else min(size / 2, size * pixel_size / lowpass_A)


def project_map(volume: np.ndarray, rot: np.ndarray, tilt: np.ndarray, pixel_size: float, lowpass_A: float,
                pad: int = 2) -> np.ndarray:
    """Projections (K, s, s) float32 of a cubic map (s, s, s) along the directions ``rot``, ``tilt`` (degrees,
    RELION's Euler convention, psi 0), by central slices of its ``pad``-times padded Fourier transform,
    band-limited at ``lowpass_A`` Å (``pixel_size``: Å/px of the map; ``lowpass_A`` <= 0: Nyquist). The
    projection is the line integral in voxels (sum along the beam), as RELION's reference projections."""
    s = volume.shape[-1]
    rot = np.asarray(rot, np.float64)
    tilt = np.asarray(tilt, np.float64)
    A = euler_to_matrix(rot, tilt, np.zeros_like(rot))
    r_max = projection_radius(s, pixel_size, lowpass_A)
    F = project(prepare_reference(np.asarray(volume, np.float64), pad, r_max), A)
    return irfft_centered(F, s, 2).astype(np.float32)


def rescaled_size(size: int, pixel_size: float, new_pixel_size: float) -> int:
    """Even box edge (pixels) that keeps the field of view of a ``size`` box at ``pixel_size`` Å/px at
    ``new_pixel_size`` Å/px: 2 ROUND(size/2 x pixel_size / new_pixel_size) (RELION's rounding, half away)."""
    return int(2 * round_half_away(np.float64(size / 2 * pixel_size / new_pixel_size)))


def rescale_images(images: np.ndarray, pixel_size: float, new_pixel_size: float) -> np.ndarray:
    """Square images (..., s, s) at ``pixel_size`` Å/px resampled to ``new_pixel_size`` Å/px by Fourier cropping
    or zero-padding in float64 (edge :func:`rescaled_size`); float32 out."""
    new = rescaled_size(images.shape[-1], pixel_size, new_pixel_size)
    return fourier_resize(np.asarray(images, np.float64), new, 2).astype(np.float32)


def disc_radius(diameter_A: float, pixel_size: float, shrink_px: int = 0) -> int:
    """Radius (pixels) of the particle disc: ROUND(diameter / (2 pixel_size)) - ``shrink_px`` (RELION's rounding,
    half away from zero); ``diameter_A`` in Å, ``pixel_size`` in Å/px."""
    return int(round_half_away(np.float64(diameter_A / (2 * pixel_size)))) - int(shrink_px)


def psi_angles(step_deg: float) -> np.ndarray:
    """In-plane angles (degrees) [0, 360) in equal steps of about ``step_deg`` degrees: 360 / ROUND(360 / step)
    (a whole number of steps around the circle)."""
    psi_step = 360.0 / float(round_half_away(np.float64(360.0 / step_deg)))
    return np.arange(int(round(360.0 / psi_step))) * psi_step

"""Angular distribution of particle viewing directions on an equal-area grid.

RELION's Euler angles are ZYZ (rot, tilt, psi) in degrees. The viewing (projection) direction of a particle
depends on rot and tilt only: the unit vector (cos rot sin tilt, sin rot sin tilt, cos tilt), i.e. rot is its
azimuth and tilt its polar angle (tilt 0 looks down +z). Psi is an in-plane rotation and does not move the
direction.

The histogram bins are equal in azimuth (rot) and in cos(tilt): by Archimedes' hat-box theorem every bin then
covers the same solid angle (4π / (n_rot * n_tilt) sr), so directions drawn uniformly on the sphere give a
flat histogram. Angles outside the usual ranges (tilt < 0 or > 180°, any rot) are folded onto the same
direction: (rot, -tilt) counts as (rot + 180°, tilt).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["AngularHistogram", "angular_histogram", "fold_angles"]


@dataclass(frozen=True)
class AngularHistogram:
    """Counts (n_tilt, n_rot): row i holds tilt in [tilt_edges[i], tilt_edges[i + 1]) degrees, column j holds
    rot in [rot_edges[j], rot_edges[j + 1]) degrees. ``cos_edges`` = cos(tilt_edges) (decreasing, 1 to -1) are
    equally spaced; ``solid_angle`` is the solid angle of one bin (sr)."""

    counts: np.ndarray
    rot_edges: np.ndarray
    tilt_edges: np.ndarray
    cos_edges: np.ndarray
    solid_angle: float


def fold_angles(rot: np.ndarray, tilt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rot, tilt) in degrees -> the same viewing directions with rot in [-180, 180) and tilt in [0, 180].

    A tilt beyond 180° (or below 0°) is mirrored, 360° - tilt, with rot turned by 180°: both give the same
    direction (cos rot sin tilt, sin rot sin tilt, cos tilt). At the poles rot is kept as given.
    """
    rot = np.asarray(rot, dtype=np.float64).ravel()
    t = np.mod(np.asarray(tilt, dtype=np.float64).ravel(), 360.0)
    flip = t > 180.0
    t = np.where(flip, 360.0 - t, t)
    r = np.mod(rot + np.where(flip, 180.0, 0.0) + 180.0, 360.0) - 180.0
    return r, t


def _edges(n_rot: int, n_tilt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rot edges over [-180, 180] deg, cos(tilt) edges from 1 to -1, tilt edges over [0, 180] deg)."""
    rot_edges = np.linspace(-180.0, 180.0, n_rot + 1)
    cos_edges = np.linspace(1.0, -1.0, n_tilt + 1)
    tilt_edges = np.rad2deg(np.arccos(cos_edges))
    return rot_edges, cos_edges, tilt_edges


def _bin_index(value: np.ndarray, start: float, width: float, n: int) -> np.ndarray:
    """floor((value - start) / width) clipped to 0..n-1 (the closing edge belongs to the last bin)."""
    return np.clip(np.floor((value - start) / width).astype(np.int64), 0, n - 1)


def angular_histogram(rot: np.ndarray, tilt: np.ndarray, weights: np.ndarray | None = None, *,
                      n_rot: int = 36, n_tilt: int = 18) -> AngularHistogram:
    """Histogram of viewing directions on an equal-area grid (see the module docstring).

    ``rot`` and ``tilt`` in degrees (RELION ZYZ convention), one per particle; ``weights`` (optional, one per
    particle) are summed instead of counting 1 per particle. Returns float64 counts of shape (n_tilt, n_rot)
    with their bin edges in degrees; ``counts.sum()`` equals the number of particles (or the weight sum).
    """
    if n_rot < 1 or n_tilt < 1:
        raise ValueError(f"need at least one bin per axis, got n_rot={n_rot}, n_tilt={n_tilt}")
    rot = np.asarray(rot, dtype=np.float64).ravel()
    tilt = np.asarray(tilt, dtype=np.float64).ravel()
    if rot.shape != tilt.shape:
        raise ValueError(f"rot and tilt have different lengths ({rot.size} and {tilt.size})")
    w = np.ones_like(rot) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if w.shape != rot.shape:
        raise ValueError(f"weights have {w.size} values but there are {rot.size} angles")
    if not (np.all(np.isfinite(rot)) and np.all(np.isfinite(tilt)) and np.all(np.isfinite(w))):
        raise ValueError("angles and weights must be finite")
    azimuth, polar = fold_angles(rot, tilt)
    cos_t = np.cos(np.deg2rad(polar))
    col = _bin_index(azimuth, -180.0, 360.0 / n_rot, n_rot)
    row = _bin_index(1.0 - cos_t, 0.0, 2.0 / n_tilt, n_tilt)
    counts = np.bincount(row * n_rot + col, weights=w, minlength=n_rot * n_tilt).reshape(n_tilt, n_rot)
    rot_edges, cos_edges, tilt_edges = _edges(n_rot, n_tilt)
    return AngularHistogram(counts, rot_edges, tilt_edges, cos_edges, 4.0 * np.pi / (n_rot * n_tilt))

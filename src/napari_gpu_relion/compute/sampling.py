"""Orientation and translation sampling in RELION's scheme: HEALPix directions, psi, offsets, local searches.

Directions come from the HEALPix grid in the NESTED scheme (Górski et al. 2005, ApJ 622, 759):
``Nside = 2^order``, ``Npix = 12·4^order`` equal-area pixels; a pixel centre gives the viewing direction
``rot = φ``, ``tilt = θ`` (degrees; rot wrapped to [−180, 180]). The coarse angular step is
``360/(6·2^order)`` degrees, used for psi as well. Translations are a disc (2D) or ball (3D) of grid points.
All functions take and return NumPy arrays; nothing here reads files. Angles in degrees unless a name
says radians; translations in pixels.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..errors import InputError
from .backend import get_array_module
from .geometry import (
    _canonical_name,
    euler_to_matrix,
    symmetry_group,
    view_direction,
)

__all__ = [
    "GivenOrientations",
    "InPlaneSampling",
    "LocalSearch",
    "Sampling",
    "angular_step",
    "asymmetric_unit_pixels",
    "direction_grid",
    "healpix_directions",
    "healpix_max_pixrad_deg",
    "healpix_nest2ring",
    "healpix_nest2xyf",
    "healpix_pix2ang_nest",
    "healpix_pix2ang_ring",
    "healpix_xyf2nest",
    "local_search",
    "orientation_grid",
    "oversampled_directions",
    "oversampled_psi",
    "oversampled_translations",
    "psi_angles",
    "psi_angles_for_order",
    "translation_grid",
]

MAX_ORDER = 13  # Npix = 805 M at order 13; RELION itself stops well before this

# Base-pixel layout (Górski et al. 2005, fig. 4): ring number of each face's southern vertex in units of
# Nside (2: north faces, 3: equatorial, 4: south) and the longitude of its centre in units of π/4.
_FACE_RING = np.array([2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4], dtype=np.int64)
_FACE_LON = np.array([1, 3, 5, 7, 0, 2, 4, 6, 1, 3, 5, 7], dtype=np.int64)


# ---------------------------------------------------------------------------------------------------------
# HEALPix
# ---------------------------------------------------------------------------------------------------------

def _check_order(order: int) -> int:
    o = int(order)
    if o != order or not 0 <= o <= MAX_ORDER:
        raise InputError(f"HEALPix order must be an integer in 0..{MAX_ORDER}; got {order!r}")
    return o


def _pixels(order: int, pix) -> np.ndarray:
    npix = 12 * 4**order
    if pix is None:
        return np.arange(npix, dtype=np.int64)
    p = np.asarray(pix, dtype=np.int64)
    if p.size and (p.min() < 0 or p.max() >= npix):
        raise InputError(f"HEALPix pixel index out of range 0..{npix - 1} for order {order}")
    return p


def _compact_bits(v: np.ndarray, nbits: int) -> np.ndarray:
    """Bits 0, 2, 4, … of ``v`` packed into bits 0, 1, 2, …"""
    out = np.zeros_like(v)
    for b in range(nbits):
        out |= ((v >> (2 * b)) & 1) << b
    return out


def _spread_bits(v: np.ndarray, nbits: int) -> np.ndarray:
    """Bits 0, 1, 2, … of ``v`` spread to bits 0, 2, 4, …"""
    out = np.zeros_like(v)
    for b in range(nbits):
        out |= ((v >> b) & 1) << (2 * b)
    return out


def healpix_nest2xyf(order: int, pix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NESTED pixel index -> (face 0..11, ix, iy) with 0 ≤ ix, iy < Nside (x in the even index bits)."""
    order = _check_order(order)
    p = _pixels(order, pix)
    face = p >> (2 * order)
    ipf = p & ((1 << (2 * order)) - 1)
    return face, _compact_bits(ipf, order), _compact_bits(ipf >> 1, order)


def healpix_xyf2nest(order: int, face, ix, iy) -> np.ndarray:
    """(face, ix, iy) -> NESTED pixel index (inverse of :func:`healpix_nest2xyf`)."""
    order = _check_order(order)
    f, x, y = (np.asarray(a, dtype=np.int64) for a in (face, ix, iy))
    return (f << (2 * order)) | _spread_bits(x, order) | (_spread_bits(y, order) << 1)


def _face_xy_to_theta_phi(face, x, y, nside: int) -> tuple[np.ndarray, np.ndarray]:
    """Continuous face coordinates (0 ≤ x, y ≤ Nside; pixel centres at ix + ½) -> (θ, φ) in radians.

    The ring coordinate is ``r = Nside·face_ring − x − y`` (ring number at pixel centres). Equatorial belt
    (Nside ≤ r ≤ 3 Nside): ``z = (2/3)(2 − r/Nside)``, ``φ = (π/4)(face_lon + (x − y)/Nside)``. Polar caps
    (``k = r`` or ``4 Nside − r`` < Nside): ``1 − |z| = k²/(3 Nside²)``, ``φ = (π/4)(face_lon + (x − y)/k)``.
    The map has constant Jacobian 4π/Npix, which makes the pixels equal-area.
    """
    face = np.asarray(face, dtype=np.int64)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = float(nside)
    r = _FACE_RING[face] * n - x - y
    lon = _FACE_LON[face].astype(np.float64)
    north = r < n
    south = r > 3 * n
    k = np.where(north, r, np.where(south, 4 * n - r, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = 0.25 * np.pi * (lon + (x - y) / k)
    phi = np.where(k > 0, phi, 0.0)                                   # the poles themselves: φ undefined
    # θ: in the caps use sin(θ/2) = k/(√6 Nside) (accurate near the poles); in the belt θ = acos(z).
    cap_theta = 2.0 * np.arcsin(np.clip(k / (np.sqrt(6.0) * n), 0.0, 1.0))
    z_belt = (2.0 / 3.0) * (2.0 - r / n)
    theta = np.where(north, cap_theta,
                     np.where(south, np.pi - cap_theta, np.arccos(np.clip(z_belt, -1.0, 1.0))))
    return theta, np.mod(phi, 2.0 * np.pi)


def healpix_pix2ang_nest(order: int, pix=None) -> tuple[np.ndarray, np.ndarray]:
    """Centres ``(θ, φ)`` in radians of NESTED pixels at ``order`` (all ``12·4^order`` when ``pix`` is None).

    θ ∈ [0, π] is the colatitude (z = cos θ), φ ∈ [0, 2π). Vectorised: bit de-interleaving to
    (face, ix, iy), then the face geometry of :func:`_face_xy_to_theta_phi`.
    """
    order = _check_order(order)
    face, ix, iy = healpix_nest2xyf(order, pix)
    return _face_xy_to_theta_phi(face, ix + 0.5, iy + 0.5, 1 << order)


def healpix_nest2ring(order: int, pix=None) -> np.ndarray:
    """NESTED -> RING pixel index at ``order`` (all pixels when ``pix`` is None)."""
    order = _check_order(order)
    nside = 1 << order
    npix = 12 * nside * nside
    ncap = 2 * nside * (nside - 1)
    face, ix, iy = healpix_nest2xyf(order, pix)
    jr = _FACE_RING[face] * nside - ix - iy - 1                      # ring number 1 .. 4 Nside − 1
    north = jr < nside
    south = jr > 3 * nside
    k = np.where(north, jr, np.where(south, 4 * nside - jr, nside))  # pixels per ring / 4
    before = np.where(north, 2 * k * (k - 1),
                      np.where(south, npix - 2 * k * (k + 1), ncap + (jr - nside) * 4 * nside))
    shift = np.where(north | south, 0, (jr - nside) & 1)
    jp = (_FACE_LON[face] * k + ix - iy + 1 + shift) // 2            # 1-based position in the ring
    jp = np.where(jp > 4 * k, jp - 4 * k, np.where(jp < 1, jp + 4 * k, jp))
    return before + jp - 1


def healpix_pix2ang_ring(order: int, pix=None) -> tuple[np.ndarray, np.ndarray]:
    """Centres ``(θ, φ)`` in radians of RING-scheme pixels (the ring-by-ring formulas of Górski et al.).

    An independent route to the same grid, used to check :func:`healpix_pix2ang_nest`. Ring pixels are
    numbered from φ = 0 (rings with (i − Nside) odd) or φ = half a pixel (the other rings), as in the
    HEALPix library.
    """
    order = _check_order(order)
    nside = 1 << order
    npix = 12 * nside * nside
    ncap = 2 * nside * (nside - 1)
    p = _pixels(order, pix)
    n = float(nside)

    def cap_ring(q):  # ring i (1-based) holding 0-based in-cap index q: 2 i (i − 1) ≤ q < 2 i (i + 1)
        i = np.floor(0.5 * (1.0 + np.sqrt(1.0 + 2.0 * q))).astype(np.int64)
        i = np.where(2 * i * (i - 1) > q, i - 1, i)
        return np.where(2 * i * (i + 1) <= q, i + 1, i)

    north = p < ncap
    south = p >= npix - ncap
    # North cap.
    i_n = cap_ring(np.where(north, p, 0))
    j_n = np.where(north, p, 0) - 2 * i_n * (i_n - 1) + 1
    # South cap (count from the last pixel backwards).
    q_s = np.where(south, npix - 1 - p, 0)
    i_s = cap_ring(q_s)
    j_s = 4 * i_s - (q_s - 2 * i_s * (i_s - 1))
    # Equatorial belt.
    q_e = np.where(north | south, 0, p - ncap)
    i_e = q_e // (4 * nside) + nside
    j_e = q_e % (4 * nside) + 1
    half = ((i_e - nside) % 2 == 0)                              # rings with (i − Nside) even start at φ = ½ step
    z = np.where(north, 1.0 - i_n**2 / (3.0 * n * n),
                 np.where(south, -1.0 + i_s**2 / (3.0 * n * n), 4.0 / 3.0 - 2.0 * i_e / (3.0 * n)))
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = np.where(north, 0.5 * np.pi / i_n * (j_n - 0.5),
                       np.where(south, 0.5 * np.pi / i_s * (j_s - 0.5),
                                0.5 * np.pi / n * (j_e - np.where(half, 0.5, 1.0))))
    return np.arccos(np.clip(z, -1.0, 1.0)), np.mod(phi, 2.0 * np.pi)


def healpix_max_pixrad_deg(order: int) -> float:
    """Largest angular distance (degrees) between a pixel centre and one of its four corners at ``order``."""
    order = _check_order(order)
    nside = 1 << order
    face, ix, iy = healpix_nest2xyf(order, None)
    tc, pc = _face_xy_to_theta_phi(face, ix + 0.5, iy + 0.5, nside)
    c = np.stack([np.sin(tc) * np.cos(pc), np.sin(tc) * np.sin(pc), np.cos(tc)], -1)
    best = 0.0
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        t, p = _face_xy_to_theta_phi(face, ix + dx, iy + dy, nside)
        v = np.stack([np.sin(t) * np.cos(p), np.sin(t) * np.sin(p), np.cos(t)], -1)
        cross = np.linalg.norm(np.cross(c, v), axis=-1)
        best = max(best, float(np.arctan2(cross, np.einsum("ij,ij->i", c, v)).max()))
    return float(np.rad2deg(best))


def _angles_from_theta_phi(theta, phi) -> tuple[np.ndarray, np.ndarray]:
    rot = np.rad2deg(phi)
    rot = np.where(rot > 180.0, rot - 360.0, rot)
    return rot, np.rad2deg(theta)


def healpix_directions(order: int, pix=None) -> tuple[np.ndarray, np.ndarray]:
    """RELION directions ``(rot, tilt)`` in degrees of NESTED pixels: rot = φ wrapped to [−180, 180],
    tilt = acos(z) ∈ [0, 180]."""
    return _angles_from_theta_phi(*healpix_pix2ang_nest(order, pix))


# ---------------------------------------------------------------------------------------------------------
# Steps, psi and translations
# ---------------------------------------------------------------------------------------------------------

def angular_step(order: int) -> float:
    """RELION's angular sampling at a HEALPix order, ``360/(6·2^order)`` degrees (order 2: 15°)."""
    return 360.0 / (6 * 2 ** _check_order(order))


def psi_angles(step_deg: float, multiple_of: int = 1) -> np.ndarray:
    """In-plane angles ``psi_i = i·360/nr_psi`` (degrees) with ``nr_psi = ceil(360/step)``.

    ``multiple_of`` rounds nr_psi up to a multiple (RELION's accelerated 2D classification uses 32).
    """
    if not step_deg > 0:
        raise InputError(f"psi step must be positive (degrees); got {step_deg!r}")
    nr = int(np.ceil(360.0 / step_deg - 1e-9))
    m = max(1, int(multiple_of))
    nr = -(-nr // m) * m
    return np.arange(nr, dtype=np.float64) * (360.0 / nr)


def psi_angles_for_order(order: int) -> np.ndarray:
    """Coarse psi angles for 3D at a HEALPix order: step = :func:`angular_step` (``6·2^order`` values)."""
    return psi_angles(angular_step(order))


def translation_grid(range_px: float, step_px: float, ndim: int = 2) -> np.ndarray:
    """Coarse translations ``(T, ndim)`` in pixels (columns x, y[, z]); RELION's order, x slowest.

    Points ``i·step`` with ``|i| ≤ ceil(range/step)`` per axis, kept where ``x² + y² < range² + 0.001``
    (2D disc) or ``x² + y² + z² ≤ range²`` (3D ball). 5/2 px -> 21, 6/2 -> 29, 8/2 -> 49, 10/2 -> 81.
    """
    if ndim not in (2, 3):
        raise InputError(f"translation grid: ndim must be 2 or 3; got {ndim!r}")
    if not step_px > 0 or range_px < 0:
        raise InputError(f"translation grid: need step > 0 and range ≥ 0 (pixels); got {step_px!r}, {range_px!r}")
    m = int(np.ceil(range_px / step_px))
    ax = np.arange(-m, m + 1, dtype=np.float64) * step_px
    g = np.stack(np.meshgrid(*([ax] * ndim), indexing="ij"), axis=-1).reshape(-1, ndim)
    r2 = np.sum(g * g, axis=1)
    keep = r2 < range_px**2 + 0.001 if ndim == 2 else r2 <= range_px**2
    return g[keep]


#: The finest coarse HEALPix order a job takes: RELION's finest angular sampling, 0.1° (its job options offer
#: 30° ... 0.1°, HEALPix orders 1 to 9: pipeline_jobs.h job_sampling_options, JobOption::getHealPixOrder), the
#: fine step being half of it. relion_refine's HEALPix library itself stops at order 13 (healpix_base.h order_max).
RELION_MAX_HEALPIX_ORDER = 9


def check_healpix_order(order, flag: str = "--healpix_order") -> None:
    """InputError unless ``order`` is a HEALPix order a job can sample: 0 .. RELION_MAX_HEALPIX_ORDER."""
    if not (0 <= order <= RELION_MAX_HEALPIX_ORDER and int(order) == order):
        raise InputError(f"{flag} must be in 0..{RELION_MAX_HEALPIX_ORDER} (RELION's finest angular sampling is "
                         f"0.1°, HEALPix order {RELION_MAX_HEALPIX_ORDER}: "
                         f"{angular_step(RELION_MAX_HEALPIX_ORDER):.3f}°), got {order}")


def check_offset_search(offset_range: float, offset_step: float, box: int) -> None:
    """InputError for a translation search that cannot work on images of ``box`` pixels: a step that is not
    > 0, a range that is not >= 0 or is larger than half the box (a particle shifted further is out of the box:
    the Fourier shift wraps it round to the other side). RELION takes any range; the half-box limit is ours."""
    if not offset_step > 0 or not np.isfinite(offset_step):
        raise InputError(f"--offset_step must be > 0 pixels, got {offset_step:g}")
    if not offset_range >= 0 or not np.isfinite(offset_range):
        raise InputError(f"--offset_range must be >= 0 pixels, got {offset_range:g}")
    if offset_range > box / 2:
        raise InputError(f"--offset_range {offset_range:g} px is larger than half the box ({box} px: at most "
                         f"{box / 2:g} px; about {np.pi * (offset_range / offset_step) ** 2:,.0f} translations at "
                         f"step {offset_step:g}): a particle shifted further leaves the box, as the Fourier shift "
                         f"wraps it round (RELION does not limit it; this limit is ours)")


# ---------------------------------------------------------------------------------------------------------
# Oversampling
# ---------------------------------------------------------------------------------------------------------

def oversampled_directions(order: int, idir, q: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``4^q`` children at ``order + q`` of NESTED pixel(s) ``idir`` at ``order``.

    ``idir`` is a HEALPix NESTED pixel index (scalar or array; for a symmetry-reduced grid pass the
    ``pix`` of :func:`direction_grid`). Returns ``(pix, rot, tilt)``, each ``idir.shape + (4^q,)``: the
    child indices (the set ``4^q·p … 4^q·p + 4^q − 1``) in RELION's loop order (sub-pixel y outer,
    x inner; for q = 1 this is ascending NESTED order) and their directions in degrees.
    """
    order = _check_order(order)
    q = int(q)
    _check_order(order + q)
    face, ix, iy = healpix_nest2xyf(order, idir)
    f = 1 << q
    sub_y, sub_x = np.meshgrid(np.arange(f), np.arange(f), indexing="ij")
    cx = ix[..., None] * f + sub_x.ravel()
    cy = iy[..., None] * f + sub_y.ravel()
    child = healpix_xyf2nest(order + q, np.broadcast_to(face[..., None], cx.shape), cx, cy)
    rot, tilt = healpix_directions(order + q, child)
    return child, rot, tilt


def oversampled_psi(psi, step: float, q: int = 1) -> np.ndarray:
    """``2^q`` fine psi values per coarse psi: ``psi − step/2 + (j + ½)·step/2^q``; shape ``psi.shape + (2^q,)``."""
    n = 1 << int(q)
    j = np.arange(n, dtype=np.float64)
    return np.asarray(psi, dtype=np.float64)[..., None] - 0.5 * step + (j + 0.5) * step / n


def oversampled_translations(t, step: float, q: int = 1) -> np.ndarray:
    """Fine translations around coarse ones ``t`` (``(..., ndim)``, pixels): each axis gets ``2^q`` values
    ``t − step/2 + (j + ½)·step/2^q``; all combinations, x slowest (RELION's order). Shape
    ``(..., 2^(q·ndim), ndim)`` (4 per coarse point for 2D, q = 1)."""
    t = np.asarray(t, dtype=np.float64)
    ndim = t.shape[-1]
    n = 1 << int(q)
    off = -0.5 * step + (np.arange(n, dtype=np.float64) + 0.5) * step / n
    grid = np.stack(np.meshgrid(*([off] * ndim), indexing="ij"), axis=-1).reshape(-1, ndim)
    return t[..., None, :] + grid


# ---------------------------------------------------------------------------------------------------------
# Symmetry-reduced grids
# ---------------------------------------------------------------------------------------------------------

# Reference point of the asymmetric unit (see asymmetric_unit_pixels): close to +z, just off the
# rot = 0 meridian, in general position for every supported group.
_AU_THETA, _AU_PHI = 0.01, 0.0123
_AU_REF = np.array([np.sin(_AU_THETA) * np.cos(_AU_PHI), np.sin(_AU_THETA) * np.sin(_AU_PHI), np.cos(_AU_THETA)])


def _unit_vectors(order: int, pix) -> np.ndarray:
    theta, phi = healpix_pix2ang_nest(order, pix)
    st = np.sin(theta)
    return np.stack([st * np.cos(phi), st * np.sin(phi), np.cos(theta)], axis=-1)


def _greedy_unique(n: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Keep-mask of the greedy pass 'visit in index order, drop a point that conflicts with a kept one'.

    ``lo < hi`` are conflicting pairs. Resolved in rounds, each vectorised over all pairs.
    """
    status = np.zeros(n, dtype=np.int8)  # 0 undecided, 1 kept, -1 dropped
    while True:
        undecided = status == 0
        if not undecided.any():
            return status > 0
        lower_kept = np.bincount(hi, weights=(status[lo] == 1), minlength=n) > 0
        lower_open = np.bincount(hi, weights=(status[lo] == 0), minlength=n) > 0
        status[undecided & lower_kept] = -1
        status[undecided & ~lower_kept & ~lower_open] = 1


def _mate_conflicts(ops: np.ndarray, v: np.ndarray, radius: float) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``lo < hi`` of rows of ``v`` (unit vectors) where a mate ``g·v[i]`` lies within ``radius`` (rad)
    of ``v[j]``, i ≠ j. A mate falling on its own point (a direction on a symmetry axis) is no conflict."""
    from scipy.spatial import cKDTree

    if v.shape[0] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    mates = np.einsum("gij,nj->gni", ops, v).reshape(-1, 3)
    owner = np.tile(np.arange(v.shape[0]), ops.shape[0])
    hits = cKDTree(v).query_ball_point(mates, 2.0 * np.sin(0.5 * radius), return_sorted=False)
    lens = np.fromiter((len(h) for h in hits), dtype=np.int64, count=len(hits))
    if not lens.sum():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    a = np.repeat(owner, lens)
    b = np.concatenate([np.asarray(h, dtype=np.int64) for h in hits if len(h)])
    a, b = a[a != b], b[a != b]
    return np.minimum(a, b), np.maximum(a, b)


@lru_cache(maxsize=64)
def _au_pixels_cached(order: int, canonical: str) -> np.ndarray:
    ops = symmetry_group(canonical).direction_operators           # (m, 3, 3) proper rotations
    npix = 12 * 4**order
    if ops.shape[0] == 1:
        out = np.arange(npix, dtype=np.int64)
        out.setflags(write=False)
        return out
    radius = 0.5 * np.deg2rad(healpix_max_pixrad_deg(order))
    allv = _unit_vectors(order, None)
    # Step 1: keep d when it is the mate g·d closest to the reference w, i.e. w·d ≥ (gᵀ w)·d for all g:
    # the Dirichlet cell of w, an exact fundamental domain.
    u = np.einsum("gji,j->gi", ops, _AU_REF)                        # gᵀ w, (m, 3)
    keep = np.zeros(npix, dtype=bool)
    chunk = max(1, (1 << 22) // ops.shape[0])
    for s in range(0, npix, chunk):
        sc = allv[s:s + chunk] @ u.T                                # (chunk, m); column 0 is the identity
        keep[s:s + sc.shape[0]] = sc[:, 0] >= sc.max(axis=1) - 1e-12
    pix = np.flatnonzero(keep)
    # Step 2 (RELION's seam rule): in index order, drop a direction with a symmetry mate within half the
    # largest pixel radius of a kept one. Where the grid is not invariant under the group (3-, 5-, 7-fold
    # axes), points on the two sides of a seam can be near-copies of each other.
    lo, hi = _mate_conflicts(ops, allv[pix], radius)
    pix = pix[_greedy_unique(pix.size, lo, hi)]
    # Step 3 (coverage): a grid direction with no mate of a kept direction within 2r = max_pixrad (seam
    # gaps; at coarse orders the cell may hold no grid point at all) is added, in index order, unless a
    # direction added before it already covers it.
    cover = 2.0 * radius
    mates = np.einsum("gij,nj->gni", ops, allv[pix]).reshape(-1, 3)
    if mates.shape[0]:
        from scipy.spatial import cKDTree  # noqa: PLC0415 - here only: its import is 0.3-0.7 s of a C1 job's start

        near, _ = cKDTree(mates).query(allv, k=1)
        gap = np.flatnonzero(near > 2.0 * np.sin(0.5 * cover))
    else:
        gap = np.arange(npix)
    if gap.size:
        lo, hi = _mate_conflicts(ops, allv[gap], cover)
        pix = np.union1d(pix, gap[_greedy_unique(gap.size, lo, hi)])
    pix = np.ascontiguousarray(pix, dtype=np.int64)
    pix.setflags(write=False)
    return pix


def asymmetric_unit_pixels(order: int, sym: str = "C1") -> np.ndarray:
    """NESTED indices (ascending) of the directions kept for point group ``sym`` at ``order``.

    Directions equivalent under the group (``d ~ det(S)·S·d``, see
    :func:`~napari_gpu_relion.compute.geometry.direction_operators`) are reduced in three steps, with
    ``r = 0.5·max_pixrad`` (RELION's seam radius, ≈ half the angular step):

    1. keep ``d`` when, among its symmetry mates, it is the one closest to a fixed reference point ``w``
       near +z (tilt 0.57°, rot 0.70°): the Dirichlet cell of ``w``, an exact asymmetric unit. For Cn
       this is the wedge ``|rot − 0.70°| ≤ 180/n`` (RELION: ``|rot| ≤ 180/n``); for Dn that wedge on
       (nearly) the upper hemisphere;
    2. RELION's seam rule, at every size (RELION skips it above 4000 directions): in index order, drop a
       direction that has a symmetry mate within ``r`` of a direction kept before it;
    3. fill gaps: add, in index order, grid directions with no mate of a kept direction within ``2r``
       (only at seams of coarse grids, e.g. the I cell at orders 0–1 holds no grid point at all).

    Result: every grid direction has a symmetry mate of a kept one within ``2r = max_pixrad`` (≈ the
    angular step), and no two kept directions are symmetry mates closer than ``r``. For groups that
    leave the grid invariant (C2, C4, D2, D4, Cs, D4h, …) the count is exactly ``12·4^order / m``
    (m = number of direction operators: |G| for proper groups, |G|/2 when G holds the inversion, which
    only turns psi). Otherwise seams cost a few points: measured 12 vs 13.7 (D7), 14 vs 16 (T), 7 vs 8
    (O), 3 vs 3.2 (I) at order 2; 53/54.9, 61/64, 32/32, 11/12.8 at order 3; within 3% at order 5.
    """
    return np.array(_au_pixels_cached(_check_order(order), _canonical_name(sym)))


def direction_grid(order: int, sym: str = "C1") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coarse directions after symmetry reduction: ``(pix, rot, tilt)`` (NESTED index, degrees)."""
    pix = asymmetric_unit_pixels(order, sym)
    rot, tilt = healpix_directions(order, pix)
    return pix, rot, tilt


def orientation_grid(order: int, sym: str = "C1", psi_step: float | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All coarse orientations ``(rot, tilt, psi)`` (degrees), direction-major and psi-minor.

    Directions: :func:`direction_grid`; psi: :func:`psi_angles` with ``psi_step`` (default the angular
    step of the order), never symmetry-reduced. C1 at order 2: 192 × 24 = 4608 orientations.
    """
    _, rot, tilt = direction_grid(order, sym)
    psi = psi_angles(angular_step(order) if psi_step is None else psi_step)
    return np.repeat(rot, psi.size), np.repeat(tilt, psi.size), np.tile(psi, rot.size)


# ---------------------------------------------------------------------------------------------------------
# Local searches
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class LocalSearch:
    """Local-search priors over the coarse grid, per particle (leading shape ``P`` = the priors' shape).

    ``pix, rot, tilt`` (n_dirs,) are the candidate directions (:func:`direction_grid`) and ``psi``
    (n_psi,) the candidate psi angles. ``dir_mask`` / ``psi_mask`` (P + (n_dirs,) / P + (n_psi,)) say which
    are searched; ``dir_log_prior`` / ``psi_log_prior`` are log-probabilities normalised over the kept
    entries (−inf elsewhere); ``dir_distance`` is the angle (degrees) from each direction's closest
    symmetry mate to the prior direction, ``psi_distance`` the wrapped |Δψ|.
    """

    pix: np.ndarray
    rot: np.ndarray
    tilt: np.ndarray
    psi: np.ndarray
    dir_mask: np.ndarray
    dir_log_prior: np.ndarray
    dir_distance: np.ndarray
    psi_mask: np.ndarray
    psi_log_prior: np.ndarray
    psi_distance: np.ndarray


def _gaussian_log_prior(dist, sigma, cutoff: float):
    """Mask ``dist < cutoff·σ`` (at least the closest entry per row) and log-prior −d²/2σ² normalised
    (NumPy or CuPy arrays)."""
    xp = get_array_module(dist)
    mask = dist < cutoff * sigma
    empty = ~mask.any(axis=-1)
    if bool(empty.any()):
        closest = xp.argmin(dist, axis=-1)
        rows = xp.flatnonzero(empty)
        mask[rows, closest[rows]] = True
    logit = xp.where(mask, -0.5 * (dist / sigma) ** 2, -np.inf)
    top = logit.max(axis=-1, keepdims=True)
    lse = top + xp.log(xp.exp(logit - top).sum(axis=-1, keepdims=True))
    return mask, logit - lse


def local_search(prior_rot, prior_tilt, prior_psi, sigma_deg, order: int, sym: str = "C1",
                 psi_step: float | None = None, *, sigma_psi_deg=None, sigma_cutoff: float = 3.0,
                 bimodal_psi: bool = False, xp=np) -> LocalSearch:
    """Directions and psi angles of the coarse grid near prior poses (RELION's local searches, degrees).

    Priors are scalars or arrays of one shape ``P`` (a batch of particles); ``sigma_deg`` is a scalar or
    broadcasts to ``P`` (σ_rot = σ_tilt; ``sigma_psi_deg`` defaults to it). A direction is kept when the
    angle ``d`` between the prior viewing direction and the closest symmetry mate of the direction is
    ``< sigma_cutoff·σ``; its prior is ∝ exp(−d²/2σ²), normalised over the kept directions. psi likewise
    with ``|Δψ|`` wrapped to ≤ 180 (``bimodal_psi``: folded to ≤ 90). Where nothing survives, the closest
    single direction / psi is kept with prior 1. Vectorised over particles and directions; ``xp`` (NumPy or
    CuPy) holds the per-particle arrays (the grids stay NumPy).
    """
    order = _check_order(order)
    pix, rot, tilt = direction_grid(order, sym)
    psi = psi_angles(angular_step(order) if psi_step is None else psi_step)
    pr, pt, pp = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in (prior_rot, prior_tilt, prior_psi)))
    shape = pr.shape
    sig = np.broadcast_to(np.asarray(sigma_deg, dtype=np.float64), shape).reshape(-1, 1)
    sig_psi = sig if sigma_psi_deg is None else \
        np.broadcast_to(np.asarray(sigma_psi_deg, dtype=np.float64), shape).reshape(-1, 1)
    if np.any(sig <= 0) or np.any(sig_psi <= 0):
        raise InputError("local search: sigma must be positive (degrees)")
    n = pr.size
    sig, sig_psi = xp.asarray(sig), xp.asarray(sig_psi)
    # Directions: closest mate. max_g p·(g d) = max_g (gᵀ p)·d, so rotate the (few) priors, not the grid.
    ops = xp.asarray(symmetry_group(sym).direction_operators)
    dirs = xp.asarray(view_direction(rot, tilt))                           # (n_dirs, 3)
    prior_dir = xp.asarray(view_direction(pr.ravel(), pt.ravel()))         # (n, 3)
    best = xp.empty((n, dirs.shape[0]))
    chunk = max(1, (1 << 23) // max(1, ops.shape[0] * dirs.shape[0]))
    for s in range(0, n, chunk):
        pm = xp.einsum("gji,nj->ngi", ops, prior_dir[s:s + chunk])         # (c, m, 3)
        best[s:s + chunk] = xp.einsum("ngi,di->ngd", pm, dirs).max(axis=1)
    dist = xp.rad2deg(xp.arccos(xp.clip(best, -1.0, 1.0)))
    dmask, dlog = _gaussian_log_prior(dist, sig, sigma_cutoff)
    pmask, plog, dpsi = _psi_window(pp.reshape(-1, 1), sig_psi, psi, sigma_cutoff, bimodal_psi, xp, distance=True)
    nd, npsi = dirs.shape[0], psi.size
    return LocalSearch(
        pix=pix, rot=rot, tilt=tilt, psi=psi,
        dir_mask=dmask.reshape(shape + (nd,)), dir_log_prior=dlog.reshape(shape + (nd,)),
        dir_distance=dist.reshape(shape + (nd,)),
        psi_mask=pmask.reshape(shape + (npsi,)), psi_log_prior=plog.reshape(shape + (npsi,)),
        psi_distance=dpsi.reshape(shape + (npsi,)),
    )


def _psi_window(prior_psi, sig_psi, psi, cutoff: float, bimodal: bool, xp, distance: bool = False):
    """The psi part of a local search: mask and normalised log prior (I, n_psi) of the wrapped |Δψ| (no
    symmetry, as in RELION; ``bimodal`` folds it to <= 90°) from priors and sigmas (I, 1) in degrees."""
    dpsi = xp.abs(xp.mod(xp.asarray(psi)[None, :] - xp.asarray(prior_psi) + 180.0, 360.0) - 180.0)
    if bimodal:
        dpsi = xp.where(dpsi > 90.0, 180.0 - dpsi, dpsi)
    mask, log = _gaussian_log_prior(dpsi, xp.asarray(sig_psi), cutoff)
    return (mask, log, dpsi) if distance else (mask, log)


#: Particles per local_search call in local_candidates: its (particles x directions) float64 tables are not in
#: the memory plan (at HEALPix order 7, 196,608 directions: 0.8 GB per table for 512 particles).
LOCAL_CANDIDATE_BATCH = 512


def local_candidates(angles: np.ndarray, sampling, sigma_deg: float, sym: str = "C1", n_classes: int = 1,
                     xp=np, tree: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-particle coarse candidate rows and log priors (I, n) of RELION's local searches: every (direction,
    psi) of ``sampling`` inside the 3-sigma window around each particle's angles (I, 3) (rot, tilt, psi in
    degrees), with the Gaussian log prior of direction and psi, rows direction x n_psi + psi; the same window
    in every class (rows are class-major, class k adds k x n_orient); -1 pads (log prior -inf). ``xp``: where
    the (I, n_dirs) distance tables are made and the results live (CuPy: on the GPU, where a batch of 512
    particles against the 12,288 directions of HEALPix order 5 costs milliseconds instead of seconds). In pieces of
    LOCAL_CANDIDATE_BATCH particles, padded to the widest: the same rows as one call."""
    n = len(angles)
    if tree is None:  # the k-d tree on the CPU, and on a GPU for the finest grids (TREE_DIRECTIONS)
        tree = xp is np or asymmetric_unit_pixels(sampling.order, sym).size >= TREE_DIRECTIONS
    parts = [_kept_windows(angles[s:s + LOCAL_CANDIDATE_BATCH], sampling, sigma_deg, sym, xp, tree)
             for s in range(0, max(1, n), LOCAL_CANDIDATE_BATCH)]

    def stacked(name: str, fill):  # one field of every piece, padded to the widest piece
        width = max(getattr(q, name).shape[1] for q in parts)
        out = xp.full((n, width), fill, dtype=getattr(parts[0], name).dtype)
        for i, q in enumerate(parts):
            a = getattr(q, name)
            out[i * LOCAL_CANDIDATE_BATCH:i * LOCAL_CANDIDATE_BATCH + a.shape[0], :a.shape[1]] = a
        return out

    d_idx, d_ok, d_lp = stacked("d_idx", 0), stacked("d_ok", False), stacked("d_lp", 0.0)
    p_idx, p_ok, p_lp = stacked("p_idx", 0), stacked("p_ok", False), stacked("p_lp", 0.0)
    n_psi = parts[0].n_psi
    ok = (d_ok[:, :, None] & p_ok[:, None, :]).reshape(n, -1)
    cand = xp.where(ok, (d_idx[:, :, None] * n_psi + p_idx[:, None, :]).reshape(n, -1), -1)
    lpc = xp.where(ok, (d_lp[:, :, None] + p_lp[:, None, :]).reshape(n, -1), -np.inf)
    if n_classes > 1:
        R = sampling.n_orient
        cand = xp.concatenate([xp.where(cand >= 0, cand + k * R, -1) for k in range(n_classes)], axis=1)
        lpc = xp.concatenate([lpc] * n_classes, axis=1)
    return cand, lpc


class _KeptWindows(NamedTuple):
    """One piece of particles' kept directions and psi (_kept_first: indices, validity) with their log priors,
    (I, nd) and (I, np), padded to the piece's largest counts; n_psi the psi grid's size."""

    d_idx: object
    d_ok: object
    d_lp: object
    p_idx: object
    p_ok: object
    p_lp: object
    n_psi: int


#: Coarse directions from which a local search on the GPU finds each particle's window with a k-d tree of the grid
#: (on the host) instead of dense (particles x directions) tables: HEALPix order 7 and finer (196,608 directions
#: and more). At order 9 (3,145,728 directions) the dense tables of one piece of 512 particles are four float64
#: arrays of 12.9 GB each: they took most of a box-256 iteration's time and ran an H200 out of memory (twenty-sixth
#: session, issue 48). Below it the GPU's dense tables take milliseconds. On the CPU the tree is used at every order
#: (512 particles on the 2-core machine: order 4 0.009 s against 0.18 s dense, order 6 0.04 against 1.8 s, order 9
#: 0.07 s). Both give the same rows and priors (tests/test_sampling.py).
TREE_DIRECTIONS = 150_000


def _kept_windows(angles: np.ndarray, sampling, sigma_deg: float, sym: str, xp, tree: bool) -> _KeptWindows:
    if tree:
        d_idx, d_ok, d_lp = _tree_directions(angles, sampling.order, sym, sigma_deg, 3.0)
        psi = psi_angles(angular_step(sampling.order) if sampling.psi_step is None else sampling.psi_step)
        pmask, plog = _psi_window(np.asarray(angles[:, 2], np.float64).reshape(-1, 1),
                                  np.full((len(angles), 1), float(sigma_deg)), psi, 3.0, False, np)
        p_idx, p_ok = _kept_first(pmask)
        return _KeptWindows(xp.asarray(d_idx), xp.asarray(d_ok), xp.asarray(d_lp), xp.asarray(p_idx),
                            xp.asarray(p_ok), xp.asarray(np.take_along_axis(plog, p_idx, axis=1)), int(psi.size))
    ls = local_search(angles[:, 0], angles[:, 1], angles[:, 2], sigma_deg, sampling.order, sym, sampling.psi_step,
                      xp=xp)
    d_idx, d_ok = _kept_first(ls.dir_mask)  # (I, nd), few directions per particle
    p_idx, p_ok = _kept_first(ls.psi_mask)  # (I, np)
    return _KeptWindows(d_idx, d_ok, xp.take_along_axis(ls.dir_log_prior, d_idx, axis=1),
                        p_idx, p_ok, xp.take_along_axis(ls.psi_log_prior, p_idx, axis=1), int(ls.psi_mask.shape[1]))


@lru_cache(maxsize=4)
def _direction_tree(order: int, sym: str):
    """The coarse directions' unit vectors (n_dirs, 3) and a k-d tree of them (built once per order and group)."""
    from scipy.spatial import cKDTree  # noqa: PLC0415

    _, rot, tilt = direction_grid(order, sym)
    dirs = view_direction(rot, tilt)
    return dirs, cKDTree(dirs)


def _tree_directions(angles: np.ndarray, order: int, sym: str, sigma_deg: float, cutoff: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kept directions of :func:`local_search`'s window for each particle, found in a k-d tree: the same
    indices (ascending, padded with 0), validity and normalised log priors as the dense tables' rows, at a cost
    that does not grow with the grid. A direction is kept when the angle from the prior direction to its
    closest symmetry mate is below cutoff x sigma; every such direction lies within the chord 2 sin(angle / 2)
    of one of the prior's mates, so the tree's ball around each mate finds all of them, and the distance is then
    computed for the candidates exactly as the dense path computes it."""
    dirs, tree = _direction_tree(order, sym)
    ops = symmetry_group(sym).direction_operators
    n = len(angles)
    prior = view_direction(angles[:, 0], angles[:, 1])                      # (I, 3)
    mates = np.einsum("gji,nj->ngi", ops, prior)                             # (I, m, 3)
    m = mates.shape[1]
    limit = cutoff * float(sigma_deg)
    chord = 2.0 * np.sin(np.radians(min(limit, 180.0)) / 2.0) * (1 + 1e-9) + 1e-12
    found = tree.query_ball_point(mates.reshape(-1, 3), chord)              # one list per (particle, mate)
    lengths = np.fromiter((len(f) for f in found), np.int64, count=n * m)
    cand = np.fromiter((j for f in found for j in f), np.int64, count=int(lengths.sum()))
    owner = np.repeat(np.arange(n * m) // m, lengths)
    key = np.unique(owner * dirs.shape[0] + cand)                           # particle-major, directions ascending
    owner, cand = key // dirs.shape[0], key % dirs.shape[0]
    best = np.einsum("kgi,ki->kg", mates[owner], dirs[cand]).max(axis=1)
    dist = np.rad2deg(np.arccos(np.clip(best, -1.0, 1.0)))
    inside = dist < limit
    owner, cand, dist = owner[inside], cand[inside], dist[inside]
    empty = np.setdiff1d(np.arange(n), owner)
    if empty.size:  # nothing inside the window: the closest direction alone, prior 1 (as the dense path)
        _, near = tree.query(mates[empty].reshape(-1, 3))
        near = near.reshape(-1, m)
        close = np.einsum("egi,edi->egd", mates[empty], dirs[near]).max(axis=1)  # (E, m) of each mate's nearest
        pick = near[np.arange(empty.size), np.argmax(close, axis=1)]
        order_ = np.argsort(np.concatenate([owner, empty]), kind="stable")
        owner = np.concatenate([owner, empty])[order_]
        cand = np.concatenate([cand, pick])[order_]
        dist = np.concatenate([dist, np.zeros(empty.size)])[order_]
    logit = -0.5 * (dist / sigma_deg) ** 2
    counts = np.bincount(owner, minlength=n)
    starts = np.cumsum(counts) - counts
    top = np.maximum.reduceat(logit, starts)
    lse = top + np.log(np.add.reduceat(np.exp(logit - np.repeat(top, counts)), starts))
    width = max(1, int(counts.max()))
    pos = np.arange(owner.size) - starts[owner]
    idx = np.zeros((n, width), np.int64)
    ok = np.zeros((n, width), bool)
    lp = np.zeros((n, width))
    idx[owner, pos], ok[owner, pos], lp[owner, pos] = cand, True, logit - np.repeat(lse, counts)
    return idx, ok, lp


def _kept_first(mask):
    """Indices of the True entries of each row of ``mask`` (I, M), first and in order, padded to the largest
    count: (I, n) indices (0 in the padding) and (I, n) validity. One pass (positions by a running count), no
    sort."""
    xp = get_array_module(mask)
    counts = mask.sum(axis=1)
    n = max(1, int(counts.max()))
    rows, cols = xp.nonzero(mask)  # row-major order: each row's entries in ascending column order
    first = xp.cumsum(counts) - counts
    pos = xp.arange(rows.size) - first[rows]
    idx = xp.zeros((mask.shape[0], n), dtype=np.int64)
    idx[rows, pos] = cols
    ok = xp.arange(n)[None, :] < counts[:, None]
    return idx, ok


# ---------------------------------------------------------------------------------------------------------
# The sampling of one iteration (what the E-step iterates over)
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Sampling:
    """Coarse orientations and translations of one iteration, with RELION's random perturbation.

    Orientation index r = idir * n_psi + ipsi (direction-major). Translations in pixels. ``perturb`` is
    RELION's rho in [-0.5, 0.5]: angles are perturbed by rho x (angular step) about all three Euler axes,
    translations by rho x (offset step)."""

    order: int
    sym: str = "C1"
    psi_step: float | None = None
    offset_range: float = 5.0
    offset_step: float = 2.0
    perturb: float = 0.0
    oversampling: int = 1
    dir_pix: np.ndarray = field(init=False)
    rot: np.ndarray = field(init=False)
    tilt: np.ndarray = field(init=False)
    psi: np.ndarray = field(init=False)
    translations: np.ndarray = field(init=False)  # (T, 2) pixels, the perturbation included (the searched ones)
    grid_translations: np.ndarray = field(init=False)  # (T, 2) the same before the perturbation (RELION's prior)
    _fine: _FineTable | None = field(default=None, init=False, repr=False, compare=False)  # fine_matrices kept

    def __post_init__(self):
        self.dir_pix, self.rot, self.tilt = direction_grid(self.order, self.sym)
        self.psi = psi_angles(self.angular_step if self.psi_step is None else self.psi_step)
        self.grid_translations = translation_grid(self.offset_range, self.offset_step, 2)
        self.translations = self.grid_translations + self.perturb * self.offset_step

    @property
    def angular_step(self) -> float:
        return angular_step(self.order)

    @property
    def psi_step_actual(self) -> float:
        return 360.0 / self.psi.size

    @property
    def fine_angular_step(self) -> float:
        return self.angular_step / (1 << self.oversampling)

    @property
    def fine_offset_step(self) -> float:
        return self.offset_step / (1 << self.oversampling)

    @property
    def n_children(self) -> int:
        """Oversampled orientations per coarse one: 4^q directions x 2^q psi."""
        return 1 << (3 * self.oversampling)

    @property
    def n_dirs(self) -> int:
        return int(self.dir_pix.size)

    @property
    def n_psi(self) -> int:
        return int(self.psi.size)

    @property
    def n_orient(self) -> int:
        return self.n_dirs * self.n_psi

    def _perturbation(self) -> np.ndarray:
        d = self.perturb * self.angular_step
        return euler_to_matrix(d, d, d)

    def coarse_angles(self, r) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = np.asarray(r)
        return self.rot[r // self.n_psi], self.tilt[r // self.n_psi], self.psi[r % self.n_psi]

    def coarse_matrices(self, r=None) -> np.ndarray:
        """(n, 3, 3) perturbed matrices of coarse orientations r (default all)."""
        r = np.arange(self.n_orient) if r is None else np.asarray(r)
        return euler_to_matrix(*self.coarse_angles(r)) @ self._perturbation()

    def fine_matrices(self, r) -> np.ndarray:
        """(n, 8, 3, 3) perturbed matrices of the oversampled children of coarse orientations r
        (4^q directions x 2^q psi, psi innermost, as RELION's iover_rot). Up to FINE_TABLE_MAX_ORIENT coarse
        orientations (global searches) each is computed once per sampling and kept (_FineTable): the batches of
        a global search ask for many of the same rows (the unions of significant rows; in 3D classification every
        class's rows share the orientations), and computing them took 13 ms per batch at HEALPix order 2, 30 ms
        with 4 classes."""
        r = np.asarray(r)
        if self.n_orient > FINE_TABLE_MAX_ORIENT:
            return self.fine_matrices_of(r)
        key = (self.order, self.sym, self.psi_step, float(self.perturb), self.oversampling)
        if self._fine is None or self._fine.key != key:  # a field changed since: start again
            self._fine = _FineTable(key, self.n_orient, self.n_children)
        return self._fine.matrices(self, r)

    def fine_matrices_of(self, r) -> np.ndarray:
        """fine_matrices computed for r alone (no table)."""
        r = np.asarray(r)
        q = self.oversampling
        _, crot, ctilt = oversampled_directions(self.order, self.dir_pix[r // self.n_psi], q)  # (n, 4)
        cpsi = oversampled_psi(self.psi[r % self.n_psi], self.psi_step_actual, q)  # (n, 2)
        nd, npsi = crot.shape[-1], cpsi.shape[-1]
        rot = np.repeat(crot, npsi, axis=-1)
        tilt = np.repeat(ctilt, npsi, axis=-1)
        psi = np.tile(cpsi, (1, nd))
        return euler_to_matrix(rot, tilt, psi) @ self._perturbation()

    def fine_translations(self) -> np.ndarray:
        """(T, 4, 2) children of each coarse translation (pixels, x slowest)."""
        return oversampled_translations(self.translations, self.offset_step, self.oversampling)


#: Coarse orientations up to which Sampling.fine_matrices keeps every child's matrix it has computed (at most
#: 72 bytes x 8 children each: 21 MB at HEALPix order 3 in C1, 75 MB at the limit; larger grids, local searches
#: at order 4 and beyond in C1, compute the ones they need). The kept matrices live as long as the sampling.
FINE_TABLE_MAX_ORIENT = 1 << 17


class _FineTable:
    """The fine matrices of one sampling's coarse orientations, each computed the first time a row asks for it
    (the same values as computing it alone: each matrix is computed on its own)."""

    def __init__(self, key: tuple, n_orient: int, n_children: int):
        self.key = key  # (order, sym, psi_step, perturb, oversampling) of the sampling they were computed for
        self.table = np.empty((n_orient, n_children, 3, 3))
        self.done = np.zeros(n_orient, dtype=bool)
        self.lock = threading.Lock()  # two jobs of one process may share a sampling

    def matrices(self, smp: Sampling, r: np.ndarray) -> np.ndarray:
        with self.lock:
            missing = np.unique(r[~self.done[r]])
            if missing.size:
                self.table[missing] = smp.fine_matrices_of(missing)
                self.done[missing] = True
            return self.table[r]


@dataclass
class GivenOrientations:
    """The sampling of --skip_align: row r is orientation ``matrices[r]`` (one per particle of the data set),
    the only translation is 0 (the data are pre-shifted to their exact offsets) and there is no oversampling.
    Offers the parts of Sampling's interface that the E-step uses."""

    matrices: np.ndarray  # (R, 3, 3)
    order: int = 0
    perturb: float = 0.0
    oversampling: int = 0
    offset_step: float = 1.0
    translations: np.ndarray = field(default_factory=lambda: np.zeros((1, 2)))

    @property
    def grid_translations(self) -> np.ndarray:
        return self.translations

    @property
    def n_orient(self) -> int:
        return int(self.matrices.shape[0])

    n_dirs = n_orient
    n_psi = 1
    n_children = 1
    angular_step = fine_angular_step = psi_step_actual = 0.0

    def coarse_matrices(self, r=None) -> np.ndarray:
        return self.matrices if r is None else self.matrices[np.asarray(r)]

    def fine_matrices(self, r) -> np.ndarray:
        return self.coarse_matrices(r)[:, None]

    def fine_translations(self) -> np.ndarray:
        return self.translations[:, None, :]


@dataclass
class InPlaneSampling:
    """The sampling of 2D classification: in-plane angles only (one "direction"), RELION's psi grid
    360/ceil(360/step), 2^q psi children per coarse psi, translations and perturbation as in Sampling. Rows
    are psi indices; matrices are Euler (0, 0, psi), whose upper-left 2x2 block rotates the 2D references."""

    psi_step: float = 10.0
    offset_range: float = 5.0
    offset_step: float = 2.0
    perturb: float = 0.0
    oversampling: int = 1
    order: int = 0
    sym: str = "C1"
    psi: np.ndarray = field(init=False)
    translations: np.ndarray = field(init=False)
    grid_translations: np.ndarray = field(init=False)

    def __post_init__(self):
        self.psi = psi_angles(self.psi_step)
        self.grid_translations = translation_grid(self.offset_range, self.offset_step, 2)
        self.translations = self.grid_translations + self.perturb * self.offset_step

    @property
    def psi_step_actual(self) -> float:
        return 360.0 / self.psi.size

    angular_step = psi_step_actual

    @property
    def fine_angular_step(self) -> float:
        return self.psi_step_actual / (1 << self.oversampling)

    @property
    def fine_offset_step(self) -> float:
        return self.offset_step / (1 << self.oversampling)

    @property
    def n_children(self) -> int:
        return 1 << self.oversampling

    n_dirs = 1

    @property
    def n_psi(self) -> int:
        return int(self.psi.size)

    n_orient = n_psi

    def coarse_angles(self, r) -> np.ndarray:
        """Perturbed psi (degrees) of coarse rows r."""
        return self.psi[np.asarray(r)] + self.perturb * self.psi_step_actual

    def coarse_matrices(self, r=None) -> np.ndarray:
        r = np.arange(self.n_orient) if r is None else np.asarray(r)
        psi = self.coarse_angles(r)
        return euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)

    def fine_matrices(self, r) -> np.ndarray:
        """(n, 2^q, 3, 3) matrices of the psi children of coarse rows r."""
        psi = oversampled_psi(self.coarse_angles(r), self.psi_step_actual, self.oversampling)
        return euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)

    def fine_translations(self) -> np.ndarray:
        return oversampled_translations(self.translations, self.offset_step, self.oversampling)


def local_search_rows(angular_step_deg: float, sigma_deg: float) -> int:
    """About how many coarse orientations a local search visits per particle (for the memory plan): RELION's
    3-sigma window, a cone of radius 3 sigma in direction times 6 sigma of psi, at the coarse step; at least 1."""
    step = max(angular_step_deg, 1e-6)
    return int(max(1, np.ceil(np.pi * (3 * sigma_deg / step) ** 2) * np.ceil(6 * sigma_deg / step)))

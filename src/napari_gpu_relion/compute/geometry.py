"""Rotation geometry in RELION's conventions: Euler angles, viewing directions and point groups.

Euler convention (RELION, ZYZ, angles in degrees)::

    A(rot, tilt, psi) = Rz(psi) · Ry(tilt) · Rz(rot)

with the *passive* (coordinate) rotations ``Rz(a) = [[c, s, 0], [-s, c, 0], [0, 0, 1]]`` and
``Ry(b) = [[c, 0, -s], [0, 1, 0], [s, 0, c]]``. ``A`` maps reference (map) coordinates to image
coordinates: the image is the z-projection of ``V(Aᵀ r)``, and its Fourier transform is the central
slice ``V̂(Aᵀ (kx, ky, 0))``. The third row of ``A`` is the viewing direction in the map frame,
``(sin tilt cos rot, sin tilt sin rot, cos tilt)``. ``A`` equals the transpose of SciPy's
``Rotation.from_euler('ZYZ', [rot, tilt, psi], degrees=True).as_matrix()``.

Symmetry: a map with point group G satisfies ``V(S x) = V(x)`` for every S in G. A pose ``A`` is then
equivalent to ``A Sᵀ`` for a proper S (det +1), whose viewing direction is ``S d``. For an improper S
(mirror, inversion, rotoreflection; det −1) the equivalent *proper* pose is ``Rz(180°) · A · (−S)ᵀ``:
the projection along ``(−S) d`` with psi turned by 180° is the same image. So on viewing directions
every member acts as the proper rotation ``det(S) · S`` (see :func:`direction_operators`).
This module imports only NumPy (and the array-module helper); no files, no Qt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from ..errors import InputError
from .backend import get_array_module

__all__ = [
    "SymmetryGroup",
    "angular_distance_deg",
    "direction_operators",
    "euler_to_matrix",
    "matrix_to_euler",
    "rotation_angle_deg",
    "rotation_about_axis",
    "symmetry_group",
    "symmetry_matrices",
    "view_direction",
]

# Below this sin(tilt) a matrix is treated as a gimbal case (tilt 0 or 180, rot set to 0).
_GIMBAL_SIN = 1e-12


# ---------------------------------------------------------------------------------------------------------
# Euler angles
# ---------------------------------------------------------------------------------------------------------

def euler_to_matrix(rot, tilt, psi):
    """RELION rotation matrices ``A = Rz(psi)·Ry(tilt)·Rz(rot)`` (passive), from angles in degrees.

    ``rot``, ``tilt`` and ``psi`` are scalars or arrays (broadcast together; NumPy or CuPy). Returns
    float64 ``(..., 3, 3)`` in the inputs' array module; scalars give ``(3, 3)``.
    """
    xp = get_array_module(rot, tilt, psi)
    r, t, p = xp.broadcast_arrays(*(xp.asarray(a, dtype=xp.float64) for a in (rot, tilt, psi)))
    r, t, p = xp.deg2rad(r), xp.deg2rad(t), xp.deg2rad(p)
    ca, sa = xp.cos(r), xp.sin(r)
    cb, sb = xp.cos(t), xp.sin(t)
    cg, sg = xp.cos(p), xp.sin(p)
    A = xp.empty(r.shape + (3, 3), dtype=xp.float64)
    # Rows of Ry(tilt)·Rz(rot): m0 = (cb ca, cb sa, -sb), m1 = (-sa, ca, 0), m2 = (sb ca, sb sa, cb);
    # Rz(psi) then mixes m0 and m1.
    A[..., 0, 0] = cg * cb * ca - sg * sa
    A[..., 0, 1] = cg * cb * sa + sg * ca
    A[..., 0, 2] = -cg * sb
    A[..., 1, 0] = -sg * cb * ca - cg * sa
    A[..., 1, 1] = -sg * cb * sa + cg * ca
    A[..., 1, 2] = sg * sb
    A[..., 2, 0] = sb * ca
    A[..., 2, 1] = sb * sa
    A[..., 2, 2] = cb
    return A


def matrix_to_euler(A):
    """RELION Euler angles ``(rot, tilt, psi)`` in degrees from rotation matrices ``(..., 3, 3)``.

    tilt ∈ [0, 180] (sin tilt ≥ 0), rot and psi ∈ (−180, 180]. Where sin tilt > 0 this equals RELION's
    ``rot = atan2(A21, A20)``, ``psi = atan2(A12, −A02)``; psi is computed as the in-plane angle left
    after removing ``Ry(tilt)·Rz(rot)``, so the angles rebuild ``A`` to rounding even for tiny tilts.
    Gimbal rule: when sin tilt < 1e-12 (tilt 0 or 180), rot = 0, tilt is set to exactly 0 or 180 and psi
    carries the whole in-plane rotation (``A = Rz(psi)`` at tilt 0, ``A = Rz(psi)·Ry(180)`` at tilt 180).
    NumPy or CuPy input; returns three float64 arrays of shape ``A.shape[:-2]``.
    """
    xp = get_array_module(A)
    A = xp.asarray(A, dtype=xp.float64)
    sb = xp.hypot(A[..., 2, 0], A[..., 2, 1])
    gimbal = sb < _GIMBAL_SIN
    tilt = xp.where(gimbal, xp.where(A[..., 2, 2] >= 0, 0.0, np.pi), xp.arctan2(sb, A[..., 2, 2]))
    rot = xp.where(gimbal, 0.0, xp.arctan2(A[..., 2, 1], A[..., 2, 0]))
    ca, sa = xp.cos(rot), xp.sin(rot)
    cb, sb = xp.cos(tilt), xp.sin(tilt)
    # Q = A · (Ry(tilt) Rz(rot))ᵀ = Rz(psi); Q00 = cos psi, Q01 = sin psi.
    q00 = A[..., 0, 0] * cb * ca + A[..., 0, 1] * cb * sa - A[..., 0, 2] * sb
    q01 = -A[..., 0, 0] * sa + A[..., 0, 1] * ca
    psi = xp.arctan2(q01, q00)
    return xp.rad2deg(rot), xp.rad2deg(tilt), xp.rad2deg(psi)


def magnified(A, mag):
    """Projection matrices of orientations ``A`` (..., 3, 3) for images with the anisotropic magnification ``mag``
    (2x2, RELION's rlnMagMat00/01/10/11; None: A itself): the slice at image pixel k then samples the reference at
    A^T (mag k, 0), as RELION's ObservationModel::applyAnisoMag (its projector's A^-1 becomes A^-1 M). The pose
    stays A; only where the images' pixels fall in the reference changes."""
    if mag is None:
        return A
    xp = get_array_module(A)
    m3 = np.eye(3)
    m3[:2, :2] = np.asarray(mag, np.float64)
    return xp.asarray(m3.T, dtype=A.dtype) @ A


def magnified_frequencies(mag, fx, fy):
    """(fx', fy') = mag (fx, fy): the frequencies at which the CTF of an image with magnification matrix ``mag``
    is evaluated (RELION's CTF with an observation model's mag matrix); ``fx, fy`` themselves for None."""
    if mag is None:
        return fx, fy
    m = np.asarray(mag, np.float64)
    return m[0, 0] * fx + m[0, 1] * fy, m[1, 0] * fx + m[1, 1] * fy


def view_direction(rot, tilt):
    """Unit viewing directions ``(sin tilt cos rot, sin tilt sin rot, cos tilt)``, shape ``(..., 3)``.

    Angles in degrees (broadcast; NumPy or CuPy). This is the third row of :func:`euler_to_matrix`.
    """
    xp = get_array_module(rot, tilt)
    r, t = xp.broadcast_arrays(xp.asarray(rot, dtype=xp.float64), xp.asarray(tilt, dtype=xp.float64))
    r, t = xp.deg2rad(r), xp.deg2rad(t)
    st = xp.sin(t)
    return xp.stack([st * xp.cos(r), st * xp.sin(r), xp.cos(t)], axis=-1)


def rotation_angle_deg(R):
    """Rotation angle in degrees ∈ [0, 180] of proper rotation matrices ``(..., 3, 3)``.

    Uses ``atan2(|R − Rᵀ|/(2√2), (tr R − 1)/2)``, accurate near 0 and near 180.
    """
    xp = get_array_module(R)
    R = xp.asarray(R, dtype=xp.float64)
    tr = R[..., 0, 0] + R[..., 1, 1] + R[..., 2, 2]
    wx = R[..., 2, 1] - R[..., 1, 2]
    wy = R[..., 0, 2] - R[..., 2, 0]
    wz = R[..., 1, 0] - R[..., 0, 1]
    s = 0.5 * xp.sqrt(wx * wx + wy * wy + wz * wz)  # = sin(angle)
    return xp.rad2deg(xp.arctan2(s, 0.5 * (tr - 1.0)))


def angular_distance_deg(A, B, sym=None):
    """Rotation angle (degrees) of ``A·Bᵀ`` for rotation matrices ``(..., 3, 3)`` (broadcast).

    With ``sym`` (symmetry matrices ``(n, 3, 3)`` as from :func:`symmetry_matrices`, or a group name)
    the minimum over the symmetry mates of ``A``: ``A·Sᵀ`` for proper S, ``Rz(180)·A·(−S)ᵀ`` for
    improper S (the proper pose that gives the same image). NumPy or CuPy.
    """
    xp = get_array_module(A, B)
    A = xp.asarray(A, dtype=xp.float64)
    B = xp.asarray(B, dtype=xp.float64)
    if sym is None:
        return rotation_angle_deg(A @ xp.swapaxes(B, -1, -2))
    S = symmetry_matrices(sym) if isinstance(sym, str) else np.asarray(sym, dtype=np.float64)
    S = xp.asarray(S)
    det = xp.linalg.det(S)
    P = S * xp.sign(det)[:, None, None]                         # proper part det(S)·S
    # mate·Bᵀ = F·A·Pᵀ·Bᵀ with F = Rz(180) = diag(-1, -1, 1) for improper members, else identity.
    M = xp.einsum("...ij,skj,...lk->s...il", A, P, B)
    F = xp.ones((S.shape[0], 3), dtype=xp.float64)
    F[:, :2] = xp.where(det < 0, -1.0, 1.0)[:, None]
    M = M * F.reshape((S.shape[0],) + (1,) * (M.ndim - 3) + (3, 1))
    return rotation_angle_deg(M).min(axis=0)


# ---------------------------------------------------------------------------------------------------------
# Point groups
# ---------------------------------------------------------------------------------------------------------

_PHI = (1.0 + np.sqrt(5.0)) / 2.0                               # golden ratio
# Icosahedral axis components (RELION's decimals in brackets).
_S5 = 1.0 / np.sqrt(1.0 + _PHI**2)                              # 0.525731
_C5 = _PHI * _S5                                                # 0.850651
_T1 = 1.0 / np.sqrt(1.0 + _PHI**4)                              # 0.356822
_T2 = _PHI**2 * _T1                                             # 0.934172


def rotation_about_axis(axis, angle_deg: float) -> np.ndarray:
    """Active rotation matrix (3, 3) by ``angle_deg`` degrees about ``axis`` (normalised here)."""
    n = np.asarray(axis, dtype=np.float64)
    n = n / np.linalg.norm(n)
    a = np.deg2rad(angle_deg)
    K = np.array([[0.0, -n[2], n[1]], [n[2], 0.0, -n[0]], [-n[1], n[0], 0.0]])
    return np.eye(3) + np.sin(a) * K + (1.0 - np.cos(a)) * (K @ K)


def _mirror(normal) -> np.ndarray:
    """Reflection through the plane with the given normal (det −1)."""
    n = np.asarray(normal, dtype=np.float64)
    n = n / np.linalg.norm(n)
    return np.eye(3) - 2.0 * np.outer(n, n)


_INVERSION = -np.eye(3)


def _rot(n: int, axis) -> np.ndarray:
    return rotation_about_axis(axis, 360.0 / n)


# RELION's generator lists (symmetries.cpp), with the decimal axes written in closed form.
_ICO_PROPER = {
    "I2": ((2, (0.0, 0.0, 1.0)), (5, (_S5, 0.0, _C5)), (3, (0.0, _T1, _T2))),
    "I1": ((2, (1.0, 0.0, 0.0)), (5, (_C5, 0.0, -_S5)), (3, (_T2, _T1, 0.0))),
    "I3": ((2, (-_S5, 0.0, _C5)), (5, (0.0, 0.0, 1.0)), (3, (-_T2 * _S5, _T1, _T2 * _C5))),
    "I4": ((2, (_S5, 0.0, _C5)), (5, (2 * _S5 * _C5, 0.0, _C5**2 - _S5**2)), (3, (_T2 * _S5, _T1, _T2 * _C5))),
}
_ICO_MIRROR = {"I2": (1.0, 0.0, 0.0), "I1": (0.0, 0.0, -1.0), "I3": (_C5, 0.0, _S5), "I4": (_C5, 0.0, -_S5)}

_T_TWOFOLD = (0.0, np.sqrt(2.0 / 3.0), np.sqrt(1.0 / 3.0))     # (0, .816496, .577350)

_VALID_FORMS = ("C1, Cn, Ci, Cs, Cnv, Cnh, Sn (n even), Dn, Dnv, Dnh, T, Td, Th, O, Oh, "
                "I (= I2), I1, I2, I3, I4, IH (= I2H), I1H, I2H, I3H, I4H (n a positive integer, "
                "case-insensitive)")


def _generators(name: str) -> list[np.ndarray]:
    """RELION's generators for a canonical (upper-case) group name; InputError if unknown."""
    if name == "CI":
        return [_INVERSION]
    if name == "CS":
        return [_mirror((0, 0, 1))]
    m = re.fullmatch(r"([CDS])(\d+)([VH]?)", name)
    if m:
        kind, n, suffix = m.group(1), int(m.group(2)), m.group(3)
        if n < 1:
            raise InputError(f"symmetry group {name!r}: the order n must be at least 1")
        z = (0.0, 0.0, 1.0)
        if kind == "C":
            gens = [_rot(n, z)]
            if suffix == "V":
                gens.append(_mirror((0, 1, 0)))                 # RELION: mirror plane normal to y
            elif suffix == "H":
                gens.append(_mirror(z))
            return gens
        if kind == "D":
            gens = [_rot(n, z), _rot(2, (1, 0, 0))]
            if suffix == "V":
                gens.append(_mirror((1, 0, 0)))                 # RELION: mirror plane normal to x
            elif suffix == "H":
                gens.append(_mirror(z))
            return gens
        if suffix == "" and n % 2 == 0:                         # Sn: RELION uses C(n/2) about z + inversion
            return [_rot(n // 2, z), _INVERSION]
        if suffix == "":
            raise InputError(f"symmetry group {name!r}: Sn needs an even n (RELION's convention)")
    if name == "T":
        return [_rot(3, (0, 0, 1)), _rot(2, _T_TWOFOLD)]
    if name == "TD":
        return [_rot(3, (0, 0, 1)), _rot(2, _T_TWOFOLD), _mirror((1.0, np.sqrt(3.0), 0.0))]
    if name == "TH":
        return [_rot(3, (0, 0, 1)), _rot(2, tuple(-c for c in _T_TWOFOLD)), _INVERSION]
    if name in ("O", "OH"):
        gens = [_rot(3, (1, 1, 1)), _rot(4, (0, 0, 1))]
        if name == "OH":
            gens.append(_mirror((0, 1, 1)))
        return gens
    m = re.fullmatch(r"I([1-4]?)(H?)", name)
    if m:
        setting = "I" + (m.group(1) or "2")
        gens = [_rot(n, ax) for n, ax in _ICO_PROPER[setting]]
        if m.group(2):
            gens.append(_mirror(_ICO_MIRROR[setting]))
        return gens
    raise InputError(f"unknown symmetry group {name!r}; valid forms: {_VALID_FORMS}")


def _closure(gens: list[np.ndarray], tol: float = 1e-6, max_order: int = 10000) -> np.ndarray:
    """All products of the generators (identity first), deduplicated to ``tol``; (n, 3, 3)."""
    elems = [np.eye(3)]
    frontier = [np.eye(3)]
    while frontier:
        stack = np.array(elems)
        new: list[np.ndarray] = []
        for e in frontier:
            for g in gens:
                p = g @ e
                if np.abs(stack - p).max(axis=(1, 2)).min() > tol and not any(
                        np.abs(q - p).max() <= tol for q in new):
                    new.append(p)
        elems.extend(new)
        frontier = new
        if len(elems) > max_order:
            raise RuntimeError("symmetry closure did not terminate (generators not of a finite group)")
    return np.array(elems)


def _canonical_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"symmetry group must be a name such as C1, D7, O or I; got {name!r}")
    return name.strip().upper()


@dataclass(frozen=True, eq=False)
class SymmetryGroup:
    """A point group: ``name`` (upper case, as given), ``matrices`` (order, 3, 3) float64 with the
    identity first (read-only), and ``order``."""

    name: str
    matrices: np.ndarray = field(repr=False)
    order: int

    @property
    def is_proper(self) -> bool:
        """True when every member is a rotation (no mirrors or inversion)."""
        return bool(np.all(np.linalg.det(self.matrices) > 0))

    @property
    def direction_operators(self) -> np.ndarray:
        """The distinct proper rotations ``det(S)·S`` that map viewing directions to equivalent ones."""
        return direction_operators(self.matrices)


@cache
def _group_cached(canonical: str) -> SymmetryGroup:
    mats = _closure(_generators(canonical))
    mats.setflags(write=False)
    return SymmetryGroup(canonical, mats, int(mats.shape[0]))


def symmetry_group(name: str) -> SymmetryGroup:
    """The point group called ``name`` in RELION's notation (case-insensitive), e.g. ``"c4"``, ``"D7"``, ``"I3"``.

    Generators follow RELION (symmetries.cpp): Cn: n-fold about z; Ci: inversion; Cs: mirror z;
    Cnv: Cn + mirror plane normal to y; Cnh: Cn + mirror z; Sn (n even): C(n/2) about z + inversion
    (RELION's definition: for n/2 odd this is the crystallographic S_n, for n/2 even it is C(n/2)h rather
    than the rotoreflection group S_n; order n either way); Dn: Cn + 2-fold about x; Dnv: Dn + mirror normal
    to x; Dnh: Dn + mirror z; T: 3-fold z + 2-fold (0, .816496, .577350); Td: T + mirror normal
    (√2, √6, 0); Th: T + inversion; O: 3-fold (1,1,1) + 4-fold z; Oh: O + mirror normal (0,1,1);
    I2 (= I): 2-fold z, 5-fold (.525731, 0, .850651), 3-fold (0, .356822, .934172); I1 = I2 turned 90°
    about z (2-fold x, 5-fold (.850651, 0, −.525731)); I3 = I2 turned −31.72° about y (5-fold z, 2-fold
    (−.525731, 0, .850651)); I4 = I2 turned +31.72° about y (5-fold z among its axes, generator 5-fold
    (.894427, 0, .447214), 2-fold (.525731, 0, .850651)); IxH = Ix + the mirror RELION lists (I2H: normal x,
    I1H: normal z, I3H: normal (.850651, 0, .525731), I4H: normal (.850651, 0, −.525731)).
    Members are generated to closure; an unknown name raises :class:`InputError`.
    """
    return _group_cached(_canonical_name(name))


def symmetry_generators(name: str) -> list[np.ndarray]:
    """RELION's generators of group ``name`` (see :func:`symmetry_group`), the identity left out: a few members
    whose products make the whole group."""
    return [G for G in _generators(_canonical_name(name)) if not np.allclose(G, np.eye(3))]


def symmetry_matrices(name: str) -> np.ndarray:
    """Symmetry matrices ``(n, 3, 3)`` float64 of group ``name`` (identity first); see :func:`symmetry_group`."""
    return np.array(symmetry_group(name).matrices)


def direction_operators(matrices) -> np.ndarray:
    """Distinct proper rotations ``det(S)·S`` (identity first) acting on viewing directions, ``(m, 3, 3)``.

    For a proper group this is the group itself; a group containing the inversion gives |G|/2 operators
    (the inversion only turns psi by 180°, which never reduces the set of directions).
    """
    S = np.asarray(matrices, dtype=np.float64)
    P = S * np.sign(np.linalg.det(S))[:, None, None]
    keep = [0]
    for i in range(1, P.shape[0]):
        if np.abs(P[keep] - P[i]).max(axis=(1, 2)).min() > 1e-6:
            keep.append(i)
    return P[keep]


def small_turns(step_deg: float) -> np.ndarray:
    """(27, 3, 3): the turns by (a, b, c) x ``step_deg`` degrees about x, y and z, a, b, c in (-1, 0, 1), as
    rotation vectors (exp of the skew matrix), identity included: the neighbourhood of a local search over
    rotations (composed on the left of the current best). Near the identity Euler angles would not do: rot and
    psi both turn about z there, and no turn about x is reached."""
    v = np.radians(step_deg) * np.array([(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)],
                                        dtype=np.float64)
    theta = np.linalg.norm(v, axis=1)
    out = np.tile(np.eye(3), (len(v), 1, 1))
    for i, (w, t) in enumerate(zip(v, theta, strict=True)):
        if t == 0:
            continue
        k = w / t
        K = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
        out[i] = np.eye(3) + np.sin(t) * K + (1 - np.cos(t)) * K @ K
    return out

"""Putting a map made in C1 onto a point group's symmetry axes, and applying the symmetry (what
relion_align_symmetry does after RELION's 3D initial model, which always runs in C1).

The map is first centred on its centre of mass (the symmetry axes must pass through the box centre). Then a
rotation R is searched that makes the rotated map most nearly invariant under the group: the score of R is the
mean masked correlation between the map and the map turned by ``R^T g R`` for each of RELION's generators g of
the group (a map
invariant under the generators is invariant under the whole group, and correlating with the turned copy is the
same as correlating the rotated map with its image under g). The search runs on a low-passed, downsampled copy:
view directions on an equal-area grid, the turn about the group's main axis only over one of its periods, then
local hill climbs at a third, a ninth and a 27th of the step. The map is rotated by the best R at full size and
averaged over every member of the group (mirrors included). Rotations and the averaging are real-space, about
RELION's box centre (voxel N // 2 in every axis, where masks and projections are centred), on (z, y, x) arrays
with RELION's convention (a rotation A takes a map f to f(A^T x)).
"""

from __future__ import annotations

import numpy as np

from .fourier import fourier_resize, lowpass_map
from .geometry import euler_to_matrix, small_turns, symmetry_generators, symmetry_group
from .masks import soft_spherical_mask


def rotate_map(vol: np.ndarray, R: np.ndarray, order: int = 1, center=None) -> np.ndarray:
    """The map turned by the rotation (or any orthogonal matrix) ``R`` about ``center`` ((z, y, x) voxels;
    default RELION's box centre N // 2): output voxel x takes the input at R^T x (x, y, z order; arrays are
    (z, y, x)); zero outside; ``order`` of the spline."""
    from scipy.ndimage import affine_transform  # noqa: PLC0415 - scipy is imported only where maps are turned

    c = (np.asarray(vol.shape) // 2).astype(np.float64) if center is None else np.asarray(center, np.float64)
    M = np.asarray(R, np.float64)[::-1, ::-1].T
    return affine_transform(np.asarray(vol, np.float64), M, offset=c - M @ c, order=order, mode="constant",
                            cval=0.0)


def symmetrize(vol: np.ndarray, matrices: np.ndarray, order: int = 3) -> np.ndarray:
    """The mean of the map turned by every member of the group (``matrices``, identity first)."""
    out = np.zeros(vol.shape, np.float64)
    for S in matrices:
        out += rotate_map(vol, S, order) if not np.allclose(S, np.eye(3)) else np.asarray(vol, np.float64)
    return out / len(matrices)


def z_period_deg(matrices: np.ndarray) -> float:
    """The smallest turn about z that belongs to the group (360° when none): the search's range of the last
    Euler angle, since turns by it leave the score unchanged."""
    best = 360.0
    for S in matrices:
        if np.linalg.det(S) > 0 and np.allclose(S[2], [0, 0, 1], atol=1e-6) and not np.allclose(S, np.eye(3)):
            a = np.degrees(np.arctan2(S[1, 0], S[0, 0])) % 360.0
            best = min(best, a, 360.0 - a) if a > 1e-6 else best
    return best


def center_of_mass_shift(vol: np.ndarray) -> np.ndarray:
    """The (z, y, x) shift in voxels that moves the centre of mass of the map's positive density to the box
    centre (voxel N // 2)."""
    w = np.clip(np.asarray(vol, np.float64), 0, None)
    if w.sum() <= 0:
        return np.zeros(3)
    grids = np.indices(vol.shape, dtype=np.float64)
    com = np.array([(g * w).sum() / w.sum() for g in grids])
    return (np.asarray(vol.shape) // 2).astype(np.float64) - com


def _shift(vol: np.ndarray, shift_zyx: np.ndarray) -> np.ndarray:
    from scipy.ndimage import fourier_shift  # noqa: PLC0415

    return np.fft.ifftn(fourier_shift(np.fft.fftn(vol), shift_zyx)).real


def _search_rotations(step_deg: float, period_deg: float) -> np.ndarray:
    """Rotations whose third-row (the direction taken to z) covers the sphere at about ``step_deg`` and whose
    last turn about z covers [0, period)."""
    n_tilt = max(2, int(round(180.0 / step_deg)) + 1)
    rows = []
    for t in np.degrees(np.arccos(np.linspace(1, -1, n_tilt))):
        n_rot = max(1, int(round(360.0 * np.sin(np.radians(t)) / step_deg)))
        for r in np.arange(n_rot) * 360.0 / n_rot:
            for p in np.arange(0.0, period_deg - 1e-9, step_deg):
                rows.append((r, t, p))
    a = np.asarray(rows)
    return euler_to_matrix(a[:, 0], a[:, 1], a[:, 2])


def _masked_unit(x: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """``x`` masked, mean-removed inside the mask and scaled to unit norm (None when it is flat)."""
    a = x * mask
    a = a - a[mask > 0].mean() * mask
    n = np.sqrt((a * a).sum())
    return a / n if n > 0 else None


def symmetry_score(small: np.ndarray, R: np.ndarray, generators: list[np.ndarray], mask: np.ndarray,
                   unit: np.ndarray | None = None) -> float:
    """Mean masked Pearson correlation of ``small`` with itself turned by R^T g R for every generator g
    (``unit``: ``_masked_unit(small, mask)`` when the caller has it already)."""
    a = _masked_unit(small, mask) if unit is None else unit
    score = 0.0
    for g in generators:
        b = _masked_unit(rotate_map(small, R.T @ g @ R, order=1), mask)
        score += float((a * b).sum()) if a is not None and b is not None else -1.0
    return score / len(generators)


def _centred(vol: np.ndarray, pixel_size: float, resolution_A: float) -> tuple[np.ndarray, np.ndarray]:
    """(``vol`` moved so that the centre of mass of its low-passed positive density is at the box centre, the
    shift (z, y, x voxels))."""
    vol = np.asarray(vol, np.float64)
    shift = center_of_mass_shift(lowpass_map(vol, pixel_size, resolution_A))
    return _shift(vol, shift), shift


def _align_centred(centred: np.ndarray, shift: np.ndarray, sym: str, pixel_size: float, resolution_A: float,
                   step_deg: float, box: int) -> dict:
    """The rotation that puts the (centred) map's symmetry axes on those of group ``sym`` (RELION's axis
    conventions).

    Returns {"matrix" (3, 3) to apply to the centred map, "shift_zyx" (``shift``: voxels, applied first), "score"
    (mean correlation with the generators' images at the best rotation, 1 = exactly symmetric), "score_unaligned"
    (the same for the map as given, centred)}. The search uses the map low-passed to ``resolution_A`` Å and
    resampled to ``box`` voxels; ``step_deg`` is its angular step."""
    group = symmetry_group(sym)
    N = centred.shape[0]
    b = min(box, N)
    small = lowpass_map(centred, pixel_size, resolution_A)
    small = fourier_resize(small, b, 3) if b != N else small
    mask = soft_spherical_mask(b, b / 2 - 2, 2.0, 3)
    gens = symmetry_generators(sym)
    if not gens:  # C1: nothing to align
        return {"matrix": np.eye(3), "shift_zyx": shift, "score": 1.0, "score_unaligned": 1.0}
    unit = _masked_unit(small, mask)

    def score(R):
        return symmetry_score(small, R, gens, mask, unit)

    best_R, best = np.eye(3), -2.0
    for R in _search_rotations(step_deg, z_period_deg(group.matrices)):
        s = score(R)
        if s > best:
            best, best_R = s, R
    step = step_deg
    for _ in range(3):  # local searches around the best at a third of the step each time, each one repeated
        step /= 3.0     # while it still moves (a hill climb: the best of the coarse grid may lie a step away)
        turns = small_turns(step)
        for _ in range(6):
            moved = False
            for R in np.einsum("nij,jk->nik", turns, best_R):
                s = score(R)
                if s > best + 1e-9:
                    best, best_R, moved = s, R, True
            if not moved:
                break
    return {"matrix": best_R, "shift_zyx": shift, "score": best, "score_unaligned": score(np.eye(3))}


def align_and_symmetrize(vol: np.ndarray, sym: str, pixel_size: float, resolution_A: float = 20.0,
                         step_deg: float = 10.0, box: int = 32) -> tuple[np.ndarray, dict]:
    """``vol`` centred, turned onto group ``sym``'s axes and averaged over the group (cubic splines); returns
    (map as float32, the alignment: see ``_align_centred``)."""
    centred, shift = _centred(vol, pixel_size, resolution_A)
    al = _align_centred(centred, shift, sym, pixel_size, resolution_A, step_deg, box)
    aligned = rotate_map(centred, al["matrix"], order=3)
    return symmetrize(aligned, symmetry_group(sym).matrices).astype(np.float32), al

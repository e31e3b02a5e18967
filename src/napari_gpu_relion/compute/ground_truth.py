"""Comparisons with ground truth for simulated data (tests, benchmarks, the demo's report)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .geometry import angular_distance_deg


@dataclass(frozen=True)
class ClassAssignmentReport:
    """Each class is labelled with the true state most of its particles come from.

    accuracy: fraction of particles whose class is labelled with their own state; sizes (K,), label (K,)
    (-1 for an empty class), purity (K,) fraction of the class's particles from its label state;
    split_states: states whose particles fill more than one class (each holding >= ``min_fraction``)."""

    accuracy: float
    sizes: np.ndarray
    label: np.ndarray
    purity: np.ndarray
    empty_classes: list[int]
    split_states: list[int]


def class_assignment_report(classes: np.ndarray, states: np.ndarray, K: int,
                            min_fraction: float = 0.05) -> ClassAssignmentReport:
    """Compare 0-based class assignments with 0-based true states (both (n,) int)."""
    classes, states = np.asarray(classes, int), np.asarray(states, int)
    S = int(states.max()) + 1
    table = np.zeros((K, S), int)
    np.add.at(table, (classes, states), 1)
    sizes = table.sum(1)
    label = np.where(sizes > 0, table.argmax(1), -1)
    correct = sum(int(table[k, label[k]]) for k in range(K) if label[k] >= 0)
    purity = np.where(sizes > 0, table.max(1) / np.maximum(sizes, 1), 0.0)
    n = len(classes)
    big = sizes >= min_fraction * n
    split = [s for s in range(S) if int(np.sum(big & (label == s))) > 1]
    empty = [k for k in range(K) if sizes[k] < min_fraction * n]
    return ClassAssignmentReport(correct / n, sizes, label, purity, empty, split)


def pick_matches(truth_xy: np.ndarray, picks_xy: np.ndarray, radius_px: float,
                 care: np.ndarray | None = None) -> tuple[int, int, int, int]:
    """(particles found, particles, correct picks, picks counted) for one micrograph: a particle is found when a
    pick lies within ``radius_px`` of it, a pick is correct when a particle lies within ``radius_px``.
    ``care`` (n_truth,) False marks "don't care" particles (e.g. on contamination): they are neither missed nor
    counted when picked. recall = found / particles, precision = correct / counted."""
    from scipy.spatial import cKDTree  # noqa: PLC0415

    truth_xy, picks_xy = np.asarray(truth_xy, float).reshape(-1, 2), np.asarray(picks_xy, float).reshape(-1, 2)
    care = np.ones(len(truth_xy), bool) if care is None else np.asarray(care, bool)
    if len(picks_xy) == 0 or len(truth_xy) == 0:
        return 0, int(care.sum()), 0, len(picks_xy)
    d, _ = cKDTree(picks_xy).query(truth_xy)
    d2, j = cKDTree(truth_xy).query(picks_xy)
    hit = d2 <= radius_px
    counted = ~hit | care[j]
    return int((d[care] <= radius_px).sum()), int(care.sum()), int((hit & counted).sum()), int(counted.sum())


def aligned_correlation(a: np.ndarray, b: np.ndarray, step_deg: float = 3.0) -> float:
    """Best Pearson correlation of image ``a`` with image ``b`` over in-plane rotations of b (``step_deg``
    steps, bilinear) and cyclic shifts (float64): how well a class average matches a true projection."""
    from scipy.ndimage import rotate  # noqa: PLC0415

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    A = np.fft.fft2(a - a.mean())
    best = -1.0
    for ang in np.arange(0.0, 360.0, step_deg):
        r = rotate(b, ang, reshape=False, order=1)
        cc = np.fft.ifft2(A * np.conj(np.fft.fft2(r - r.mean()))).real
        dy, dx = np.unravel_index(cc.argmax(), cc.shape)
        best = max(best, float(np.corrcoef(a.ravel(), np.roll(r, (dy, dx), (0, 1)).ravel())[0, 1]))
    return best


#: The z-flip D = diag(1, 1, -1): a projection along z is the same for an object and its mirror image in z.
_Z_FLIP = np.diag([1.0, 1.0, -1.0])


def _nearest_rotation(M: np.ndarray) -> np.ndarray:
    """The proper rotation closest to the 3 x 3 matrix ``M`` (Frobenius norm; polar part by SVD)."""
    U, _, Vt = np.linalg.svd(M)
    d = np.sign(np.linalg.det(U @ Vt))
    return U @ np.diag([1.0, 1.0, d]) @ Vt


def frame_aligned_angular_errors(refined: np.ndarray, true: np.ndarray, mirrored: bool = False,
                                 rounds: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Angular errors (degrees) of refined poses against the true ones after the best common rotation G, for a
    refinement whose map sits in another frame than the truth (as one from an initial model made from the
    particles alone: its orientation is arbitrary). ``refined``, ``true`` (n, 3, 3) RELION matrices (image =
    projection of the map at A). A map turned by G (V'(y) = V(G y)) gives refined poses A = B G; a mirrored map
    (``mirrored``: V'(y) = V(S y) with S improper) gives A = (D B D) G with D the z-flip, since a projection along
    z is blind to z -> -z; the errors of the wrong hand are large. G is the rotation closest to the sum of
    B^T A over the particles (least squares), refitted ``rounds`` times on the particles within max(3 x median,
    5°) of it, so that a few lost particles do not tilt it. Returns (errors (n,), G (3, 3))."""
    A = np.asarray(refined, np.float64)
    B = np.asarray(true, np.float64)
    if mirrored:
        B = _Z_FLIP @ B @ _Z_FLIP
    keep = np.ones(len(A), bool)
    for _ in range(max(1, rounds)):
        G = _nearest_rotation(np.einsum("nji,njk->ik", B[keep], A[keep]))
        err = angular_distance_deg(A, B @ G)
        keep = err <= max(3.0 * float(np.median(err)), 5.0)
        if keep.sum() < 3:
            keep[:] = True
    return err, G

"""benchmarks/vs_relion.py's frame-aligned pose errors: a refinement whose two half sets drifted by known turns and
shifts of their frames, on top of known per-particle errors, gives back the drifts and the per-particle errors."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from napari_gpu_relion.compute.geometry import (
    angular_distance_deg,
    euler_to_matrix,
    matrix_to_euler,
    rotation_about_axis,
)

_dir = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_dir))
_spec = importlib.util.spec_from_file_location("vs_relion", _dir / "vs_relion.py")
vs_relion = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_relion)


def _table(A: np.ndarray, xy: np.ndarray, halves: np.ndarray) -> pd.DataFrame:
    rot, tilt, psi = matrix_to_euler(A)
    return pd.DataFrame({"rlnAngleRot": rot, "rlnAngleTilt": tilt, "rlnAnglePsi": psi,
                         "rlnOriginXAngst": xy[:, 0], "rlnOriginYAngst": xy[:, 1], "rlnRandomSubset": halves})


def test_frame_drift_of_each_half_is_found_and_removed():
    rng = np.random.default_rng(0)
    n = 4000
    q = rng.normal(size=(n, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T  # uniform random rotations from unit quaternions
    B = np.stack([np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)], -1),
                  np.stack([2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)], -1),
                  np.stack([2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], -1)], 1)
    halves = np.where(np.arange(n) % 2 == 0, 1, 2)
    xy_true = rng.normal(0, 3, (n, 2))
    drift = {1: (rotation_about_axis([1.0, 2.0, 0.5], 0.4), np.array([0.3, -0.2, 0.1])),
             2: (rotation_about_axis([0.0, -1.0, 1.0], 0.25), np.array([-0.1, 0.0, 0.25]))}
    noise = np.stack([rotation_about_axis(rng.normal(size=3), a) for a in np.abs(rng.normal(0, 0.1, n))])
    A = np.empty_like(B)
    xy = xy_true + rng.normal(0, 0.05, (n, 2))
    for h, (G, t) in drift.items():
        s = halves == h
        A[s] = noise[s] @ B[s] @ G  # the map turned by G: every pose A = B G, each particle off by its own turn
        xy[s] += (B[s][:, :2, :] @ t)
    truth = _table(B, xy_true, halves)
    refined = _table(euler_to_matrix(*matrix_to_euler(A)), xy, halves)

    raw, _ = vs_relion.pose_differences(truth, refined)
    res = vs_relion.frame_aligned_pose_errors(truth, refined)
    own = angular_distance_deg(noise, np.broadcast_to(np.eye(3), noise.shape))
    assert abs(res["turn_deg"][1] - 0.4) < 0.01 and abs(res["turn_deg"][2] - 0.25) < 0.01
    assert abs(res["shift_A"][1] - np.linalg.norm(drift[1][1])) < 0.01
    assert abs(res["shift_A"][2] - np.linalg.norm(drift[2][1])) < 0.01
    assert abs(np.median(res["angular_deg"]) - np.median(own)) < 0.005  # the particles' own errors back
    assert np.median(raw) > np.median(own) + 0.1  # the raw errors count the drift
    assert np.median(res["offset_A"]) < 0.08  # the offsets' own noise (0.05 Å per axis: median 0.059)


def test_truth_turned_into_the_refinement_frame_projects_as_the_refined_poses_see_it():
    """realistic.py judges a refined map against rotate_map(truth, G^T): the map whose projections at the refined poses
    A = B G are the truth's projections at the true poses B (projections summed along z after rotate_map by the pose,
    RELION's image = A . map coordinates)."""
    from scipy import ndimage

    from napari_gpu_relion.compute.symmetry_alignment import rotate_map

    rng = np.random.default_rng(3)
    n = 32
    vol = np.zeros((n, n, n))
    for _ in range(6):  # an asymmetric set of blobs
        vol[tuple(rng.integers(10, 22, 3))] += rng.uniform(0.5, 1.5)
    vol = ndimage.gaussian_filter(vol, 1.0)
    G = rotation_about_axis([0.3, -0.5, 1.0], 15.0)
    turned = rotate_map(vol, G.T, order=3)
    wrong = rotate_map(vol, G, order=3)  # the other way round

    def image(v, A):
        return rotate_map(v, A, order=3).sum(axis=0)

    def cc(a, b):
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))

    for B in (rotation_about_axis([1.0, 0.2, 0.1], 40.0), rotation_about_axis([0.0, 1.0, -1.0], 110.0)):
        assert cc(image(turned, B @ G), image(vol, B)) > 0.999
        assert cc(image(wrong, B @ G), image(vol, B)) < 0.95
        assert cc(image(turned, B), image(vol, B)) < 0.95  # the turn is seen without it

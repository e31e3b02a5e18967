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
    moved = np.zeros((n, 2))  # each particle's offset change from its half's frame shift
    for h, (G, t) in drift.items():
        s = halves == h
        A[s] = noise[s] @ B[s] @ G  # the map turned by G: every pose A = B G, each particle off by its own turn
        moved[s] = B[s][:, :2, :] @ t
    xy += moved
    truth = _table(B, xy_true, halves)
    refined = _table(euler_to_matrix(*matrix_to_euler(A)), xy, halves)

    raw, _ = vs_relion.pose_differences(truth, refined)
    res = vs_relion.frame_aligned_pose_errors(truth, refined)
    own = angular_distance_deg(noise, np.broadcast_to(np.eye(3), noise.shape))
    assert abs(res["turn_deg"][1] - 0.4) < 0.01 and abs(res["turn_deg"][2] - 0.25) < 0.01
    assert abs(res["shift_A"][1] - np.linalg.norm(drift[1][1])) < 0.01
    assert abs(res["shift_A"][2] - np.linalg.norm(drift[2][1])) < 0.01
    assert abs(np.median(res["angular_deg"]) - np.median(own)) < 0.005  # the particles' own errors back
    np.testing.assert_allclose(res["angular_deg"], own, atol=0.02)  # particle by particle
    assert np.median(raw) > np.median(own) + 0.1  # the raw errors count the drift
    assert np.median(res["offset_A"]) < 0.08  # the offsets' own noise (0.05 Å per axis: median 0.059)
    np.testing.assert_allclose(res["offset_A"], np.linalg.norm(xy - xy_true - moved, axis=1), atol=0.01)


def test_truth_in_the_refinement_frame_projects_as_the_refined_poses_see_it():
    """realistic.py judges a refined map against vs_relion.truth_in_frame(truth, G, t): the map whose projections (the
    package's Fourier projector) at the refined poses A = B G, with the particle moved back by the fitted offset change
    (B t)_xy (``frame_fit``'s model), are the truth's projections at the true poses B."""
    from scipy import ndimage

    from napari_gpu_relion.compute.projector import prepare_reference, project

    rng = np.random.default_rng(3)
    n = 48
    vol = np.zeros((n, n, n))
    for _ in range(8):  # an asymmetric set of blobs
        vol[tuple(rng.integers(14, 34, 3))] += rng.uniform(0.5, 1.5)
    vol = ndimage.gaussian_filter(vol, 1.5)
    G = rotation_about_axis([0.3, -0.5, 1.0], 15.0)
    t = np.array([1.5, -2.0, 1.0])  # pixels
    refined_frame = prepare_reference(vs_relion.truth_in_frame(vol, G, t).astype(np.float32))
    wrong_shift = prepare_reference(vs_relion.truth_in_frame(vol, G, -t).astype(np.float32))
    wrong_turn = prepare_reference(vs_relion.truth_in_frame(vol, G.T, t).astype(np.float32))
    true_ref = prepare_reference(vol.astype(np.float32))

    def image(ref, A, offset=(0.0, 0.0)):
        """The projection with its centre at the box centre minus ``offset`` (x, y pixels)."""
        F = project(ref, np.asarray(A)[None])[0]
        im = np.fft.fftshift(np.fft.irfft2(F, s=(n, n)))
        return ndimage.shift(im, (-offset[1], -offset[0]), order=3)

    def cc(a, b):
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum()))

    for B in (euler_to_matrix(30.0, 50.0, 70.0), euler_to_matrix(-120.0, 100.0, 10.0)):
        d = B[:2] @ t  # the refined offsets' change: the particle is found this much further off
        seen = image(true_ref, B)
        assert cc(image(refined_frame, B @ G, d), seen) > 0.999
        assert cc(image(wrong_shift, B @ G, d), seen) < 0.97
        assert cc(image(wrong_turn, B @ G, d), seen) < 0.9
        assert cc(image(refined_frame, B, d), seen) < 0.9  # the turn is seen without it

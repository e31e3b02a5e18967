"""Angular distribution on an equal-area grid: against a direct count, uniform directions, single directions."""

import numpy as np
import pytest

from napari_gpu_relion.compute.angular_distribution import angular_histogram, fold_angles


def _direct_count(rot, tilt, weights, n_rot, n_tilt):
    """Float64 loop: fold each (rot, tilt) by hand, then find its bin by comparing with the degree edges."""
    rot_edges = [-180.0 + 360.0 * j / n_rot for j in range(n_rot + 1)]
    tilt_edges = [float(np.degrees(np.arccos(1.0 - 2.0 * i / n_tilt))) for i in range(n_tilt + 1)]
    out = np.zeros((n_tilt, n_rot))
    for r, t, w in zip(rot, tilt, weights, strict=True):
        r, t = float(r), float(t)
        if t < 0:  # (rot, -tilt) is the direction (rot + 180, tilt)
            r, t = r + 180.0, -t
        while r >= 180.0:
            r -= 360.0
        while r < -180.0:
            r += 360.0
        i = next(k for k in range(n_tilt) if tilt_edges[k] <= t < tilt_edges[k + 1] or k == n_tilt - 1)
        j = next(k for k in range(n_rot) if rot_edges[k] <= r < rot_edges[k + 1])
        out[i, j] += w
    return out


def _uniform_directions(n, rng):
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return np.degrees(np.arctan2(v[:, 1], v[:, 0])), np.degrees(np.arccos(v[:, 2]))


def test_matches_a_direct_count_with_weights_and_folded_angles():
    rng = np.random.default_rng(1)
    n = 3000
    rot = rng.uniform(-500, 500, n)  # any rot
    tilt = rng.uniform(-180, 180, n)  # negative tilts are folded
    w = rng.uniform(0.1, 2.0, n)
    for n_rot, n_tilt in ((36, 18), (7, 5), (1, 1)):
        h = angular_histogram(rot, tilt, w, n_rot=n_rot, n_tilt=n_tilt)
        assert h.counts.shape == (n_tilt, n_rot)
        np.testing.assert_allclose(h.counts, _direct_count(rot, tilt, w, n_rot, n_tilt), rtol=1e-12, atol=1e-9)
        assert h.counts.sum() == pytest.approx(w.sum())
    h = angular_histogram(rot, tilt)
    np.testing.assert_array_equal(h.counts, _direct_count(rot, tilt, np.ones(n), 36, 18))


def test_bins_cover_equal_solid_angles():
    h = angular_histogram([0.0], [0.0], n_rot=12, n_tilt=9)
    np.testing.assert_allclose(np.diff(h.cos_edges), -2.0 / 9)
    np.testing.assert_allclose(np.cos(np.radians(h.tilt_edges)), h.cos_edges, atol=1e-12)
    assert h.tilt_edges[0] == 0.0 and h.tilt_edges[-1] == pytest.approx(180.0)
    np.testing.assert_allclose(h.rot_edges, np.linspace(-180, 180, 13))
    band = np.radians(np.diff(h.rot_edges))[None, :] * -np.diff(h.cos_edges)[:, None]  # dphi * d(cos theta)
    np.testing.assert_allclose(band, h.solid_angle)
    assert h.solid_angle * 12 * 9 == pytest.approx(4 * np.pi)


def test_uniform_directions_give_a_flat_histogram():
    """Uniform directions on the sphere: every bin holds n / bins within Poisson noise (chi-square and the
    largest deviation); binning tilt in equal degrees instead would starve the polar bins."""
    rng = np.random.default_rng(0)
    n, n_rot, n_tilt = 200_000, 36, 18
    rot, tilt = _uniform_directions(n, rng)
    c = angular_histogram(rot, tilt, n_rot=n_rot, n_tilt=n_tilt).counts
    expected = n / (n_rot * n_tilt)
    dof = n_rot * n_tilt - 1
    chi2 = float(((c - expected) ** 2 / expected).sum())
    assert chi2 < dof + 5 * np.sqrt(2 * dof), chi2
    assert np.abs(c - expected).max() < 5 * np.sqrt(expected)
    naive = np.histogram2d(tilt, rot, bins=(n_tilt, n_rot), range=((0, 180), (-180, 180)))[0]
    assert naive[0].mean() < 0.2 * expected  # equal-degree bins are not equal-area (about 0.14 here)


@pytest.mark.parametrize("rot, tilt, row, col", [
    (100.0, 60.0, 4, 28),  # 1 - cos 60° = 0.5 -> row 4 of 18; (100 + 180) / 10 -> column 28
    (10.0, -60.0, 4, 1),  # the same direction as (190 = -170, 60)
    (-180.0, 0.0, 0, 0),
    (179.999, 180.0, 17, 35),
    (0.0, 90.0, 9, 18),
    (370.0, 45.0, 2, 19),  # 1 - cos 45° = 0.293 -> row 2
])
def test_single_direction_lands_in_the_expected_bin(rot, tilt, row, col):
    h = angular_histogram([rot], [tilt], n_rot=36, n_tilt=18)
    assert h.counts.sum() == 1 and h.counts[row, col] == 1
    r, t = fold_angles([rot], [tilt])
    assert h.rot_edges[col] <= r[0] < h.rot_edges[col + 1]
    assert h.tilt_edges[row] <= t[0] <= h.tilt_edges[row + 1]


def test_bad_input():
    with pytest.raises(ValueError, match="different lengths"):
        angular_histogram([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="weights"):
        angular_histogram([1.0], [1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        angular_histogram([np.nan], [1.0])
    with pytest.raises(ValueError, match="at least one bin"):
        angular_histogram([1.0], [1.0], n_rot=0)
    assert angular_histogram([], []).counts.sum() == 0

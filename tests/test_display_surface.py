"""The coloured surface of the local-resolution view (display_surface.py, no GUI) against analytic cases: a sphere whose
"local resolution" is a known function of the position; the vertices' values are that function at the vertices,
exactly where trilinear interpolation is exact (a linear function), within its error otherwise; voxels without a
value (RELION's 0 Å) do not pull a vertex towards 0; the colour range is the percentiles inside the mask; a surface
made on a block-averaged map takes its values at the right place of the full grid."""

from __future__ import annotations

import numpy as np
import pytest

from napari_gpu_relion.display_surface import (
    coloured_surface,
    full_grid_points,
    iso_mesh,
    sample_linear,
    value_limits,
)

N = 40
C = (N - 1) / 2.0
R = 11.0


def _sphere() -> tuple[np.ndarray, np.ndarray]:
    """A ball density 1 at the centre falling linearly through 0.5 at radius R (so the 0.5 surface is the sphere of
    radius R), and the radius map."""
    z, y, x = np.mgrid[:N, :N, :N].astype(np.float64) - C
    r = np.sqrt(x * x + y * y + z * z)
    return np.clip(0.5 + (R - r) / 6.0, 0.0, 1.0).astype(np.float32), r


def test_values_of_a_linear_map_are_exact_at_the_vertices():
    vol, _ = _sphere()
    z = np.mgrid[:N, :N, :N][0].astype(np.float64)
    locres = 3.0 + 0.05 * z  # Å, growing along z
    s = coloured_surface(vol, locres, 0.5)
    assert len(s.faces) > 500 and s.values.shape == (len(s.vertices),) and s.values.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(s.vertices - C, axis=1), R, atol=0.1)  # the sphere
    np.testing.assert_allclose(s.values, 3.0 + 0.05 * s.vertices[:, 0], rtol=0, atol=1e-5)
    # the colours span the 5-95 % of the whole map (no mask): 3 + 0.05 * (z at 5 %, 95 %)
    assert s.limits == pytest.approx((3.0 + 0.05 * np.percentile(z, 5), 3.0 + 0.05 * np.percentile(z, 95)))


def test_values_growing_with_radius_within_interpolation_error():
    vol, r = _sphere()
    locres = 2.0 + 0.2 * r  # a cone: trilinear interpolation is not exact near its tip, close to it at radius R
    s = coloured_surface(vol, locres, 0.5)
    analytic = 2.0 + 0.2 * np.linalg.norm(s.vertices.astype(np.float64) - C, axis=1)
    # the cone's curvature 0.2 / r over a voxel: an error below 0.2 / (8 R) Å
    np.testing.assert_allclose(s.values, analytic, rtol=0, atol=0.2 / (8 * R))
    np.testing.assert_allclose(s.values, 2.0 + 0.2 * R, atol=0.03)


def test_voxels_without_a_value_do_not_pull_vertices_to_zero():
    vol, r = _sphere()
    z = np.mgrid[:N, :N, :N][0].astype(np.float64)
    locres = np.where(r < R + 0.3, 4.0 + 0.1 * z, 0.0)  # no window reached beyond R + 0.3: 0, as RELION writes
    s = coloured_surface(vol, locres, 0.5)
    analytic = 4.0 + 0.1 * s.vertices[:, 0]
    # the valid neighbours of a vertex lie within one voxel of it: an error below the gradient over one voxel
    np.testing.assert_allclose(s.values, analytic, rtol=0, atol=0.1)
    plain = sample_linear(locres, s.vertices)  # ... where plain interpolation mixes in the zeros
    assert (analytic - plain).max() > 1.0
    # a vertex with no valid neighbour at all takes the upper colour limit (shown as the worst resolution)
    far = sample_linear(locres, [[0.0, 0.0, 0.0]], locres != 0)
    assert np.isnan(far[0])
    lone = coloured_surface(vol, np.where(r < 3, 5.0, 0.0), 0.5)
    assert np.all(lone.values == np.float32(lone.limits[1]))


def test_colour_limits_are_the_percentiles_inside_the_mask():
    vol, r = _sphere()
    locres = 2.0 + 0.2 * r
    mask = (r < 8).astype(np.float32)
    inside = locres[r < 8]
    s = coloured_surface(vol, locres, 0.5, mask=mask)
    assert s.limits == pytest.approx(tuple(np.percentile(inside, [5, 95])))
    assert value_limits(locres, mask, percentiles=(0, 100)) == pytest.approx((inside.min(), inside.max()))
    assert value_limits(np.zeros((4, 4, 4)), None, np.zeros((4, 4, 4), bool)) == pytest.approx((0.0, 0.001))
    with pytest.raises(ValueError, match="mask"):
        coloured_surface(vol, locres, 0.5, mask=mask[:-1])


def test_a_surface_of_the_binned_map_takes_its_values_from_the_full_grid():
    vol, _ = _sphere()
    z = np.mgrid[:N, :N, :N][0].astype(np.float64)
    locres = 3.0 + 0.05 * z
    binned = vol.reshape(N // 2, 2, N // 2, 2, N // 2, 2).mean(axis=(1, 3, 5))  # as display_model.bin_volume
    s = coloured_surface(binned, locres, 0.5, bin_factor=2)
    full = full_grid_points(s.vertices, 2)
    np.testing.assert_allclose(full[:, 0], s.vertices[:, 0] * 2 + 0.5)  # binned voxel i: voxels 2i, 2i + 1
    np.testing.assert_allclose(s.values, 3.0 + 0.05 * full[:, 0], atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(full - C, axis=1), R, atol=0.5)  # the same sphere, in full voxels
    with pytest.raises(ValueError, match="binned"):
        coloured_surface(vol, locres[:20], 0.5)


def test_a_level_outside_the_map_gives_an_empty_surface():
    vol, r = _sphere()
    verts, faces = iso_mesh(vol, 2.0)
    assert len(faces) == 1 and not np.ptp(verts)
    s = coloured_surface(vol, 2.0 + r, 2.0)
    assert len(s.values) == len(s.vertices) == 3

"""Display geometry of maps: iso-surfaces, and a surface coloured by a second map (arrays in, arrays out).

No napari, no Qt, nothing of the package: the live display prepares maps with it in a job's worker thread
(widgets/display_model.py), and a test can check it against analytic cases.

* :func:`iso_mesh`: the iso-surface of a map at a level, as a triangle mesh (marching cubes, scikit-image);
* :func:`sample_linear`: a map's values at points between voxels (trilinear), optionally only from the voxels
  where the map is defined (RELION's relion_locres.mrc is 0 where no window reached: such a voxel must not pull
  a vertex's resolution towards 0 Å);
* :func:`value_limits`: the colour range of a value map, its percentiles inside a mask (> 0.5);
* :func:`coloured_surface`: what RELION users look at after a LocalRes job (ChimeraX's "surface colour by volume
  data value"): the surface of the locally filtered (or post-processed) map, each vertex coloured by the local
  resolution at that place.

Coordinates are voxel indices in (z, y, x) order, as the arrays are stored; a mesh made on a block-averaged copy
of a map (``bin_factor`` f, as the display makes for boxes above 128) has its vertex v at full-grid voxel
``v * f + (f - 1) / 2`` (binned voxel i is the mean of voxels i f .. i f + f - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MESH_VOXELS_PER_STEP", "ColouredSurface", "iso_mesh", "sample_linear", "value_limits",
           "coloured_surface", "full_grid_points"]

#: Marching-cubes step (voxels) per this many voxels of box: meshes of big maps stay small (fast to draw).
MESH_VOXELS_PER_STEP = 80
#: Percentiles of the value map (inside the mask) that span the colour range by default: the range the
#: local-resolution job's summary line reports (5-95 %).
LIMIT_PERCENTILES = (5.0, 95.0)


def _empty_mesh() -> tuple[np.ndarray, np.ndarray]:
    """One degenerate triangle: nothing is drawn, but a layer can hold it."""
    return np.zeros((3, 3), np.float32), np.array([[0, 1, 2]], np.int32)


def iso_mesh(volume: np.ndarray, level: float, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The iso-surface of ``volume`` at ``level`` as (vertices (n, 3) float32 in voxels (z, y, x), faces (m, 3)
    int32), by marching cubes (scikit-image) with a step of ``step`` voxels (default: one per
    MESH_VOXELS_PER_STEP voxels of box, so big boxes give small meshes). A level outside the volume's range gives
    one degenerate triangle (nothing drawn)."""
    vol = np.asarray(volume, dtype=np.float32)
    finite = vol[np.isfinite(vol)]
    if vol.ndim != 3 or min(vol.shape) < 2 or not finite.size or not finite.min() < level < finite.max():
        return _empty_mesh()
    from skimage.measure import marching_cubes  # napari's dependency; imported where it is used

    if step is None:
        step = max(1, int(round(max(vol.shape) / MESH_VOXELS_PER_STEP)))
    verts, faces, _, _ = marching_cubes(np.nan_to_num(vol, nan=float(finite.min())), level=float(level),
                                        step_size=int(step), allow_degenerate=False)
    if not len(faces):
        return _empty_mesh()
    return np.ascontiguousarray(verts, dtype=np.float32), np.ascontiguousarray(faces, dtype=np.int32)


def sample_linear(values: np.ndarray, points: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """``values`` (a 3D map) at ``points`` (n, 3) (z, y, x in voxels), trilinearly interpolated (points outside
    the box take the nearest edge voxel). With ``valid`` (a boolean map of the same shape) only the valid voxels
    among a point's eight neighbours count, weighted as trilinear interpolation weighs them and renormalised; a
    point with no valid neighbour is NaN. Float64."""
    from scipy.ndimage import map_coordinates

    vol = np.asarray(values, dtype=np.float64)
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    if not len(pts):
        return np.zeros(0)
    coords = pts.T
    if valid is None:
        return map_coordinates(vol, coords, order=1, mode="nearest")
    ok = np.asarray(valid, dtype=np.float64)
    weight = map_coordinates(ok, coords, order=1, mode="nearest")
    total = map_coordinates(vol * ok, coords, order=1, mode="nearest")
    out = np.full(len(pts), np.nan)
    has = weight > 1e-6
    out[has] = total[has] / weight[has]
    return out


def value_limits(values: np.ndarray, mask: np.ndarray | None = None, valid: np.ndarray | None = None,
                 percentiles: tuple[float, float] = LIMIT_PERCENTILES) -> tuple[float, float]:
    """(low, high): the ``percentiles`` of ``values`` over the voxels inside ``mask`` (> 0.5; everywhere without
    one) where ``valid`` holds (everywhere without it). Where none is left: over the valid voxels, then over all;
    a non-empty range (high > low) always."""
    vol = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(vol) if valid is None else np.asarray(valid, bool) & np.isfinite(vol)
    inside = keep & (np.asarray(mask) > 0.5) if mask is not None else keep
    for where in (inside, keep, np.isfinite(vol)):
        if where.any():
            lo, hi = (float(v) for v in np.percentile(vol[where], percentiles))
            return (lo, hi) if hi > lo else (lo, lo + max(abs(lo) * 1e-3, 1e-3))
    return 0.0, 1.0


def full_grid_points(vertices: np.ndarray, bin_factor: int = 1) -> np.ndarray:
    """Vertices of a mesh made on a map block-averaged by ``bin_factor`` -> voxel coordinates of the full grid."""
    f = max(1, int(bin_factor))
    return np.asarray(vertices, dtype=np.float64) * f + (f - 1) / 2.0


@dataclass(frozen=True)
class ColouredSurface:
    """A surface and one value per vertex: ``vertices`` (n, 3) float32 (z, y, x in voxels of the map the mesh was
    made on), ``faces`` (m, 3) int32, ``values`` (n,) float32, and ``limits`` (low, high), the colour range."""

    vertices: np.ndarray
    faces: np.ndarray
    values: np.ndarray
    limits: tuple[float, float]


def coloured_surface(volume: np.ndarray, value_map: np.ndarray, level: float, *, bin_factor: int = 1,
                     mask: np.ndarray | None = None, step: int | None = None, missing: float | None = 0.0,
                     percentiles: tuple[float, float] = LIMIT_PERCENTILES) -> ColouredSurface:
    """The iso-surface of ``volume`` at ``level``, each vertex given the value of ``value_map`` there.

    ``volume`` may be a block-averaged copy (``bin_factor``) of a map on ``value_map``'s grid (see the module
    docstring). ``missing``: the value that marks voxels of ``value_map`` without a value (RELION's local
    resolution is 0 where no window reached; None: every voxel has one); they do not count in a vertex's
    interpolation, and a vertex with no valid neighbour takes the upper colour limit (the worst resolution shown).
    The colour limits are ``value_limits`` of the valid voxels inside ``mask``."""
    vmap = np.asarray(value_map, dtype=np.float64)
    if vmap.ndim != 3:
        raise ValueError(f"the value map must be 3D, got shape {vmap.shape}")
    f = max(1, int(bin_factor))
    shape = np.asarray(volume).shape
    if len(shape) != 3 or any(n * f > m for n, m in zip(shape, vmap.shape, strict=True)):
        raise ValueError(f"a map of shape {shape} binned by {f} does not lie on a value map of shape {vmap.shape}")
    if mask is not None and np.shape(mask) != vmap.shape:
        raise ValueError(f"the mask's shape {np.shape(mask)} differs from the value map's {vmap.shape}")
    valid = None if missing is None else vmap != missing
    limits = value_limits(vmap, mask, valid, percentiles)
    verts, faces = iso_mesh(volume, level, step)
    values = sample_linear(vmap, full_grid_points(verts, f), valid)
    values = np.where(np.isfinite(values), values, limits[1]).astype(np.float32)
    return ColouredSurface(verts, faces, values, limits)

"""What the live display draws, prepared from job events in the job's worker thread (no Qt, no napari).

The GUI thread must only hand finished arrays to napari (issue 18: no freezes). So the runner calls
:func:`prepare_event` in the worker thread on every event before it is queued for the GUI
(widgets/runner.py), and the display (widgets/display.py) uses what it computed:

* a map (:class:`PreparedMap`): the volume for display, block-averaged to at most MAX_DISPLAY_BOX voxels a side
  (the scale and a half-bin shift keep it in place, in Å), its contrast limits, its iso-surface level and the
  iso-surface itself as a triangle mesh (marching cubes). The display draws the mesh: a ray-cast iso volume
  took 2-3 s per frame with software OpenGL on a 1366 x 768 window (llvmpipe, 2 cores), the mesh of the same
  map about 0.1 s, and rotating it stays fluid. A map event with ``surface_values`` (the local resolution) gets
  its surface coloured: one value per vertex and the colour range (``display_surface.coloured_surface``);
* 2D class averages (:class:`PreparedClasses`): the grid layout and the composed grid image;
* an FSC curve (:class:`PreparedFsc`): its plot drawn to an image (widgets/plots.py; the display adds it);
* extracted particles (:class:`PreparedExtraction`): the gallery image of a micrograph's first particles and the
  positions of their boxes.

It also holds the display-only view of micrographs (:func:`display_micrograph`: binned and/or low-passed for the
eye; the picker never sees it).

The prepared events are subclasses of the job events, so every handler of a job event still receives them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..display_surface import MESH_VOXELS_PER_STEP, coloured_surface, iso_mesh
from ..events import ClassAveragesUpdated, FscUpdated, MapUpdated, ParticlesExtracted
from .class_grid_model import ClassGrid, compose_tiles
from .layers import VALUES_COLORMAP, iso_level

__all__ = ["MAX_DISPLAY_BOX", "MESH_VOXELS_PER_STEP", "PreparedMap", "PreparedClasses", "PreparedFsc",
           "PreparedExtraction", "bin_volume", "iso_mesh", "prepare_map", "prepare_classes", "prepare_extraction",
           "prepare_event", "extraction_boxes", "bin_image", "lowpass_image", "display_micrograph"]

#: Largest map box drawn (voxels a side); bigger maps are block-averaged for display only (the files keep
#: every voxel).
MAX_DISPLAY_BOX = 128


@dataclass(frozen=True)
class PreparedMap(MapUpdated):
    """A MapUpdated with what its layer needs, computed off the GUI thread."""

    display_volume: np.ndarray | None = None
    display_scale: tuple[float, ...] = (1.0, 1.0, 1.0)
    display_translate: tuple[float, ...] = (0.0, 0.0, 0.0)
    contrast_limits: tuple[float, float] = (0.0, 1.0)
    iso_threshold: float = 0.0
    bin_factor: int = 1
    vertices: np.ndarray | None = None  # (n, 3) z, y, x in voxels of display_volume
    faces: np.ndarray | None = None  # (m, 3) vertex indices
    vertex_values: np.ndarray | None = None  # (n,) surface_values at the vertices (a coloured surface), else None
    value_limits: tuple[float, float] = (0.0, 1.0)  # colour range of vertex_values
    value_colormap: str = VALUES_COLORMAP


@dataclass(frozen=True)
class PreparedFsc(FscUpdated):
    """An FscUpdated with its plot already drawn to an image (widgets/plots.render_fsc, off the GUI thread), and the
    job it belongs to (``source``: "Refine3D/job012"; "" unknown), named in the plot's title."""

    rendered: Any = None
    source: str = ""


@dataclass(frozen=True)
class PreparedClasses(ClassAveragesUpdated):
    """A ClassAveragesUpdated with its grid layout and grid image, computed off the GUI thread."""

    grid: ClassGrid | None = None
    grid_image: np.ndarray | None = None


def bin_volume(volume: np.ndarray, factor: int) -> np.ndarray:
    """Mean of ``factor``-sided blocks (trailing voxels that do not fill a block are dropped); float32."""
    vol = np.asarray(volume, dtype=np.float32)
    if factor <= 1:
        return np.ascontiguousarray(vol)
    shape = tuple(n // factor for n in vol.shape)
    cropped = vol[tuple(slice(0, n * factor) for n in shape)]
    blocks = cropped.reshape(shape[0], factor, shape[1], factor, shape[2], factor)
    return np.ascontiguousarray(blocks.mean(axis=(1, 3, 5), dtype=np.float32))


def _limits(vol: np.ndarray) -> tuple[float, float]:
    finite = vol[np.isfinite(vol)]
    lo = float(finite.min()) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 1.0
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def prepare_map(event: MapUpdated, max_box: int = MAX_DISPLAY_BOX, level: float | None = None) -> PreparedMap:
    """The display volume of a map (binned when its box exceeds ``max_box``), its scale and shift in Å, contrast
    limits and iso-surface level (``level``, else layers.iso_level of the display volume)."""
    if isinstance(event, PreparedMap) and level is None:
        return event
    vol = np.asarray(event.volume, dtype=np.float32)
    pixel = float(event.pixel_size) if event.pixel_size else 1.0
    factor = max(1, int(np.ceil(max(vol.shape) / max_box))) if vol.ndim == 3 else 1
    shown = bin_volume(vol, factor) if vol.ndim == 3 else np.ascontiguousarray(vol)
    scale = (pixel * factor,) * shown.ndim
    # voxel i of the binned map is the mean of voxels i*f .. i*f+f-1: its centre is (f-1)/2 voxels further
    translate = (pixel * (factor - 1) / 2.0,) * shown.ndim
    level = float(iso_level(shown) if level is None else level)
    base = {f.name: getattr(event, f.name) for f in fields(MapUpdated)}
    extra: dict[str, Any] = {}
    if shown.ndim == 3 and event.surface_values is not None:  # a surface coloured by a second map (display_surface)
        surface = coloured_surface(shown, event.surface_values, level, bin_factor=factor, mask=event.values_mask,
                                   missing=event.values_missing)
        verts, faces = surface.vertices, surface.faces
        extra = {"vertex_values": surface.values, "value_limits": surface.limits}
    else:
        verts, faces = iso_mesh(shown, level) if shown.ndim == 3 else (None, None)
    return PreparedMap(**base, display_volume=shown, display_scale=scale, display_translate=translate,
                       contrast_limits=_limits(shown), iso_threshold=level, bin_factor=factor, vertices=verts,
                       faces=faces, **extra)


def prepare_classes(event: ClassAveragesUpdated) -> PreparedClasses:
    """The class grid of an iteration's class averages and its image (each tile scaled to its own mean/std)."""
    if isinstance(event, PreparedClasses):
        return event
    imgs = np.asarray(event.images, dtype=np.float32)
    grid = ClassGrid(event.distribution, event.resolution_A, imgs.shape[-1], event.path)
    base = {f.name: getattr(event, f.name) for f in fields(ClassAveragesUpdated)}
    return PreparedClasses(**base, grid=grid, grid_image=grid.compose(imgs))


@dataclass(frozen=True)
class PreparedExtraction(ParticlesExtracted):
    """A ParticlesExtracted with its gallery image (tiles of the first particles), composed off the GUI thread."""

    gallery_image: np.ndarray | None = None


def prepare_extraction(event: ParticlesExtracted) -> PreparedExtraction:
    """The gallery of an extracted micrograph: its first particles in a grid like the class grid's (row by row, each
    tile scaled to its own mean and std)."""
    if isinstance(event, PreparedExtraction):
        return event
    imgs = np.asarray(event.images, dtype=np.float32)
    image = compose_tiles(imgs) if len(imgs) else np.zeros((1, 1), np.float32)
    base = {f.name: getattr(event, f.name) for f in fields(ParticlesExtracted)}
    return PreparedExtraction(**base, gallery_image=image)


def extraction_boxes(index: int, coords: Any) -> np.ndarray:
    """(n, 3) (micrograph, y, x) centres, in micrograph pixels, of the boxes cut around integer coordinates
    ``coords`` (n, 2) x, y: a box of even side B covers pixels x - B/2 .. x + B/2 - 1, and pixel i spans
    i - 0.5 .. i + 0.5, so its centre is at x - 0.5 (a square of side B there covers exactly the box)."""
    xy = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
    return np.column_stack([np.full(len(xy), float(index)), xy[:, 1] - 0.5, xy[:, 0] - 0.5])


def prepare_event(event: object) -> object:
    """The prepared form of a map, class-average or extraction event; any other event unchanged."""
    if isinstance(event, MapUpdated):
        return prepare_map(event)
    if isinstance(event, ClassAveragesUpdated):
        return prepare_classes(event)
    if isinstance(event, ParticlesExtracted):
        return prepare_extraction(event)
    return event


# ----------------------------------------------------------------------------------------------------------
# Micrographs for the eye: binned and/or low-passed (display only)


def bin_image(image: np.ndarray, factor: int) -> np.ndarray:
    """Mean of ``factor`` x ``factor`` pixel blocks of the last two axes (trailing pixels that do not fill a block
    are dropped); float32."""
    img = np.asarray(image, dtype=np.float32)
    if factor <= 1:
        return np.ascontiguousarray(img)
    ny, nx = img.shape[-2] // factor, img.shape[-1] // factor
    cropped = img[..., : ny * factor, : nx * factor]
    blocks = cropped.reshape(*img.shape[:-2], ny, factor, nx, factor)
    return np.ascontiguousarray(blocks.mean(axis=(-3, -1), dtype=np.float64).astype(np.float32))


def lowpass_image(image: np.ndarray, pixel_size: float, resolution_A: float) -> np.ndarray:
    """``image`` (..., ny, nx) low-passed at ``resolution_A`` Å: spatial frequencies |s| up to 1/resolution kept,
    a raised-cosine edge of 2 Fourier pixels (of the longer side) centred there, none beyond; float32. Any size
    (a micrograph need not be square or even)."""
    img = np.asarray(image, dtype=np.float32)
    ny, nx = img.shape[-2:]
    sy = np.fft.fftfreq(ny, d=pixel_size)[:, None]
    sx = np.fft.rfftfreq(nx, d=pixel_size)[None, :]
    s = np.sqrt(sy * sy + sx * sx)
    width = 2.0 / (max(ny, nx) * pixel_size)
    lo, hi = 1.0 / resolution_A - width / 2, 1.0 / resolution_A + width / 2
    filt = np.where(s < lo, 1.0, np.where(s > hi, 0.0, 0.5 + 0.5 * np.cos(np.pi * (s - lo) / width)))
    F = np.fft.rfft2(img, axes=(-2, -1))
    return np.fft.irfft2(F * filt.astype(np.float32), s=(ny, nx), axes=(-2, -1)).astype(np.float32)


def display_micrograph(image: np.ndarray, pixel_size: float, bin_factor: int = 1, lowpass_A: float = 0.0
                       ) -> tuple[np.ndarray, float, float]:
    """What the eye sees of micrograph(s) ``image`` (..., ny, nx) at ``pixel_size`` Å: binned by ``bin_factor``
    (block means), then low-passed at ``lowpass_A`` Å (0: not). Returns (image, its pixel size in Å, the shift in
    Å of its first pixel's centre): binned pixel j is the mean of pixels j f .. j f + f - 1, centred (f - 1)/2
    pixels further, so a layer drawn at that scale and shift lies exactly on the original (picks still line up).
    The low-pass is done at the binned pixel size (cheaper); a cut-off finer than its Nyquist does nothing."""
    f = max(1, int(bin_factor))
    out = bin_image(image, f)
    apix = float(pixel_size) * f
    if lowpass_A and lowpass_A > 0:
        out = lowpass_image(out, apix, float(lowpass_A))
    return out, apix, float(pixel_size) * (f - 1) / 2.0

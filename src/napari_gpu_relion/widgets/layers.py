"""Layer conventions shared by the napari reader (_reader.py) and the widgets (the live display, the picking dock,
the micrograph view): layer names, colormaps, units, the keyword arguments of map and picks layers, contrast limits
and iso-surface levels, and the file helpers both make layers with (a micrographs STAR's files and pixel size, a
post-processing STAR's FSC curves).

No napari, no Qt, and nothing from _reader (which imports the widgets, so the widgets must not import it).

The conventions (docs/napari_conventions.md, section 4):

* array axes are (z, y, x) for maps, (n, y, x) for stacks and micrograph sets, (y, x) for one micrograph;
* ``scale`` is the pixel size in Å on the spatial axes (1 on a stack axis), ``units`` angstrom on every axis
  (napari uses units only when all layers agree on all axes, so stack axes carry angstrom too);
* RELION picks (rlnCoordinateX, rlnCoordinateY) become napari points (row=Y, col=X), in micrograph pixels,
  with the micrograph's scale so that they overlay it; scores live in ``features`` (fom, class, psi).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import InputError
from ..events import FscUpdated
from ..io.jobdir import project_path
from ..io.mrc import mrc_header_info
from ..io.star import read_micrographs, read_star

__all__ = [
    "PICKS_LAYER",
    "BOXES_LAYER",
    "GALLERY_LAYER",
    "IMAGE_COLORMAP",
    "MAP_COLORMAP",
    "ANGSTROM",
    "PIXEL",
    "DEFAULT_POINT_SIZE",
    "FEATURE_DEFAULTS",
    "FSC_COLUMNS",
    "PostprocessFsc",
    "layer_units",
    "robust_limits",
    "iso_level",
    "map_kwargs",
    "points_kwargs",
    "header_pixel_size",
    "project_file",
    "micrographs_table",
    "postprocess_fsc",
    "VALUES_COLORMAP",
]

#: The live display's one picks layer (mic, y, x).
PICKS_LAYER = "picks"
#: The boxes particle extraction cut (Points, squares of the box size over the micrographs) and its gallery.
BOXES_LAYER = "extraction boxes"
GALLERY_LAYER = "extracted particles"
#: Colormap of image layers: micrographs, stacks, maps, class grids, particle galleries.
IMAGE_COLORMAP = "gray"
#: Colour of map surfaces (one value per vertex; light grey, shaded).
MAP_COLORMAP = "gray"
#: Colormap of a surface coloured by a second map (the local resolution): low values (fine resolution) blue,
#: high values (coarse) red, as ResMap and RELION users colour local-resolution maps.
VALUES_COLORMAP = "turbo"
#: napari's units: Å when the pixel size is known, else pixels.
ANGSTROM = "angstrom"
PIXEL = "pixel"
#: Point size (micrograph pixels) when the particle size is unknown.
DEFAULT_POINT_SIZE = 64.0
#: RELION's "not given" markers of a pick's scores (what its manual picker writes).
FEATURE_DEFAULTS = {"fom": -999.0, "class": -999, "psi": -999.0}
#: FSC columns of a post-processing STAR (RELION's and ours) and their names in the plot.
FSC_COLUMNS = {"rlnFourierShellCorrelationCorrected": "corrected",
               "rlnFourierShellCorrelationUnmaskedMaps": "unmasked",
               "rlnFourierShellCorrelationMaskedMaps": "masked",
               "rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps": "phase randomised"}


# ----------------------------------------------------------------------------------------------------------
# Scale, contrast, iso level


def layer_units(ndim: int, pixel_size: float | None, stack_axes: int = 0) -> tuple[tuple, tuple]:
    """(scale, units) for ``ndim`` axes whose first ``stack_axes`` are indices (not spatial)."""
    p = float(pixel_size) if pixel_size else 1.0
    spatial = ANGSTROM if pixel_size else PIXEL
    scale = (1.0,) * stack_axes + (p,) * (ndim - stack_axes)
    # Index axes (particle, micrograph) get the spatial unit too, with scale 1: napari needs one unit on
    # every axis of every layer to draw a scale bar in Å (it warns and drops units otherwise).
    units = (spatial,) * ndim
    return scale, units


def robust_limits(sample: np.ndarray, low: float = 0.5, high: float = 99.5) -> tuple[float, float]:
    """Percentile contrast limits of a (sub)sample; a non-empty range even for flat images."""
    values = np.asarray(sample, dtype=np.float32).ravel()
    values = values[np.isfinite(values)]
    if values.size == 0:
        return 0.0, 1.0
    lo, hi = (float(v) for v in np.percentile(values, [low, high]))
    if not hi > lo:
        lo, hi = float(values.min()), float(values.max())
    if not hi > lo:
        hi = lo + 1.0
    return lo, hi


def iso_level(volume: np.ndarray) -> float:
    """An iso-surface threshold separating density from solvent.

    Otsu's threshold of the voxel histogram, raised to median + 4 noise sigmas (sigma from the median
    absolute deviation; most voxels of a map are solvent) when the map is noisy, so that the surface of a
    noisy half map is not drawn through its noise. Computed on a subsample of at most ~1M voxels.
    """
    vol = np.asarray(volume, dtype=np.float32)
    step = max(1, int(np.ceil((vol.size / 2**20) ** (1 / 3))))
    values = vol[::step, ::step, ::step].ravel() if vol.ndim == 3 else vol.ravel()[::step]
    values = values[np.isfinite(values)]
    if values.size == 0:
        return 0.0
    lo, hi = float(values.min()), float(values.max())
    if not hi > lo:
        return lo
    hist, edges = np.histogram(values, bins=256, range=(lo, hi))
    centres = 0.5 * (edges[:-1] + edges[1:])
    w0 = np.cumsum(hist).astype(np.float64)
    w1 = w0[-1] - w0
    m0 = np.cumsum(hist * centres)
    mu0 = np.divide(m0, w0, out=np.zeros_like(m0), where=w0 > 0)
    mu1 = np.divide(m0[-1] - m0, w1, out=np.zeros_like(m0), where=w1 > 0)
    between = w0 * w1 * (mu0 - mu1) ** 2
    otsu = float(edges[int(np.argmax(between)) + 1])
    median = float(np.median(values))
    noise = 1.4826 * float(np.median(np.abs(values - median)))
    above_noise = median + 4.0 * noise
    return above_noise if otsu < above_noise < hi else otsu


# ----------------------------------------------------------------------------------------------------------
# Layer keyword arguments


def map_kwargs(vol: np.ndarray, pixel_size: float | None, name: str, path: Path | None = None) -> dict[str, Any]:
    """Layer keyword arguments of a 3D map (shared with the live display of jobs)."""
    scale, units = layer_units(3, pixel_size)
    finite = vol[np.isfinite(vol)] if vol.size else vol
    lo = float(finite.min()) if finite.size else 0.0
    hi = float(finite.max()) if finite.size else 1.0
    if not hi > lo:
        hi = lo + 1.0
    return {
        "name": name,
        "scale": scale,
        "units": units,
        "axis_labels": ("z", "y", "x"),
        "contrast_limits": (lo, hi),
        "colormap": IMAGE_COLORMAP,
        "rendering": "iso",
        "iso_threshold": iso_level(vol),
        "metadata": {"path": None if path is None else str(path), "pixel_size": pixel_size, "kind": "map"},
    }


def points_kwargs(n_axes: int, pixel_size: float | None, features: dict[str, np.ndarray], name: str,
                  size: float | None = None, metadata: dict | None = None) -> dict[str, Any]:
    """Keyword arguments of a picks Points layer: (y, x) or (mic, y, x), Å scale, discs without fill."""
    scale, units = layer_units(n_axes, pixel_size, stack_axes=n_axes - 2)
    labels = ("y", "x") if n_axes == 2 else ("mic", "y", "x")
    return {
        "name": name,
        "scale": scale,
        "units": units,
        "axis_labels": labels,
        "features": features,
        # a point added by hand gets RELION's "not given" markers (what the manual picker writes)
        "feature_defaults": {k: FEATURE_DEFAULTS.get(k, 0) for k in features},
        "size": float(size) if size else DEFAULT_POINT_SIZE,
        "symbol": "disc",
        "face_color": "transparent",
        "border_color": "yellow",
        "border_width": 0.06,
        "border_width_is_relative": True,
        "projection_mode": "none",
        "metadata": dict(metadata or {}, pixel_size=pixel_size, kind="picks"),
    }


# ----------------------------------------------------------------------------------------------------------
# Files behind layers


def header_pixel_size(path: Path | None) -> float | None:
    """The pixel size (Å) in an MRC file's header; None without a file or a usable header."""
    if path is None:
        return None
    try:
        return mrc_header_info(path).pixel_size
    except InputError:
        return None


def project_file(star: Path, name: str) -> Path:
    """A path from a STAR table resolved like RELION: relative to the project folder (see
    :func:`..io.jobdir.project_path`); InputError listing the folders tried when it is nowhere."""
    found, tried = project_path(name, star)
    if found is None:
        looked = ", ".join(str(t) for t in tried)
        raise InputError(f"file {name!r} not found; looked in {looked} (the current folder, then the STAR "
                         "file's folder and its parents)", path=str(star))
    return found


def micrographs_table(path: str | os.PathLike) -> tuple[list[Path], float | None, Any]:
    """Micrograph files (resolved), pixel size (Å or None) and the table of a micrographs STAR."""
    p = Path(path)
    try:
        table = read_micrographs(p)
        df = table.particles
        try:
            pixel_size: float | None = table.pixel_size
        except InputError:
            pixel_size = None
    except InputError:
        blocks = read_star(p)
        df = next((b for b in blocks.values() if isinstance(b, pd.DataFrame) and "rlnMicrographName" in b.columns),
                  None)
        if df is None:
            raise
        pixel_size = None
    files = [project_file(p, str(n)) for n in df["rlnMicrographName"]]
    if pixel_size is None and files:
        pixel_size = header_pixel_size(files[0])
    return files, pixel_size, df


@dataclass(frozen=True)
class PostprocessFsc(FscUpdated):
    """The FSC curves of a post-processing STAR, with the STAR they were read from (``star``): the live display
    shows the map beside it too when the STAR was opened as a file."""

    star: Path | None = None


def postprocess_fsc(path: str | os.PathLike) -> PostprocessFsc:
    """The FSC curves of a post-processing STAR (RELION's postprocess.star or ours) as an FscUpdated event:
    curves against rlnResolution (1/Å), the resolution from rlnFinalResolution (FSC 0.143)."""
    blocks = read_star(path)
    fsc = blocks.get("fsc")
    if not isinstance(fsc, pd.DataFrame) or "rlnResolution" not in fsc.columns:
        raise InputError("no data_fsc block with rlnResolution", path=str(path))
    curves = {name: fsc[col].to_numpy(dtype=np.float64) for col, name in FSC_COLUMNS.items() if col in fsc.columns}
    general = blocks.get("general")
    final = float(general.get("rlnFinalResolution", np.nan)) if isinstance(general, dict) else float("nan")
    return PostprocessFsc(fsc["rlnResolution"].to_numpy(dtype=np.float64), curves, final, 0.143, star=Path(path))

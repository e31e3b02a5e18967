"""napari reader for RELION files: MRC maps, stacks and micrographs; coordinate, particle and micrograph STARs;
post-processing and model STARs (shown through the live display); job folders (followed live).

``get_reader(path)`` only looks at the suffix (and, for STAR files, at the labels in the file's first lines)
and returns a reading function or None; the pixels are read when napari calls that function.

Layers follow one convention (docs/napari_conventions.md, section 4):

* array axes are (z, y, x) for maps, (n, y, x) for stacks and micrograph sets, (y, x) for one micrograph;
* ``scale`` is the pixel size in Å on the spatial axes (1 on a stack axis), ``units`` angstrom on every axis
  (napari uses units only when all layers agree on all axes, so stack axes carry angstrom too);
* RELION picks (rlnCoordinateX, rlnCoordinateY) become napari points (row=Y, col=X), in micrograph pixels,
  with the micrograph's scale so that they overlay it; scores live in ``features`` (fom, class, psi).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pandas as pd

from .errors import InputError
from .io.jobdir import project_path
from .io.mrc import is_stack, mrc_header_info, read_mrc
from .io.particle_images import load_images
from .io.star import read_coordinates, read_micrographs, read_particles, read_star

__all__ = [
    "get_reader",
    "read_paths",
    "read_mrc_layers",
    "read_star_layers",
    "coordinate_layer",
    "micrographs_layer",
    "particles_layer",
    "map_layer",
    "star_kind",
    "robust_limits",
    "iso_level",
]

LayerData = tuple[Any, dict[str, Any], str]
ReaderFunction = Callable[[str | Sequence[str]], list[LayerData]]

MRC_SUFFIXES = (".mrc", ".mrcs", ".map")
STAR_SUFFIXES = (".star",)

#: Stacks bigger than this (bytes) are read one section at a time through dask instead of loaded whole.
LAZY_STACK_BYTES = 256 * 2**20
#: At most this many particles of a particle STAR are loaded into the stack layer.
MAX_PARTICLES = 1000
#: Pixels used to estimate contrast limits (a strided subsample).
CONTRAST_SAMPLE_PIXELS = 2**20
#: Point size (micrograph pixels) when the particle size is unknown.
DEFAULT_POINT_SIZE = 64.0
#: Labels sniffed from the start of a STAR file; larger headers are not expected.
_SNIFF_BYTES = 1 << 20

_FEATURE_DEFAULTS = {"fom": -999.0, "class": -999, "psi": -999.0}

_ANGSTROM = "angstrom"
_PIXEL = "pixel"


# ----------------------------------------------------------------------------------------------------------
# Entry point


def get_reader(path: str | Sequence[str]) -> ReaderFunction | None:
    """Return a function that reads ``path`` (or every path of a list), or None if we cannot read it.

    Decided from suffixes; a STAR file is accepted only if it holds coordinates, particles, micrographs, the
    FSC curves of a post-processing or a model's class table (sniffed from its labels), so other plugins may take
    other STARs (optimiser, sampling); a folder only if it is a job folder (a model STAR of an iteration, or a
    postprocess.star).
    """
    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
    if not paths:
        return None
    for p in paths:
        if not isinstance(p, str | os.PathLike):
            return None
        if Path(p).is_dir():
            from .widgets.follow_model import is_job_folder  # no Qt

            if is_job_folder(p):
                continue
            return None
        suffix = Path(p).suffix.lower()
        if suffix in MRC_SUFFIXES:
            continue
        if suffix in STAR_SUFFIXES and star_kind(p) is not None:
            continue
        return None
    return read_paths


def read_paths(path: str | Sequence[str]) -> list[LayerData]:
    """Read one path or a list of paths into napari layer-data tuples (one or more per file)."""
    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
    layers: list[LayerData] = []
    for p in paths:
        suffix = Path(p).suffix.lower()
        if Path(p).is_dir():
            layers.extend(follow_job_folder(p))
        elif suffix in MRC_SUFFIXES:
            layers.extend(read_mrc_layers(p))
        elif suffix in STAR_SUFFIXES:
            layers.extend(read_star_layers(p))
        else:
            raise InputError("not an MRC or STAR file", path=str(p))
    return layers


# ----------------------------------------------------------------------------------------------------------
# Display helpers


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


def _subsample(image: np.ndarray, pixels: int = CONTRAST_SAMPLE_PIXELS) -> np.ndarray:
    """A strided view with about ``pixels`` values (reads only those rows of a memmap)."""
    arr = np.asarray(image) if not isinstance(image, np.ndarray) else image
    n = int(np.prod(arr.shape[-2:]))
    step = max(1, int(np.ceil(np.sqrt(n / pixels))))
    return np.asarray(arr[..., ::step, ::step], dtype=np.float32)


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


def _units(ndim: int, pixel_size: float | None, stack_axes: int = 0) -> tuple[tuple, tuple]:
    """(scale, units) for ``ndim`` axes whose first ``stack_axes`` are indices (not spatial)."""
    p = float(pixel_size) if pixel_size else 1.0
    spatial = _ANGSTROM if pixel_size else _PIXEL
    scale = (1.0,) * stack_axes + (p,) * (ndim - stack_axes)
    # Index axes (particle, micrograph) get the spatial unit too, with scale 1: napari needs one unit on
    # every axis of every layer to draw a scale bar in Å (it warns and drops units otherwise).
    units = (spatial,) * ndim
    return scale, units


# ----------------------------------------------------------------------------------------------------------
# MRC


def read_mrc_layers(path: str | os.PathLike) -> list[LayerData]:
    """One Image layer: a map (3D), a stack (.mrcs or image-stack header) or a single micrograph (2D)."""
    p = Path(path)
    info = mrc_header_info(p)
    shape = info.shape
    if len(shape) == 4:
        raise InputError(f"stacks of volumes {shape} are not supported", path=str(p))
    if len(shape) == 3 and shape[0] == 1 and p.suffix.lower() != ".mrcs":
        shape = shape[1:]
    if len(shape) == 2:
        return [micrograph_layer(p)]
    if is_stack(p):
        return [stack_layer(p)]
    return [map_layer(p)]


def micrograph_layer(path: str | os.PathLike) -> LayerData:
    """A single 2D micrograph, memory-mapped (a 4096² uint16 file costs nothing until displayed)."""
    p = Path(path)
    mrc = read_mrc(p, mmap=True)
    data = mrc.data
    if data.ndim == 3:
        data = data[0]
    if not data.dtype.isnative:
        data = np.asarray(data, dtype=data.dtype.newbyteorder("="))
    scale, units = _units(2, mrc.pixel_size)
    kwargs = {
        "name": p.stem,
        "scale": scale,
        "units": units,
        "axis_labels": ("y", "x"),
        "contrast_limits": robust_limits(_subsample(data)),
        "colormap": "gray",
        "metadata": {"path": str(p), "pixel_size": mrc.pixel_size, "kind": "micrograph"},
    }
    return data, kwargs, "image"


def _section_reader(path: Path, dtype: np.dtype, shape: tuple[int, int], offset: int) -> Callable[[int], np.ndarray]:
    """A function reading section i of a stack as float32 (open, read, close: nothing stays mapped)."""
    count = int(shape[0] * shape[1])
    nbytes = count * dtype.itemsize

    def read(i: int) -> np.ndarray:
        with open(path, "rb") as fh:
            fh.seek(offset + int(i) * nbytes)
            arr = np.fromfile(fh, dtype=dtype, count=count)
        return arr.reshape(shape).astype(np.float32)

    return read


def _lazy_stack(path: Path) -> tuple[Any, Callable[[int], np.ndarray]]:
    """A dask array (n, y, x) of float32 with one chunk per section, and the section reader."""
    info = mrc_header_info(path)
    n, ny, nx = (1,) * (3 - len(info.shape)) + tuple(info.shape)
    read = _section_reader(path, info.dtype, (ny, nx), info.offset)
    delayed = dask.delayed(read, pure=True)
    parts = [da.from_delayed(delayed(i), shape=(ny, nx), dtype=np.float32) for i in range(n)]
    return da.stack(parts), read


def _stack_sample(read: Callable[[int], np.ndarray], n: int) -> np.ndarray:
    """Subsample of the first, middle and last sections for contrast limits."""
    idx = sorted({0, n // 2, n - 1})
    return np.concatenate([_subsample(read(i)).ravel() for i in idx])


def stack_layer(path: str | os.PathLike) -> LayerData:
    """An image stack (n, y, x), scale (1, p, p); stacks above LAZY_STACK_BYTES are read per section."""
    p = Path(path)
    info = mrc_header_info(p)
    nbytes = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    if nbytes > LAZY_STACK_BYTES:
        data, read = _lazy_stack(p)
        limits = robust_limits(_stack_sample(read, int(data.shape[0])))
        lazy = True
    else:
        data = np.asarray(read_mrc(p).data, dtype=np.float32)
        if data.ndim == 2:
            data = data[np.newaxis]
        limits = robust_limits(_subsample(data[:: max(1, data.shape[0] // 64)]))
        lazy = False
    scale, units = _units(3, info.pixel_size, stack_axes=1)
    kwargs = {
        "name": p.stem,
        "scale": scale,
        "units": units,
        "axis_labels": ("n", "y", "x"),
        "contrast_limits": limits,
        "colormap": "gray",
        "metadata": {"path": str(p), "pixel_size": info.pixel_size, "kind": "stack", "lazy": lazy},
    }
    if lazy:
        kwargs["cache"] = False
    return data, kwargs, "image"


def map_layer(path: str | os.PathLike, name: str | None = None) -> LayerData:
    """A 3D map (z, y, x) in Å, ready for iso-surface rendering in 3D (threshold from Otsu's method)."""
    p = Path(path)
    mrc = read_mrc(p)
    vol = np.asarray(mrc.data, dtype=np.float32)
    return (vol, map_kwargs(vol, mrc.pixel_size, name or p.stem, path=p), "image")


def map_kwargs(vol: np.ndarray, pixel_size: float | None, name: str, path: Path | None = None) -> dict[str, Any]:
    """Layer keyword arguments of a 3D map (shared with the live display of jobs)."""
    scale, units = _units(3, pixel_size)
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
        "colormap": "gray",
        "rendering": "iso",
        "iso_threshold": iso_level(vol),
        "metadata": {"path": None if path is None else str(path), "pixel_size": pixel_size, "kind": "map"},
    }


# ----------------------------------------------------------------------------------------------------------
# STAR


def _sniff_labels(path: str | os.PathLike) -> set[str]:
    """Labels (without '_') of the non-optics blocks of a STAR file, read from its first megabyte."""
    labels: set[str] = set()
    block = None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(_SNIFF_BYTES)
    except OSError:
        return labels
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("data_"):
            block = line[5:].strip()
        elif line.startswith("_") and block != "optics":
            labels.add(line.split()[0][1:])
    return labels


#: FSC columns of a post-processing STAR (RELION's and ours) and their names in the plot.
FSC_COLUMNS = {"rlnFourierShellCorrelationCorrected": "corrected",
               "rlnFourierShellCorrelationUnmaskedMaps": "unmasked",
               "rlnFourierShellCorrelationMaskedMaps": "masked",
               "rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps": "phase randomised"}


def star_kind(path: str | os.PathLike) -> str | None:
    """'particles' (rlnImageName), 'coordinates' (rlnCoordinateX/Y), 'micrographs' (rlnMicrographName),
    'postprocess' (FSC curves of a post-processing: rlnResolution and an FSC column), 'model' (the model STAR of a
    relion_refine-style job: rlnReferenceImage, rlnClassDistribution), or None."""
    labels = _sniff_labels(path)
    if "rlnImageName" in labels:
        return "particles"
    if {"rlnCoordinateX", "rlnCoordinateY"} <= labels:
        return "coordinates"
    if "rlnMicrographName" in labels:
        return "micrographs"
    if "rlnResolution" in labels and labels & set(FSC_COLUMNS):
        return "postprocess"
    if {"rlnReferenceImage", "rlnClassDistribution"} <= labels:
        return "model"
    return None


def postprocess_fsc(path: str | os.PathLike) -> Any:
    """The FSC curves of a post-processing STAR (RELION's postprocess.star or ours) as an FscUpdated event:
    curves against rlnResolution (1/Å), the resolution from rlnFinalResolution (FSC 0.143)."""
    from .events import FscUpdated

    blocks = read_star(path)
    fsc = blocks.get("fsc")
    if not isinstance(fsc, pd.DataFrame) or "rlnResolution" not in fsc.columns:
        raise InputError("no data_fsc block with rlnResolution", path=str(path))
    curves = {name: fsc[col].to_numpy(dtype=np.float64) for col, name in FSC_COLUMNS.items() if col in fsc.columns}
    general = blocks.get("general")
    final = float(general.get("rlnFinalResolution", np.nan)) if isinstance(general, dict) else float("nan")
    return FscUpdated(fsc["rlnResolution"].to_numpy(dtype=np.float64), curves, final, 0.143)


def open_fsc_plot(path: str | os.PathLike) -> list[LayerData]:
    """Show a post-processing STAR's FSC curves in the current viewer's FSC dock (the plugin's live display);
    no layer (napari's "nothing to add" answer)."""
    import napari

    from .widgets.display import LiveDisplay

    event = postprocess_fsc(path)
    viewer = napari.current_viewer()
    if viewer is not None:
        LiveDisplay.for_viewer(viewer).show_fsc(event)
    return [(None,)]  # type: ignore[list-item]


def open_model_star(path: str | os.PathLike) -> list[LayerData]:
    """Show the iteration a model STAR stands for (run_itNNN_model.star: the class grid or the class maps;
    run_itNNN_half1_model.star: both half maps and the FSC; run_model.star: the final map) in the current viewer,
    through the plugin's live display, as a running job's results; no layer (napari's "nothing to add" answer)."""
    import napari

    from .widgets.display import LiveDisplay
    from .widgets.follow_model import model_snapshot, snapshot_events

    snap = model_snapshot(path)
    events = snapshot_events(snap, Path(path).parent.name)
    viewer = napari.current_viewer()
    if viewer is not None:
        display = LiveDisplay.for_viewer(viewer)
        for event in events:
            display.handle(display.prepare_event(event))
        display.flush()
    return [(None,)]  # type: ignore[list-item]


def follow_job_folder(path: str | os.PathLike) -> list[LayerData]:
    """Follow a RELION job folder live in the current viewer (the Jobs dock opens and says what it shows): its
    newest complete iteration now, each new one as its files appear (widgets/jobs_panel.py); no layer."""
    import napari

    from .widgets.jobs_panel import PLUGIN

    viewer = napari.current_viewer()
    if viewer is not None:
        _, panel = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
        panel.follow_folder(path)
    return [(None,)]  # type: ignore[list-item]


def read_star_layers(path: str | os.PathLike) -> list[LayerData]:
    """Layers of a coordinate, particle or micrograph STAR file (see :func:`star_kind`); a post-processing STAR
    opens its FSC plot instead."""
    kind = star_kind(path)
    if kind == "particles":
        return [particles_layer(path)]
    if kind == "coordinates":
        return [coordinate_layer(path)]
    if kind == "micrographs":
        return micrographs_layers(path)
    if kind == "postprocess":
        return open_fsc_plot(path)
    if kind == "model":
        return open_model_star(path)
    raise InputError("STAR file holds no coordinates (rlnCoordinateX/Y), particles (rlnImageName) or "
                     "micrographs (rlnMicrographName)", path=str(path))


_PICK_SUFFIXES = ("_autopick", "_manualpick", "_pick", "_picks", "_truth", "_coords", "_coordinates")


def find_micrograph(coord_path: str | os.PathLike) -> Path | None:
    """The micrograph a per-micrograph coordinate file belongs to, by name, or None.

    ``coords/mic001_autopick.star`` -> ``mic001.mrc`` looked for beside the STAR file, in its parent and in
    ``micrographs``/``Micrographs`` folders there (RELION names pick files ``<micrograph>_<suffix>.star``).
    """
    p = Path(coord_path)
    stems = [p.stem]
    for suffix in _PICK_SUFFIXES:
        if p.stem.endswith(suffix):
            stems.insert(0, p.stem[: -len(suffix)])
    if "_" in p.stem:
        stems.append(p.stem.rsplit("_", 1)[0])
    folders = [p.parent, p.parent.parent]
    for base in list(folders):
        folders.extend([base / "micrographs", base / "Micrographs"])
    for folder in folders:
        for stem in stems:
            for ext in (".mrc", ".MRC"):
                cand = folder / f"{stem}{ext}"
                if cand.is_file() and cand.resolve() != p.resolve():
                    return cand
    return None


def _header_pixel_size(path: Path | None) -> float | None:
    if path is None:
        return None
    try:
        return mrc_header_info(path).pixel_size
    except InputError:
        return None


def points_kwargs(n_axes: int, pixel_size: float | None, features: dict[str, np.ndarray], name: str,
                  size: float | None = None, metadata: dict | None = None) -> dict[str, Any]:
    """Keyword arguments of a picks Points layer: (y, x) or (mic, y, x), Å scale, discs without fill."""
    scale, units = _units(n_axes, pixel_size, stack_axes=n_axes - 2)
    labels = ("y", "x") if n_axes == 2 else ("mic", "y", "x")
    return {
        "name": name,
        "scale": scale,
        "units": units,
        "axis_labels": labels,
        "features": features,
        # a point added by hand gets RELION's "not given" markers (what the manual picker writes)
        "feature_defaults": {k: _FEATURE_DEFAULTS.get(k, 0) for k in features},
        "size": float(size) if size else DEFAULT_POINT_SIZE,
        "symbol": "disc",
        "face_color": "transparent",
        "border_color": "yellow",
        "border_width": 0.06,
        "border_width_is_relative": True,
        "projection_mode": "none",
        "metadata": dict(metadata or {}, pixel_size=pixel_size, kind="picks"),
    }


def coordinate_features(df: Any) -> dict[str, np.ndarray]:
    """fom / class / psi feature columns from a read_coordinates table."""
    return {
        "fom": df["rlnAutopickFigureOfMerit"].to_numpy(dtype=np.float64),
        "class": df["rlnClassNumber"].to_numpy(dtype=np.int64),
        "psi": df["rlnAnglePsi"].to_numpy(dtype=np.float64),
    }


def coordinate_layer(path: str | os.PathLike, pixel_size: float | None = None,
                     size: float | None = None) -> LayerData:
    """A coordinate STAR as Points (row=Y, col=X) in micrograph pixels.

    One micrograph: (y, x). A table with several rlnMicrographName values: (mic, y, x), micrographs
    numbered in order of appearance (names in ``metadata['micrograph_names']``). The pixel size comes from
    ``pixel_size``, else from the matching micrograph's header (:func:`find_micrograph`), else 1 (pixels).
    """
    p = Path(path)
    df = read_coordinates(p)
    yx = df[["rlnCoordinateY", "rlnCoordinateX"]].to_numpy(dtype=np.float64)
    metadata: dict[str, Any] = {"path": str(p)}
    names: list[str] = []
    if "rlnMicrographName" in df.columns and df["rlnMicrographName"].nunique() > 1:
        codes, uniques = _codes(df["rlnMicrographName"].astype(str).to_numpy())
        names = list(uniques)
        data = np.column_stack([codes.astype(np.float64), yx])
        metadata["micrograph_names"] = names
    else:
        data = yx
    micrograph = find_micrograph(p) if pixel_size is None else None
    if pixel_size is None:
        pixel_size = _header_pixel_size(micrograph)
    if micrograph is not None:
        metadata["micrograph"] = str(micrograph)
    kwargs = points_kwargs(data.shape[1], pixel_size, coordinate_features(df), p.stem, size, metadata)
    return data, kwargs, "points"


def _codes(values: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Integer codes of values in order of first appearance."""
    order: dict[str, int] = {}
    codes = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        codes[i] = order.setdefault(v, len(order))
    return codes, list(order)


def particles_layer(path: str | os.PathLike, max_particles: int = MAX_PARTICLES) -> LayerData:
    """The first ``max_particles`` particle images of a particle STAR as an Image stack (n, y, x)."""
    p = Path(path)
    table = read_particles(p)
    n = len(table)
    rows = np.arange(min(n, max_particles))
    images = load_images(table, rows=rows)
    try:
        pixel_size: float | None = table.pixel_size
    except InputError:
        pixel_size = None
    scale, units = _units(3, pixel_size, stack_axes=1)
    kwargs = {
        "name": p.stem,
        "scale": scale,
        "units": units,
        "axis_labels": ("particle", "y", "x"),
        "contrast_limits": robust_limits(_subsample(images[:: max(1, len(images) // 64)])),
        "colormap": "gray",
        "metadata": {"path": str(p), "pixel_size": pixel_size, "kind": "particles", "n_particles": n,
                     "rows_shown": len(rows)},
    }
    return images, kwargs, "image"


def _project_file(star: Path, name: str) -> Path:
    """A path from a STAR table resolved like RELION: relative to the project folder (see
    :func:`.io.jobdir.project_path`); InputError listing the folders tried when it is nowhere."""
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
    files = [_project_file(p, str(n)) for n in df["rlnMicrographName"]]
    if pixel_size is None and files:
        pixel_size = _header_pixel_size(files[0])
    return files, pixel_size, df


def micrographs_layer(files: Sequence[Path], pixel_size: float | None, name: str,
                      metadata: dict | None = None) -> LayerData:
    """Micrographs as one lazy Image stack (mic, y, x): each file is read only when its slice is shown."""
    if not files:
        raise InputError("no micrographs listed", path=name)
    infos = [mrc_header_info(f) for f in files]
    shapes = {tuple(i.shape[-2:]) for i in infos}
    if len(shapes) > 1:
        raise InputError(f"micrographs have different sizes ({sorted(shapes)}); open them one by one",
                         path=str(files[0]))
    ny, nx = shapes.pop()
    readers = [_section_reader(Path(f), info.dtype, (ny, nx), info.offset)
               for f, info in zip(files, infos, strict=True)]
    parts = [da.from_delayed(dask.delayed(r, pure=True)(0), shape=(ny, nx), dtype=np.float32) for r in readers]
    data = da.stack(parts)
    scale, units = _units(3, pixel_size, stack_axes=1)
    kwargs = {
        "name": name,
        "scale": scale,
        "units": units,
        "axis_labels": ("mic", "y", "x"),
        "contrast_limits": robust_limits(_subsample(readers[0](0))),
        "colormap": "gray",
        "cache": False,
        "metadata": dict(metadata or {}, pixel_size=pixel_size, kind="micrographs",
                         micrograph_names=[str(f) for f in files]),
    }
    return data, kwargs, "image"


def micrographs_layers(path: str | os.PathLike) -> list[LayerData]:
    """A micrographs STAR as an Image stack; with rlnMicrographCoordinates also its picks as Points."""
    p = Path(path)
    files, pixel_size, df = micrographs_table(p)
    layers = [micrographs_layer(files, pixel_size, p.stem, {"path": str(p)})]
    if "rlnMicrographCoordinates" in df.columns:
        coord_files = [_project_file(p, str(c)) for c in df["rlnMicrographCoordinates"]]
        layers.append(picks_over_stack(coord_files, pixel_size, f"{p.stem} picks"))
    return layers


def picks_over_stack(coord_files: Sequence[Path | None], pixel_size: float | None, name: str,
                     size: float | None = None) -> LayerData:
    """One Points layer (mic, y, x) from per-micrograph coordinate files (None = no picks for that mic)."""
    rows, feats = [], []
    for i, f in enumerate(coord_files):
        if f is None:
            continue
        df = read_coordinates(f)
        yx = df[["rlnCoordinateY", "rlnCoordinateX"]].to_numpy(dtype=np.float64)
        rows.append(np.column_stack([np.full(len(df), float(i)), yx]))
        feats.append(coordinate_features(df))
    data = np.concatenate(rows) if rows else np.empty((0, 3))
    features = {k: np.concatenate([f[k] for f in feats]) if feats else np.empty(0) for k in ("fom", "class", "psi")}
    metadata = {"coordinate_files": [None if f is None else str(f) for f in coord_files]}
    return data, points_kwargs(3, pixel_size, features, name, size, metadata), "points"

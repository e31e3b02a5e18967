"""napari reader for RELION files: MRC maps, stacks and micrographs; coordinate, particle and micrograph STARs;
post-processing and model STARs (shown through the live display); job folders (followed live).

``get_reader(path)`` only looks at the suffix (and, for STAR files, at the labels in the file's first lines)
and returns a reading function or None; the pixels are read when napari calls that function.

Layers follow one convention (docs/napari_conventions.md, section 4), written down with the layer names, colormaps,
units and layer keyword arguments in widgets/layers.py, which the widgets share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np

from .errors import InputError
from .io.mrc import is_stack, mrc_header_info, read_mrc
from .io.particle_images import load_images
from .io.star import read_coordinates, read_particles
from .widgets.layers import (
    FSC_COLUMNS,
    IMAGE_COLORMAP,
    header_pixel_size,
    iso_level,
    layer_units,
    map_kwargs,
    micrographs_table,
    points_kwargs,
    postprocess_fsc,
    project_file,
    robust_limits,
)

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
#: Labels sniffed from the start of a STAR file; larger headers are not expected.
_SNIFF_BYTES = 1 << 20


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


def _subsample(image: np.ndarray, pixels: int = CONTRAST_SAMPLE_PIXELS) -> np.ndarray:
    """A strided view with about ``pixels`` values (reads only those rows of a memmap)."""
    arr = np.asarray(image) if not isinstance(image, np.ndarray) else image
    n = int(np.prod(arr.shape[-2:]))
    step = max(1, int(np.ceil(np.sqrt(n / pixels))))
    return np.asarray(arr[..., ::step, ::step], dtype=np.float32)


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
    scale, units = layer_units(2, mrc.pixel_size)
    kwargs = {
        "name": p.stem,
        "scale": scale,
        "units": units,
        "axis_labels": ("y", "x"),
        "contrast_limits": robust_limits(_subsample(data)),
        "colormap": IMAGE_COLORMAP,
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
    scale, units = layer_units(3, info.pixel_size, stack_axes=1)
    kwargs = {
        "name": p.stem,
        "scale": scale,
        "units": units,
        "axis_labels": ("n", "y", "x"),
        "contrast_limits": limits,
        "colormap": IMAGE_COLORMAP,
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
        pixel_size = header_pixel_size(micrograph)
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
    scale, units = layer_units(3, pixel_size, stack_axes=1)
    kwargs = {
        "name": p.stem,
        "scale": scale,
        "units": units,
        "axis_labels": ("particle", "y", "x"),
        "contrast_limits": robust_limits(_subsample(images[:: max(1, len(images) // 64)])),
        "colormap": IMAGE_COLORMAP,
        "metadata": {"path": str(p), "pixel_size": pixel_size, "kind": "particles", "n_particles": n,
                     "rows_shown": len(rows)},
    }
    return images, kwargs, "image"


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
    scale, units = layer_units(3, pixel_size, stack_axes=1)
    kwargs = {
        "name": name,
        "scale": scale,
        "units": units,
        "axis_labels": ("mic", "y", "x"),
        "contrast_limits": robust_limits(_subsample(readers[0](0))),
        "colormap": IMAGE_COLORMAP,
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
        coord_files = [project_file(p, str(c)) for c in df["rlnMicrographCoordinates"]]
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

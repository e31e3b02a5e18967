"""The local-resolution dock's model (no Qt, no napari): a LocalRes job folder's files, the coloured-surface event
made from them, and the colour bar's ticks.

RELION's LocalRes job (and ours, jobs/local_resolution.py) writes ``<folder>/relion_locres.mrc`` (the local
resolution in Å of every voxel, 0 where no window reached) and ``<folder>/relion_locres_filtered.mrc`` (the map
locally filtered at that resolution). What RELION users look at is the filtered map's surface coloured by the local
resolution, with a colour bar in Å: :func:`surface_event` makes that map event from the files (the display colours it
through widgets/display_model.prepare_map and display_surface.coloured_surface), also for a folder RELION itself
wrote; :func:`legend_ticks` places the colour bar's labels.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..events import MapUpdated
from ..io.mrc import read_mrc
from ..jobs.local_resolution import DEFAULT_ROOT, SURFACE_NAME, VALUES_LABEL

__all__ = ["LOCRES_SUFFIX", "FILTERED_SUFFIX", "locres_files", "surface_event", "legend_ticks", "tick_label"]

LOCRES_SUFFIX = "_locres.mrc"
FILTERED_SUFFIX = "_locres_filtered.mrc"


def locres_files(folder: str | os.PathLike) -> tuple[Path, Path]:
    """(local-resolution map, locally filtered map) of a LocalRes job folder: ``relion_locres.mrc`` and
    ``relion_locres_filtered.mrc`` (RELION's rootname), else the only ``<root>_locres.mrc`` with its filtered map.
    InputError saying what is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError("the job folder is not there (run the job, or choose a LocalRes job folder)",
                         path=str(folder))
    roots = sorted(n[: -len(LOCRES_SUFFIX)] for n in os.listdir(folder) if n.endswith(LOCRES_SUFFIX))
    if not roots:
        raise InputError(f"no local-resolution map (<root>{LOCRES_SUFFIX}, RELION: relion{LOCRES_SUFFIX}) in the "
                         "folder yet", path=str(folder))
    root = DEFAULT_ROOT if DEFAULT_ROOT in roots else roots[-1]
    locres, filtered = folder / f"{root}{LOCRES_SUFFIX}", folder / f"{root}{FILTERED_SUFFIX}"
    if not filtered.is_file():
        raise InputError(f"{locres.name} has no locally filtered map {filtered.name} beside it", path=str(folder))
    return locres, filtered


def surface_event(folder: str | os.PathLike, mask: str | os.PathLike | None = None) -> MapUpdated:
    """The map event of a LocalRes job folder's result: the locally filtered map, its surface coloured by the local
    resolution (colour range from the resolutions inside ``mask``, > 0.5, where given). Reads the files (call it in
    a worker thread)."""
    locres_path, filtered_path = locres_files(folder)
    locres = read_mrc(locres_path)
    filtered = read_mrc(filtered_path)
    values = np.asarray(locres.data, np.float32)
    volume = np.asarray(filtered.data, np.float32)
    if values.shape != volume.shape or values.ndim != 3:
        raise InputError(f"the local-resolution map's shape {values.shape} differs from the filtered map's "
                         f"{volume.shape}", path=str(locres_path))
    mask_values = None
    if mask is not None and str(mask).strip():
        m = np.asarray(read_mrc(mask).data, np.float32)
        if m.shape != values.shape:
            raise InputError(f"the mask's shape {m.shape} differs from the maps' {values.shape}", path=str(mask))
        mask_values = m
    pixel = float(filtered.pixel_size or locres.pixel_size or 1.0)
    return MapUpdated(SURFACE_NAME, volume, pixel, filtered_path, surface_values=values, values_mask=mask_values,
                      values_label=VALUES_LABEL, values_path=locres_path, values_missing=0.0)


def legend_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """``count`` values evenly spaced from ``low`` to ``high`` (both ends included): where the colour bar's labels
    go. One value for an empty range."""
    if not high > low or count < 2:
        return [float(low)]
    return [float(v) for v in np.linspace(low, high, count)]


def tick_label(value: float, unit: str = "Å") -> str:
    """A colour-bar label: one decimal (local resolutions differ by tenths of Å), then the unit."""
    return f"{value:.1f} {unit}".rstrip()

"""napari writer: a Points layer to RELION coordinate STAR file(s).

Points are (y, x) or (mic, y, x) in micrograph pixels (our reader and the live display give them the
micrograph's pixel size as ``scale``, so data coordinates are pixels). A layer whose metadata records the
micrograph ``pixel_size`` but whose scale differs (e.g. drawn in a layer of scale 1 over an Å-scaled image)
is converted through world coordinates: pixel = (data * scale + translate) / pixel_size.

Only points that are ``shown`` are written (a figure-of-merit threshold hides picks without deleting them,
and saving keeps what the user sees). Feature columns ``fom``, ``class`` and ``psi`` become
rlnAutopickFigureOfMerit, rlnClassNumber and rlnAnglePsi.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .io.star import write_coordinates

__all__ = ["write_points"]

_FEATURE_COLUMNS = {
    "fom": ("fom", "rlnAutopickFigureOfMerit", "score"),
    "class_number": ("class", "rlnClassNumber"),
    "psi": ("psi", "rlnAnglePsi"),
}


def _feature(features: Any, names: tuple[str, ...], keep: np.ndarray) -> np.ndarray | None:
    if features is None:
        return None
    columns = getattr(features, "columns", features)
    for name in names:
        if name in columns:
            values = np.asarray(features[name])
            return values[keep] if values.shape[:1] == keep.shape else None
    return None


def _to_pixels(data: np.ndarray, meta: dict[str, Any]) -> np.ndarray:
    """Data coordinates -> micrograph pixels on the last two axes (see the module docstring)."""
    metadata = meta.get("metadata") or {}
    pixel_size = metadata.get("pixel_size")
    scale = np.asarray(meta.get("scale", np.ones(data.shape[1])), dtype=np.float64)
    translate = np.asarray(meta.get("translate", np.zeros(data.shape[1])), dtype=np.float64)
    if not pixel_size or data.size == 0:
        return data
    same_scale = np.allclose(scale[-2:], float(pixel_size), rtol=1e-9, atol=0.0)
    no_shift = np.all(translate[-2:] == 0)
    if same_scale and no_shift:
        return data
    out = data.copy()
    out[:, -2:] = (data[:, -2:] * scale[-2:] + translate[-2:]) / float(pixel_size)
    return out


def _mic_label(index: int, names: list[str] | None) -> str:
    if names and 0 <= index < len(names):
        return Path(str(names[index])).stem
    return f"mic{index + 1:03d}"


def write_points(path: str, data: Any, meta: dict[str, Any]) -> list[str]:
    """Write a points layer as RELION coordinate STAR; returns the paths written.

    2D points, or 3D points all on one micrograph, go to ``path``. Points on several micrographs
    ((mic, y, x) layers) go to one file per micrograph beside ``path``: ``<stem>_<micrograph>.star``,
    named after ``metadata['micrograph_names']`` when present (RELION's per-micrograph layout).
    """
    pts = np.asarray(data, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] < 2:
        pts = pts.reshape(-1, max(2, pts.shape[-1] if pts.ndim else 2))
    n = len(pts)
    shown = meta.get("shown")
    keep = np.ones(n, dtype=bool) if shown is None or len(shown) != n else np.asarray(shown, dtype=bool)
    features = meta.get("features")
    columns = {key: _feature(features, names, keep) for key, names in _FEATURE_COLUMNS.items()}
    pts = _to_pixels(pts[keep], meta)

    out = Path(os.fspath(path))
    if out.suffix.lower() != ".star":
        out = out.with_name(out.name + ".star")

    if pts.shape[1] == 2:
        groups = {None: np.arange(len(pts))}
    else:
        lead = np.round(pts[:, :-2]).astype(np.int64)
        if lead.shape[1] > 1:
            lead = lead[:, -1:]
        mics = lead[:, 0]
        uniq = np.unique(mics)
        groups = {None: np.arange(len(pts))} if len(uniq) <= 1 else {int(m): np.flatnonzero(mics == m) for m in uniq}

    names = (meta.get("metadata") or {}).get("micrograph_names")
    written: list[str] = []
    for mic, rows in groups.items():
        target = out if mic is None else out.with_name(f"{out.stem}_{_mic_label(mic, names)}.star")
        write_coordinates(
            target,
            x=pts[rows, -1],
            y=pts[rows, -2],
            fom=None if columns["fom"] is None else columns["fom"][rows],
            class_number=None if columns["class_number"] is None else columns["class_number"][rows],
            psi=None if columns["psi"] is None else columns["psi"][rows],
        )
        written.append(str(target))
    return written

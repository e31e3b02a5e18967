"""Dock widget "Auto-picking" (napari.yaml): the generic job widget of jobs.autopick, plus a pick threshold and
saving of edited picks.

Each micrograph's picks arrive as MicrographPicked (one Points layer "picks" over the micrographs, FOM in
features; widgets/display.py). The "Threshold (FOM)" slider hides picks below it without re-picking; its range
follows the FOMs of the automatic picks. Points can be added, moved and deleted by hand in the picks layer
(napari's point tools); "Save picks" writes one coordinate STAR per micrograph (<micrograph>_autopick.star, shown
picks only, through the plugin's writer) and an autopick.star list to a folder, ready for particle extraction.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from magicgui.widgets import FileEdit, FloatSlider, Label, PushButton
from napari.utils.notifications import show_info

from .._writer import write_points
from ..errors import InputError
from ..io.micrographs import output_root, write_coordinate_list
from ..jobs import autopick
from .job_widget import JobWidget
from .runner import error_message

if TYPE_CHECKING:
    import napari

__all__ = ["AutopickWidget", "widget", "save_picks_layer"]

EDITED_FOLDER = "edited_picks"
#: Slider positions between the lowest and the highest figure of merit.
SLIDER_STEPS = 1000


def _micrograph_label(index: int, names: list[str]) -> tuple[str, str | None]:
    """(file root, micrograph name or None) of micrograph ``index``: RELION's output root of its name."""
    name = names[index] if 0 <= index < len(names) and names[index] else None
    return (output_root(name) if name else f"mic{index + 1:03d}"), name


def save_picks_layer(layer: Any, folder: Path) -> tuple[list[Path], int]:
    """Write a (mic, y, x) picks layer as <folder>/<micrograph>_autopick.star per micrograph (shown points only,
    through :func:`napari_gpu_relion._writer.write_points`; a micrograph without shown picks gets an empty file)
    and <folder>/autopick.star listing them. Returns (files written, picks written)."""
    data = np.asarray(layer.data, dtype=np.float64)
    if data.ndim != 2 or data.shape[1] != 3:
        raise InputError(f"the picks layer must have (micrograph, y, x) points, got shape {data.shape}")
    names = list((layer.metadata or {}).get("micrograph_names") or [])
    mics = np.round(data[:, 0]).astype(np.int64)
    shown = np.asarray(layer.shown, dtype=bool)
    features = layer.features
    scale, translate = np.asarray(layer.scale), np.asarray(layer.translate)
    indices = sorted({i for i, nm in enumerate(names) if nm} | set(mics.tolist()))
    files, listed, n_written = [], ([], []), 0
    for m in indices:
        rows = mics == m
        root, name = _micrograph_label(m, names)
        meta = {"scale": scale[1:], "translate": translate[1:], "shown": shown[rows],
                "features": features[rows].reset_index(drop=True), "metadata": dict(layer.metadata)}
        target = Path(write_points(str(folder / f"{root}_autopick.star"), data[rows, 1:], meta)[0])
        files.append(target)
        n_written += int(shown[rows].sum())
        if name is not None:
            listed[0].append(name)
            listed[1].append(str(target))
    if listed[0]:
        files.append(write_coordinate_list(folder / "autopick.star", *listed))
    return files, n_written


class AutopickWidget(JobWidget):
    """The auto-picking job widget with a FOM threshold slider and "Save picks" (see the module docstring)."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        super().__init__(viewer, autopick)
        self.fom_slider = FloatSlider(value=0.0, min=0.0, max=1.0, name="pick_threshold", label="Threshold (FOM)",
                                     enabled=False)
        self.fom_slider.tooltip = ("Hide picks with a figure of merit below this (no re-picking; hidden picks are "
                                  "not saved). Points added by hand are always shown.")
        self.picks_info = Label(value="no picks yet", name="picks_info", label="picks")
        self.picks_folder = FileEdit(mode="d", nullable=True, name="picks_folder", label="picks folder")
        self.picks_folder.line_edit.value = ""
        self.picks_folder.tooltip = f"Folder for the saved coordinate files; empty: <job folder>/{EDITED_FOLDER}"
        self.save_picks_button = PushButton(text="Save picks", name="save_picks_button", label="")
        self.save_picks_button.tooltip = ("Write the shown picks (edited by hand or not) as one coordinate STAR "
                                          "per micrograph plus autopick.star")
        self.extend([self.fom_slider, self.picks_info, self.picks_folder, self.save_picks_button])
        self.last_saved: tuple[list[Path], int] | None = None
        self.fom_slider.changed.connect(self._on_threshold)
        self.save_picks_button.changed.connect(self.save_picks)
        display, callback = self.display, self._on_picks
        display.connect("picks", callback)
        self.native.destroyed.connect(lambda *_: display.disconnect("picks", callback))
        self._on_picks(None)

    def picks_layer(self) -> Any:
        """The live picks layer, or None."""
        return self.display.picks_layer()

    # -- threshold ---------------------------------------------------------------------------------------

    def _on_picks(self, _layer: Any) -> None:
        """Picks shown or edited: the slider spans the automatic picks' FOMs (the threshold kept inside)."""
        if self._closed:
            return
        fom_range = self.display.pick_fom_range()
        if fom_range is not None:
            self._set_threshold_range(*fom_range)
        self._update_info()

    def _set_threshold_range(self, lo: float, hi: float) -> None:
        hi = hi if hi > lo else lo + max(abs(lo), 1.0) * 1e-3
        current = self.display.pick_threshold
        target = lo if not np.isfinite(current) or current <= lo else min(current, hi)
        slider = self.fom_slider
        with slider.changed.blocked():
            slider.min, slider.max = min(lo, slider.min), max(hi, slider.max)  # never an empty range meanwhile
            slider.min, slider.max = lo, hi
            slider.step = (hi - lo) / SLIDER_STEPS
            slider.value = target
        slider.enabled = True
        self._on_threshold(slider.value)

    def _on_threshold(self, value: float) -> None:
        """At the slider's lowest position everything is shown (no rounding of the lowest FOM can hide it)."""
        self.display.set_pick_threshold(-np.inf if value <= self.fom_slider.min else float(value))
        self._update_info()

    def _update_info(self) -> None:
        layer = self.picks_layer()
        if layer is None or self._closed:
            return
        shown = int(np.count_nonzero(layer.shown))
        threshold = self.display.pick_threshold
        above = f" (FOM ≥ {threshold:.4g})" if np.isfinite(threshold) else ""
        self.picks_info.value = f"{shown} of {len(layer.data)} picks shown{above}"

    # -- saving ------------------------------------------------------------------------------------------

    def picks_path(self) -> Path:
        """Folder "Save picks" writes to: the one chosen, else <job folder>/edited_picks."""
        text = self.picks_folder.line_edit.value.strip()
        if text:
            return Path(text).expanduser()
        return Path(self.folder.value.strip() or ".") / EDITED_FOLDER

    def save_picks(self, *_: Any) -> list[Path] | None:
        """Write the shown picks per micrograph (see :func:`save_picks_layer`); report how many."""
        layer = self.picks_layer()
        if layer is None:
            self._report_error("Save picks: no picks layer yet (run auto-picking first)")
            return None
        folder = self.picks_path()
        try:
            files, n = save_picks_layer(layer, folder)
        except (InputError, OSError) as exc:
            self._report_error(f"Save picks: {error_message(exc)}")
            return None
        n_mics = sum(1 for f in files if f.name != "autopick.star")
        message = f"wrote {n} picks of {n_mics} micrograph(s) to {folder}"
        self._set_status(message)
        show_info(message)
        self.last_saved = (files, n)
        return files


widget = AutopickWidget

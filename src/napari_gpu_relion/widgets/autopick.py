"""Dock widget "Auto-picking" (napari.yaml): the generic job widget of jobs.autopick, plus a pick threshold and
saving of edited picks.

Each micrograph's picks arrive as MicrographPicked (one Points layer "picks" over the micrographs, FOM in features;
widgets/display.py, state in widgets/pick_model.py). The layer is made, empty, when the dock opens over micrographs,
so that the picks only fill it (no new layer while they arrive). The "Threshold (FOM)" slider hides picks below it
without re-picking; its range follows the FOMs of the automatic picks, and a histogram of those FOMs under it shows
the threshold as a line (PickModel.fom_histogram, drawn by plots.FomHistogramView). Points can be added, moved and
deleted by hand in the picks layer (napari's point tools); "Save picks" writes one coordinate STAR per micrograph
(<micrograph>_autopick.star, shown picks only, as the plugin's writer does) and an autopick.star list to a folder,
ready for particle extraction.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from magicgui.widgets import FileEdit, FloatSlider, Label, PushButton
from napari.utils.notifications import show_info

from ..errors import InputError
from ..io.micrographs import output_root, write_coordinate_list
from ..io.star import write_coordinates
from ..jobs import autopick
from .job_widget import JobWidget, chooser_button, wrapping
from .layers import micrographs_table
from .micrograph_view import MicrographDisplay
from .pick_model import PickModel
from .plots import FomHistogramView
from .runner import error_message

if TYPE_CHECKING:
    import napari

__all__ = ["AutopickWidget", "widget", "write_pick_files"]

EDITED_FOLDER = "edited_picks"
#: Slider positions between the lowest and the highest figure of merit.
SLIDER_STEPS = 1000


def _micrograph_label(index: int, name: str) -> str:
    """File root of micrograph ``index``: RELION's output root of its name, else micNNN."""
    return output_root(name) if name else f"mic{index + 1:03d}"


def write_pick_files(model: PickModel, folder: Path) -> tuple[list[Path], int]:
    """Write :meth:`PickModel.coordinate_tables` as <folder>/<micrograph>_autopick.star per micrograph (shown
    picks only; a micrograph without shown picks gets an empty file) and <folder>/autopick.star listing the
    named ones. Returns (files written, picks written)."""
    files, listed, n_written = [], ([], []), 0
    for table in model.coordinate_tables():
        target = write_coordinates(folder / f"{_micrograph_label(table.index, table.name)}_autopick.star",
                                   x=table.x, y=table.y, fom=table.fom, class_number=table.class_number,
                                   psi=table.psi)
        files.append(target)
        n_written += len(table)
        if table.name:
            listed[0].append(table.name)
            listed[1].append(str(target))
    if listed[0]:
        files.append(write_coordinate_list(folder / "autopick.star", *listed))
    return files, n_written


def _set_decimals(slider: FloatSlider, span: float) -> None:
    """Enough decimals in the slider's number to tell about 100 positions apart (at least 2)."""
    decimals = int(np.clip(2 - np.floor(np.log10(span)) if span > 0 else 3, 2, 6))
    set_decimals = getattr(slider.native, "setDecimals", None)
    if set_decimals is not None:
        set_decimals(decimals)


def _pixel_size_of(params: Any) -> float | None:
    """The micrographs' pixel size (Å) of auto-picking parameters: --angpix, else the micrographs STAR's."""
    if getattr(params, "angpix", -1) and params.angpix > 0:
        return float(params.angpix)
    try:
        return micrographs_table(params.i)[1]
    except (InputError, OSError, ValueError, KeyError):
        return None


class AutopickWidget(JobWidget):
    """The auto-picking job widget with a FOM threshold slider and "Save picks" (see the module docstring)."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        super().__init__(viewer, autopick)
        self.fom_slider = FloatSlider(value=0.0, min=0.0, max=1.0, name="pick_threshold", label="Threshold (FOM)",
                                     enabled=False)
        self.fom_slider.tooltip = ("Hide picks with a figure of merit below this (no re-picking; hidden picks are "
                                  "not saved). Points added by hand are always shown. The slider ends at the "
                                  "highest FOM, or below an outlier at the top (which stays shown).")
        self.picks_info = Label(value="no picks yet", name="picks_info", label="picks")
        wrapping(self.picks_info)
        self.picks_folder = FileEdit(mode="d", nullable=True, name="picks_folder", label="picks folder")
        self.picks_folder.line_edit.value = ""
        self.picks_folder.line_edit.native.setMinimumWidth(60)
        chooser_button(self.picks_folder, "Choose the folder for the saved picks")
        self.picks_folder.tooltip = f"Folder for the saved coordinate files; empty: <job folder>/{EDITED_FOLDER}"
        self.save_picks_button = PushButton(text="Save picks", name="save_picks_button", label="")
        self.save_picks_button.tooltip = ("Write the shown picks (edited by hand or not) as one coordinate STAR "
                                          "per micrograph plus autopick.star")
        box = self.add_results_tab("Picks", [self.fom_slider, self.picks_info, self.picks_folder,
                                             self.save_picks_button])
        self.fom_histogram = FomHistogramView()
        self.fom_histogram.setToolTip("Figures of merit of the automatic picks (grey: all, blue: shown) and the "
                                      "threshold (red line). Template picks (--fom zscore): noise standard "
                                      "deviations; LoG: RELION's LoG response")
        box.native.layout().insertWidget(1, self.fom_histogram)
        self.micrograph_display = MicrographDisplay(viewer)  # display-only binning and low-pass of the micrographs
        self.add_results_tab("Display", [self.micrograph_display], front=False, labels=False)
        self.last_saved: tuple[list[Path], int] | None = None
        self.fom_slider.changed.connect(self._on_threshold)
        self.save_picks_button.changed.connect(self.save_picks)
        self.display.connect("picks", self._on_picks)  # held weakly by the display: nothing to undo at close
        self._on_picks(None)
        # the empty picks layer now (next display turn), not while the picks arrive (LiveDisplay.prepare_picks_layer)
        self.display.later(self.display.prepare_picks_layer)

    def picks_layer(self) -> Any:
        """The live picks layer, or None."""
        return self.display.picks_layer()

    def start_job(self, *args: Any) -> Any:
        """Start picking; the picks layer gets the micrographs' pixel size (Å, like the micrographs), from
        --angpix or from the micrographs STAR, when no micrograph layer tells it."""
        job = super().start_job(*args)
        params = self.last_params
        if job is not None and params is not None and not self.display.micrograph_pixel_size:
            self.display.micrograph_pixel_size = _pixel_size_of(params)
        return job

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
            _set_decimals(slider, hi - lo)
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
        model = self.display.pick_model()
        if not len(model) and not len(layer.data):  # the layer made ahead, still empty
            self.picks_info.value = "no picks yet"
            self.fom_histogram.set_histogram(None)
            return
        above = f" (FOM ≥ {model.threshold:.4g})" if np.isfinite(model.threshold) else ""
        self.picks_info.value = f"{model.n_shown} of {len(model)} picks shown{above}"
        self.fom_histogram.set_histogram(model.fom_histogram())

    # -- saving ------------------------------------------------------------------------------------------

    def picks_path(self) -> Path:
        """Folder "Save picks" writes to: the one chosen, else <job folder>/edited_picks."""
        text = self.picks_folder.line_edit.value.strip()
        if text:
            return Path(text).expanduser()
        return Path(self.folder.value.strip() or ".") / EDITED_FOLDER

    def save_picks(self, *_: Any) -> list[Path] | None:
        """Write the shown picks per micrograph (see :func:`write_pick_files`); report how many."""
        layer = self.picks_layer()
        if layer is None or not len(layer.data):
            self._report_error("Save picks: no picks yet (run auto-picking first, or add points to the picks layer)")
            return None
        folder = self.picks_path()
        try:
            files, n = write_pick_files(self.display.pick_model(), folder)
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

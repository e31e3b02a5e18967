"""Dock widget "3D auto-refine" (napari.yaml): the generic job widget of jobs.refine3d, plus the angular
distribution.

Each iteration's half maps arrive as MapUpdated (updated in place) and the FSC as FscUpdated
(widgets/display.py). When the job finishes, the viewing directions of its final data STAR (the Finished event's
"data" output) are drawn in the "Angular distribution" dock (equal-area bins, rot and tilt in degrees);
"Show angular distribution" draws it for the newest data STAR of the job folder at any time (final, else the
newest iteration's; names from io/jobdir.py). The STAR is read and the plot drawn in a background thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from magicgui.widgets import PushButton
from napari.qt.threading import create_worker

from ..compute.angular_distribution import angular_histogram
from ..errors import InputError
from ..events import Finished
from ..io.jobdir import RunFiles
from ..io.star import read_particles
from ..jobs import refine3d
from .job_widget import JobWidget
from .plots import render_angular_distribution
from .runner import error_message

if TYPE_CHECKING:
    import napari

__all__ = ["Refine3DWidget", "widget", "read_angles"]

ANGLES = ("rlnAngleRot", "rlnAngleTilt")


def read_angles(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(rot, tilt) in degrees of every particle of a particles STAR."""
    parts = read_particles(path, require=ANGLES, uniform_optics=False, even_box=False).particles
    return parts["rlnAngleRot"].to_numpy(dtype=np.float64), parts["rlnAngleTilt"].to_numpy(dtype=np.float64)


class Refine3DWidget(JobWidget):
    """The 3D auto-refine job widget; shows the angular distribution when the job finishes."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        super().__init__(viewer, refine3d)
        self.angdist_button = PushButton(text="Show angular distribution", name="angdist_button", label="")
        self.angdist_button.tooltip = "Viewing directions of the newest data STAR of the job folder"
        self.add_results_tab("Results", [self.angdist_button])
        self.angdist_button.changed.connect(self.show_angular_distribution)
        self._angdist_worker: Any = None

    def _on_finished(self, ev: Finished) -> None:
        super()._on_finished(ev)
        data = (ev.outputs or {}).get("data")
        if data is not None:
            self.show_angular_distribution(path=Path(data))

    def show_angular_distribution(self, *_: Any, path: Path | None = None) -> Any:
        """Draw the angular distribution of ``path`` (default: the newest data STAR of the job folder). The STAR
        is read, binned and drawn in a background thread; the dock shows the picture when it is ready. Returns
        that thread's worker (None, with the reason in the status line, when there is no data STAR)."""
        folder = self.folder.value.strip()
        if path is None:
            path = RunFiles.from_output(folder).latest_data() if folder else None
        if path is None:
            self._report_error("angular distribution: no data STAR (final or of an iteration) in the job folder")
            return None
        worker = create_worker(_angular_distribution, Path(path), self.display.plot_colors, _start_thread=False)
        worker.returned.connect(self._show_angdist)
        worker.errored.connect(self._angdist_failed)
        self._angdist_worker = worker  # kept until it is done
        worker.start()
        return worker

    def _show_angdist(self, result: tuple[Any, Path, Any]) -> None:
        if not self._closed:
            hist, path, rendered = result
            self.display.show_angular_histogram(hist, path, rendered)

    def _angdist_failed(self, exc: BaseException) -> None:
        if isinstance(exc, InputError | OSError | ValueError):
            self._report_error(f"angular distribution: {error_message(exc)}")
        else:
            self._report_error(f"angular distribution failed: {error_message(exc)}")


def _angular_distribution(path: Path, colors: tuple[str, str]) -> tuple[Any, Path, Any]:
    """(histogram, path, rendered plot) of the viewing directions of a particles STAR (a worker thread)."""
    rot, tilt = read_angles(path)
    hist = angular_histogram(rot, tilt)
    return hist, path, render_angular_distribution(hist, path, colors)


widget = Refine3DWidget

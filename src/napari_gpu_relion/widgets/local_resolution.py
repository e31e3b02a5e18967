"""Dock widget "Local resolution" (napari.yaml): the generic job widget of jobs.local_resolution (RELION's LocalRes
job, relion_postprocess --locres), plus the result as RELION users look at it.

The dock asks for the job folder and passes ``<folder>/relion`` as the job's rootname, as RELION's LocalRes job does
(files ``relion_locres.mrc``, ``relion_locres_filtered.mrc``, ``relion_locres_fscs.star``): the job's DEFAULT_ROOT,
through the rootname every job dock derives from its output field (job_widget.output_rootname). The Jobs dock fills it
from a post-processing (its half maps, mask and sharpening B-factor; widgets/jobs_model.companions).

When the job finishes, its map event carries the locally filtered map and the local resolution
(jobs/local_resolution.py): the display draws the filtered map's surface coloured by the local resolution (turbo:
fine resolution blue, coarse red; the colour range the 5-95 % of the resolutions inside the mask, the range the job's
summary line gives) with napari's colour bar on the canvas, made in the job's worker thread
(display_surface.coloured_surface). The "Result" tab shows the same colour bar with its unit (Å) and, with "Show
coloured surface", draws it again from the job folder's files at another surface level (empty: automatic), also for
a LocalRes folder RELION wrote; the files are read and the surface made in a background thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from magicgui.widgets import Label, LineEdit, PushButton
from napari.qt.threading import create_worker

from ..errors import InputError
from ..events import MapUpdated
from ..jobs import local_resolution
from .display_model import PreparedMap, prepare_map
from .job_widget import JobWidget, wrapping
from .layers import VALUES_COLORMAP
from .locres_model import surface_event
from .plots import ColourBarView
from .runner import error_message

if TYPE_CHECKING:
    import napari

__all__ = ["LocalResolutionWidget", "widget", "colormap_colours"]


def colormap_colours(name: str = VALUES_COLORMAP, n: int = 256) -> Any:
    """(n, 4) RGBA in 0..1 of napari's colormap ``name`` from its low to its high end (what the surface uses)."""
    import numpy as np
    from napari.utils.colormaps import ensure_colormap

    return ensure_colormap(name).map(np.linspace(0.0, 1.0, n))


class LocalResolutionWidget(JobWidget):
    """The local-resolution job widget; shows the coloured surface's colour bar (see the module docstring)."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        super().__init__(viewer, local_resolution)
        self.legend = ColourBarView("Run the job (or choose a LocalRes job folder and click Show) to colour the "
                                    "map by its local resolution")
        self.legend.setToolTip("The surface's colours: its local resolution in Å (blue: finest). The range is the "
                               "5-95 % of the local resolutions inside the mask.")
        self.result_info = Label(value="", name="locres_result", label="")
        wrapping(self.result_info)
        level_label = Label(value="Surface level (map units; empty = automatic):", name="surface_level_label")
        wrapping(level_label)
        self.surface_level = LineEdit(value="", name="surface_level", label="Surface level (map units)")
        self.surface_level.tooltip = ("The level of the filtered map at which its surface is drawn; empty: automatic "
                                      "(Otsu's threshold, above the noise)")
        self.show_button = PushButton(text="Show coloured surface", name="show_surface_button", label="")
        self.show_button.tooltip = ("Draw the locally filtered map of the job folder coloured by its local "
                                    "resolution (relion_locres.mrc, relion_locres_filtered.mrc; RELION's too)")
        box = self.add_results_tab("Result", [self.result_info, level_label, self.surface_level, self.show_button],
                                   front=True, labels=False)
        box.native.layout().insertWidget(0, self.legend)
        self.show_button.changed.connect(self.show_surface)
        self._surface_worker: Any = None

    # -- the coloured surface ---------------------------------------------------------------------------------

    def _on_map(self, ev: MapUpdated) -> None:
        super()._on_map(ev)
        self._show_legend(ev)

    def _show_legend(self, ev: Any) -> None:
        """The colour bar and the level of a coloured surface just drawn (a PreparedMap with vertex values)."""
        values = getattr(ev, "vertex_values", None)
        if values is None or self._closed:
            return
        low, high = ev.value_limits
        self.legend.set_range(low, high, f"{ev.values_label or 'value'}", colormap_colours(ev.value_colormap))
        where = "inside the mask" if ev.values_mask is not None else "where windows reach"
        self.result_info.value = (f"Colours: {low:.2f}-{high:.2f} Å (5-95 % of the local resolutions {where}); "
                                  f"surface of the filtered map at level {ev.iso_threshold:.3g}")
        self.show_results_tab()

    def show_surface(self, *_: Any) -> Any:
        """Draw the job folder's filtered map coloured by its local resolution, at the level typed (empty:
        automatic). The files are read and the surface made in a background thread; returns its worker (None, with
        the reason in the status line, for a bad level or no folder)."""
        folder = self.folder.value.strip() or self.inputs["o"].line_edit.value.strip()
        if not folder:
            self._report_error("local resolution: choose the job folder first")
            return None
        text = self.surface_level.value.strip()
        try:
            level = float(text) if text else None
        except ValueError:
            self._report_error(f"local resolution: the surface level must be a number or empty, got {text!r}")
            return None
        mask = self.inputs["mask"].line_edit.value.strip() or None
        worker = create_worker(_coloured_surface, Path(folder), mask, level, _start_thread=False)
        worker.returned.connect(self._surface_ready)
        worker.errored.connect(self._surface_failed)
        self._surface_worker = worker  # kept until it is done
        self._set_status("local resolution: colouring the surface...")
        worker.start()
        return worker

    def _surface_ready(self, ev: PreparedMap) -> None:
        if self._closed:
            return
        self.display.expect()  # the 3D view, if the viewer shows 2D results now
        self.display.handle(ev)  # replaces the surface of the same name in place
        self.display.drain()
        self._show_legend(ev)
        self._set_status(f"local resolution: surface of {Path(ev.path).name if ev.path else 'the map'} at level "
                         f"{ev.iso_threshold:.3g}, coloured by {Path(ev.values_path).name if ev.values_path else ''}")

    def _surface_failed(self, exc: BaseException) -> None:
        if isinstance(exc, InputError | OSError | ValueError):
            self._report_error(f"local resolution: {error_message(exc)}")
        else:
            self._report_error(f"local resolution: could not colour the surface: {error_message(exc)}")


def _coloured_surface(folder: Path, mask: str | None, level: float | None) -> PreparedMap:
    """The coloured surface of a LocalRes job folder, prepared for the display (a worker thread)."""
    return prepare_map(surface_event(folder, mask), level=level)


widget = LocalResolutionWidget

"""Dock widget "2D classification" (napari.yaml): the generic job widget of jobs.class2d, plus class selection.

Each iteration's class averages arrive as ClassAveragesUpdated and are shown as one labelled grid, largest class
first (widgets/display.py, layout and selection in widgets/class_grid_model.py). Clicking a tile (grid, labels or
selection layer active, pan/zoom mode) toggles its class; selected tiles are outlined. "Save selection" writes the
particles of the selected classes of the shown iteration (the data STAR of its classes stack, named by
io/jobdir.py) to a particles STAR through the Select job's own writer (jobs.select.write_selection).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from magicgui.widgets import FileEdit, Label, PushButton
from napari.utils.notifications import show_info

from ..errors import InputError
from ..io.jobdir import RunFiles, data_for_classes_stack
from ..io.star import read_particles
from ..jobs import class2d
from ..jobs.select import write_selection
from .job_widget import JobWidget, chooser_button, wrapping
from .runner import error_message

if TYPE_CHECKING:
    import napari

__all__ = ["Class2DWidget", "widget", "data_star_for", "save_selected_particles"]

GRID_LAYER = "classes"
SELECTION_FILE = "selected_particles.star"


def data_star_for(classes_path: Path | str | None, folder: Path | str | None) -> Path | None:
    """Particles STAR of the shown class averages (the data STAR of the same iteration), else the newest data STAR
    of the job ``folder`` (a folder or the job's ``--o`` rootname; default: the folder of ``classes_path``)."""
    if classes_path is not None:
        candidate = data_for_classes_stack(classes_path)
        if candidate is not None and candidate.is_file():
            return candidate
        folder = folder or Path(classes_path).parent
    return RunFiles.from_output(folder).latest_data() if folder else None


def save_selected_particles(data_star: Path, classes: list[int], out: Path) -> tuple[int, int]:
    """Write the particles of ``classes`` (1-based) of ``data_star`` to ``out`` as the Select job does (rows and
    optics kept, image names valid from ``out``), atomically; returns (particles written, particles read)."""
    table = read_particles(data_star)
    return len(write_selection(table, classes, out)), len(table)


class Class2DWidget(JobWidget):
    """The 2D classification job widget with a class selection row (see the module docstring)."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        super().__init__(viewer, class2d)
        self.selection_info = Label(value="click class tiles in the grid to select them", name="selection_info",
                                    label="selection")
        wrapping(self.selection_info)
        self.selection_file = FileEdit(mode="w", filter="*.star", nullable=True, name="selection_file",
                                       label="selection file")
        self.selection_file.line_edit.value = ""
        self.selection_file.line_edit.native.setMinimumWidth(60)
        chooser_button(self.selection_file, "Choose the particles STAR to write")
        self.selection_file.tooltip = (f"Particles STAR to write the selected classes to; empty: <job folder>/"
                                       f"{SELECTION_FILE}")
        self.save_selection_button = PushButton(text="Save selection", name="save_selection_button", label="")
        self.save_selection_button.tooltip = "Write the particles of the selected classes (as the Select job)"
        self.add_results_tab("Selection", [self.selection_info, self.selection_file, self.save_selection_button])
        self.last_saved: tuple[Path, int] | None = None
        self.save_selection_button.changed.connect(self.save_selection)
        self.display.connect("selection", self._on_selection)  # held weakly: nothing to undo at close
        grid = self.grid_layer()
        if grid is not None:
            self._on_selection(grid)
        else:  # the grid's labels layer now (next display turn), not while the class averages arrive
            self.display.later(self.display.prepare_class_labels, GRID_LAYER)

    def grid_layer(self) -> Any:
        """The class grid of this job (its folder), else the one named "classes"; None if there is none."""
        viewer = self.display.viewer  # the viewer itself, not napari's proxy of it
        if viewer is None:
            return None
        grids = [la for la in viewer.layers if (getattr(la, "metadata", None) or {}).get("kind") == "classes"]
        folder = self.folder.value.strip()
        for grid in grids:
            path = grid.metadata.get("path")
            if folder and path is not None and Path(path).parent == Path(folder):
                return grid
        named = [g for g in grids if g.name == GRID_LAYER]
        return (named or grids or [None])[0]

    def _on_selection(self, grid: Any) -> None:
        if self._closed:
            return
        classes = self.display.selected_classes(grid.name)
        self.selection_info.value = (f"{len(classes)} class(es): {', '.join(map(str, classes))}" if classes
                                     else "no classes selected")

    def selection_path(self, grid: Any) -> Path:
        """Where "Save selection" writes: the file chosen, else <job folder>/selected_particles.star."""
        text = self.selection_file.line_edit.value.strip()
        if text:
            return Path(text).expanduser()
        path = grid.metadata.get("path")
        folder = Path(path).parent if path is not None else Path(self.folder.value.strip() or ".")
        return folder / SELECTION_FILE

    def save_selection(self, *_: Any) -> Path | None:
        """Write the particles of the selected classes; report how many (None, with the reason, if nothing)."""
        grid = self.grid_layer()
        if grid is None:
            self._report_error("Save selection: no class grid yet (run 2D classification first)")
            return None
        classes = self.display.selected_classes(grid.name)
        if not classes:
            self._report_error("Save selection: no classes selected (click tiles of the class grid)")
            return None
        data_star = data_star_for(grid.metadata.get("path"), self.folder.value.strip() or None)
        if data_star is None:
            self._report_error("Save selection: cannot find the data STAR of the shown classes")
            return None
        out = self.selection_path(grid)
        try:
            n, total = save_selected_particles(data_star, classes, out)
        except (InputError, OSError) as exc:
            self._report_error(f"Save selection: {error_message(exc)}")
            return None
        message = (f"wrote {n} of {total} particles (classes {', '.join(map(str, classes))} of {data_star.name}) "
                   f"to {out}")
        self._set_status(message)
        show_info(message)
        self.last_saved = (out, n)
        return out


widget = Class2DWidget

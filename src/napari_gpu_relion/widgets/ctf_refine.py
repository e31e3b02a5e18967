"""Dock widget "CTF refinement" (napari.yaml): the generic job widget of jobs.ctf_refine (RELION's CtfRefine job,
relion_ctf_refine), plus its aberration plots.

The Jobs dock fills it from a finished 3D auto-refine (its final particles, and the newest post-processing of that
refinement as ``--f``, else its two half maps), from a post-processing (its STAR and the refinement's particles) or
from an earlier CTF refinement (its particles and the same maps: RELION runs CtfRefine in rounds); its
particles_ctf_refine.star goes on to the next 3D auto-refine (widgets/jobs_model.companions). With "MPI ranks" above 1
the micrographs are shared among the ranks, as on the command line.

When the job finishes, the "Result" tab shows its summary (the rms change of the defocus) and the per-optics-group
aberration plots it wrote (``asymmetric_aberrations_optics-group_N.png``: beam tilt and odd Zernike terms;
``symmetric_aberrations_optics-group_N.png``: even terms), measured phase beside the fit, as RELION's EPS plots;
"Show aberration plots" shows those of the job folder at any time (also a CtfRefine folder RELION wrote, when it
holds PNGs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magicgui.widgets import ComboBox, Container, Label, PushButton
from qtpy.QtCore import Qt, QUrl
from qtpy.QtGui import QDesktopServices, QPixmap
from qtpy.QtWidgets import QComboBox, QLabel, QSizePolicy, QVBoxLayout, QWidget

from ..events import Finished
from ..jobs import ctf_refine
from .job_widget import JobWidget, _wrap_labels, wrapping

if TYPE_CHECKING:
    import napari

__all__ = ["CtfRefineWidget", "widget", "aberration_plots", "FIT_QUESTIONS", "fit_mode_of", "answers_of"]

#: Width (pixels) a plot is drawn at before the dock's width is known.
PLOT_WIDTH_HINT = 250
#: RELION's CtfRefine questions, each a character of --fit_mode (phase, defocus, astigmatism, Cs, B-factor; Cs is
#: never fitted, as in RELION's GUI): (character position, field name, question).
FIT_QUESTIONS = ((1, "fit_defocus_mode", "Fit defocus?"), (2, "fit_astigmatism_mode", "Fit astigmatism?"),
                 (4, "fit_bfactor_mode", "Fit B-factor?"), (0, "fit_phase_mode", "Fit phase-shift?"))
#: Widest (pixels) a question's label may be: it wraps ("Fit / astigmatism?") so that the answers are not elided.
QUESTION_LABEL_WIDTH = 96
#: The answers (RELION's words) and their --fit_mode characters.
FIT_ANSWERS = {"No": "f", "Per-micrograph": "m", "Per-particle": "p"}


def fit_mode_of(answers: dict[str, str]) -> str:
    """--fit_mode from RELION's answers {field name: "No" | "Per-micrograph" | "Per-particle"} (Cs fixed)."""
    chars = ["f"] * 5
    for position, name, _ in FIT_QUESTIONS:
        chars[position] = FIT_ANSWERS[answers[name]]
    return "".join(chars)


def answers_of(fit_mode: str) -> dict[str, str] | None:
    """RELION's answers of a --fit_mode (None for one that is not 5 characters of p, m, f)."""
    text = str(fit_mode).strip()
    if len(text) != 5 or any(c not in "pmf" for c in text):
        return None
    words = {c: w for w, c in FIT_ANSWERS.items()}
    return {name: words[text[position]] for position, name, _ in FIT_QUESTIONS}


def aberration_plots(folder: str | os.PathLike) -> list[Path]:
    """The aberration plots of a CtfRefine job folder (ours: PNG, RELION's names with .png), antisymmetric before
    symmetric, by optics group; [] for a folder without any."""
    folder = Path(folder)
    try:
        names = os.listdir(folder)
    except OSError:
        return []

    def key(name: str) -> tuple[int, int, str]:
        group = name.rsplit("_", 1)[-1].removesuffix(".png")
        return (0 if name.startswith("asymmetric") else 1, int(group) if group.isdigit() else 0, name)

    plots = [n for n in names if n.endswith(".png") and "aberrations_optics-group_" in n]
    return [folder / n for n in sorted(plots, key=key)]


class _PlotImage(QLabel):
    """A PNG shown at the width of the dock, keeping its aspect ratio; a click opens the file in the system's image
    viewer (full size)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._pixmap = QPixmap(str(path))
        self.setToolTip(f"{path}\n(click: open it full size)")
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(100)
        self._rescale(PLOT_WIDTH_HINT)

    @property
    def loaded(self) -> bool:
        return not self._pixmap.isNull()

    def _rescale(self, width: int) -> None:
        if self._pixmap.isNull():
            self.setText(f"cannot read {self.path.name}")
            return
        scaled = self._pixmap.scaledToWidth(max(width, 50), Qt.TransformationMode.SmoothTransformation)
        self.setFixedHeight(scaled.height())
        self.setPixmap(scaled)

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        if not self._pixmap.isNull() and abs(self.pixmap().width() - self.width()) > 2:
            self._rescale(self.width())

    def mouseReleaseEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        if event.button() == Qt.MouseButton.LeftButton:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.path.resolve())))
        super().mouseReleaseEvent(event)


class CtfRefineWidget(JobWidget):
    """The CTF refinement job widget with the aberration plots of its result (see the module docstring)."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        super().__init__(viewer, ctf_refine)
        self._syncing = False
        self._add_fit_questions()
        self.result_info = Label(value="No result yet: the refined particles' summary and the aberration plots "
                                 "appear here when the job finishes.", name="ctf_refine_result", label="")
        wrapping(self.result_info)
        self.plots_button = PushButton(text="Show aberration plots", name="show_plots_button", label="")
        self.plots_button.tooltip = "The aberration plots (PNG) of the job folder"
        box = self.add_results_tab("Result", [self.result_info, self.plots_button], labels=False)
        self._plots_holder = QWidget()
        self._plots_layout = QVBoxLayout(self._plots_holder)
        self._plots_layout.setContentsMargins(0, 0, 0, 0)
        box.native.layout().addWidget(self._plots_holder)
        self.plot_views: list[_PlotImage] = []
        self.plots_button.changed.connect(self.show_plots)

    # -- RELION's questions for --fit_mode -----------------------------------------------------------------------

    def _add_fit_questions(self) -> dict[str, ComboBox]:
        """RELION's CtfRefine questions (Fit defocus? astigmatism? B-factor? phase-shift?: No, per micrograph, per
        particle) in the CTF tab, under "Fit defocus", kept in step with the --fit_mode field (folded under More
        options), which is what the job is given."""
        boxes = {}
        for _, name, question in FIT_QUESTIONS:
            box = ComboBox(choices=list(FIT_ANSWERS), name=name, label=question)
            box.tooltip = (f"{question} No, once per micrograph or for every particle: a character of RELION's "
                           "--fit_mode (with --fit_defocus)")
            combo = box.native  # no wider than the dock's least width needs ("Per-micrograph" may be elided)
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(4)
            boxes[name] = box
        group = Container(widgets=list(boxes.values()), labels=True, name="fit_questions")
        group.margins = (0, 0, 0, 0)
        _wrap_labels(group)
        for label in group.native.findChildren(QLabel):  # the answers ("Per-micrograph") keep their width
            label.setMaximumWidth(QUESTION_LABEL_WIDTH)
        page = self._tab_page("CTF")
        if page is not None:
            page.layout().insertWidget(1, group.native)
        self.fit_questions = boxes
        self._answers_from_field()  # the field's value (its default, or the one remembered)
        for box in boxes.values():
            box.changed.connect(self._field_from_answers)
        self.inputs["fit_mode"].changed.connect(self._answers_from_field)
        return boxes

    def _tab_page(self, name: str) -> QWidget | None:
        for k in range(self.tabs.count()):
            if self.tabs.tabText(k) == name:
                scroll = self.tabs.widget(k)
                return scroll.widget() if hasattr(scroll, "widget") else None
        return None

    def _field_from_answers(self, *_: Any) -> None:
        if self._syncing:
            return
        self._syncing = True
        try:
            self.inputs["fit_mode"].value = fit_mode_of({n: b.value for n, b in self.fit_questions.items()})
        finally:
            self._syncing = False

    def _answers_from_field(self, *_: Any) -> None:
        if self._syncing:
            return
        answers = answers_of(self.inputs["fit_mode"].value)
        if answers is None:  # a mode being typed: the questions keep their answers
            return
        self._syncing = True
        try:
            for name, word in answers.items():
                self.fit_questions[name].value = word
        finally:
            self._syncing = False

    def _on_finished(self, ev: Finished) -> None:
        super()._on_finished(ev)
        if self._closed:
            return
        self.result_info.value = ev.summary or "finished"
        plots = [Path(p) for name, p in (ev.outputs or {}).items() if str(name).endswith(".png")]
        self.show_plots(paths=plots)
        self.show_results_tab()

    def show_plots(self, *_: Any, paths: list[Path] | None = None) -> list[Path]:
        """Show ``paths`` (default: the job folder's aberration plots) under the summary; returns those shown."""
        if paths is None:
            folder = self.folder.value.strip() or self.inputs["o"].line_edit.value.strip()
            paths = aberration_plots(folder) if folder else []
            if not paths:
                self._set_status(f"no aberration plots in {folder or 'the job folder'} (only --fit_beamtilt and "
                                 "--fit_aberr write them)")
        for view in self.plot_views:
            self._plots_layout.removeWidget(view)
            view.deleteLater()
        self.plot_views = [_PlotImage(Path(p)) for p in paths]
        for view in self.plot_views:
            self._plots_layout.addWidget(view)
        return [v.path for v in self.plot_views]


widget = CtfRefineWidget

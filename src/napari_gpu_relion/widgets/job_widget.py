"""One dock widget for any job, generated from the job module's ``Params`` dataclass.

A job module defines ``JOB_NAME``, a frozen dataclass ``Params`` whose fields carry ``metadata={"flag":
"--ini_high", "help": "..."}`` and a generator ``run(params) -> Iterator[Event]``. :func:`make_job_widget`
turns it into a magicgui Container:

* one input widget per field, chosen from the field type (Path: file/folder chooser, int/float: spin boxes,
  bool: check box, str: line edit, ``X | None``: a line edit where empty means None), labelled in words with
  its unit, the help text and the RELION flag in its tooltip, laid out in RELION-like tabs with the advanced
  options folded (widgets/form_model.py); a job widget may add a results tab (:meth:`JobWidget.add_results_tab`);
* Run / Cancel (acknowledged at once: "cancelling..."), a progress bar, a status line that wraps (errors stay
  there), the map levels of the job's maps, the job folder and "Open" (it); closing the dock cancels the job;
* the dock fits a 1366 x 768 screen beside napari's canvas: it is a tab of the plugin's panel (widgets/dock_layout.py),
  usable at PANEL_MIN_WIDTH pixels (option tabs scroll; labels wrap, check boxes' words too; a file field's
  chooser is a folder icon); Run, Cancel, the progress bar and the status line stay under the option tabs,
  outside their scroll areas;
* the last values are remembered in ``~/.config/napari-gpu-relion/<job>.json`` (directory overridable with
  the NAPARI_GPU_RELION_CONFIG_DIR environment variable).

Bad values are caught when Params is built (its ``__post_init__`` raises InputError): the message goes to
the status line and to ``show_error``, and nothing starts. The job itself runs through the shared
:class:`~napari_gpu_relion.widgets.runner.JobRunner` of its device; results reach the viewer through
:class:`~napari_gpu_relion.widgets.display.LiveDisplay`. No algorithm lives here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import math
import os
import time
import types
import typing
import weakref
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from magicgui.widgets import (
    CheckBox,
    ComboBox,
    Container,
    FileEdit,
    FloatSpinBox,
    Label,
    LineEdit,
    ProgressBar,
    PushButton,
    SpinBox,
)
from napari.utils.notifications import show_error, show_info, show_warning
from qtpy.QtCore import QEvent, QObject, Qt, QTimer, QUrl
from qtpy.QtGui import QDesktopServices
from qtpy.QtWidgets import (
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QScrollArea,
    QSizePolicy,
    QStyle,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)
from superqt import QCollapsible

from ..errors import InputError
from ..events import (
    ClassAveragesUpdated,
    Finished,
    FscUpdated,
    IterationFinished,
    IterationStarted,
    MapUpdated,
    Message,
    MicrographPicked,
    ParticlesExtracted,
    Progress,
    Started,
)
from ..mpi_child import MPI_JOBS, mpi_available, run_under_mpi
from ..runtime.device import device_key
from .display import LiveDisplay
from .dock_layout import dock_as_panel
from .follow_model import job_label
from .form_model import form_layout, form_of
from .jobs_model import SESSION
from .layout_model import PANEL_MIN_WIDTH, tab_title
from .progress_model import ProgressReport, RunProgress
from .runner import Job, JobRunner, JobState, error_message, get_runner

if TYPE_CHECKING:
    import napari

__all__ = ["make_job_widget", "job_widget_class", "JobWidget", "config_dir", "field_kind"]

log = logging.getLogger(__name__)

CONFIG_ENV = "NAPARI_GPU_RELION_CONFIG_DIR"
#: Narrowest the dock widget may become (pixels): labels and fields stay readable, nothing is cut off.
MIN_DOCK_WIDTH = PANEL_MIN_WIDTH
#: Widest an option label may be (pixels); longer labels wrap.
LABEL_MAX_WIDTH = 140
#: Labels up to this width (pixels) never wrap.
LABEL_MIN_WIDTH = 90
#: Narrowest a number field may become (pixels).
SPIN_BOX_MIN_WIDTH = 90
#: Margin (pixels) around the dock widget's content.
DOCK_MARGIN = 4
#: Width (pixels) the dock widget asks for.
DOCK_WIDTH_HINT = 340
#: Zero-width space: where a wrapped status line may break inside a long path.
_BREAK = "\u200b"
_INT_LIMIT = 2**31 - 1
_FLOAT_LIMIT = 1e12


def config_dir() -> Path:
    """Where remembered parameters live: $NAPARI_GPU_RELION_CONFIG_DIR, else ~/.config/napari-gpu-relion."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return Path.home() / ".config" / "napari-gpu-relion"


# ----------------------------------------------------------------------------------------------------------
# Field types -> widgets


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What the widget needs to know about one Params field."""

    name: str
    kind: str  # "path" | "int" | "float" | "bool" | "str" | "choice"
    optional: bool
    default: Any
    flag: str
    help: str
    metadata: dict
    choices: tuple = ()


def field_kind(tp: Any) -> tuple[str, bool, tuple]:
    """(kind, optional, choices) of a resolved type annotation."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else str
        origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "choice", optional, tuple(typing.get_args(tp))
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return "choice", optional, tuple(tp)
        if issubclass(tp, bool):
            return "bool", optional, ()
        if issubclass(tp, int):
            return "int", optional, ()
        if issubclass(tp, float):
            return "float", optional, ()
        if issubclass(tp, PurePath):
            return "path", optional, ()
    return "str", optional, ()


def field_specs(params_cls: type) -> list[FieldSpec]:
    """One FieldSpec per dataclass field of ``params_cls`` (fields with init=False are skipped)."""
    hints = typing.get_type_hints(params_cls)
    specs = []
    for f in dataclasses.fields(params_cls):
        if not f.init:
            continue
        kind, optional, choices = field_kind(hints.get(f.name, str))
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        md = dict(f.metadata)
        specs.append(FieldSpec(f.name, kind, optional, default, md.get("flag") or f"--{f.name}",
                               md.get("help", ""), md, choices))
    return specs


def _decimals(value: Any) -> int:
    """Decimals a spin box needs to show ``value`` exactly (at least 3, at most 8)."""
    if not isinstance(value, int | float) or not math.isfinite(float(value)):
        return 3
    text = repr(float(value))
    if "e" in text:
        return 8
    frac = text.split(".")[1].rstrip("0") if "." in text else ""
    return min(8, max(3, len(frac)))


#: Path mode of a relion_refine output rootname: the widget shows a folder, the job gets <folder>/run.
ROOT = "root"
#: relion_refine's rootname in a job folder.
RUN_ROOT = "run"


def output_rootname(job_module: Any, spec: FieldSpec) -> str | None:
    """The rootname in the job folder that field ``spec`` asks for (the job gets ``<folder>/<rootname>``): the job's
    own ``DEFAULT_ROOT`` for its ``--o`` (local resolution: ``relion``, as RELION's LocalRes job), else ``run`` for
    a relion_refine rootname (``mode="root"``); None for a folder or a file."""
    own = getattr(job_module, "DEFAULT_ROOT", None)
    if own is not None and spec.name == "o":
        return str(own)
    return RUN_ROOT if spec.metadata.get("mode") == ROOT else None


def _path_mode(spec: FieldSpec) -> str:
    """'r' for inputs; for the output ``o``: 'd' for a folder, 'w' for a file (from metadata/default/help)."""
    if "mode" in spec.metadata:
        return str(spec.metadata["mode"])
    if spec.name != "o":
        return "r"
    if spec.default is not None:
        return "w" if Path(spec.default).suffix else "d"
    text = spec.help.lower()
    return "d" if ("folder" in text or "directory" in text) else "w"


def _tooltip(spec: FieldSpec) -> str:
    """The help text, then the RELION flag and the default (the label says it in words)."""
    parts = [spec.help] if spec.help else []
    if spec.optional:
        parts.append("Leave empty for none.")
    default = "none" if spec.default is None else spec.default
    parts.append(f"RELION option {spec.flag} (default: {default})")
    return "\n".join(parts)


def _make_input(spec: FieldSpec, label: str | None = None) -> Any:
    """The input widget of one field, labelled ``label`` (default: the flag), the flag in its tooltip."""
    label = label or spec.flag
    common = {"name": spec.name, "label": label, "tooltip": _tooltip(spec)}
    md = spec.metadata
    if spec.kind == "path":
        mode = _path_mode(spec)
        w = FileEdit(mode="d" if mode == ROOT else mode, filter=md.get("filter"), nullable=True, **common)
        w.line_edit.value = "" if spec.default is None else str(spec.default)
        w.line_edit.native.setMinimumWidth(60)  # the path scrolls; the dock stays narrow
        chooser_button(w, "Choose a folder" if mode in ("d", ROOT) else "Choose a file")
        return w
    if spec.optional and spec.kind in ("int", "float", "str"):
        return LineEdit(value="" if spec.default is None else str(spec.default), **common)
    if spec.kind == "bool":  # its words go to a wrapping label beside the box (_wrap_check_boxes)
        common["label"] = ""
        return CheckBox(value=bool(spec.default), text=label, **common)
    if spec.kind == "int":
        return _narrow(SpinBox(value=int(spec.default or 0), min=int(md.get("min", -_INT_LIMIT)),
                       max=int(md.get("max", _INT_LIMIT)), step=int(md.get("step", 1)), **common))
    if spec.kind == "float":
        w = FloatSpinBox(min=float(md.get("min", -_FLOAT_LIMIT)), max=float(md.get("max", _FLOAT_LIMIT)),
                         step=float(md.get("step", 0.1)), **common)
        w.native.setDecimals(int(md.get("decimals", _decimals(spec.default))))
        w.value = float(spec.default or 0.0)
        return _narrow(w)
    if spec.kind == "choice":
        choices = list(spec.choices)
        return ComboBox(choices=choices, value=spec.default if spec.default in choices else choices[0], **common)
    return LineEdit(value="" if spec.default is None else str(spec.default), **common)


#: Width (pixels) of a file field's chooser button (a folder icon).
CHOOSER_WIDTH = 30


def chooser_button(edit: FileEdit, tooltip: str) -> None:
    """A file field's chooser as a narrow folder-icon button (``tooltip`` says what it chooses), not "Choose
    directory" / "Browse...", which would widen the dock."""
    button = edit.choose_btn
    button.text = ""
    button.tooltip = tooltip
    native = button.native
    native.setIcon(native.style().standardIcon(QStyle.StandardPixmap.SP_DirOpenIcon))
    native.setFixedWidth(CHOOSER_WIDTH)
    native.setAccessibleName(tooltip)


def _narrow(widget: Any) -> Any:
    """A spin box no wider than its numbers need: Qt sizes it for its largest allowed value (2^31, 1e12),
    which would make every dock wide."""
    widget.native.setMinimumWidth(SPIN_BOX_MIN_WIDTH)
    return widget


def _read_input(spec: FieldSpec, widget: Any) -> Any:
    """The Params value of one input widget; InputError naming the flag for unparsable text."""
    if spec.kind == "path":
        text = widget.line_edit.value.strip()
        return Path(os.path.expanduser(text)) if text else None
    if spec.optional and spec.kind in ("int", "float", "str"):
        text = str(widget.value).strip()
        if not text or text.lower() == "none":
            return None
        if spec.kind == "str":
            return text
        try:
            return int(text) if spec.kind == "int" else float(text)
        except ValueError:
            raise InputError(f"{spec.flag} must be {'a whole number' if spec.kind == 'int' else 'a number'} or "
                             f"empty, got {text!r}") from None
    return widget.value


def _to_json(spec: FieldSpec, widget: Any) -> Any:
    if spec.kind == "path":
        return widget.line_edit.value
    if spec.optional and spec.kind in ("int", "float", "str"):
        return widget.value
    value = widget.value
    if isinstance(value, enum.Enum):
        return value.name
    return value


def _from_json(spec: FieldSpec, widget: Any, value: Any) -> None:
    if spec.kind == "path" or (spec.optional and spec.kind in ("int", "float", "str")):
        target = widget.line_edit if spec.kind == "path" else widget
        target.value = "" if value is None else str(value)
    elif spec.kind == "choice" and spec.choices and isinstance(spec.choices[0], enum.Enum):
        widget.value = type(spec.choices[0])[value]
    elif spec.kind == "bool":
        widget.value = bool(value)
    elif spec.kind == "int":
        widget.value = int(value)
    elif spec.kind == "float":
        widget.value = float(value)
    else:
        widget.value = value


def mpi_ranks_input(job_name: str) -> SpinBox | None:
    """The "MPI ranks" field of a job that runs under MPI (enabled where mpi4py and mpiexec are installed)."""
    if job_name not in MPI_JOBS:
        return None
    box = SpinBox(value=1, min=1, max=256, name="job_mpi_ranks", label="MPI ranks")
    if mpi_available():
        box.tooltip = ("Run the job on this many MPI ranks (mpiexec in a child process; results appear as they "
                       "come). With --gpu 0:1:2:3 the ranks take these GPUs in turn; several may share one.")
    else:
        box.enabled = False
        box.tooltip = "MPI is not installed: pip install 'napari-gpu-relion[mpi]'"
    return box


def _device_of(params: Any) -> str:
    """Runner key: jobs on the same device run one after another. The device is the one the job will really
    use: a job that may use a GPU runs on the CPU where there is none, so it queues with the CPU jobs."""
    return device_key(params)


# ----------------------------------------------------------------------------------------------------------
# Layout: option tabs, wrapping status, dock close


def breakable(text: str) -> str:
    """``text`` with a zero-width space after every slash, so that a wrapped label can break long paths."""
    return text.replace("/", "/" + _BREAK)


def wrapping(label: Label) -> None:
    """A status label that wraps (and can be selected), never wider than the dock."""
    native = label.native
    native.setWordWrap(True)
    native.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
    native.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    native.setMinimumWidth(40)
    native.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)


class _PageScroll(QScrollArea):
    """A vertical scroll area that asks for the width of its page (and of the scroll bar, shown or not), as the
    page is now: a page whose labels wrap or whose content changes is never cut off on the right."""

    def minimumSizeHint(self):  # noqa: N802 - Qt's name
        hint = super().minimumSizeHint()
        page = self.widget()
        if page is not None:
            hint.setWidth(page.minimumSizeHint().width() + self.verticalScrollBar().sizeHint().width())
        hint.setHeight(max(hint.height(), PAGE_MIN_HEIGHT))
        return hint


#: Lowest (pixels) a tab page's scroll area may be.
PAGE_MIN_HEIGHT = 100


def _scroll_page(page: QWidget) -> QScrollArea:
    """A tab page in a vertical scroll area, never narrower than the page (no horizontal scrolling: labels and
    buttons are never cut off)."""
    scroll = _PageScroll()
    scroll.setWidgetResizable(True)
    scroll.setFrameShape(QScrollArea.Shape.NoFrame)
    scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    scroll.setWidget(page)
    return scroll


class _CheckText(QLabel):
    """The words of a check box, wrapping (a QCheckBox's own text cannot); a click on them toggles the box."""

    def __init__(self, box: QWidget, text: str) -> None:
        super().__init__(text)
        self._box = weakref.ref(box)
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(LABEL_MIN_WIDTH)
        self.setToolTip(box.toolTip())

    def mouseReleaseEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        box = self._box()
        if box is not None and box.isEnabled() and event.button() == Qt.MouseButton.LeftButton:
            box.click()
        super().mouseReleaseEvent(event)


def _wrap_check_boxes(container: Container) -> None:
    """Each check box of ``container`` as a row of the box and its words in a wrapping label (the box's own text
    would set the dock's minimum width to that of its longest sentence)."""
    layout = container.native.layout()
    for widget in list(container):
        if not isinstance(widget, CheckBox) or not widget.text:
            continue
        box = widget.native
        index = layout.indexOf(box)
        if index < 0:
            continue
        row = QWidget()
        row.setObjectName(f"check_row_{widget.name}")
        row_layout = QHBoxLayout(row)
        row_layout.setContentsMargins(0, 0, 0, 0)
        text = _CheckText(box, widget.text)
        widget.text = ""
        box.setAccessibleName(text.text())
        layout.insertWidget(index, row)
        row_layout.addWidget(box)  # taken out of the container's layout
        row_layout.addWidget(text, 1)


def _option_tabs(job: str, specs: list[FieldSpec], inputs: dict[str, Any]) -> QTabWidget:
    """The options in RELION-like tabs (widgets/form_model.py): per tab the basic options, then the advanced
    ones folded in a collapsible "More options". Each tab scrolls, so the dock's height stays small."""
    tabs = _OptionTabs()
    tabs.setObjectName("job_option_tabs")
    tabs.setUsesScrollButtons(True)
    tabs.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Expanding)
    for tab in form_layout(job, [(s.name, s.flag) for s in specs]):
        page = QWidget()
        page.setObjectName(f"job_tab_{tab.name}")
        layout = QVBoxLayout(page)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(2)
        if tab.basic:
            basic = Container(widgets=[inputs[n] for n in tab.basic], labels=True, name=f"basic_{tab.name}")
            basic.margins = (0, 0, 0, 0)
            _wrap_labels(basic)
            _wrap_check_boxes(basic)
            layout.addWidget(basic.native)
        if tab.advanced:
            more = QCollapsible("More options" if tab.basic else f"{tab.name} options")
            more.setObjectName(f"job_more_{tab.name}")
            advanced = Container(widgets=[inputs[n] for n in tab.advanced], labels=True,
                                 name=f"advanced_{tab.name}")
            advanced.margins = (0, 0, 0, 0)
            _wrap_labels(advanced)
            _wrap_check_boxes(advanced)
            more.addWidget(advanced.native)
            layout.addWidget(more)
            if not tab.basic:
                more.expand(animate=False)
        layout.addStretch(1)
        tabs.addTab(_scroll_page(page), tab.name)
    return tabs


def _wrap_labels(container: Container) -> None:
    """Option labels wrap onto a second line rather than widen the dock (at most LABEL_MAX_WIDTH pixels); labels
    that wrap already (status and value lines, :func:`wrapping`) keep their width."""
    for label in container.native.findChildren(QLabel):
        if label.text() and not label.wordWrap():
            text_width = label.fontMetrics().horizontalAdvance(label.text()) + 4
            label.setWordWrap(True)
            label.setMinimumWidth(min(text_width, LABEL_MIN_WIDTH))  # short labels stay on one line
            label.setMaximumWidth(LABEL_MAX_WIDTH)


class _OptionTabs(QTabWidget):
    """The option tabs, asking for no more than DOCK_WIDTH_HINT pixels of width (the tab bar scrolls), so that
    napari docks the widget narrow enough to leave the canvas room on a laptop screen."""

    def sizeHint(self):  # noqa: N802 - Qt's name
        hint = super().sizeHint()
        hint.setWidth(min(hint.width(), DOCK_WIDTH_HINT))
        return hint


#: The question a dock's close button asks while its job runs or waits.
CLOSE_QUESTION = "A job is running: cancel it and close?"


def ask_yes_no(parent: QWidget | None, question: str) -> bool:
    """Ask ``question`` in a modal message box; True for Yes (the default answer is No)."""
    answer = QMessageBox.question(parent, "napari-gpu-relion", question,
                                  QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                  QMessageBox.StandardButton.No)
    return answer == QMessageBox.StandardButton.Yes


class _DockCloseWatcher(QObject):
    """Calls ``on_close()`` when ``widget`` is taken out of its napari dock (the dock's close button): napari
    removes the dock and sets the inner widget's parent to None, without deleting it, so ``destroyed`` does not
    come. Before that, ``may_close()`` is asked when the dock's close button is clicked (False keeps the dock).
    Both callbacks are held weakly (bound methods), so the watcher never keeps a closed widget alive."""

    def __init__(self, widget: QWidget, on_close: Any, may_close: Any = None) -> None:
        super().__init__(widget)
        self._callback = weakref.WeakMethod(on_close)
        self._may_close = None if may_close is None else weakref.WeakMethod(may_close)
        self._docked = widget.parent() is not None
        widget.installEventFilter(self)

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt's name
        if event.type() == QEvent.Type.ParentChange:
            if obj.parent() is not None:
                self._docked = True
                QTimer.singleShot(0, self._guard_close_button)
            elif self._docked:
                self._docked = False
                callback = self._callback()
                if callback is not None:
                    callback()
        return False

    def _guard_close_button(self) -> None:
        """Ask ``may_close()`` before napari's dock closes: its close button calls the dock's ``destroyOnClose``,
        which is wrapped here once per dock. The wrapper holds this watcher weakly: when the widget is gone, the
        dock closes as napari would close it."""
        try:
            widget = self.parent()
        except RuntimeError:
            return
        dock = widget
        while dock is not None and not isinstance(dock, QDockWidget):
            dock = dock.parentWidget()
        original = getattr(dock, "destroyOnClose", None)
        if dock is None or original is None or getattr(original, "_asks_first", False):
            return
        watcher = weakref.ref(self)

        def destroy_on_close() -> None:
            w = watcher()
            try:
                allowed = w is None or w.may_close()
            except RuntimeError:  # the widget was deleted meanwhile
                allowed = True
            if allowed:
                original()

        destroy_on_close._asks_first = True  # type: ignore[attr-defined]
        dock.destroyOnClose = destroy_on_close

    def may_close(self) -> bool:
        callback = self._may_close() if self._may_close is not None else None
        return True if callback is None else bool(callback())


# ----------------------------------------------------------------------------------------------------------
# The widget


class JobWidget(Container):
    """The dock widget of one job module (see the module docstring). Build it with :func:`make_job_widget`."""

    def __init__(self, viewer: napari.viewer.Viewer, job_module: Any, *, runner: JobRunner | None = None):
        self.viewer = viewer
        self.job_module = job_module
        self.job_name: str = getattr(job_module, "JOB_NAME", job_module.__name__.rsplit(".", 1)[-1])
        self.specs = field_specs(job_module.Params)
        #: field name -> the rootname its job folder stands for (values() passes <folder>/<rootname>)
        self.rootnames = {s.name: r for s in self.specs if (r := output_rootname(job_module, s)) is not None}
        self.inputs: dict[str, Any] = {
            s.name: _make_input(s, form_of(self.job_name, s.flag).label) for s in self.specs}
        self._runner = runner
        self.display = LiveDisplay.for_viewer(viewer)
        LiveDisplay.prepare()
        self.job: Job | None = None
        self.last_params: Any = None
        self.last_error: str | None = None
        self.status_text = "ready"
        self._closed = False
        self._loading = False
        self._results_tab: QWidget | None = None
        self._progress = RunProgress(self.job_name)  # the bar and the progress line (widgets/progress_model.py)
        self._bar_before_cancel: tuple[int, int] | None = None  # the bar when Cancel was clicked

        self.run_button = PushButton(text="Run", name="job_run_button")
        self.run_button.tooltip = f"Start {self.job_name} with these parameters (queued if the device is busy)"
        self.cancel_button = PushButton(text="Cancel", name="job_cancel_button", enabled=False)
        self.cancel_button.tooltip = "Stop the job at its next step; files already written stay valid"
        buttons = Container(widgets=[self.run_button, self.cancel_button], layout="horizontal", labels=False,
                            name="job_buttons", label="")
        buttons.margins = (0, 0, 0, 0)
        self.progress = ProgressBar(value=0, min=0, max=1, name="job_progress", label="progress")
        self.status = Label(value="ready", name="job_status", label="status")
        wrapping(self.status)
        self.folder = LineEdit(value="", name="job_folder", label="job folder")
        self.folder.native.setReadOnly(True)
        self.folder.native.setMinimumWidth(60)
        self.open_button = PushButton(text="Open", name="job_open_folder")
        self.open_button.tooltip = "Open the job folder in the system's file browser (note.txt: the command line)"
        folder_row = Container(widgets=[self.folder, self.open_button], layout="horizontal", labels=False,
                               name="job_folder_row", label="job folder")
        folder_row.margins = (0, 0, 0, 0)
        self.maps_info = Label(value="", name="job_maps", label="map level")
        self.maps_info.tooltip = ("The level (map units) at which each map of this job is drawn as a surface: "
                                  "Otsu's threshold, above the noise (use it e.g. as the mask's initial threshold)")
        wrapping(self.maps_info)
        self.maps_info.visible = False
        self._map_levels: dict[str, float] = {}
        #: how the job runs: progress, status, folder (always shown, under the option tabs)
        self.mpi_ranks = mpi_ranks_input(self.job_name)  # None for jobs that do not run under MPI
        extra = [self.mpi_ranks] if self.mpi_ranks is not None else []
        self.panel = Container(widgets=[*extra, self.progress, self.status, self.maps_info, folder_row], labels=True,
                               name="job_panel")
        self.panel.margins = (0, 0, 0, 0)

        super().__init__(widgets=[buttons, self.panel], labels=False, name=f"{self.job_name}_widget")
        self.margins = (DOCK_MARGIN,) * 4
        self.tabs = _option_tabs(self.job_name, self.specs, self.inputs)
        self.native.layout().insertWidget(0, self.tabs, 1)
        self.native.setMinimumWidth(MIN_DOCK_WIDTH)

        self._load_settings()
        self._update_folder_from_params()
        self.run_button.changed.connect(self.start_job)
        self.cancel_button.changed.connect(self.cancel_job)
        self.open_button.changed.connect(self.open_folder)
        for spec in self.specs:
            self.inputs[spec.name].changed.connect(self._on_input_changed)
        self.native.destroyed.connect(self._on_destroyed)
        self._close_watch = _DockCloseWatcher(self.native, self._on_dock_closed, self.may_close)
        dock_as_panel(self.native, tab_title(self.job_name))  # a tab of the plugin's panel (widgets/dock_layout.py)

    def add_results_tab(self, name: str, widgets: list[Any], front: bool = True, labels: bool = True) -> Container:
        """A tab after the option tabs for what the job produced (picks threshold, class selection, ...): a
        Container of ``widgets`` (``labels``: with their labels beside them); :meth:`show_results_tab` brings it
        (``front``; else the first results tab) to the front."""
        box = Container(widgets=widgets, labels=labels, name=f"results_{name}")
        box.margins = (4, 4, 4, 4)
        _wrap_labels(box)
        _wrap_check_boxes(box)
        page = QWidget()
        layout = QVBoxLayout(page)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(box.native)
        layout.addStretch(1)
        scroll = _scroll_page(page)
        self.tabs.addTab(scroll, name)
        if front or self._results_tab is None:
            self._results_tab = scroll
        return box

    def show_results_tab(self) -> None:
        """Bring the results tab (if any) to the front."""
        if self._results_tab is not None and not self._closed:
            self.tabs.setCurrentWidget(self._results_tab)

    # -- parameters --------------------------------------------------------------------------------------

    @property
    def runner(self) -> JobRunner | None:
        """The runner given at construction, else the one that ran the last job (None before any)."""
        if self._runner is not None:
            return self._runner
        return self.job.runner if self.job is not None else None

    def values(self) -> dict[str, Any]:
        """Current field values as Params keyword arguments (InputError for unparsable text). A rootname output
        is asked for as the job folder and passed as <folder>/<rootname> (:func:`output_rootname`)."""
        out = {s.name: _read_input(s, self.inputs[s.name]) for s in self.specs}
        for name, root in self.rootnames.items():
            if out.get(name) is not None:
                out[name] = Path(out[name]) / root
        return out

    def build_params(self) -> Any:
        """Params from the widgets; InputError (or TypeError/ValueError) if a value is rejected."""
        return self.job_module.Params(**self.values())

    def set_values(self, **values: Any) -> None:
        """Set input widgets from Python values (paths as str or Path, None for empty optional fields)."""
        specs = {s.name: s for s in self.specs}
        for name, value in values.items():
            spec = specs[name]
            _from_json(spec, self.inputs[name], str(value) if isinstance(value, PurePath) else value)

    def _settings_path(self) -> Path:
        return config_dir() / f"{self.job_name}.json"

    def save_settings(self) -> None:
        """Write the current values to the config file (atomically; errors only logged)."""
        data = {"job": self.job_name, "values": {s.name: _to_json(s, self.inputs[s.name]) for s in self.specs}}
        path = self._settings_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(data, indent=1, default=str))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not save parameters to %s: %s", path, exc)

    def _load_settings(self) -> None:
        path = self._settings_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        values = data.get("values", {}) if isinstance(data, dict) else {}
        self._loading = True
        try:
            for spec in self.specs:
                if spec.name not in values:
                    continue
                try:
                    _from_json(spec, self.inputs[spec.name], values[spec.name])
                except (TypeError, ValueError, KeyError) as exc:
                    log.info("ignoring remembered %s=%r: %s", spec.flag, values[spec.name], exc)
        finally:
            self._loading = False

    def _on_input_changed(self, *_: Any) -> None:
        if self._loading or self._closed:
            return
        self.save_settings()
        if self.job is None or self.job.done:
            self._update_folder_from_params()

    def _update_folder_from_params(self) -> None:
        if "o" not in self.inputs:
            return
        text = self.inputs["o"].line_edit.value.strip()
        if not text:
            self.folder.value = ""
            return
        spec = next(s for s in self.specs if s.name == "o")
        out = Path(text)
        self.folder.value = str(out if _path_mode(spec) in ("d", ROOT) else out.parent)

    # -- running -----------------------------------------------------------------------------------------

    def _set_status(self, text: str, error: bool = False) -> None:
        """The status line (``status_text``); shown wrapped, long paths broken after their slashes."""
        if self._closed:
            return
        self.status_text = text
        self.status.value = breakable(text)
        self.status.native.setStyleSheet("color: #ff6464;" if error else "")

    def _report_error(self, message: str) -> None:
        self.last_error = message
        self._set_status(message, error=True)
        show_error(message)

    def start_job(self, *_: Any) -> Job | None:
        """Validate the parameters and submit the job; on bad values show the error and start nothing."""
        if self.job is not None and not self.job.done:
            return self.job
        try:
            params = self.build_params()
        except (InputError, TypeError, ValueError) as exc:
            self._report_error(f"{self.job_name}: {error_message(exc)}")
            return None
        self.last_error = None
        self.last_params = params
        self.save_settings()
        if self._runner is None:
            runner = get_runner(_device_of(params))
        else:
            runner = self._runner
        self._set_bar(0, 1, "")
        self.status.tooltip = ""
        self._bar_before_cancel = None
        self._progress = RunProgress(self.job_name)
        self._map_levels.clear()
        self._set_status(f"{self.job_name}: submitted")
        module = self.job_module
        handlers = {
            Started: self._on_started,
            Progress: self._on_progress,
            IterationStarted: self._on_progress,
            Message: self._on_message,
            Finished: self._on_finished,
            MapUpdated: self._on_map,
            ClassAveragesUpdated: self.display.handle,
            FscUpdated: self.display.handle,
            MicrographPicked: self.display.handle,
            ParticlesExtracted: self.display.handle,
            IterationFinished: self._on_iteration,
        }
        ranks = self.mpi_ranks.value if self.mpi_ranks is not None else 1
        factory = ((lambda: run_under_mpi(self.job_name, params, ranks)) if ranks > 1  # a child mpiexec
                   else (lambda: module.run(params)))
        self.display.expect()  # the job's first class grid or map sets the view (2D or 3D) by its kind
        # its FSC plots are titled with the job ("Refine3D/job012"), drawn in the worker thread
        prepare = functools.partial(self.display.prepare_event, source=job_label(self.folder.value, self.job_name))
        self.job = runner.submit(self.job_name, factory, handlers=handlers, on_state=self._on_state,
                                 prepare=prepare)
        self._on_state(self.job)  # submit() may have started it before self.job was set
        SESSION.started(self, params, self.job)  # the jobs panel lists it (widgets/jobs_model.py)
        return self.job

    def cancel_job(self, *_: Any) -> None:
        """Cancel this widget's job (running: at its next step; queued: removed)."""
        if self.job is not None and not self.job.done:
            self.job.cancel()

    def _on_state(self, job: Job) -> None:
        if self._closed or job is not self.job:
            return
        active = job.state in (JobState.QUEUED, JobState.RUNNING)
        if job.done:
            self.display.drain()
        self.run_button.enabled = job.done
        self.cancel_button.enabled = active
        if job.state is JobState.QUEUED:
            current = job.runner.current
            self._set_status(f"{self.job_name}: queued" + (f" (waiting for {current.name})" if current else ""))
        elif job.state is JobState.RUNNING and self.status_text.startswith(f"{self.job_name}: queued"):
            self._set_status(f"{self.job_name}: starting")
        elif job.state is JobState.CANCELLING:
            if self.progress.max > 0:
                self._bar_before_cancel = (self.progress.value, self.progress.max)
            self._set_status(f"{self.job_name}: cancelling... (stops at the job's next step)")
        elif job.state is JobState.CANCELLED:
            self._set_status(f"{self.job_name}: cancelled; files already written are kept")
        elif job.state is JobState.FAILED:
            self.last_error = f"{self.job_name} failed: {error_message(job.error)}" if job.error else "failed"
            self._set_status(self.last_error, error=True)
        if job.state is not JobState.FINISHED:  # busy while cancelling, never once stopped (progress_model)
            value, maximum, text = self._progress.stopped(job.state.value, (self.progress.value, self.progress.max),
                                                          self._bar_before_cancel)
            self._set_bar(value, maximum, text or None)

    def _on_started(self, ev: Started) -> None:
        self.show_results_tab()  # what the job produces is what to look at now
        if ev.output_dir is not None:
            self.folder.value = str(ev.output_dir)
        self._set_status(f"{self.job_name}: running on {ev.backend}" + (f" — {ev.message}" if ev.message else ""))

    def _on_progress(self, ev: Progress | IterationStarted | IterationFinished) -> None:
        """The bar and the status line: "iteration n of max", the phase of the iteration (E-step, M-step, an
        auto-refine's final iteration) and the time left where it can be told (widgets/progress_model.py)."""
        self._show_progress(self._progress.update(ev, time.monotonic()))

    def _show_progress(self, report: ProgressReport | None) -> None:
        if report is None or self._closed:
            return
        if self.job is not None and self.job.state is JobState.CANCELLING:
            return  # the busy bar and "cancelling..." until the job has stopped
        self._set_bar(report.value, report.maximum, report.bar_text)
        self._set_status(report.text)

    def _set_bar(self, value: int, maximum: int, text: str | None) -> None:
        """The progress bar at ``value`` of ``maximum`` (0: busy) with ``text`` on it ("": the percentage; None:
        the words it has)."""
        if self._closed:
            return
        if (self.progress.max, self.progress.value) != (maximum, value):
            self.progress.max = maximum
            self.progress.value = value
        if text is not None:
            self.progress.native.setFormat(text or "%p%")

    def _on_message(self, ev: Message) -> None:
        """A log line of the job: the status line; while an iterative job runs, its progress line stays there (the
        timing and memory lines would hide the iteration's phase and summary) and the line goes to the status's
        tooltip. Warnings are also notifications."""
        if ev.level == "warning":
            show_warning(f"{self.job_name}: {ev.text}")
        if self._progress.in_iterations and ev.level != "warning":
            if not self._closed:
                self.status.tooltip = f"{self.job_name}: {ev.text.strip()}"
            return
        self._set_status(f"{self.job_name}: {ev.text}")

    def _on_map(self, ev: MapUpdated) -> None:
        """A map of this job: to the display, and its surface level (prepared in the worker) to the panel."""
        self.display.handle(ev)
        level = getattr(ev, "iso_threshold", None)
        if level is not None and not self._closed:
            self._map_levels[ev.name] = float(level)
            self.maps_info.value = ", ".join(f"{n} {v:.3g}" for n, v in self._map_levels.items())
            self.maps_info.visible = True

    def _on_iteration(self, ev: IterationFinished) -> None:
        self.display.handle(ev)
        self._on_progress(ev)  # "iteration n: <summary>"; the bar between iterations

    def _on_finished(self, ev: Finished) -> None:
        self.display.drain()
        report = self._progress.update(ev, time.monotonic())
        if report is not None:
            self._set_bar(report.value, report.maximum, report.bar_text)
        outputs = [Path(p) for p in ev.outputs.values()] if ev.outputs else []
        if outputs and not self.folder.value:
            first = outputs[0]
            self.folder.value = str(first if first.is_dir() else first.parent)
        self._set_status(f"{self.job_name}: finished" + (f" — {ev.summary}" if ev.summary else ""))

    # -- folder, close -----------------------------------------------------------------------------------

    def open_folder(self, *_: Any) -> bool:
        """Open the job folder in the system file browser; False (with a status message) if it does not exist."""
        text = self.folder.value.strip()
        if not text or not Path(text).is_dir():
            self._set_status(f"job folder {text or '(none)'} does not exist yet")
            return False
        return _open_in_file_browser(Path(text))

    def _on_destroyed(self, *_: Any) -> None:
        self._closed = True
        job = self.job
        if job is not None and not job.done:
            job.cancel()

    def ask(self, question: str) -> bool:
        """A yes/no question to the user (True: Yes), in a message box over this widget. Tests (or a front end
        that asks elsewhere) replace it on the instance: ``widget.ask = lambda question: True``."""
        return ask_yes_no(self.native, question)

    def may_close(self) -> bool:
        """The dock's close button was clicked: with a running or queued job, ask whether to cancel it and close
        (:data:`CLOSE_QUESTION`); Yes cancels the job (the dock then closes), No keeps both. True to close."""
        job = self.job
        if self._closed or job is None or job.done:
            return True
        if not self.ask(CLOSE_QUESTION):
            return False
        job.cancel()
        return True

    def _on_dock_closed(self) -> None:
        """The user closed this widget's dock (napari takes the widget out of it): cancel a running or queued
        job, say so, and stop reacting to the display."""
        job = self.job
        if job is not None and not job.done:
            job.cancel()
            show_info(f"{self.job_name}: its dock was closed, so the job was cancelled (files already written "
                      "are kept)")
        self._closed = True


def _open_in_file_browser(path: Path) -> bool:
    return bool(QDesktopServices.openUrl(QUrl.fromLocalFile(str(path.resolve()))))


def make_job_widget(viewer: napari.viewer.Viewer, job_module: Any, *,
                    runner: JobRunner | None = None) -> JobWidget:
    """The dock widget of ``job_module`` (see the module docstring). ``runner`` defaults to the shared
    runner of the device named by the parameters (``cpu`` / ``gpu`` fields)."""
    return JobWidget(viewer, job_module, runner=runner)


def job_widget_class(job_module: Any) -> type[JobWidget]:
    """A JobWidget subclass bound to ``job_module``, constructed as ``cls(viewer)``.

    napari's dock-widget machinery passes the viewer only to a callable whose ``__init__`` asks for it
    (an argument annotated ``napari.viewer.Viewer``); a plain factory function would be called without
    arguments. The manifest therefore points at classes made by this function.
    """

    def __init__(self: JobWidget, viewer: napari.viewer.Viewer) -> None:
        JobWidget.__init__(self, viewer, job_module)

    __init__.__annotations__["viewer"] = "napari.viewer.Viewer"
    name = "".join(part.capitalize() for part in getattr(job_module, "JOB_NAME", "job").split("_")) + "Widget"
    return type(name, (JobWidget,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})

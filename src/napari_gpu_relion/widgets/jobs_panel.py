"""Dock widget "Jobs" (napari.yaml): the project's jobs, chaining one job's outputs into the next, following a job
folder live. A thin view over widgets/jobs_model.py and widgets/follow_model.py.

* The list: every ``<project>/<Type>/jobNNN`` folder and every job started from a dock of this session
  (jobs_model.SESSION), with its type, folder, status and last iteration; rescanned every POLL_S seconds in a
  worker thread, and at once when a job of the session changes state or finishes an iteration.
* "Use as input of": what the next jobs can take from the selected job's outputs, found by the same scan in the
  worker thread (jobs_model.scan_jobs: the GUI thread lists no folder and reads no STAR), and by a new scan when
  another job is selected. **Open next job** (or a double-click) opens that job's dock (napari's plugin dock, or
  the one already open) and fills the input fields and a new output folder ``<Type>/jobNNN``.
* **Follow job** / **Follow folder...**: :class:`FolderFollow` scans a job folder (ours, or one RELION is writing)
  in a worker thread every FOLLOW_POLL_S seconds, reads each newly completed iteration there and hands its events
  (class grid, maps, FSC), prepared for display in that thread too, to the viewer's LiveDisplay, which draws them
  as it draws a running job's results. **Stop following** ends it; so does closing the viewer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from magicgui.widgets import Container, FileEdit, Label, PushButton
from napari.qt.threading import create_worker
from qtpy.QtCore import QTimer
from qtpy.QtWidgets import QAbstractItemView, QFileDialog, QHeaderView, QListWidget, QTableWidget, QTableWidgetItem

from ..errors import InputError
from ..events import Event
from .display import LiveDisplay
from .dock_layout import dock_as_panel, raise_dock
from .follow_model import SETTLE_S, FolderFollower, job_label
from .job_widget import DOCK_MARGIN, chooser_button, wrapping
from .jobs_model import SESSION, WIDGET_NAMES, JobRecord, Offer, ProjectScan, count_running, scan_jobs
from .layout_model import PANEL_MIN_WIDTH
from .per_viewer import one_per_viewer
from .runner import error_message

if TYPE_CHECKING:
    import napari

__all__ = ["JobsPanel", "FolderFollow", "open_job_dock", "PLUGIN"]

log = logging.getLogger(__name__)

PLUGIN = "napari-gpu-relion"
#: Seconds between two scans of the project folder.
POLL_S = 3.0
#: Seconds between two scans of a followed job folder.
FOLLOW_POLL_S = 1.0
COLUMNS = ("Job", "Folder", "Status", "Iter.")
#: Least height (pixels) of the job list: about four rows, also in a dock shared with the plots on a laptop.
TABLE_MIN_HEIGHT = 130
#: Greatest height (pixels) of the "Use as input of" list (it scrolls): the job list gets the rest. A refinement's
#: ten offers fit whole (about 14 px a row, and the sideways scroll bar): at 110 px only seven showed at 1366x768.
OFFERS_MAX_HEIGHT = 170


def open_job_dock(viewer: Any, job: str) -> Any:
    """The dock widget of ``job`` (our job name): the one already docked, else a new one from the plugin; its tab
    is brought to the front of the panel."""
    dock, widget = viewer.window.add_plugin_dock_widget(PLUGIN, WIDGET_NAMES[job])
    raise_dock(dock)
    return widget


class FolderFollow:
    """Follows one job folder for a viewer (see the module docstring). One per viewer: :meth:`for_viewer`."""

    _instances: dict[int, tuple[weakref.ref, FolderFollow]] = {}

    def __init__(self, viewer: Any) -> None:
        self.display = LiveDisplay.for_viewer(viewer)
        self.folder: Path | None = None
        self.shown = ""
        self.error: str | None = None
        #: what the followed folder's newest state waits for (follow_model.FolderFollower.waiting), or None
        self.waiting: str | None = None
        self.interval = FOLLOW_POLL_S
        self.settle_s = SETTLE_S
        self._worker: Any = None
        self._stop: threading.Event | None = None
        self._listeners: list[weakref.WeakMethod] = []

    @classmethod
    def for_viewer(cls, viewer: Any) -> FolderFollow:
        return one_per_viewer(cls._instances, viewer, cls)

    @property
    def active(self) -> bool:
        return self._worker is not None

    def connect(self, callback: Any) -> None:
        """Call ``callback()`` (a bound method, held weakly) when the state or the shown iteration changes."""
        self._listeners.append(weakref.WeakMethod(callback))

    def _notify(self) -> None:
        self._listeners = [r for r in self._listeners if r() is not None]
        for ref in list(self._listeners):
            callback = ref()
            if callback is not None:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the follow
                    log.exception("error in a follow listener")

    def start(self, folder: str | os.PathLike) -> None:
        """Follow ``folder`` (stops following the previous one)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise InputError("not a folder", path=str(folder))
        self.stop()
        self.folder, self.shown, self.error, self.waiting = folder, "", None, None
        self.display.begin(job_label(folder))  # the former job's plots cleared, saying whose are awaited
        stop = self._stop = threading.Event()
        follower = FolderFollower(folder, self.settle_s)
        worker = create_worker(_follow, follower, self.display, self.interval, stop, _start_thread=False)
        worker.yielded.connect(self._on_yielded)
        worker.errored.connect(self._on_errored)
        worker.finished.connect(self._on_finished)
        self._worker = worker
        worker.start()
        _stop_on_quit(self)
        self._notify()

    def stop(self) -> None:
        """Stop following (the worker ends within a poll step)."""
        if self._stop is not None:
            self._stop.set()
        if self._worker is not None:
            self._worker.quit()
        self._worker = None
        self._notify()

    def _on_yielded(self, item: Any) -> None:
        if isinstance(item, Event):
            self.display.handle(item)
        elif isinstance(item, tuple) and item and item[0] == "shown":
            self.shown = item[1]
            self._notify()
        elif isinstance(item, tuple) and item and item[0] == "error":
            self.error = item[1]
            self._notify()
        elif isinstance(item, tuple) and item and item[0] == "waiting":
            self.waiting = item[1]
            self._notify()

    def _on_errored(self, exc: BaseException) -> None:
        self.error = error_message(exc)
        self._notify()

    def _on_finished(self) -> None:
        if self._stop is not None and self._stop.is_set():
            return
        self._worker = None
        self._notify()


def _stop_on_quit(follow: FolderFollow) -> None:
    """Stop ``follow`` when Qt quits (its thread would otherwise keep the application waiting)."""
    from qtpy.QtWidgets import QApplication

    app = QApplication.instance()
    if app is not None and not getattr(follow, "_quit_hooked", False):
        app.aboutToQuit.connect(follow.stop)
        follow._quit_hooked = True  # noqa: SLF001


def _follow(follower: FolderFollower, display: LiveDisplay, interval: float, stop: threading.Event):
    """The follow loop (worker thread): scan, read and prepare a new iteration's events, wait, again; it ends when
    stopped or when the viewer is closed."""
    source = job_label(follower.folder)
    waiting = None
    while not stop.is_set() and display.viewer is not None:
        try:
            events = follower.poll()
            prepared = [display.prepare_event(ev, source) for ev in events]
        except (InputError, OSError, ValueError) as exc:
            yield ("error", f"{follower.folder}: {error_message(exc)}")
            prepared = []
        if follower.waiting != waiting:  # what the newest iteration waits for, files named
            waiting = follower.waiting
            yield ("waiting", waiting)
        for ev in prepared:
            if stop.is_set():
                return
            yield ev
        if prepared:
            yield ("shown", follower.shown.description if follower.shown is not None else "")
        stop.wait(interval)


class JobsPanel(Container):
    """The "Jobs" dock (see the module docstring)."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        self.viewer = viewer
        self.follow = FolderFollow.for_viewer(viewer)
        self.records: list[JobRecord] = []
        self.current_offers: list[Offer] = []
        self.offers_folder: Path | None = None  # the job whose offers are shown
        self.last_opened: Any = None
        self._closed = False
        self._scan_worker: Any = None
        self._rescan = False

        self.project = FileEdit(mode="d", nullable=True, name="project", label="project")
        self.project.line_edit.value = str(SESSION.latest_project() or os.getcwd())
        self._project_is_default = True  # until the user picks a folder
        self.project.line_edit.native.setMinimumWidth(60)
        chooser_button(self.project, "Choose the project folder")
        self.project.tooltip = "The project folder: its <Type>/jobNNN folders are listed (RELION's layout)"
        self.info = Label(value="", name="jobs_info", label="")
        wrapping(self.info)
        self.offer_label = Label(value="Use as input of:", name="offers_label", label="")
        self.open_button = PushButton(text="Open next job", name="open_next_job", label="")
        self.open_button.tooltip = "Open the chosen job's dock with this output as its input and a new job folder"
        self.follow_button = PushButton(text="Follow job", name="follow_job", label="")
        self.follow_button.tooltip = ("Show the selected job's newest iteration (class averages, maps, FSC) and "
                                      "each new one as its files appear")
        self.follow_folder_button = PushButton(text="Follow folder...", name="follow_folder", label="")
        self.follow_folder_button.tooltip = "Follow any RELION job folder (Class2D/job010, Refine3D/..., PostProcess)"
        self.stop_button = PushButton(text="Stop following", name="stop_following", label="", enabled=False)
        self.follow_info = Label(value="following nothing", name="follow_info", label="")
        wrapping(self.follow_info)
        follow_row = Container(widgets=[self.follow_button, self.follow_folder_button], layout="horizontal",
                               labels=False, name="follow_row")  # two buttons a row: the dock stays narrow
        follow_row.margins = (0, 0, 0, 0)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("jobs_table")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        for col in (0, 2, 3):
            header.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setMinimumHeight(TABLE_MIN_HEIGHT)
        self.offer_list = QListWidget()
        self.offer_list.setObjectName("jobs_offers")
        self.offer_list.setMinimumHeight(60)
        self.offer_list.setMaximumHeight(OFFERS_MAX_HEIGHT)

        super().__init__(widgets=[self.project, self.info, self.offer_label, self.open_button, follow_row,
                                  self.stop_button, self.follow_info], labels=False, name="jobs_panel")
        self.margins = (DOCK_MARGIN,) * 4
        layout = self.native.layout()
        layout.insertWidget(2, self.table, 1)
        layout.insertWidget(4, self.offer_list)
        self.native.setMinimumWidth(PANEL_MIN_WIDTH)
        dock_as_panel(self.native)  # a tab of the plugin's panel, beside the job docks (widgets/dock_layout.py)

        self.table.itemSelectionChanged.connect(self._on_selection)
        self.offer_list.itemDoubleClicked.connect(self.open_offer)
        self.open_button.changed.connect(self.open_offer)
        self.follow_button.changed.connect(self.follow_selected)
        self.follow_folder_button.changed.connect(self.choose_folder_to_follow)
        self.stop_button.changed.connect(self.stop_following)
        self.project.changed.connect(self._on_project_changed)
        SESSION.connect(self._on_session)
        self.follow.connect(self._on_follow)
        self.native.destroyed.connect(self._on_destroyed)
        self._timer = QTimer(self.native)
        self._timer.timeout.connect(self.refresh)
        self._timer.start(int(POLL_S * 1000))
        self._on_follow()
        self.refresh()

    # -- the list ----------------------------------------------------------------------------------------

    def _on_project_changed(self, *_: Any) -> None:
        if self.project_folder() != SESSION.latest_project():
            self._project_is_default = False  # the user's choice: no longer follows the session's jobs
        self.refresh()

    def project_folder(self) -> Path | None:
        text = self.project.line_edit.value.strip()
        return Path(text).expanduser() if text else None

    def refresh(self, *_: Any) -> Any:
        """Rescan the project and the selected job's offers (in a worker thread) and redraw them; returns the
        worker (None when one is still scanning: it scans again when done)."""
        if self._closed:
            return None
        if self._scan_worker is not None:
            self._rescan = True
            return None
        selected = self.selected()
        worker = create_worker(_scan, self.project_folder(), selected.folder if selected is not None else None,
                               _start_thread=False)
        worker.returned.connect(self._show_records)
        worker.finished.connect(self._scan_done)
        self._scan_worker = worker
        worker.start()
        return worker

    def _scan_done(self) -> None:
        self._scan_worker = None
        if self._rescan and not self._closed:
            self._rescan = False
            self.refresh()

    def _on_session(self) -> None:
        """A job started, changed or finished: while the project is still the default (the current folder), it
        becomes the project of the newest session job; then rescan."""
        project = SESSION.latest_project()
        if project is not None and self._project_is_default and self.project_folder() != project:
            self._set_project(project)  # its change signal rescans
            return
        self.refresh()

    def _set_project(self, folder: Path) -> None:
        self.project.line_edit.value = str(folder)
        self._project_is_default = True

    def _show_records(self, scan: ProjectScan) -> None:
        if self._closed:
            return
        selected = self.selected()
        records = self.records = scan.records
        project = self.project_folder()
        self.table.setRowCount(len(records))
        for row, rec in enumerate(records):
            cells = (rec.job_type, rec.display_folder(project), rec.status,
                     "" if rec.iteration is None else str(rec.iteration))
            for col, text in enumerate(cells):
                item = self.table.item(row, col)
                if item is None:
                    item = QTableWidgetItem()
                    self.table.setItem(row, col, item)
                if item.text() != text:
                    item.setText(text)
            self.table.item(row, 1).setToolTip(str(rec.folder))
        running = count_running(records)
        self.info.value = (f"{len(records)} job(s), {running} running" if records
                           else "no jobs yet in this project (run one from a job dock)")
        if selected is not None:
            for row, rec in enumerate(records):
                if rec.folder == selected.folder:
                    if scan.folder == rec.folder:
                        self._show_offers(rec.folder, list(scan.offers))
                    if self.table.currentRow() != row:
                        self.table.selectRow(row)
                    break

    def selected(self) -> JobRecord | None:
        row = self.table.currentRow()
        return self.records[row] if 0 <= row < len(self.records) else None

    def select_job(self, folder: str | os.PathLike) -> JobRecord | None:
        """Select the job of ``folder`` in the list (tests, scripts); its record, or None if it is not listed."""
        for row, rec in enumerate(self.records):
            if rec.folder.resolve() == Path(folder).resolve():
                self.table.selectRow(row)
                return rec
        return None

    def _on_selection(self) -> None:
        """Another job selected: its offers come from a scan in the worker thread; none are offered until then."""
        rec = self.selected()
        if rec is not None and rec.folder != self.offers_folder:
            self._show_offers(None, [])
            self.refresh()

    def _show_offers(self, folder: Path | None, new: list[Offer]) -> None:
        """Show ``new``, the offers of the job of ``folder``."""
        self.offers_folder = folder
        if [(o.job, o.values) for o in new] == [(o.job, o.values) for o in self.current_offers]:
            return
        current = self.offer_list.currentRow()
        self.current_offers = new
        self.offer_list.clear()
        for offer in new:
            self.offer_list.addItem(offer.label)
            self.offer_list.item(self.offer_list.count() - 1).setToolTip(
                "\n".join(f"{k}: {v}" for k, v in offer.values.items()))
        if new:
            self.offer_list.setCurrentRow(min(max(current, 0), len(new) - 1))
        self.open_button.enabled = bool(new)

    # -- chaining ----------------------------------------------------------------------------------------

    def open_offer(self, *_: Any, offer: Offer | None = None) -> Any:
        """Open the next job's dock with the chosen offer's values; returns that job widget."""
        if offer is None:
            row = self.offer_list.currentRow()
            if not 0 <= row < len(self.current_offers):
                self.info.value = "select a job, then what to use its output for"
                return None
            offer = self.current_offers[row]
        widget = open_job_dock(self.viewer, offer.job)
        widget.set_values(**offer.values)
        if hasattr(widget, "_set_status"):
            widget._set_status(f"{offer.job}: input from {offer.output.path.name}; check the options, "  # noqa: SLF001
                               "then Run")
        self.last_opened = widget
        return widget

    # -- following ---------------------------------------------------------------------------------------

    def follow_selected(self, *_: Any) -> None:
        rec = self.selected()
        if rec is None:
            self.follow_info.value = "select a job to follow"
            return
        self.follow_folder(rec.folder)

    def follow_folder(self, folder: str | os.PathLike) -> None:
        """Follow ``folder`` live (class averages, maps, FSC of each new iteration)."""
        try:
            self.follow.start(folder)
        except InputError as exc:
            self.follow_info.value = error_message(exc)

    def choose_folder_to_follow(self, *_: Any) -> None:
        folder = QFileDialog.getExistingDirectory(self.native, "Job folder to follow",
                                                  str(self.project_folder() or os.getcwd()))
        if folder:
            self.follow_folder(folder)

    def stop_following(self, *_: Any) -> None:
        self.follow.stop()

    def _on_follow(self) -> None:
        if self._closed:
            return
        f = self.follow
        self.stop_button.enabled = f.active
        if f.folder is None:
            self.follow_info.value = "following nothing"
            return
        text = f"following {f.folder}" if f.active else f"stopped following {f.folder}"
        text += f": {f.shown} shown" if f.shown else (": waiting for a complete iteration" if f.active else "")
        if f.waiting and f.active:
            text += f"; waiting: {f.waiting}" if f.shown else f" ({f.waiting})"
        if f.error:
            text += f" ({f.error})"
        self.follow_info.value = text.replace("/", "/\u200b")

    def _on_destroyed(self, *_: Any) -> None:
        self._closed = True


def _scan(project: Path | None, selected: Path | None) -> ProjectScan:
    """The list and the offers of the job of folder ``selected`` (worker thread; jobs_model.scan_jobs)."""
    t0 = time.monotonic()
    scan = scan_jobs(project, selected)
    log.debug("jobs scan: %d jobs, %d offers in %.3f s", len(scan.records), len(scan.offers), time.monotonic() - t0)
    return scan


widget = JobsPanel

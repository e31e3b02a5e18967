"""The plugin's docks on a laptop screen (issue 49), measured on the real widgets in a real (Xvfb) napari window.

The tutorial's docks are opened one after another with the Jobs dock open and none closed (the hardest case:
every dock stays), in a 1366 x 768 window on a 1366 x 768 screen (and in a 1920 x 1080 one). After each step: the
window within the screen, the canvas at least CANVAS_FRACTION of the window's width, the job docks tabs of one
panel, the plots tabs of one group under it, and the current dock's Run, Cancel, progress bar and status line (and
the picking dock's Save picks and picks count, the 2D classification dock's Save selection) drawn whole: inside
the window and inside every widget around them (a scroll area's viewport included), so seen without scrolling.
A status line of several lines is drawn whole too. The panel's tabs read whole (RELION's job types, never elided
to "3D..."), the one in front in view, each with its dock's full name as tooltip. The arithmetic of the sizes is
checked without Qt.

pytest-xvfb's screen is 800 x 600; the layout's idea of the screen (dock_layout.screen_room) is set to the
screen size of the test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("napari")

from qtpy.QtCore import QPoint, QRect, Qt  # noqa: E402
from qtpy.QtWidgets import QApplication, QDockWidget, QToolButton  # noqa: E402

from napari_gpu_relion.compute.angular_distribution import angular_histogram  # noqa: E402
from napari_gpu_relion.events import FscUpdated  # noqa: E402
from napari_gpu_relion.widgets import dock_layout  # noqa: E402
from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: E402
from napari_gpu_relion.widgets.layout_model import (  # noqa: E402
    CANVAS_FRACTION,
    PANEL_MIN_WIDTH,
    PANEL_WIDTH,
    PLOT_MIN_HEIGHT,
    panel_width,
    plot_height,
    tab_title,
)

PLUGIN = "napari-gpu-relion"
#: The tutorial's job docks, in its order.
TUTORIAL = ("Auto-picking", "Particle extraction", "2D classification", "Class selection", "3D initial model",
            "3D auto-refine", "Mask creation", "Post-process")
ALL_DOCKS = ("Jobs", "Reconstruct", *TUTORIAL[:6], "3D classification", *TUTORIAL[6:])
#: The panel's tab of each dock (RELION's job types) and the full name its tooltip gives.
TABS = {"Jobs": "Jobs", "Auto-picking": "AutoPick", "Particle extraction": "Extract", "2D classification": "Class2D",
        "Class selection": "Select", "3D initial model": "InitialModel", "3D auto-refine": "Refine3D",
        "Mask creation": "MaskCreate", "Post-process": "PostProcess", "Reconstruct": "Reconstruct",
        "3D classification": "Class3D"}
LONG_STATUS = ("postprocess failed: Not a directory: /home/someone/relion_tutorial/PostProcess/job012/"
               "postprocess_masked.mrc (the folder above it is a file; choose another output folder)")

pytestmark = pytest.mark.usefixtures("config_dir")


def _pump(seconds: float = 0.3) -> None:
    end = time.monotonic() + seconds
    while True:
        QApplication.processEvents()
        if time.monotonic() >= end:
            return
        time.sleep(0.02)


def _pump_until(condition, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        _pump(0.05)


def _window(make_napari_viewer, monkeypatch, screen: tuple[int, int]):
    monkeypatch.setattr(dock_layout, "screen_room", lambda main: QRect(0, 0, *screen))
    viewer = make_napari_viewer(show=True)
    main = viewer.window._qt_window  # noqa: SLF001 - the QMainWindow whose geometry is measured
    main.resize(*screen)
    _pump()
    return viewer, main


def _clipped_rect(widget, main) -> tuple[QRect, QRect]:
    """(the widget's rectangle in the window, the part of it that is drawn: inside every ancestor and the
    window)."""
    rect = QRect(widget.mapTo(main, QPoint(0, 0)), widget.size())
    shown = QRect(rect)
    parent = widget.parentWidget()
    while parent is not None and parent is not main:
        shown = shown.intersected(QRect(parent.mapTo(main, QPoint(0, 0)), parent.size()))
        parent = parent.parentWidget()
    return rect, shown.intersected(main.rect())


def assert_shown_whole(widget, main, what: str) -> None:
    native = getattr(widget, "native", widget)
    assert native.isVisible(), f"{what} is hidden"
    rect, shown = _clipped_rect(native, main)
    assert rect.width() > 0 and rect.height() > 0, what
    assert shown == rect, f"{what} is cut off or needs scrolling: {rect} drawn {shown}"


def _canvas(viewer):
    return viewer.window._qt_viewer.canvas.native  # noqa: SLF001 - the canvas whose share is measured


def _dock(widget) -> QDockWidget:
    dock = dock_layout.dock_of(getattr(widget, "native", widget))
    assert dock is not None
    return dock


def assert_room(viewer, main, screen: tuple[int, int], step: str) -> None:
    """The window within the screen, the canvas its share of the window's width."""
    assert main.width() <= screen[0] and main.height() <= screen[1], (step, main.size())
    assert main.minimumSizeHint().height() <= screen[1], (step, main.minimumSizeHint())
    canvas = _canvas(viewer)
    assert canvas.width() >= CANVAS_FRACTION * main.width(), (step, canvas.width(), main.width())
    assert canvas.height() >= 0.8 * main.height(), (step, canvas.height())


def assert_job_dock_usable(widget, main, step: str) -> None:
    """The job dock in front, its Run/Cancel/progress/status drawn whole; a status of several lines too."""
    dock = _dock(widget)
    assert dock.isVisible() and not dock.visibleRegion().isEmpty(), step
    for name in ("run_button", "cancel_button", "progress", "status"):
        assert_shown_whole(getattr(widget, name), main, f"{step}: {name}")
    assert widget.native.width() >= widget.native.minimumSizeHint().width(), step  # nothing squeezed off
    before = widget.status_text
    widget._set_status(LONG_STATUS)  # noqa: SLF001 - a long error, as a failed job shows it
    label = widget.status.native
    _pump_until(lambda: label.height() >= label.heightForWidth(label.width()))  # laid out (a loaded machine: slow)
    assert label.height() >= label.heightForWidth(label.width()), f"{step}: status line cut"
    assert_shown_whole(label, main, f"{step}: long status")
    assert_shown_whole(widget.run_button, main, f"{step}: Run under a long status")
    widget._set_status(before)  # noqa: SLF001


def assert_tabs_readable(dock: QDockWidget, expected: dict[str, str], step: str) -> None:
    """The panel's tab bar: each tab's whole text (no elision, drawn in full in its tab), its dock's full name as
    its tooltip, and the tab in front inside the part of the bar that is drawn (not under the scroll arrows)."""
    bar = dock_layout.tab_bar_of(dock)
    assert bar is not None, step
    assert bar.elideMode() == Qt.TextElideMode.ElideNone, step
    texts = [bar.tabText(k) for k in range(bar.count())]
    assert {TABS[name] for name in expected} == set(texts), (step, texts)
    for k, text in enumerate(texts):
        needed = bar.fontMetrics().horizontalAdvance(text)
        assert bar.tabRect(k).width() >= needed, (step, text, bar.tabRect(k).width(), needed)
        assert bar.tabToolTip(k) == expected[next(n for n in expected if TABS[n] == text)], (step, text)
    front = bar.tabRect(bar.currentIndex())
    assert texts[bar.currentIndex()] == dock.windowTitle(), step
    arrows = [b.geometry() for b in bar.findChildren(QToolButton) if b.isVisible()]
    assert bar.rect().contains(front) and not any(a.intersects(front) for a in arrows), (step, front, arrows)


def _fsc(display: LiveDisplay) -> None:
    x = np.linspace(0.0, 1.0 / 6.0, 33)
    display.show_fsc(FscUpdated(resolution_inv_A=x, curves={"gold-standard": np.exp(-30 * x)}, resolution_A=12.0))
    rng = np.random.default_rng(0)
    display.show_angular_histogram(angular_histogram(rng.uniform(-180, 180, 375), rng.uniform(0, 180, 375)))


def _walk_the_tutorial(viewer, main, screen) -> dict[str, float]:
    """Every step's docks with the Jobs dock open; the geometry asserted after each; the canvas share per step."""
    shares = {}
    viewer.open_sample(PLUGIN, "micrographs")
    _, jobs = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    _pump()
    assert_room(viewer, main, screen, "Jobs")
    assert_shown_whole(jobs.open_button, main, "Jobs: Open next job")
    assert_shown_whole(jobs.follow_folder_button, main, "Jobs: Follow folder...")
    display = LiveDisplay.for_viewer(viewer)
    panel_docks = [_dock(jobs)]
    names = {"Jobs": "Jobs"}
    for step in TUTORIAL:
        _, widget = viewer.window.add_plugin_dock_widget(PLUGIN, step)
        _pump()
        if step == "3D auto-refine":
            _fsc(display)  # the refinement's FSC and angular distribution docks
            _pump()
        widget.show_results_tab()
        _pump(0.1)
        dock = _dock(widget)
        panel_docks.append(dock)
        assert_room(viewer, main, screen, step)
        assert_job_dock_usable(widget, main, step)
        # one panel: every job dock and the Jobs dock tabs of one group, this one in front
        assert set(main.tabifiedDockWidgets(dock)) == set(panel_docks) - {dock}, step
        names[step] = step
        assert_tabs_readable(dock, names, step)
        if step == "Auto-picking":
            for name in ("fom_slider", "picks_info", "save_picks_button"):
                assert_shown_whole(getattr(widget, name), main, f"{step}: {name}")
        if step == "2D classification":
            assert_shown_whole(widget.save_selection_button, main, f"{step}: Save selection")
        if display.fsc is not None:  # the plots: tabs of one group under the panel, as wide as it
            fsc_dock, ang_dock = _dock(display.fsc.widget), _dock(display.angdist.widget)
            assert main.tabifiedDockWidgets(fsc_dock) == [ang_dock], step
            front = ang_dock if ang_dock.isVisible() else fsc_dock
            assert front.geometry().top() >= dock.geometry().bottom(), (step, front.geometry(), dock.geometry())
            assert abs(front.geometry().left() - dock.geometry().left()) <= 2, step
            assert front.height() >= PLOT_MIN_HEIGHT - 2, step
        shares[step] = _canvas(viewer).width() / main.width()
    return shares


@pytest.mark.slow
def test_the_tutorials_docks_leave_the_canvas_room_on_a_1366x768_screen(make_napari_viewer, monkeypatch, session):
    viewer, main = _window(make_napari_viewer, monkeypatch, (1366, 768))
    shares = _walk_the_tutorial(viewer, main, (1366, 768))
    assert min(shares.values()) >= CANVAS_FRACTION


@pytest.mark.slow
def test_the_tutorials_docks_on_a_1920x1080_screen(make_napari_viewer, monkeypatch, session):
    viewer, main = _window(make_napari_viewer, monkeypatch, (1920, 1080))
    shares = _walk_the_tutorial(viewer, main, (1920, 1080))
    assert min(shares.values()) >= 0.6  # the panel at its preferred width leaves more than the least share
    dock = _dock(viewer.window.dock_widgets[f"Post-process ({PLUGIN})"])
    assert dock.width() >= PANEL_WIDTH - 2


def test_every_job_dock_is_usable_at_the_panels_least_width(make_napari_viewer):
    """No dock asks for more than the panel's least width (more would be cut off there)."""
    viewer = make_napari_viewer()
    for name in ALL_DOCKS:
        dock, widget = viewer.window.add_plugin_dock_widget(PLUGIN, name)
        QApplication.processEvents()
        assert widget.native.minimumSizeHint().width() <= PANEL_MIN_WIDTH, (name, widget.native.minimumSizeHint())
        viewer.window.remove_dock_widget(dock)


def test_a_job_dock_opened_again_comes_to_the_front(make_napari_viewer, monkeypatch, session):
    viewer, main = _window(make_napari_viewer, monkeypatch, (1366, 768))
    from napari_gpu_relion.widgets.jobs_panel import open_job_dock

    pick = open_job_dock(viewer, "autopick")
    _pump()
    ext = open_job_dock(viewer, "extract")
    _pump()
    assert _dock(ext).isVisible() and not _dock(ext).visibleRegion().isEmpty()
    assert open_job_dock(viewer, "autopick") is pick  # the one already docked, in front now
    _pump()
    assert not _dock(pick).visibleRegion().isEmpty() and _dock(ext).visibleRegion().isEmpty()
    assert _dock(pick).windowTitle() == "AutoPick"  # the tab reads RELION's job type
    assert _dock(pick).title.title.text() == "Auto-picking"  # napari's title bar the full name, without the plugin's


def test_every_docks_tab_is_relions_job_type():
    widgets = {"autopick": "Auto-picking", "extract": "Particle extraction", "class2d": "2D classification",
               "select": "Class selection", "initial_model": "3D initial model", "refine3d": "3D auto-refine",
               "mask_create": "Mask creation", "postprocess": "Post-process", "reconstruct": "Reconstruct",
               "class3d": "3D classification"}
    assert {widgets[job]: tab_title(job) for job in widgets} == {k: v for k, v in TABS.items() if k != "Jobs"}
    assert tab_title("ctf_refine") == "CtfRefine"  # a job without a listed type: its name's words run together


# ----------------------------------------------------------------------------------------------------------
# The arithmetic (no Qt)


def test_panel_width_gives_the_canvas_its_share():
    # 1366 px window, napari's 320 px layer docks: the canvas had 647 px beside a 373 px dock
    width = panel_width(1366, canvas_width=647, current_width=373)
    assert width == PANEL_MIN_WIDTH or 647 + (373 - width) >= CANVAS_FRACTION * 1366
    assert panel_width(1366, canvas_width=720, current_width=300) == 268  # 752 px = 55.05 % of 1366
    assert panel_width(1920, canvas_width=1200, current_width=300) == PANEL_WIDTH  # room: the preferred width
    assert panel_width(1000, canvas_width=300, current_width=300) == PANEL_MIN_WIDTH  # never below the least


def test_plot_height_leaves_the_panel_its_minimum():
    assert plot_height(700, 300) == round(0.38 * 700)
    assert plot_height(600, 500) == PLOT_MIN_HEIGHT  # the panel needs more: the plots at their least
    assert plot_height(1000, 100) == 380

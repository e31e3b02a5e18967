"""Where the plugin's docks go in napari's window, so that the canvas keeps the room on a laptop screen (issue 49).

* The *panel*: the Jobs dock and every job dock share one right-hand dock area as tabs (a newly docked one, or one
  opened again, comes to the front); a job dock's tab reads RELION's job type ("Refine3D":
  layout_model.tab_title), whole (never elided: tabs that do not fit are reached by the bar's scroll arrows), its
  tooltip and napari's title bar above the dock the full name ("3D auto-refine", without napari's
  " (napari-gpu-relion)").
* The *plots* (FSC, angular distribution) are tabs of one group under the panel, never a column beside it.
* The panel is :data:`~napari_gpu_relion.widgets.layout_model.PANEL_WIDTH` pixels wide where the window has room,
  narrower (not below PANEL_MIN_WIDTH) until the canvas keeps CANVAS_FRACTION of the window's width; the plots get
  PLOT_FRACTION of the area's height under it (widgets/layout_model.py holds the arithmetic).
* A window that grew past its screen while a dock was added is brought back within it (:func:`screen_room`).

A widget takes part by :func:`dock_as_panel` (job docks, the Jobs dock: placed when napari docks it) or through
:func:`dock_plot` (the live display's plots). The user may still drag any dock elsewhere or float it: a floating dock
is left alone, and nothing is placed again until the next dock arrives.
"""

from __future__ import annotations

import weakref
from typing import Any

from qtpy.QtCore import QEvent, QObject, Qt, QTimer
from qtpy.QtWidgets import QDockWidget, QLabel, QMainWindow, QTabBar, QTabWidget, QWidget

from .layout_model import panel_width, plot_height

__all__ = ["PANEL", "PLOT", "ROLE_PROPERTY", "TAB_PROPERTY", "FULL_NAME_PROPERTY", "dock_as_panel", "dock_plot",
           "place_panel", "place_plot", "fit_docks", "dock_of", "docks_of_role", "canvas_widget", "raise_dock",
           "screen_room", "tab_bar_of", "full_name"]

#: Qt property of a docked widget that says which part of the plugin's area it belongs to.
ROLE_PROPERTY = "gpu_relion_dock"
PANEL = "panel"
PLOT = "plot"
#: Qt property of a docked widget: the text of its tab (the dock's name where it has none).
TAB_PROPERTY = "gpu_relion_tab"
#: Qt property of a docked widget: its dock's full name (napari's, without the plugin's suffix).
FULL_NAME_PROPERTY = "gpu_relion_full_name"
#: What napari appends to a plugin dock's name ("<widget> (<plugin>)"); the tabs leave it out.
_PLUGIN_SUFFIX = " (napari-gpu-relion)"


def dock_of(widget: Any) -> QDockWidget | None:
    """The QDockWidget that holds ``widget`` (a QWidget; None if it is not docked or was deleted)."""
    try:
        w = widget
        while w is not None and not isinstance(w, QDockWidget):
            w = w.parentWidget()
        return w
    except RuntimeError:  # deleted by Qt
        return None


def _role(dock: QDockWidget) -> str | None:
    try:
        inner = dock.widget()
    except RuntimeError:
        return None
    role = inner.property(ROLE_PROPERTY) if inner is not None else None
    return str(role) if role else None


def docks_of_role(main: QMainWindow, role: str, area: Any = None) -> list[QDockWidget]:
    """The docked (not floating, not closed) docks of ``role`` in ``main``, in the order they were made; only
    those of dock area ``area`` when given."""
    out = []
    for dock in main.findChildren(QDockWidget):
        if _role(dock) != role or dock.isFloating() or dock.isHidden() and not main.tabifiedDockWidgets(dock):
            continue
        if dock.parentWidget() is not main or area is not None and main.dockWidgetArea(dock) != area:
            continue
        out.append(dock)
    return out


def _main_of(dock: QDockWidget | None) -> QMainWindow | None:
    main = dock.parentWidget() if dock is not None else None
    return main if isinstance(main, QMainWindow) and not dock.isFloating() else None


def _short_title(dock: QDockWidget) -> None:
    """The tab reads the widget's tab text (:data:`TAB_PROPERTY`), else its name alone; the full name (without the
    plugin's suffix) is kept as :data:`FULL_NAME_PROPERTY` and put in napari's title bar above the dock."""
    inner = dock.widget()
    if inner is None:
        return
    full = full_name(dock)
    if not inner.property(FULL_NAME_PROPERTY):
        inner.setProperty(FULL_NAME_PROPERTY, full)
    tab = inner.property(TAB_PROPERTY)
    dock.setWindowTitle(str(tab) if tab else full)
    bar = getattr(dock, "title", None)  # napari's QtCustomTitleBar; its QLabel reads "<name> (<plugin>)"
    label = getattr(bar, "title", None)
    if isinstance(label, QLabel) and label.text() != full:
        label.setText(full)


def full_name(dock: QDockWidget) -> str:
    """The dock's full name: napari's name of it without " (napari-gpu-relion)" ("3D auto-refine")."""
    inner = dock.widget()
    kept = inner.property(FULL_NAME_PROPERTY) if inner is not None else None
    if kept:
        return str(kept)
    title = str(getattr(dock, "name", "") or dock.windowTitle())
    return title[: -len(_PLUGIN_SUFFIX)] if title.endswith(_PLUGIN_SUFFIX) else title


def tab_bar_of(dock: QDockWidget) -> QTabBar | None:
    """The tab bar that switches ``dock`` (its group's, made by the QMainWindow), None if it has none."""
    main = _main_of(dock)
    if main is None:
        return None
    title = dock.windowTitle()
    bars = [bar for bar in main.findChildren(QTabBar) if bar.parentWidget() is main and bar.isVisible()
            and any(bar.tabText(k) == title for k in range(bar.count()))]
    if len(bars) > 1:  # the same title in two groups: the bar just above or below the dock
        g = dock.geometry()
        bars.sort(key=lambda b: min(abs(b.geometry().bottom() - g.top()), abs(b.geometry().top() - g.bottom())))
    return bars[0] if bars else None


def _label_tabs(main: QMainWindow) -> None:
    """The tab bars of the plugin's groups: whole texts (no elision; scroll arrows where they do not fit) and each
    tab's tooltip its dock's full name. Qt makes the bars as it lays the docks out, so this runs after it."""
    names = {}
    for role in (PANEL, PLOT):
        for dock in docks_of_role(main, role):
            names[dock.windowTitle()] = full_name(dock)
    for bar in main.findChildren(QTabBar):
        if bar.parentWidget() is not main:
            continue
        texts = [bar.tabText(k) for k in range(bar.count())]
        if not any(t in names for t in texts):
            continue
        if bar.elideMode() != Qt.TextElideMode.ElideNone:
            bar.setElideMode(Qt.TextElideMode.ElideNone)
        bar.setUsesScrollButtons(True)
        for k, text in enumerate(texts):
            if text in names and bar.tabToolTip(k) != names[text]:
                bar.setTabToolTip(k, names[text])


def raise_dock(dock: QDockWidget | None) -> None:
    """Show ``dock`` and bring its tab to the front."""
    if dock is not None:
        dock.show()
        dock.raise_()


def place_panel(widget: QWidget) -> QDockWidget | None:
    """``widget`` (a job dock's or the Jobs dock's QWidget, just docked by napari) joins the panel: a tab of the
    first panel dock of its dock area, brought to the front; then the area is sized (:func:`fit_docks`)."""
    dock = dock_of(widget)
    main = _main_of(dock)
    if main is None:
        return dock
    area = main.dockWidgetArea(dock)
    _short_title(dock)
    main.setTabPosition(area, QTabWidget.TabPosition.North)  # the tabs above the dock they switch, as a tab widget
    others = [d for d in docks_of_role(main, PANEL, area) if d is not dock]
    if others and dock not in main.tabifiedDockWidgets(others[0]):
        main.tabifyDockWidget(others[0], dock)
    raise_dock(dock)
    fit_docks(main)
    QTimer.singleShot(0, lambda: _fit_later(weakref.ref(main)))  # once the tabs are laid out
    return dock


def place_plot(dock: QDockWidget) -> None:
    """A new plot dock (napari put it at the bottom of its area) joins the plot group: a tab of the first plot dock
    of the area; the first plot stays where napari put it, under the panel."""
    main = _main_of(dock)
    if main is None:
        return
    area = main.dockWidgetArea(dock)
    _short_title(dock)
    others = [d for d in docks_of_role(main, PLOT, area) if d is not dock]
    if others and dock not in main.tabifiedDockWidgets(others[0]):
        main.tabifyDockWidget(others[0], dock)
    raise_dock(dock)
    fit_docks(main)
    QTimer.singleShot(0, lambda: _fit_later(weakref.ref(main)))


def dock_plot(window: Any, widget: QWidget, name: str) -> QDockWidget:
    """Dock the plot ``widget`` as ``name`` in napari's ``window`` (napari.window.Window) into the plot group."""
    widget.setProperty(ROLE_PROPERTY, PLOT)
    dock = window.add_dock_widget(widget, name=name, area="right", tabify=False)
    place_plot(dock)
    return dock


def _fit_later(main_ref: weakref.ref) -> None:
    main = main_ref()
    try:
        if main is not None:
            fit_docks(main)
    except RuntimeError:  # the window was closed meanwhile
        pass


def canvas_widget(main: QMainWindow) -> QWidget | None:
    """napari's canvas: the largest OpenGL widget of the central widget (the central widget itself if none)."""
    central = main.centralWidget()
    if central is None:
        return None
    try:
        from qtpy.QtOpenGLWidgets import QOpenGLWidget
    except ImportError:  # Qt 5
        from qtpy.QtWidgets import QOpenGLWidget
    gl = central.findChildren(QOpenGLWidget)
    return max(gl, key=lambda w: w.width() * w.height()) if gl else central


def _front(docks: list[QDockWidget]) -> QDockWidget | None:
    """The tab in front of a group (the one visible), else the first."""
    for dock in docks:
        if dock.isVisible():
            return dock
    return docks[0] if docks else None


def fit_docks(main: QMainWindow) -> None:
    """Size the right-hand area: the panel as wide as layout_model.panel_width allows, the plots
    layout_model.plot_height tall under it; the window within its screen."""
    area = Qt.DockWidgetArea.RightDockWidgetArea
    panel = _front(docks_of_role(main, PANEL, area))
    plots = _front(docks_of_role(main, PLOT, area))
    column = panel or plots
    if column is None:
        return
    canvas = canvas_widget(main)
    if canvas is not None and canvas.width() > 0:
        width = panel_width(main.width(), canvas.width(), column.width())
        main.resizeDocks([column], [width], Qt.Orientation.Horizontal)
    _within_screen(main)
    if panel is not None and plots is not None:
        total = panel.height() + plots.height()
        group = [panel, *main.tabifiedDockWidgets(panel)]
        need = max(d.minimumSizeHint().height() for d in group)
        height = plot_height(total, need)
        main.resizeDocks([panel, plots], [total - height, height], Qt.Orientation.Vertical)
    _label_tabs(main)


def screen_room(main: QMainWindow) -> Any:
    """The available geometry (QRect) of the screen ``main`` is on; None if unknown."""
    screen = main.screen() if hasattr(main, "screen") else None
    return screen.availableGeometry() if screen is not None else None


def _within_screen(main: QMainWindow) -> None:
    """A window that grew taller or wider than its screen (a dock stacked for a moment, see _PanelPlacer) is
    brought back within it, as far as its minimum size allows."""
    room = screen_room(main)
    if room is None or main.isMaximized() or main.isFullScreen():
        return
    frame = main.frameGeometry()
    extra_w, extra_h = frame.width() - main.width(), frame.height() - main.height()
    width = max(main.minimumSizeHint().width(), min(main.width(), room.width() - extra_w))
    height = max(main.minimumSizeHint().height(), min(main.height(), room.height() - extra_h))
    if (width, height) != (main.width(), main.height()):
        main.resize(width, height)


class _PanelPlacer(QObject):
    """Places its widget into the panel (:func:`place_panel`) each time napari docks it (on the next event-loop
    turn: napari adds the dock to its window after handing it the widget).

    Until then the widget asks for almost no height: napari first stacks a new dock under the others of its area,
    and the window, whose minimum height would be their sum for that moment, would grow past the screen (and stay
    so) before the dock becomes a tab."""

    def __init__(self, widget: QWidget) -> None:
        super().__init__(widget)
        self._min_height: int | None = None
        widget.installEventFilter(self)

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt's name
        if event.type() == QEvent.Type.ParentChange and obj.parent() is not None:
            if self._min_height is None:
                self._min_height = obj.minimumHeight()
                obj.setMinimumHeight(1)
            QTimer.singleShot(0, self._place)
        return False

    def _place(self) -> None:
        try:
            widget = self.parent()
        except RuntimeError:  # deleted before this turn came
            return
        if not isinstance(widget, QWidget):
            return
        if self._min_height is not None:
            widget.setMinimumHeight(self._min_height)
            self._min_height = None
        place_panel(widget)


def dock_as_panel(widget: QWidget, tab: str | None = None) -> None:
    """Mark ``widget`` as a panel dock (a job dock, the Jobs dock): whenever napari docks it, it becomes a tab of
    the plugin's panel (:func:`place_panel`), reading ``tab`` (else the dock's name)."""
    widget.setProperty(ROLE_PROPERTY, PANEL)
    if tab:
        widget.setProperty(TAB_PROPERTY, tab)
    if widget.findChild(_PanelPlacer) is None:
        _PanelPlacer(widget)

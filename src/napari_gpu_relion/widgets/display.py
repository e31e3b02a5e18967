"""Job events -> napari layers and plots, updated in place (never one new layer per iteration).

* :class:`~napari_gpu_relion.jobs.events.MapUpdated`: one 3D Image layer per ``event.name``, created once
  (Å scale, iso-surface rendering, threshold by Otsu's method), then ``layer.data = volume``.
* :class:`~napari_gpu_relion.jobs.events.FscUpdated`: one matplotlib dock widget "FSC", redrawn.
* :class:`~napari_gpu_relion.jobs.events.MicrographPicked`: one Points layer "picks" (mic, y, x) over the
  micrograph stack, scores in ``features['fom']``, a threshold that hides picks through ``shown``. Points
  added by hand get RELION's manual-pick markers (fom, class, psi = -999), ``features['manual']`` True (never
  hidden by the threshold) and ``features['mic']`` from their slice; edits survive later picks of the job.
* :class:`~napari_gpu_relion.jobs.events.ClassAveragesUpdated`: one grid image; a click on a tile (grid, its
  labels or its selection layer active, pan/zoom mode) toggles that class in ``metadata['selected']``
  (1-based class numbers), outlined by a Shapes layer "<name> selection"; kept when the grid is redrawn.
* :meth:`LiveDisplay.show_angular_distribution`: a matplotlib dock "Angular distribution" (rot × cos tilt,
  equal-area bins).

Widgets follow changes through :meth:`LiveDisplay.connect` ("picks": picks shown or edited, "selection":
class selection toggled).

Updates are coalesced (newest map per name, newest FSC, all new picks) and applied one item per event-loop
turn, at most every MIN_REFRESH_INTERVAL seconds and at most about a third of the GUI thread's time, so a
fast job cannot flood the GUI thread. All methods run in the GUI thread
(the runner dispatches events there).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .._reader import map_kwargs, points_kwargs
from ..compute.angular_distribution import AngularHistogram, angular_histogram
from ..jobs.events import ClassAveragesUpdated, FscUpdated, MapUpdated, MicrographPicked

if TYPE_CHECKING:
    import napari

__all__ = ["LiveDisplay", "FscPlot", "AngularDistributionPlot", "grid_shape", "tile_at", "class_at",
           "tile_corners"]

log = logging.getLogger(__name__)

PICKS_LAYER = "picks"
FSC_DOCK = "FSC"
ANGDIST_DOCK = "Angular distribution"
#: RELION's "not given" value of fom, class and psi (what its manual picker writes).
MANUAL_PICK_VALUE = -999
#: Canvas pixels the mouse may move between press and release for a click (more is a pan).
CLICK_TOLERANCE = 5.0
SELECTION_COLOR = "cyan"
#: Seconds between two display refreshes while a job streams results.
MIN_REFRESH_INTERVAL = 0.1
#: Smallest pause (s) between two items of one refresh, so that queued GUI events get their turn.
MIN_TICK_GAP = 0.02


def _matplotlib_dock(object_name: str, figsize: tuple[float, float]) -> tuple[Any, Any, Any]:
    """(QWidget, Figure, canvas): an empty matplotlib figure filling a widget for a napari dock."""
    from matplotlib.backends.backend_qtagg import FigureCanvasQTAgg
    from matplotlib.figure import Figure
    from qtpy.QtWidgets import QVBoxLayout, QWidget

    widget = QWidget()
    widget.setObjectName(object_name)
    figure = Figure(figsize=figsize)
    canvas = FigureCanvasQTAgg(figure)
    canvas.setMinimumHeight(200)
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(canvas)
    return widget, figure, canvas


class FscPlot:
    """A matplotlib FSC plot in a napari dock widget: curves against resolution (1/Å), threshold line,
    resolution in the title. Build once, call :meth:`update` for every new FscUpdated."""

    def __init__(self, viewer: napari.viewer.Viewer):
        self.widget, self.figure, self.canvas = _matplotlib_dock("gpu_relion_fsc_plot", (4, 3))
        self.figure.subplots_adjust(left=0.16, right=0.97, bottom=0.16, top=0.88)
        self.axes = self.figure.add_subplot(111)
        self._colors = _theme_colors(viewer)
        self.last_event: FscUpdated | None = None
        self.draw_count = 0

    def update(self, event: FscUpdated) -> None:
        fg, bg = self._colors
        ax = self.axes
        ax.clear()
        self.figure.set_facecolor(bg)
        ax.set_facecolor(bg)
        x = np.asarray(event.resolution_inv_A, dtype=float)
        for name, curve in event.curves.items():
            y = np.asarray(curve, dtype=float)
            n = min(len(x), len(y))
            ax.plot(x[:n], y[:n], label=name, linewidth=1.5)
        ax.axhline(event.threshold, color="0.6", linestyle="--", linewidth=1)
        ax.axhline(0.0, color="0.4", linewidth=0.5)
        if np.isfinite(event.resolution_A) and event.resolution_A > 0:
            ax.axvline(1.0 / event.resolution_A, color="0.6", linestyle=":", linewidth=1)
            title = f"Resolution {event.resolution_A:.2f} Å (FSC = {event.threshold:g})"
        else:
            title = "FSC"
        ax.set_title(title, color=fg, fontsize=10)
        ax.set_xlabel("resolution (1/Å)", color=fg)
        ax.set_ylabel("FSC", color=fg)
        ax.set_ylim(-0.1, 1.05)
        if len(x):
            ax.set_xlim(0, float(np.nanmax(x)))
        ax.tick_params(colors=fg)
        for spine in ax.spines.values():
            spine.set_color(fg)
        if event.curves:
            ax.legend(fontsize=8, frameon=False, labelcolor=fg)
        self.canvas.draw_idle()
        self.last_event = event
        self.draw_count += 1


def _theme_colors(viewer: Any) -> tuple[str, str]:
    """(foreground, background) colours of the viewer's theme, so the plot matches the dark/light UI."""
    try:
        from napari.utils.theme import get_theme

        theme = get_theme(viewer.theme)
        return theme.text.as_hex(), theme.background.as_hex()
    except Exception:  # noqa: BLE001 - cosmetic only
        return "black", "white"


class AngularDistributionPlot:
    """A matplotlib dock: particles per equal-area bin of viewing direction, rot (°) across, tilt (°) down,
    with a colour bar. Build once, call :meth:`update` with each new histogram."""

    def __init__(self, viewer: napari.viewer.Viewer):
        self.widget, self.figure, self.canvas = _matplotlib_dock("gpu_relion_angular_distribution", (4.5, 3))
        self._colors = _theme_colors(viewer)
        self.axes: Any = None
        self.colorbar: Any = None
        self.histogram: AngularHistogram | None = None
        self.source: Path | None = None
        self.draw_count = 0

    def update(self, hist: AngularHistogram, source: Path | None = None) -> None:
        """Redraw with ``hist`` (bins drawn at their true tilt edges, so equal-area bins look taller near
        the poles); ``source`` names the STAR file in the title."""
        fg, bg = self._colors
        self.figure.clear()
        self.figure.set_facecolor(bg)
        ax = self.figure.add_subplot(111)
        ax.set_facecolor(bg)
        mesh = ax.pcolormesh(hist.rot_edges, hist.tilt_edges, hist.counts, cmap="viridis", shading="flat")
        ax.set_xlim(-180, 180)
        ax.set_ylim(180, 0)  # tilt 0 (top view) at the top
        ax.set_xticks(np.arange(-180, 181, 90))
        ax.set_yticks(np.arange(0, 181, 45))
        ax.set_xlabel("rot (°)", color=fg)
        ax.set_ylabel("tilt (°)", color=fg)
        total = float(hist.counts.sum())
        name = f" — {Path(source).name}" if source else ""
        ax.set_title(f"{total:.0f} particles{name}", color=fg, fontsize=10)
        ax.tick_params(colors=fg)
        for spine in ax.spines.values():
            spine.set_color(fg)
        cbar = self.figure.colorbar(mesh, ax=ax)
        cbar.set_label("particles", color=fg)
        cbar.ax.tick_params(colors=fg)
        self.figure.tight_layout()
        self.canvas.draw_idle()
        self.axes, self.colorbar, self.histogram, self.source = ax, cbar, hist, source
        self.draw_count += 1


# ----------------------------------------------------------------------------------------------------------
# Class grid geometry (pure functions, tested without a viewer)


def grid_shape(K: int) -> tuple[int, int]:
    """(rows, columns) of the class grid of K tiles: ceil(sqrt(K)) columns, filled row by row."""
    ncol = max(1, math.ceil(math.sqrt(K)))
    return max(1, math.ceil(K / ncol)), ncol


def tile_at(y: float, x: float, K: int, N: int, pixel_size: float = 1.0) -> int | None:
    """Index (0-based, row-major) of the tile under (y, x) in Å (pixels times ``pixel_size``) of a grid of K
    tiles of N x N pixels, or None outside the tiles. Pixel i is centred at i, so tiles start at -0.5 px."""
    nrow, ncol = grid_shape(K)
    row = math.floor((y / pixel_size + 0.5) / N)
    col = math.floor((x / pixel_size + 0.5) / N)
    if not (0 <= row < nrow and 0 <= col < ncol):
        return None
    tile = row * ncol + col
    return tile if tile < K else None


def class_at(y: float, x: float, order: Any, N: int, pixel_size: float = 1.0) -> int | None:
    """RELION class number (1-based) shown under (y, x) in Å; ``order[i]`` is the 0-based class of tile i."""
    order = np.asarray(order)
    tile = tile_at(y, x, len(order), N, pixel_size)
    return None if tile is None else int(order[tile]) + 1


def tile_corners(tile: int, ncol: int, N: int, inset: float = 0.0) -> np.ndarray:
    """(4, 2) corners (y, x) in pixels of tile ``tile`` of a grid with ``ncol`` columns of N-pixel tiles, moved
    ``inset`` pixels inwards (so that outlines of neighbouring tiles stay apart)."""
    r, c = divmod(int(tile), ncol)
    y0, x0 = r * N - 0.5 + inset, c * N - 0.5 + inset
    size = N - 2 * inset
    return np.array([[y0, x0], [y0, x0 + size], [y0 + size, x0 + size], [y0 + size, x0]], dtype=np.float64)


class LiveDisplay:
    """Shows a running job's results in a viewer. One per viewer: use :meth:`for_viewer`."""

    _instances: dict[int, tuple[weakref.ref, LiveDisplay]] = {}

    def __init__(self, viewer: napari.viewer.Viewer):
        self._viewer_ref = weakref.ref(_unwrap(viewer))
        self.fsc: FscPlot | None = None
        self._fsc_dock: Any = None
        self.pick_threshold: float = -np.inf
        self.micrograph_pixel_size: float | None = None
        self.pick_size: float | None = None
        # micrograph index -> (name, (n, 2) x/y pixels, (n,) fom, (n,) picked by hand)
        self._picks: dict[int, tuple[str, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._applying_picks = False  # True while the display itself changes the picks layer
        self._picks_edited = False  # the user changed the picks layer since _picks was last synced
        self._watched_picks: weakref.WeakSet = weakref.WeakSet()
        self.angdist: AngularDistributionPlot | None = None
        self._angdist_dock: Any = None
        self._listeners: dict[str, list[Callable[..., None]]] = {}
        self.map_updates: dict[str, int] = {}
        self.min_interval = MIN_REFRESH_INTERVAL
        self._pending_maps: dict[str, MapUpdated] = {}
        self._pending_fsc: FscUpdated | None = None
        self._picks_dirty = False
        self._timer: Any = None
        self._next_allowed = 0.0
        self._turn = 0

    @classmethod
    def for_viewer(cls, viewer: napari.viewer.Viewer) -> LiveDisplay:
        """The display shared by all job widgets of ``viewer`` (one FSC dock, one picks layer)."""
        real = _unwrap(viewer)
        for key, (ref, _) in list(cls._instances.items()):
            if ref() is None:
                del cls._instances[key]
        entry = cls._instances.get(id(real))
        if entry is not None and entry[0]() is real:
            return entry[1]
        display = cls(real)
        cls._instances[id(real)] = (weakref.ref(real), display)
        return display

    @property
    def viewer(self) -> napari.viewer.Viewer | None:
        return self._viewer_ref()

    # -- listeners ---------------------------------------------------------------------------------------

    def connect(self, kind: str, callback: Callable[..., None]) -> None:
        """Call ``callback(layer)`` after changes of ``kind``: "picks" (picks shown, added or deleted) or
        "selection" (a class of a grid toggled, or the grid redrawn; the grid layer is passed)."""
        self._listeners.setdefault(kind, []).append(callback)

    def disconnect(self, kind: str, callback: Callable[..., None]) -> None:
        """Stop calling ``callback`` (no error if it was not connected)."""
        callbacks = self._listeners.get(kind, [])
        if callback in callbacks:
            callbacks.remove(callback)

    def _emit(self, kind: str, *args: Any) -> None:
        for callback in list(self._listeners.get(kind, ())):
            try:
                callback(*args)
            except Exception:  # noqa: BLE001 - a widget's bug must not break the display
                log.exception("error in a %s listener", kind)

    def handle(self, event: Any) -> None:
        """Take ``event`` and schedule the display update; other event types are ignored.

        Updates are coalesced: the newest map per name, the newest FSC and all picks received since the last
        refresh are applied one item per event-loop turn, at most every ``min_interval`` seconds, so that a
        fast job cannot keep the GUI thread busy with updates nobody sees. :meth:`flush` applies them at once
        (a job's Finished).
        """
        if self.viewer is None:
            return
        if isinstance(event, (MapUpdated, ClassAveragesUpdated)):
            self._pending_maps[event.name] = event
        elif isinstance(event, FscUpdated):
            self._pending_fsc = event
        elif isinstance(event, MicrographPicked):
            self._store_picks(event)
            self._picks_dirty = True
        else:
            return  # IterationFinished: references arrive as MapUpdated; class averages come with class2d
        self._schedule()

    def _schedule(self, delay: float | None = None) -> None:
        from qtpy.QtCore import QTimer

        if self._timer is None:
            self._timer = QTimer()
            self._timer.setSingleShot(True)
            self._timer.timeout.connect(self._tick)
        if delay is None:
            if self._timer.isActive():
                return
            delay = max(self._next_allowed - time.monotonic(), 0.0)
        self._timer.start(max(0, int(delay * 1000)))

    @property
    def pending(self) -> bool:
        """True while updates wait for the next refresh."""
        return bool(self._pending_maps) or self._pending_fsc is not None or self._picks_dirty

    def _apply_one(self) -> None:
        """Apply one pending item, taking maps, FSC and picks in turn (none starves the others)."""
        for _ in range(3):
            kind = self._turn
            self._turn = (self._turn + 1) % 3
            if kind == 0 and self._pending_maps:
                name = next(iter(self._pending_maps))
                ev = self._pending_maps.pop(name)
                self.show_classes(ev) if isinstance(ev, ClassAveragesUpdated) else self.show_map(ev)
                return
            if kind == 1 and self._pending_fsc is not None:
                fsc, self._pending_fsc = self._pending_fsc, None
                self.show_fsc(fsc)
                return
            if kind == 2 and self._picks_dirty:
                self._picks_dirty = False
                self._apply_picks()
                return

    def _tick(self) -> None:
        """Timer-driven refresh: one item per event-loop turn, and the GUI thread spends at most about a third
        of its time on job results (the next refresh waits twice as long as this one took)."""
        if self.viewer is None or not self.pending:
            return
        t0 = time.monotonic()
        self._apply_one()
        cost = time.monotonic() - t0
        self._next_allowed = time.monotonic() + max(self.min_interval, 2.0 * cost)
        if self.pending:
            self._schedule(max(MIN_TICK_GAP, 2.0 * cost))

    def flush(self) -> None:
        """Apply all pending updates now (e.g. when a job finished)."""
        if self._timer is not None:
            self._timer.stop()
        while self.viewer is not None and self.pending:
            self._apply_one()
        self._next_allowed = time.monotonic() + self.min_interval

    @staticmethod
    def prepare() -> None:
        """Import the plotting modules now (about 0.15 s the first time) rather than at the first FSC."""
        import matplotlib.backends.backend_qtagg  # noqa: F401
        import matplotlib.figure  # noqa: F401

    # -- maps --------------------------------------------------------------------------------------------

    def show_map(self, event: MapUpdated) -> Any:
        """Create the map layer on the first event of a name, then update its data in place."""
        viewer = self.viewer
        vol = np.asarray(event.volume, dtype=np.float32)
        pixel_size = float(event.pixel_size) if event.pixel_size else None
        kwargs = map_kwargs(vol, pixel_size, event.name, event.path)
        layer = _find_layer(viewer, event.name, "Image")
        if layer is not None and layer.ndim != vol.ndim:
            viewer.layers.remove(layer)
            layer = None
        if layer is None:
            first_map = not any(getattr(la, "metadata", {}).get("kind") == "map" for la in viewer.layers)
            layer = viewer.add_image(vol, **kwargs)
            if first_map and vol.ndim == 3 and viewer.dims.ndisplay == 2 and len(viewer.layers) == 1:
                viewer.dims.ndisplay = 3
        else:
            layer.data = vol
            if tuple(layer.scale) != tuple(kwargs["scale"]):
                layer.scale = kwargs["scale"]
            lo, hi = kwargs["contrast_limits"]
            layer.contrast_limits_range = (lo, hi)
            layer.contrast_limits = (lo, hi)
            layer.iso_threshold = kwargs["iso_threshold"]
            layer.metadata.update(kwargs["metadata"])
        self.map_updates[event.name] = self.map_updates.get(event.name, 0) + 1
        return layer

    def show_classes(self, event: ClassAveragesUpdated) -> Any:
        """One 2D image: the class averages in a grid, largest class first (each scaled to its own mean and
        std), with a Points layer "<name> labels" that writes "class: distribution, resolution" on each tile.
        Clicks toggle classes (see :meth:`toggle_class_at`); the selection of the same job is kept."""
        viewer = self.viewer
        imgs = np.asarray(event.images, dtype=np.float32)
        K, N = imgs.shape[0], imgs.shape[-1]
        order = np.argsort(-np.asarray(event.distribution), kind="stable")
        nrow, ncol = grid_shape(K)
        grid = np.zeros((nrow * N, ncol * N), np.float32)
        pos = np.zeros((K, 2))
        for i, k in enumerate(order):  # K tiles (a display copy, not a hot path)
            r, c = divmod(i, ncol)
            im = imgs[k]
            grid[r * N:(r + 1) * N, c * N:(c + 1) * N] = (im - im.mean()) / (im.std() or 1.0)
            pos[i] = (r * N + 1, c * N + 1)
        scale = (float(event.pixel_size or 1.0),) * 2
        layer = _find_layer(viewer, event.name, "Image")
        selected = _kept_selection(layer, event.path, K)
        if layer is not None and layer.data.shape != grid.shape:
            viewer.layers.remove(layer)
            layer = None
        if layer is None:
            layer = viewer.add_image(grid, name=event.name, scale=scale, colormap="gray",
                                     metadata={"kind": "classes"})
        else:
            layer.data = grid
        # tile i shows class order[i] (0-based); "selected" holds 1-based class numbers
        layer.metadata.update(path=event.path, order=order, tile_size=N, selected=selected)
        self._listen_for_clicks(layer)
        text = [f"{k + 1}: {100 * event.distribution[k]:.1f}% {event.resolution_A[k]:.0f} Å" for k in order]
        lname = f"{event.name} labels"
        labels = _find_layer(viewer, lname, "Points")
        if labels is not None:
            viewer.layers.remove(labels)
        labels = viewer.add_points(pos, name=lname, scale=scale, size=0, features={"label": text},
                                   text={"string": "{label}", "anchor": "upper_left", "size": 8, "color": "yellow"},
                                   metadata={"kind": "class_labels", "grid": event.name})
        self._listen_for_clicks(labels)
        self._draw_selection(layer)
        self._emit("selection", layer)
        self.map_updates[event.name] = self.map_updates.get(event.name, 0) + 1
        return layer

    # -- class selection ---------------------------------------------------------------------------------

    def _listen_for_clicks(self, layer: Any) -> None:
        """Toggle classes on clicks while ``layer`` (the grid, its labels or its selection) is active."""
        if self._on_grid_click not in layer.mouse_drag_callbacks:
            layer.mouse_drag_callbacks.append(self._on_grid_click)

    def _on_grid_click(self, layer: Any, event: Any) -> Any:
        """napari drag callback: a left click without modifiers that does not move more than CLICK_TOLERANCE
        canvas pixels toggles the class under the cursor; a drag (pan) does nothing."""
        if event.type != "mouse_press" or event.button != 1 or event.modifiers \
                or str(getattr(layer, "mode", "pan_zoom")) != "pan_zoom" or len(event.dims_displayed) != 2:
            return
        start = np.asarray(event.pos, dtype=np.float64)
        position = tuple(event.position)
        grid_name = (layer.metadata or {}).get("grid", layer.name)
        yield
        moved = False
        while event.type == "mouse_move":
            moved = moved or float(np.linalg.norm(np.asarray(event.pos, np.float64) - start)) > CLICK_TOLERANCE
            yield
        if not moved and float(np.linalg.norm(np.asarray(event.pos, np.float64) - start)) <= CLICK_TOLERANCE:
            self.toggle_class_at(grid_name, position)

    def toggle_class_at(self, grid_name: str, position: Any) -> int | None:
        """Toggle the class under ``position`` (world coordinates, Å) of the grid layer ``grid_name``; returns
        its 1-based number, or None when the position is outside the tiles or the grid is hidden."""
        grid = _find_layer(self.viewer, grid_name, "Image")
        if grid is None or not grid.visible or "order" not in grid.metadata:
            return None
        y, x = np.asarray(grid.world_to_data(position), dtype=np.float64)[-2:]
        k = class_at(y, x, grid.metadata["order"], int(grid.metadata["tile_size"]))
        if k is not None:
            self.toggle_class(grid_name, k)
        return k

    def toggle_class(self, grid_name: str, class_number: int) -> bool:
        """Select or deselect class ``class_number`` (1-based) of grid ``grid_name``; True if now selected."""
        grid = _find_layer(self.viewer, grid_name, "Image")
        if grid is None:
            raise KeyError(f"no class grid named {grid_name!r}")
        selected = set(grid.metadata.get("selected") or ())
        now = class_number not in selected
        (selected.add if now else selected.discard)(int(class_number))
        grid.metadata["selected"] = selected
        self._draw_selection(grid)
        self._emit("selection", grid)
        return now

    def selected_classes(self, grid_name: str) -> list[int]:
        """The selected 1-based class numbers of grid ``grid_name``, sorted (empty without such grid)."""
        grid = _find_layer(self.viewer, grid_name, "Image")
        return sorted(grid.metadata.get("selected") or ()) if grid is not None else []

    def _draw_selection(self, grid: Any) -> Any:
        """Outline the selected tiles in the Shapes layer "<grid> selection" (made on the first selection)."""
        name = f"{grid.name} selection"
        order = [int(k) for k in grid.metadata["order"]]
        N = int(grid.metadata["tile_size"])
        ncol = grid_shape(len(order))[1]
        tile_of = {k + 1: i for i, k in enumerate(order)}
        width = max(1.0, N / 32)
        rects = [tile_corners(tile_of[k], ncol, N, width) for k in sorted(grid.metadata.get("selected") or ())
                 if k in tile_of]
        layer = _find_layer(self.viewer, name, "Shapes")
        if layer is None and not rects:
            return None
        if layer is None:
            layer = self.viewer.add_shapes(name=name, scale=grid.scale, metadata={"kind": "class_selection",
                                                                                 "grid": grid.name})
            self._listen_for_clicks(layer)
        elif tuple(layer.scale) != tuple(grid.scale):
            layer.scale = grid.scale
        layer.data = []
        if rects:
            layer.add_rectangles(rects, edge_width=width, edge_color=SELECTION_COLOR, face_color="transparent")
        return layer

    # -- FSC ---------------------------------------------------------------------------------------------

    def show_fsc(self, event: FscUpdated) -> FscPlot:
        """Redraw the FSC dock (created on first use, re-created if the user closed it)."""
        if self.fsc is None or not _alive(self.fsc.widget):
            self.fsc = FscPlot(self.viewer)
            self._fsc_dock = self.viewer.window.add_dock_widget(self.fsc.widget, name=FSC_DOCK, area="right",
                                                                tabify=True)
        self.fsc.update(event)
        return self.fsc

    # -- picks -------------------------------------------------------------------------------------------

    def _micrograph_pixel_size(self) -> float | None:
        if self.micrograph_pixel_size:
            return self.micrograph_pixel_size
        for layer in self.viewer.layers:
            md = getattr(layer, "metadata", {}) or {}
            if md.get("kind") in ("micrographs", "micrograph") and md.get("pixel_size"):
                return float(md["pixel_size"])
        return None

    def show_picks(self, event: MicrographPicked) -> Any:
        """Replace the picks of micrograph ``event.index`` in the one picks layer (mic, y, x), now."""
        self._store_picks(event)
        return self._apply_picks()

    def _store_picks(self, event: MicrographPicked) -> None:
        """Keep the picks of one micrograph (after taking in the user's edits, so that they are not lost)."""
        self._sync_edited_picks()
        scores = np.asarray(event.scores, dtype=np.float64).ravel()
        self._picks[int(event.index)] = (event.name, np.asarray(event.coords, dtype=np.float64).reshape(-1, 2),
                                         scores, np.zeros(len(scores), bool))

    def _apply_picks(self) -> Any:
        mics = sorted(self._picks)
        data = np.concatenate([
            np.column_stack([np.full(len(self._picks[m][1]), float(m)), self._picks[m][1][:, ::-1]])
            for m in mics
        ]) if mics else np.empty((0, 3))
        fom = np.concatenate([self._picks[m][2] for m in mics]) if mics else np.empty(0)
        manual = np.concatenate([self._picks[m][3] for m in mics]) if mics else np.empty(0, bool)
        mic_col = np.concatenate([np.full(len(self._picks[m][2]), m, dtype=np.int64) for m in mics]) if mics \
            else np.empty(0, np.int64)
        unknown = np.full(len(fom), MANUAL_PICK_VALUE)  # class and psi are not in MicrographPicked
        features = pd.DataFrame({"fom": fom, "class": unknown.astype(np.int64), "psi": unknown.astype(float),
                                 "mic": mic_col, "manual": manual})
        names = [""] * (max(mics) + 1 if mics else 0)
        for m in mics:
            names[m] = self._picks[m][0]
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        self._applying_picks = True
        try:
            if layer is None:
                kwargs = points_kwargs(3, self._micrograph_pixel_size(), features, PICKS_LAYER, self.pick_size,
                                       {"micrograph_names": names})
                kwargs["border_color"] = "fom"
                kwargs["border_colormap"] = "plasma"
                layer = self.viewer.add_points(data, **kwargs)
            else:
                layer.data = data  # features are padded here; the full table is assigned right after
                layer.features = features
                layer.metadata["micrograph_names"] = names
            layer.feature_defaults = _manual_pick_defaults()  # assigning features resets them
        finally:
            self._applying_picks = False
        self._watch_picks(layer)
        layer.shown = self._pick_visibility(layer)
        self._emit("picks", layer)
        return layer

    def _watch_picks(self, layer: Any) -> None:
        """Follow the user's edits of the picks layer (once per layer)."""
        if layer not in self._watched_picks:
            layer.events.data.connect(self._on_picks_edited)
            self._watched_picks.add(layer)

    def _on_picks_edited(self, event: Any) -> None:
        """Points added, moved or deleted by hand: mark new points as manual picks on their micrograph and
        remember that ``_picks`` must be re-read from the layer before the job's next picks are merged."""
        if self._applying_picks:
            return
        action = str(getattr(event, "action", ""))
        if action not in ("added", "removed", "changed"):
            return
        layer = getattr(event, "source", None) or _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is None:
            return
        if action == "added":
            _mark_manual(layer, getattr(event, "data_indices", ()))
        self._picks_edited = True
        if action != "changed":  # moves change neither the number of picks nor their scores
            self._emit("picks", layer)

    def _sync_edited_picks(self) -> None:
        """Re-read ``_picks`` from the layer after the user edited it (points grouped by micrograph)."""
        if not self._picks_edited:
            return
        self._picks_edited = False
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is None or layer.ndim != 3:
            return
        data = np.asarray(layer.data, dtype=np.float64)
        n = len(data)
        fom = _feature_column(layer, "fom", float, MANUAL_PICK_VALUE)
        manual = _feature_column(layer, "manual", bool, False)
        mics = np.round(data[:, 0]).astype(np.int64) if n else np.empty(0, np.int64)
        names = list(layer.metadata.get("micrograph_names") or [])
        old = self._picks
        self._picks = {}
        for m in sorted(set(old) | set(mics.tolist())):
            rows = mics == m
            name = old[m][0] if m in old else (names[m] if 0 <= m < len(names) and names[m] else "")
            self._picks[m] = (name, data[rows][:, [2, 1]], fom[rows], manual[rows])

    def _pick_visibility(self, layer: Any) -> np.ndarray:
        """Shown: figure of merit at least the threshold, or picked by hand."""
        fom = _feature_column(layer, "fom", float, np.inf)
        return (fom >= self.pick_threshold) | _feature_column(layer, "manual", bool, False)

    def set_pick_threshold(self, threshold: float) -> None:
        """Hide picks whose figure of merit is below ``threshold`` (no re-picking; the writer skips them).
        Points added by hand (``features['manual']``) stay shown."""
        self.pick_threshold = float(threshold)
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is not None and "fom" in layer.features:
            layer.shown = self._pick_visibility(layer)

    def picks_layer(self) -> Any:
        """The live picks layer (Points named "picks"), or None."""
        return _find_layer(self.viewer, PICKS_LAYER, "Points")

    def pick_fom_range(self) -> tuple[float, float] | None:
        """(lowest, highest) figure of merit of the automatic picks in the picks layer; None without any."""
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is None or "fom" not in layer.features:
            return None
        fom = _feature_column(layer, "fom", float, np.nan)
        fom = fom[~_feature_column(layer, "manual", bool, False) & np.isfinite(fom)]
        return (float(fom.min()), float(fom.max())) if len(fom) else None

    def reset_picks(self) -> None:
        """Forget picks of a previous run (the layer is emptied in place)."""
        self._picks.clear()
        self._picks_dirty = False
        self._picks_edited = False
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is not None:
            self._applying_picks = True
            try:
                layer.data = np.empty((0, layer.ndim))
            finally:
                self._applying_picks = False
            self._emit("picks", layer)

    # -- angular distribution ----------------------------------------------------------------------------

    def show_angular_distribution(self, rot: np.ndarray, tilt: np.ndarray, source: Path | None = None,
                                  weights: np.ndarray | None = None) -> AngularDistributionPlot:
        """Histogram the viewing directions (RELION rot/tilt, degrees) on an equal-area grid and draw it in
        the "Angular distribution" dock (created on first use, re-created if the user closed it)."""
        hist = angular_histogram(rot, tilt, weights)
        if self.angdist is None or not _alive(self.angdist.widget):
            self.angdist = AngularDistributionPlot(self.viewer)
            self._angdist_dock = self.viewer.window.add_dock_widget(self.angdist.widget, name=ANGDIST_DOCK,
                                                                    area="right", tabify=True)
        self.angdist.update(hist, source)
        return self.angdist


def _unwrap(viewer: Any) -> Any:
    """The viewer itself when napari handed us its PublicOnlyProxy (a new proxy object per widget)."""
    return getattr(viewer, "__wrapped__", viewer)


def _manual_pick_defaults() -> dict[str, Any]:
    """Features of a point added by hand: RELION's manual-pick markers, flagged manual."""
    return {"fom": float(MANUAL_PICK_VALUE), "class": MANUAL_PICK_VALUE, "psi": float(MANUAL_PICK_VALUE), "mic": 0,
            "manual": True}


def _feature_column(layer: Any, name: str, dtype: type, default: Any) -> np.ndarray:
    """One feature column as an array of ``dtype`` (``default`` everywhere when it is missing)."""
    features = layer.features
    n = len(layer.data)
    if name in features and len(features) == n:
        return features[name].to_numpy(dtype=dtype)
    return np.full(n, default, dtype=dtype)


def _mark_manual(layer: Any, indices: Any) -> None:
    """Set the features of points just added by hand: manual-pick markers, their micrograph (the slice)."""
    n = len(layer.data)
    rows = sorted({int(i) % n for i in indices}) if n else []
    if not rows:
        return
    features = layer.features
    values = _manual_pick_defaults()
    if layer.ndim == 3:
        values["mic"] = np.round(np.asarray(layer.data)[rows, 0]).astype(np.int64)
    for column, value in values.items():
        if column not in features:
            features[column] = np.zeros(n, dtype=bool) if column == "manual" else np.full(n, MANUAL_PICK_VALUE)
        features.iloc[rows, features.columns.get_loc(column)] = value


def _kept_selection(grid: Any, path: Path | None, K: int) -> set[int]:
    """Selected classes to keep when a grid is redrawn: those <= K, none when the job folder changed."""
    if grid is None:
        return set()
    old = grid.metadata.get("path")
    if old is not None and path is not None and Path(old).parent != Path(path).parent:
        return set()
    return {int(k) for k in grid.metadata.get("selected") or () if 1 <= int(k) <= K}


def _find_layer(viewer: Any, name: str, kind: str) -> Any:
    if viewer is None or name not in viewer.layers:
        return None
    layer = viewer.layers[name]
    return layer if type(layer).__name__ == kind else None


def _alive(widget: Any) -> bool:
    """False once Qt deleted the widget (e.g. the user closed the dock)."""
    try:
        widget.objectName()
    except RuntimeError:
        return False
    return True

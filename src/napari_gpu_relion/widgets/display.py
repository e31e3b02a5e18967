"""The live display: job events -> napari layers and docks, updated in place (never one new layer per iteration).

A thin view. The pick and class-selection state lives in plain models (no Qt, no napari):
:class:`~napari_gpu_relion.widgets.pick_model.PickModel` and
:class:`~napari_gpu_relion.widgets.class_grid_model.ClassGrid`; the plots are in widgets/plots.py. Here:

* :class:`~napari_gpu_relion.jobs.events.MapUpdated`: one 3D Image layer per ``event.name``, created once
  (Å scale, iso-surface rendering, threshold by Otsu's method), then ``layer.data = volume``.
* :class:`~napari_gpu_relion.jobs.events.FscUpdated`: one matplotlib dock widget "FSC", redrawn.
* :class:`~napari_gpu_relion.jobs.events.MicrographPicked`: into the PickModel, shown as one Points layer "picks"
  (mic, y, x; row i of the model is point i), features fom, class, psi, mic and manual, ``shown`` from the
  model's threshold. Points added by hand get RELION's manual-pick markers (fom, class, psi = -999), ``manual``
  True and ``mic`` from their slice; the user's edits of the layer are read back into the model before it is
  used again, so they survive later picks of the job.
* :class:`~napari_gpu_relion.jobs.events.ClassAveragesUpdated`: a ClassGrid drawn as one image, a Points layer
  "<name> labels" and a Shapes layer "<name> selection" outlining the selected classes. A click on a tile (grid,
  labels or selection layer active, pan/zoom mode) toggles its class. The model lives in the grid layer's
  ``metadata['class_grid']``, mirrored for widgets as ``order``, ``tile_size``, ``selected`` (1-based class
  numbers) and ``path``; the selection is kept when the same job's grid is redrawn.
* :meth:`LiveDisplay.show_angular_distribution`: a matplotlib dock "Angular distribution".

Widgets follow changes through :meth:`LiveDisplay.connect` ("picks": picks shown or edited, "selection":
class selection toggled).

Updates are coalesced (newest map per name, newest FSC, all new picks) and applied one item per event-loop
turn, at most every MIN_REFRESH_INTERVAL seconds and at most about a third of the GUI thread's time, so a
fast job cannot flood the GUI thread. All methods run in the GUI thread
(the runner dispatches events there).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from qtpy.QtCore import QTimer

from .._reader import map_kwargs, points_kwargs
from ..compute.angular_distribution import angular_histogram
from ..jobs.events import ClassAveragesUpdated, FscUpdated, MapUpdated, MicrographPicked
from . import plots
from .class_grid_model import ClassGrid, class_at, grid_shape, tile_at, tile_corners
from .pick_model import MANUAL_PICK_VALUE, PickModel
from .plots import AngularDistributionPlot, FscPlot

if TYPE_CHECKING:
    import napari

# the grid geometry is re-exported for callers of its former home (docs/screenshots.py, widget tests)
__all__ = ["LiveDisplay", "grid_shape", "tile_at", "class_at", "tile_corners"]

log = logging.getLogger(__name__)

PICKS_LAYER = "picks"
FSC_DOCK = "FSC"
ANGDIST_DOCK = "Angular distribution"
#: Key of a class grid layer's metadata that holds its ClassGrid.
GRID_MODEL = "class_grid"
#: Canvas pixels the mouse may move between press and release for a click (more is a pan).
CLICK_TOLERANCE = 5.0
SELECTION_COLOR = "cyan"
#: Seconds between two display refreshes while a job streams results.
MIN_REFRESH_INTERVAL = 0.1
#: Smallest pause (s) between two items of one refresh, so that queued GUI events get their turn.
MIN_TICK_GAP = 0.02


class LiveDisplay:
    """Shows a running job's results in a viewer. One per viewer: use :meth:`for_viewer`."""

    _instances: dict[int, tuple[weakref.ref, LiveDisplay]] = {}

    def __init__(self, viewer: napari.viewer.Viewer):
        self._viewer_ref = weakref.ref(_unwrap(viewer))
        self.fsc: FscPlot | None = None
        self._fsc_dock: Any = None
        self.micrograph_pixel_size: float | None = None
        self.pick_size: float | None = None
        self._picks = PickModel()
        self._applying_picks = False  # True while the display itself changes the picks layer
        self._picks_edited = False  # the user changed the picks layer since the model was last synced
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
        """Import the plotting modules now rather than at the first FSC (see widgets/plots.py)."""
        plots.prepare()

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
        model = ClassGrid(event.distribution, event.resolution_A, imgs.shape[-1], event.path)
        image = model.compose(imgs)
        scale = (float(event.pixel_size or 1.0),) * 2
        layer = _find_layer(viewer, event.name, "Image")
        model.keep_selection_of(_grid_model(layer))
        if layer is not None and layer.data.shape != image.shape:
            viewer.layers.remove(layer)
            layer = None
        if layer is None:
            layer = viewer.add_image(image, name=event.name, scale=scale, colormap="gray",
                                     metadata={"kind": "classes"})
        else:
            layer.data = image
        layer.metadata[GRID_MODEL] = model
        _publish_grid(layer)
        self._listen_for_clicks(layer)
        lname = f"{event.name} labels"
        labels = _find_layer(viewer, lname, "Points")
        if labels is not None:
            viewer.layers.remove(labels)
        labels = viewer.add_points(model.label_positions(), name=lname, scale=scale, size=0,
                                   features={"label": model.labels()},
                                   text={"string": "{label}", "anchor": "upper_left", "size": 8, "color": "yellow"},
                                   metadata={"kind": "class_labels", "grid": event.name})
        self._listen_for_clicks(labels)
        self._draw_selection(layer)
        self._emit("selection", layer)
        self.map_updates[event.name] = self.map_updates.get(event.name, 0) + 1
        return layer

    # -- class selection ---------------------------------------------------------------------------------

    def class_grid(self, grid_name: str) -> ClassGrid | None:
        """The model of the class grid layer ``grid_name`` (None without such grid)."""
        return _grid_model(_find_layer(self.viewer, grid_name, "Image"))

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
        model = _grid_model(grid)
        if model is None or not grid.visible:
            return None
        y, x = np.asarray(grid.world_to_data(position), dtype=np.float64)[-2:]
        k = model.class_at(y, x)
        if k is not None:
            self.toggle_class(grid_name, k)
        return k

    def toggle_class(self, grid_name: str, class_number: int) -> bool:
        """Select or deselect class ``class_number`` (1-based) of grid ``grid_name``; True if now selected."""
        grid = _find_layer(self.viewer, grid_name, "Image")
        model = _grid_model(grid)
        if model is None:
            raise KeyError(f"no class grid named {grid_name!r}")
        now = model.toggle(class_number)
        _publish_grid(grid)
        self._draw_selection(grid)
        self._emit("selection", grid)
        return now

    def selected_classes(self, grid_name: str) -> list[int]:
        """The selected 1-based class numbers of grid ``grid_name``, sorted (empty without such grid)."""
        model = self.class_grid(grid_name)
        return model.selected_classes() if model is not None else []

    def _draw_selection(self, grid: Any) -> Any:
        """Outline the selected tiles in the Shapes layer "<grid> selection" (made on the first selection)."""
        model = _grid_model(grid)
        name = f"{grid.name} selection"
        rects = model.selection_outlines()
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
            layer.add_rectangles(rects, edge_width=model.outline_width, edge_color=SELECTION_COLOR,
                                 face_color="transparent")
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

    @property
    def pick_threshold(self) -> float:
        """The FOM threshold (set it with :meth:`set_pick_threshold`); -inf shows every pick."""
        return self._picks.threshold

    def pick_model(self) -> PickModel:
        """The picks as shown, with the user's edits of the picks layer taken in."""
        self._sync_edited_picks()
        return self._picks

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
        """Put one micrograph's picks into the model (after taking in the user's edits, so they are not lost)."""
        self.pick_model().set_micrograph(event.index, event.name, event.coords, event.scores)

    def _apply_picks(self) -> Any:
        """Show the model in the picks layer (created on first use), point i being row i."""
        model = self._picks
        n = len(model)
        data = np.column_stack([model.mic.astype(np.float64), model.xy[:, ::-1]])
        unknown = np.full(n, MANUAL_PICK_VALUE)  # class and psi are not in MicrographPicked
        features = pd.DataFrame({"fom": model.fom, "class": unknown.astype(np.int64), "psi": unknown.astype(float),
                                 "mic": model.mic, "manual": model.manual})
        names = model.micrograph_names()
        layer = self.picks_layer()
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
        self._show_threshold(layer)
        self._emit("picks", layer)
        return layer

    def _show_threshold(self, layer: Any) -> None:
        """``layer.shown`` from the model (when the layer holds the model's rows)."""
        shown = self._picks.shown
        if len(shown) == len(layer.data):
            layer.shown = shown

    def _watch_picks(self, layer: Any) -> None:
        """Follow the user's edits of the picks layer (once per layer)."""
        if layer not in self._watched_picks:
            layer.events.data.connect(self._on_picks_edited)
            self._watched_picks.add(layer)

    def _on_picks_edited(self, event: Any) -> None:
        """Points added, moved or deleted by hand: mark new points as manual picks on their micrograph and
        remember that the model must be re-read from the layer before it is used again."""
        if self._applying_picks:
            return
        action = str(getattr(event, "action", ""))
        if action not in ("added", "removed", "changed"):
            return
        layer = getattr(event, "source", None) or self.picks_layer()
        if layer is None:
            return
        if action == "added":
            _mark_manual(layer, getattr(event, "data_indices", ()))
        self._picks_edited = True
        if action != "changed":  # moves change neither the number of picks nor their scores
            self._emit("picks", layer)

    def _sync_edited_picks(self) -> None:
        """Re-read the model from the layer after the user edited it (its rows in the layer's order)."""
        if not self._picks_edited:
            return
        self._picks_edited = False
        layer = self.picks_layer()
        if layer is None or layer.ndim != 3:
            return
        data = np.asarray(layer.data, dtype=np.float64).reshape(-1, 3)
        self._picks.replace(np.round(data[:, 0]).astype(np.int64), data[:, [2, 1]],
                            _feature_column(layer, "fom", float, MANUAL_PICK_VALUE),
                            _feature_column(layer, "manual", bool, False),
                            list(layer.metadata.get("micrograph_names") or []))

    def set_pick_threshold(self, threshold: float) -> None:
        """Hide picks whose figure of merit is below ``threshold`` (no re-picking; Save skips them). Points added
        by hand stay shown."""
        self.pick_model().threshold = float(threshold)
        layer = self.picks_layer()
        if layer is not None:
            self._show_threshold(layer)

    def picks_layer(self) -> Any:
        """The live picks layer (Points named "picks"), or None."""
        return _find_layer(self.viewer, PICKS_LAYER, "Points")

    def pick_fom_range(self) -> tuple[float, float] | None:
        """(lowest, highest) figure of merit of the automatic picks; None without any."""
        return self.pick_model().fom_range()

    def reset_picks(self) -> None:
        """Forget picks of a previous run (the layer is emptied in place)."""
        self._picks.clear()
        self._picks_dirty = False
        self._picks_edited = False
        layer = self.picks_layer()
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


def _grid_model(layer: Any) -> ClassGrid | None:
    """The ClassGrid of a class grid layer (None for no layer or another layer)."""
    model = (getattr(layer, "metadata", None) or {}).get(GRID_MODEL) if layer is not None else None
    return model if isinstance(model, ClassGrid) else None


def _publish_grid(layer: Any) -> None:
    """Mirror the grid layer's model in its metadata, for widgets: tile order, tile size, selection, path."""
    model = layer.metadata[GRID_MODEL]
    layer.metadata.update(path=model.path, order=model.order, tile_size=model.tile_size,
                          selected=set(model.selected))


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

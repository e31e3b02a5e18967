"""The live display: job events -> napari layers and docks, updated in place (never one new layer per iteration).

A thin view. The pick and class-selection state lives in plain models (no Qt, no napari):
:class:`~napari_gpu_relion.widgets.pick_model.PickModel` and
:class:`~napari_gpu_relion.widgets.class_grid_model.ClassGrid`; the plots are in widgets/plots.py. Here:

* :class:`~napari_gpu_relion.events.MapUpdated`: one Surface layer per ``event.name``, created once: the
  map's iso-surface mesh (Å scale; level, mesh and binning of maps larger than 128 voxels a side computed in the
  worker thread by widgets/display_model.py), then updated in place. Maps are always shown in
  3D, where they can be seen: a new map switches the viewer to 3D, frames the maps, and hides the 2D layers
  (micrographs, picks, class grids), which would otherwise lie over it; the 2D view (napari's 2D/3D button)
  shows them again and takes the maps out of the layer list meanwhile (kept, still updated, and put back in 3D),
  so that the map's z axis does not lengthen the micrograph slider. A new 2D result (picks, class grid) switches
  back to 2D, the maps kept aside first. The view follows the kind of job shown: the first class grid or map of a
  job started or followed (:meth:`LiveDisplay.expect`) sets it, later ones leave the user's choice. The second half
  map of a refinement starts hidden (it lies on the first).
* :class:`~napari_gpu_relion.events.FscUpdated`: one dock "FSC" showing the plot that
  :meth:`LiveDisplay.prepare_event` drew in the worker thread (widgets/plots.py), titled with its job; following
  another folder clears it (:meth:`LiveDisplay.begin`). A post-processing STAR opened as a file shows its curves
  and the map beside it, and says so or why not (:meth:`LiveDisplay.show_postprocess`).
* :class:`~napari_gpu_relion.events.MicrographPicked`: into the PickModel, shown as one Points layer "picks"
  (mic, y, x; row i of the model is point i), features fom, class, psi, mic and manual, ``shown`` from the
  model's threshold. Points added by hand get RELION's manual-pick markers (fom, class, psi = -999), ``manual``
  True and ``mic`` from their slice; the user's edits of the layer are read back into the model before it is
  used again, so they survive later picks of the job. The picking dock has the layer made, empty, when it opens
  (:meth:`LiveDisplay.prepare_picks_layer`), so that the picks only fill it in place.
* :class:`~napari_gpu_relion.events.ClassAveragesUpdated`: a ClassGrid drawn as one image (in Å, placed
  to the right of the micrographs so that neither hides the other), a Points layer "<name> labels" and a Shapes
  layer "<name> selection" outlining the selected classes. A click on a tile (grid,
  labels or selection layer active, pan/zoom mode) toggles its class. The model lives in the grid layer's
  ``metadata['class_grid']``, mirrored for widgets as ``order``, ``tile_size``, ``selected`` (1-based class
  numbers) and ``path``; the selection is kept when the same job's grid is redrawn. The 2D classification dock
  has the labels layer made when it opens (:meth:`LiveDisplay.prepare_class_labels`; the grid fills it in place).
* :meth:`LiveDisplay.show_angular_histogram`: a dock "Angular distribution" (drawn off the GUI thread too).

Result plots (FSC, angular distribution) are tabs of one group under the plugin's panel of job docks
(widgets/dock_layout.py), never a column beside it. Every layer is in Å and the scale bar is on.

Widgets follow changes through :meth:`LiveDisplay.connect` ("picks": picks shown or edited, "selection":
class selection toggled).

Updates are coalesced (newest map per name, newest FSC, all new picks) and applied one item per event-loop
turn (a new layer and its follow-up, e.g. a grid's labels, in separate turns), at most every MIN_REFRESH_INTERVAL
seconds and at most about a third of the GUI thread's time, so a fast job cannot flood the GUI thread. All
methods but :meth:`LiveDisplay.prepare_event` run in the GUI thread (the runner dispatches events there).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from napari.utils.notifications import show_info
from qtpy.QtCore import QTimer

from ..compute.angular_distribution import angular_histogram
from ..events import ClassAveragesUpdated, FscUpdated, MapUpdated, MicrographPicked, ParticlesExtracted
from . import dock_layout, plots
from .class_grid_model import ClassGrid, class_at, grid_shape, tile_at, tile_corners
from .display_model import (
    PreparedClasses,
    PreparedFsc,
    PreparedMap,
    extraction_boxes,
    prepare_classes,
    prepare_event,
    prepare_extraction,
    prepare_map,
)
from .follow_model import job_label, postprocess_snapshot, snapshot_events, view_of
from .layers import (
    ANGSTROM,
    BOXES_LAYER,
    GALLERY_LAYER,
    IMAGE_COLORMAP,
    MAP_COLORMAP,
    PICKS_LAYER,
    PIXEL,
    PostprocessFsc,
    points_kwargs,
)
from .per_viewer import one_per_viewer
from .pick_model import MANUAL_PICK_VALUE, PickModel
from .plots import AngularDistributionPlot, FscPlot
from .runner import frozen_gc, note_gui_busy, wait_after_collection
from .style import (
    EXTRACTION_BOX_BORDER_WIDTH,
    EXTRACTION_BOX_COLOR,
    EXTRACTION_BOX_SYMBOL,
    LABEL_COLOR,
    MANUAL_PICK_COLOR,
    PICK_BORDER_WIDTH,
    SELECTION_COLOR,
)

if TYPE_CHECKING:
    import napari

# the grid geometry is re-exported for callers of its former home (docs/screenshots.py, widget tests)
__all__ = ["LiveDisplay", "grid_shape", "tile_at", "class_at", "tile_corners"]

log = logging.getLogger(__name__)

#: Metadata key of a picks layer made ahead of the picks (LiveDisplay.prepare_picks_layer), until its first picks.
PREPARED_KEY = "made_ahead"
#: Every character of a class label (ClassGrid.labels: "4: 35.0% 12 Å", "inf"/"nan" resolutions).
LABEL_GLYPHS = "0123456789:.% Åinfa-"
FSC_DOCK = "FSC"
ANGDIST_DOCK = "Angular distribution"
#: Key of a class grid layer's metadata that holds its ClassGrid.
GRID_MODEL = "class_grid"
#: Canvas pixels the mouse may move between press and release for a click (more is a pan).
CLICK_TOLERANCE = 5.0
#: Maps of these names (or ending in " <name>": a followed folder's "job012 half2") start hidden: they lie on a map
#: of the same job (a refinement's two halves agree).
HIDDEN_AT_FIRST = ("half2",)
#: Gap (Å, at least one tile) between the micrographs and a class grid placed beside them.
GRID_GAP_TILES = 1
#: Font size (points) and tick length (pixels) of a coloured surface's colour bar on the canvas.
COLORBAR_FONT_SIZE = 12
COLORBAR_TICK_LENGTH = 6
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
        self._listeners: dict[str, list[Callable[[], Any]]] = {}
        self.map_updates: dict[str, int] = {}
        self.min_interval = MIN_REFRESH_INTERVAL
        self._pending_maps: dict[str, MapUpdated] = {}
        self._pending_fsc: FscUpdated | None = None
        self._picks_dirty = False
        self._boxes: dict[int, tuple[np.ndarray, int, float]] = {}  # micrograph -> (coords, box, pixel size)
        self._boxes_dirty = False
        self._boxes_folder: Path | None = None
        self._pending_gallery: ParticlesExtracted | None = None
        self._timer: Any = None
        self._next_allowed = 0.0
        self._turn = 0
        self._later: deque[tuple[Callable[..., Any], tuple]] = deque()
        self._parked: dict[str, Any] = {}  # maps taken out of the layer list while the 2D view is shown
        self._hidden_for_maps: list[weakref.ref] = []  # 2D layers the 3D view of the maps hid
        self._swapping = False
        self.last_message = ""  # the last line the display said (show_postprocess)
        self._view_due = False  # the next class grid or map sets the view by its kind (expect)
        self._caption_on = False  # the canvas's text overlay names a coloured surface's values
        real = _unwrap(viewer)
        self._plot_colors = plots.theme_colors(real)
        # before napari's own handlers: the 2D layers are hidden before napari re-slices them in 3D (a micrograph
        # stack would be read whole and drawn as a volume)
        real.dims.events.ndisplay.connect(self._on_ndisplay, position="first")
        real.layers.events.removed.connect(self._on_layer_removed)
        real.layers.events.removed.connect(self._update_values_caption)
        real.layers.events.inserted.connect(self._update_values_caption)
        _scale_bar_on(real)

    @classmethod
    def for_viewer(cls, viewer: napari.viewer.Viewer) -> LiveDisplay:
        """The display shared by all job widgets of ``viewer`` (one FSC dock, one picks layer)."""
        return one_per_viewer(cls._instances, viewer, cls)

    @property
    def viewer(self) -> napari.viewer.Viewer | None:
        """The viewer; None once it is gone or closed (updates still pending then are dropped)."""
        viewer = self._viewer_ref()
        open_viewers = getattr(type(viewer), "_instances", None)
        if viewer is None or (open_viewers is not None and viewer not in open_viewers):
            return None
        return viewer

    # -- listeners ---------------------------------------------------------------------------------------

    def connect(self, kind: str, callback: Callable[..., None]) -> None:
        """Call ``callback(layer)`` after changes of ``kind``: "picks" (picks shown, added or deleted) or
        "selection" (a class of a grid toggled, or the grid redrawn; the grid layer is passed).

        A bound method is held weakly: a widget that is gone is simply not called any more, so widgets need no
        clean-up (and no closure that could outlive them) when they close."""
        ref = weakref.WeakMethod(callback) if inspect.ismethod(callback) else _Strong(callback)
        self._listeners.setdefault(kind, []).append(ref)

    def _emit(self, kind: str, *args: Any) -> None:
        refs = self._listeners.get(kind, [])
        alive = [r for r in refs if r() is not None]
        if len(alive) != len(refs):
            self._listeners[kind] = alive
        for ref in alive:
            callback = ref()
            if callback is None:
                continue
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
        elif isinstance(event, ParticlesExtracted):
            folder = None if event.path is None else Path(event.path).parent
            if folder != self._boxes_folder:  # another extraction job: its boxes replace the former job's
                self._boxes_folder = folder
                self._boxes.clear()
            self._boxes[int(event.index)] = (np.asarray(event.coords), int(event.box_size),
                                             float(event.micrograph_pixel_size))
            self._boxes_dirty = True
            self._pending_gallery = event
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
        return (bool(self._pending_maps) or self._pending_fsc is not None or self._picks_dirty or self._boxes_dirty
                or self._pending_gallery is not None or bool(self._later))

    def _apply_one(self) -> None:
        """Apply one pending item: a deferred step of a previous item first, then maps, FSC and picks in turn
        (none starves the others). Creating a layer costs napari 0.1-0.5 s of GUI time, so each turn creates at
        most one."""
        if self._later:
            method, args = self._later.popleft()
            method(*args)
            return
        for _ in range(4):
            kind = self._turn
            self._turn = (self._turn + 1) % 4
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
            if kind == 3 and self._boxes_dirty:
                self._boxes_dirty = False
                self.show_extraction_boxes()
                if self._pending_gallery is not None:
                    self.later(self._show_pending_gallery)  # a new layer at most per turn
                return
            if kind == 3 and self._pending_gallery is not None:
                self._show_pending_gallery()
                return

    def _tick(self) -> None:
        """Timer-driven refresh: one item per event-loop turn, and the GUI thread spends at most about a third
        of its time on job results (the next refresh waits twice as long as this one took), and never right after
        a full garbage collection (runner.py collects in turns of its own while jobs run)."""
        if self.viewer is None or not self.pending:
            return
        wait = wait_after_collection()
        if wait > 0:
            self._schedule(wait)
            return
        t0 = time.monotonic()
        self._apply_one()
        note_gui_busy()
        cost = time.monotonic() - t0
        self._next_allowed = time.monotonic() + max(self.min_interval, 2.0 * cost)
        if self.pending:
            self._schedule(max(MIN_TICK_GAP, 2.0 * cost))

    def flush(self) -> None:
        """Apply all pending updates now, in one go (tests, scripts; a job's end uses :meth:`drain`)."""
        if self._timer is not None:
            self._timer.stop()
        while self.viewer is not None and self.pending:
            self._apply_one()
        self._next_allowed = time.monotonic() + self.min_interval

    def drain(self) -> None:
        """Apply the pending updates soon, one per event-loop turn (a job's end: its last results appear at once,
        but the window keeps answering in between)."""
        if self.pending:
            self._next_allowed = 0.0
            self._schedule(0.0)

    def later(self, method: Callable[..., Any], *args: Any) -> None:
        """Run ``method(*args)`` at a later turn of the display's refresh (a bound method of the display: no
        closure that could outlive a widget)."""
        self._later.append((method, args))
        self._schedule(MIN_TICK_GAP)

    @staticmethod
    def prepare() -> None:
        """Import the plotting modules now rather than at the first FSC (see widgets/plots.py)."""
        plots.prepare()

    def prepare_event(self, event: Any, source: str = "") -> Any:
        """What the runner calls in the job's worker thread on every event: maps, class grids
        (widgets/display_model.py) and FSC plots (drawn to an image in the theme's colours, titled with the job
        ``source``, e.g. "Refine3D/job012") made ready, so that the GUI thread only shows them. Reads nothing of the
        viewer but the colours taken at construction."""
        if isinstance(event, FscUpdated) and not isinstance(event, PreparedFsc):
            base = {f.name: getattr(event, f.name) for f in dataclasses.fields(FscUpdated)}
            return PreparedFsc(**base, rendered=plots.render_fsc(event, self._plot_colors, source), source=source)
        return prepare_event(event)

    def expect(self) -> None:
        """Another job's results come next (a job started, a folder followed): its first class grid or map sets the
        view by its kind (2D or 3D). Later results of the same job leave the view as the user set it (a map updated
        while the 2D view is shown stays aside, see the module docstring)."""
        self._view_due = True

    def begin(self, source: str) -> None:
        """Another job is shown from now on (a folder followed, ``source`` its label): the view follows its kind
        (:meth:`expect`); the plots of the former job are cleared, saying which job's are awaited, and its FSC still
        waiting to be drawn is dropped."""
        self.expect()
        if self.fsc is not None and _alive(self.fsc.widget) and self.fsc.source != source:
            self.fsc.clear(source)
        if self.angdist is not None and _alive(self.angdist.widget):
            self.angdist.clear(source)
        pending = self._pending_fsc
        if pending is not None and getattr(pending, "source", "") != source:
            self._pending_fsc = None

    # -- maps --------------------------------------------------------------------------------------------

    def show_map(self, event: MapUpdated) -> Any:
        """Create the map's layer on the first event of a name (switching to the 3D view), then update it in
        place. A 3D map is drawn as its iso-surface mesh (a Surface layer; the display volume, its level and the
        mesh come prepared from the worker thread, see widgets/display_model.py; an event that was not prepared
        is prepared here). The layer's metadata keep the display volume ("volume"), the level ("iso_level"), the
        binning ("display_bin"), the file ("path") and the pixel size. Returns the layer, or None when the first
        map switched to the 3D view and its layer comes at the next refresh (:meth:`flush` applies both)."""
        viewer = self.viewer
        ev = event if isinstance(event, PreparedMap) else prepare_map(event)
        vol = ev.display_volume
        kind = "Surface" if vol.ndim == 3 else "Image"
        if self._view_is_due(view_of(ev) if kind == "Surface" else None):
            if self.map_layer(ev.name) is not None and viewer.dims.ndisplay == 2:
                self._enter_maps_view()  # another job's maps, their layers kept aside from before: the 3D view
        layer = self.map_layer(ev.name)
        if layer is not None and type(layer).__name__ != kind:
            self._forget_map(layer)
            layer = None
        metadata = {"path": None if ev.path is None else str(ev.path), "pixel_size": ev.pixel_size, "kind": "map",
                    "display_bin": ev.bin_factor, "iso_level": ev.iso_threshold, "volume": vol}
        if ev.vertex_values is not None:  # a surface coloured by a second map (the local resolution)
            metadata.update(values_label=ev.values_label, value_limits=tuple(ev.value_limits),
                            values_path=None if ev.values_path is None else str(ev.values_path))
        common = {"scale": ev.display_scale, "translate": ev.display_translate}
        if layer is None and kind == "Surface" and viewer.dims.ndisplay == 2 and viewer.dims.ndim >= 3:
            # first the 3D view (2D layers hidden), at the next turn the new layer: two shorter GUI stalls
            self._enter_maps_view()
            self._pending_maps = {ev.name: ev, **self._pending_maps}
            return None
        if layer is None:
            kwargs = {"name": ev.name, **common, "units": (ANGSTROM,) * vol.ndim,
                      "axis_labels": ("z", "y", "x")[-vol.ndim:], "metadata": metadata,
                      "visible": ev.name.split()[-1] not in HIDDEN_AT_FIRST}
            if kind == "Surface":
                coloured = ev.vertex_values is not None
                layer = viewer.add_surface(_surface_data(ev), colormap=ev.value_colormap if coloured else MAP_COLORMAP,
                                           contrast_limits=_colour_limits(ev), shading="smooth", **kwargs)
                if coloured:
                    self._show_coloured(layer)
                if viewer.dims.ndisplay == 2:  # a viewer without 3D data could not switch before
                    viewer.dims.ndisplay = 3
                else:
                    self._on_ndisplay()  # the 3D view: hide 2D layers shown meanwhile, frame the maps
            else:
                layer = viewer.add_image(vol, contrast_limits=ev.contrast_limits, colormap=IMAGE_COLORMAP, **kwargs)
        else:
            if tuple(layer.scale) != tuple(ev.display_scale) or tuple(layer.translate) != tuple(ev.display_translate):
                layer.scale, layer.translate = common["scale"], common["translate"]
            if kind == "Surface":
                layer.data = _surface_data(ev)
                layer.contrast_limits = _colour_limits(ev)
            else:
                layer.data = vol
                layer.contrast_limits_range = ev.contrast_limits
                layer.contrast_limits = ev.contrast_limits
            layer.metadata.update(metadata)
        self.map_updates[ev.name] = self.map_updates.get(ev.name, 0) + 1
        return layer

    def _show_coloured(self, layer: Any) -> None:
        """A new coloured surface (the local resolution) is seen alone, with its colour bar: the other maps, which
        lie at the same place and would hide its colours, are hidden (the layer list shows them again)."""
        viewer = self.viewer
        for other in list(viewer.layers) + list(self._parked.values()):
            if other is not layer and _is_map(other) and other.visible:
                other.visible = False
        colorbar = getattr(layer, "colorbar", None)  # napari >= 0.6: a layer's colour bar on the canvas
        if colorbar is not None:
            colorbar.font_size = COLORBAR_FONT_SIZE
            colorbar.tick_length = COLORBAR_TICK_LENGTH
            colorbar.visible = True
        layer.events.visible.connect(self._update_values_caption)
        self._update_values_caption()

    def _update_values_caption(self, event: Any = None) -> None:
        """The colour bar's title on the canvas (napari's colour bar has numbers only): the values' name and unit
        ("local resolution (Å)") beside it while a coloured surface is shown, nothing otherwise."""
        viewer = self.viewer
        caption = _text_overlay(viewer)
        if caption is None:
            return
        shown = [la for la in viewer.layers if la.visible and (la.metadata or {}).get("values_label")
                 and getattr(getattr(la, "colorbar", None), "visible", False)]
        if shown:
            caption.text = str(shown[-1].metadata["values_label"])
            caption.position = "top_right"
            caption.font_size = COLORBAR_FONT_SIZE
            caption.visible = True
            self._caption_on = True
        elif self._caption_on:
            caption.visible = False
            self._caption_on = False

    def map_layer(self, name: str) -> Any:
        """The map layer ``name``: in the viewer, or kept aside while the 2D view is shown; None if neither."""
        viewer = self.viewer
        if viewer is not None and name in viewer.layers and type(viewer.layers[name]).__name__ in ("Surface", "Image"):
            return viewer.layers[name]
        return self._parked.get(name)

    def _forget_map(self, layer: Any) -> None:
        self._parked.pop(layer.name, None)
        viewer = self.viewer
        if viewer is not None and layer in viewer.layers:
            with frozen_gc():
                viewer.layers.remove(layer)

    def frame_layer(self, name: str) -> None:
        """Point the camera at layer ``name`` (a new class grid beside the micrographs: its tiles and labels
        readable; pan left for the micrographs, or napari's home button for everything)."""
        viewer = self.viewer
        if viewer is None or name not in viewer.layers or viewer.dims.ndisplay != 2:
            return
        # napari's reset_view(layers=...) needs layers of the viewer's dimensionality; a 2D grid beside a
        # micrograph stack is framed here: its centre, the zoom that fits it (5 % margin)
        extent = np.asarray(viewer.layers[name].extent.world, dtype=np.float64)[:, -2:]
        size = np.maximum(extent[1] - extent[0], 1e-6)
        canvas = np.asarray(getattr(viewer.canvas, "size", (0, 0)), dtype=np.float64)[-2:]
        if not np.all(canvas > 0):
            viewer.reset_view()
            return
        viewer.camera.center = tuple(viewer.camera.center[:-2]) + tuple((extent[0] + extent[1]) / 2)
        viewer.camera.zoom = 0.95 * float(np.min(canvas / size))

    def frame_maps(self) -> None:
        """Point the 3D camera at the visible maps (all of them, nothing else)."""
        viewer = self.viewer
        maps = [la for la in viewer.layers if _is_map(la) and la.visible] if viewer is not None else []
        if maps and viewer.dims.ndisplay == 3:
            viewer.reset_view(layers=maps)

    # -- 2D view and 3D view -----------------------------------------------------------------------------

    def _on_ndisplay(self, event: Any = None) -> None:
        """napari's 2D/3D switch: the 3D view shows the maps (2D layers hidden), the 2D view the 2D layers (maps
        kept aside, out of the layer list, so that their z axis does not join the micrograph slider)."""
        viewer = self.viewer
        if viewer is None or self._swapping:
            return
        self._swapping = True
        try:
            if viewer.dims.ndisplay == 3:
                self._show_maps_view(viewer)
            else:
                self._show_2d_view(viewer)
        finally:
            self._swapping = False

    def _enter_maps_view(self) -> None:
        """Switch to the 3D view for a map that is about to be added (2D layers hidden even before it is)."""
        viewer = self.viewer
        self._swapping = True
        try:
            self._show_maps_view(viewer, force=True)  # 2D layers hidden first: napari does not slice them in 3D
            viewer.dims.ndisplay = 3
        finally:
            self._swapping = False

    def _show_maps_view(self, viewer: Any, force: bool = False) -> None:
        for name in list(self._parked):
            layer = self._parked.pop(name)
            if name not in viewer.layers:
                viewer.layers.append(layer)
        maps = [la for la in viewer.layers if _is_map(la)]
        if not maps and not force:
            return
        for layer in list(viewer.layers):
            if not _is_map(layer) and layer.visible:
                layer.visible = False
                self._hidden_for_maps.append(weakref.ref(layer))
        self.frame_maps()

    def _show_2d_view(self, viewer: Any, force: bool = False) -> None:
        hidden = [la for la in (ref() for ref in self._hidden_for_maps) if la is not None and la in viewer.layers]
        self._hidden_for_maps = []
        flat = [la for la in viewer.layers if not _is_map(la)]
        if not flat and not force:
            return  # only maps: napari's 2D view of their slices, as without this display
        with frozen_gc():
            for layer in [la for la in viewer.layers if _is_map(la)]:
                self._parked[layer.name] = layer
                viewer.layers.remove(layer)
        for layer in hidden:
            layer.visible = True
        viewer.reset_view()

    def _to_2d_view(self, park: bool = False) -> None:
        """A new 2D result (picks, class grid) is shown in the 2D view. ``park``: the first 2D result of another job
        (:meth:`expect`): the 2D view whatever put the viewer in 3D (a map of ours, one the reader opened, the
        user's 2D/3D button), with the maps kept aside first even when no 2D layer is there yet (else the maps'
        z axis joins the 2D result's world): the viewer follows the kind of job shown."""
        viewer = self.viewer
        if viewer is None:
            return
        if not park:
            if viewer.dims.ndisplay == 3 and (self._hidden_for_maps or any(_is_map(la) for la in viewer.layers)):
                viewer.dims.ndisplay = 2
            return
        if viewer.dims.ndisplay == 2 and not any(_is_map(la) for la in viewer.layers):
            return
        self._swapping = True
        try:
            self._show_2d_view(viewer, force=True)
            viewer.dims.ndisplay = 2
        finally:
            self._swapping = False

    def _view_is_due(self, view: int | None) -> bool:
        """True once, for the first result of a job started or followed (:meth:`expect`) that has a view."""
        if self._view_due and view is not None:
            self._view_due = False
            return True
        return False

    def _on_layer_removed(self, event: Any) -> None:
        """A layer the user deleted is forgotten (not put back by the next 2D/3D switch)."""
        if self._swapping:
            return
        layer = getattr(event, "value", None)
        self._hidden_for_maps = [r for r in self._hidden_for_maps if r() is not None and r() is not layer]

    def show_classes(self, event: ClassAveragesUpdated) -> Any:
        """One 2D image in Å: the class averages in a grid, largest class first (each scaled to its own mean and
        std; composed in the worker thread), with a Points layer "<name> labels" that writes "class:
        distribution, resolution" on each tile. A new grid is placed to the right of the micrographs. Clicks
        toggle classes (see :meth:`toggle_class_at`); the selection of the same job is kept."""
        viewer = self.viewer
        ev = event if isinstance(event, PreparedClasses) else prepare_classes(event)
        if self._view_is_due(view_of(ev)):
            self._to_2d_view(park=True)  # another job's results: the viewer follows its kind
        model, image = ev.grid, ev.grid_image
        scale = (float(ev.pixel_size or 1.0),) * 2
        units = (ANGSTROM,) * 2 if ev.pixel_size else (PIXEL,) * 2
        model.keep_selection_of(_grid_model(_find_layer(viewer, ev.name, "Image")))
        layer, translate = self._tile_image(ev.name, image, scale, units, model.tile_size, {"kind": "classes"})
        if translate:
            self.later(self.frame_layer, ev.name)  # the new grid fills the canvas (next turn)
        layer.metadata[GRID_MODEL] = model
        _publish_grid(layer)
        self._listen_for_clicks(layer)
        if translate is not None or not self._update_labels(ev.name):
            self.later(self._update_labels, ev.name, True)  # a new grid or labels layer: at the next turn
        self._draw_selection(layer)
        self._emit("selection", layer)
        self.map_updates[ev.name] = self.map_updates.get(ev.name, 0) + 1
        return layer

    def _update_labels(self, grid_name: str, create: bool = False) -> bool:
        """Write "class: distribution, resolution" on the tiles of grid ``grid_name``: in place in its Points layer
        "<name> labels", or (``create``) in a new one; False if the layer would have to be made first."""
        viewer = self.viewer
        grid = _find_layer(viewer, grid_name, "Image")
        model = _grid_model(grid)
        if model is None:
            return True
        lname = f"{grid_name} labels"
        labels = _find_layer(viewer, lname, "Points")
        positions, features = model.label_positions(), pd.DataFrame({"label": model.labels()})
        if labels is not None and len(labels.data) == len(positions) and \
                tuple(labels.translate) == tuple(grid.translate) and tuple(labels.scale) == tuple(grid.scale):
            labels.features = features  # in place: the text follows the features
            labels.refresh()
            return True
        if labels is not None and (labels.metadata or {}).pop(PREPARED_KEY, False):
            self._fill_prepared_labels(grid, labels, positions, features)
            return True
        if not create:
            return False
        if labels is not None:
            with frozen_gc():
                viewer.layers.remove(labels)
        labels = viewer.add_points(positions, name=lname, scale=grid.scale, translate=grid.translate,
                                   units=grid.units, axis_labels=("y", "x"), size=0, features=features,
                                   text={"string": "{label}", "anchor": "upper_left", "size": 8, "color": LABEL_COLOR},
                                   metadata={"kind": "class_labels", "grid": grid_name}, visible=grid.visible)
        viewer.layers.selection.active = grid  # clicks select classes; no editing tools of the labels layer
        self._listen_for_clicks(labels)
        return True

    def prepare_class_labels(self, grid_name: str) -> Any:
        """Create the (empty) labels layer "<grid_name> labels" of a class grid ahead of the grid, in the 2D view
        (the 2D classification dock asks for it when it opens): napari's creation of a Points layer with text
        (0.15-0.35 s with software OpenGL) then does not fall among the arriving class averages. Its first grid
        fills it in place (:meth:`_update_labels`). Returns the layer (None when not made now)."""
        viewer = self.viewer
        lname = f"{grid_name} labels"
        if viewer is None or viewer.dims.ndisplay != 2 or lname in viewer.layers:
            return None
        active = viewer.layers.selection.active
        # one point whose transparent text holds every character a label can have: its first draw loads their
        # glyphs into the layer's font atlas now (the text visual rasterises each new character on the GUI thread)
        labels = viewer.add_points(np.zeros((1, 2)), name=lname, axis_labels=("y", "x"), size=0,
                                   units=(ANGSTROM,) * 2, features=pd.DataFrame({"label": [LABEL_GLYPHS]}),
                                   text={"string": "{label}", "anchor": "upper_left", "size": 8,
                                         "color": "transparent"},
                                   metadata={"kind": "class_labels", "grid": grid_name, PREPARED_KEY: True})
        if active is not None and active in viewer.layers:
            viewer.layers.selection.active = active  # made ahead: the layer one works on stays the active one
        self._listen_for_clicks(labels)
        return labels

    def _fill_prepared_labels(self, grid: Any, labels: Any, positions: np.ndarray, features: pd.DataFrame) -> None:
        """A labels layer made ahead takes its grid's place (Å scale, offset), points and text, and moves right
        above its grid (which was added after it)."""
        viewer = self.viewer
        labels.units, labels.scale, labels.translate = grid.units, grid.scale, grid.translate
        labels.data = positions
        labels.features = features
        labels.text.color = LABEL_COLOR
        labels.visible = grid.visible
        index, above = viewer.layers.index(labels), viewer.layers.index(grid) + 1
        if index < above:
            viewer.layers.move(index, above)
        viewer.layers.selection.active = grid  # clicks select classes; no editing tools of the labels layer

    def _right_of_2d_layers(self, exclude: str, gap: float) -> float:
        """x (Å) where a new 2D layer starts so that it lies right of the visible 2D layers (0 without any)."""
        right = None
        for layer in self.viewer.layers:
            md = getattr(layer, "metadata", None) or {}
            if _is_map(layer) or not layer.visible or layer.name == exclude or md.get("grid") == exclude:
                continue
            extent = np.asarray(layer.extent.world, dtype=np.float64)
            if extent.shape[-1] >= 2 and np.all(np.isfinite(extent[:, -1])) and len(layer.data):
                x_max = float(extent[1, -1])
                right = x_max if right is None else max(right, x_max)
        return 0.0 if right is None else right + gap

    # -- extraction ----------------------------------------------------------------------------------------

    def show_extraction_boxes(self) -> Any:
        """The boxes of every micrograph extracted so far as white squares of the box size over the micrographs
        (Points (mic, y, x) in Å, like the picks; none of the pick colours), replaced in place."""
        if not self._boxes:
            return None
        if self._view_is_due(2):
            self._to_2d_view(park=True)  # an extraction after a 3D job: the viewer follows the kind of job
        items = sorted(self._boxes.items())
        data = np.concatenate([extraction_boxes(i, c) for i, (c, _, _) in items]).reshape(-1, 3)
        sizes = np.concatenate([np.full(len(c), float(b)) for _, (c, b, _) in items])
        apix = items[-1][1][2] or self._micrograph_pixel_size()
        layer = _find_layer(self.viewer, BOXES_LAYER, "Points")
        if layer is None:
            kwargs = points_kwargs(3, apix, {}, BOXES_LAYER, None)
            kwargs.update(symbol=EXTRACTION_BOX_SYMBOL, border_color=EXTRACTION_BOX_COLOR,
                          border_width=EXTRACTION_BOX_BORDER_WIDTH, size=sizes,
                          metadata={"kind": "extraction_boxes", "pixel_size": apix})
            kwargs.pop("feature_defaults", None)
            self._to_2d_view()
            layer = self.viewer.add_points(data, **kwargs)
            picks = self.picks_layer()
            if picks is not None:
                self.viewer.layers.selection.active = picks  # the picks stay the layer one edits
        else:
            layer.data = data
            layer.size = sizes
        return layer

    def _show_pending_gallery(self) -> None:
        ev, self._pending_gallery = self._pending_gallery, None
        if ev is not None:
            self.show_gallery(ev)

    def show_gallery(self, event: ParticlesExtracted) -> Any:
        """The first particles of the micrograph extracted last as a gallery (tiles like the class grid's, in Å at
        the particles' pixel size), placed to the right of the micrographs when it is new; updated in place."""
        viewer = self.viewer
        ev = prepare_extraction(event)
        image = ev.gallery_image
        scale = (float(ev.pixel_size or 1.0),) * 2
        tile = image.shape[-1] / max(1, grid_shape(len(ev.images))[1])
        layer, translate = self._tile_image(GALLERY_LAYER, image, scale, (ANGSTROM,) * 2, tile,
                                            {"kind": "particle_gallery"})
        if translate is not None and viewer.dims.ndisplay == 2:
            viewer.reset_view()  # the new gallery beside the micrographs: frame both (it was off screen)
        layer.metadata["micrograph"] = ev.name
        return layer

    def _tile_image(self, name: str, image, scale, units, tile_size: float, metadata: dict) -> tuple[Any, Any]:
        """The 2D Image layer ``name`` (class grid, particle gallery) showing ``image``: updated in place, or made
        anew (when missing or of another shape) to the right of the 2D layers, a gap of GRID_GAP_TILES tiles of
        ``tile_size`` pixels. Returns the layer and, for a new one, its x offset in Å (else None)."""
        viewer = self.viewer
        layer = _find_layer(viewer, name, "Image")
        if layer is not None and layer.data.shape != image.shape:
            with frozen_gc():
                viewer.layers.remove(layer)
            layer = None
        if layer is not None:
            layer.data = image
            return layer, None
        self._to_2d_view()
        translate = (0.0, self._right_of_2d_layers(exclude=name, gap=GRID_GAP_TILES * tile_size * scale[1]))
        layer = viewer.add_image(image, name=name, scale=scale, translate=translate, units=units,
                                 axis_labels=("y", "x"), colormap=IMAGE_COLORMAP, metadata=dict(metadata))
        return layer, translate[1]

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
            layer = self.viewer.add_shapes(name=name, scale=grid.scale, translate=grid.translate, units=grid.units,
                                           axis_labels=("y", "x"),
                                           metadata={"kind": "class_selection", "grid": grid.name})
            self._listen_for_clicks(layer)
            self.viewer.layers.selection.active = grid  # keep pan/zoom: a click selects a class, draws nothing
        elif tuple(layer.scale) != tuple(grid.scale) or tuple(layer.translate) != tuple(grid.translate):
            layer.scale, layer.translate = grid.scale, grid.translate
        layer.data = []
        if rects:
            layer.add_rectangles(rects, edge_width=model.outline_width, edge_color=SELECTION_COLOR,
                                 face_color="transparent")
        return layer

    # -- FSC ---------------------------------------------------------------------------------------------

    def show_fsc(self, event: FscUpdated) -> FscPlot:
        """Redraw the FSC dock (created on first use, re-created if the user closed it), titled with the job the
        curves belong to. The curves of a post-processing STAR opened as a file (widgets/layers.PostprocessFsc, not
        prepared by a job or a followed folder) come with the map beside them: :meth:`show_postprocess`."""
        if isinstance(event, PostprocessFsc) and not isinstance(event, PreparedFsc):
            return self.show_postprocess(event.star)
        if self.fsc is None or not _alive(self.fsc.widget):
            self.fsc = FscPlot(self.viewer)
            self._fsc_dock = self._dock_plot(self.fsc.widget, FSC_DOCK)
        self.fsc.update(event, getattr(event, "rendered", None), getattr(event, "source", ""))
        dock_layout.raise_dock(self._fsc_dock if _alive(self._fsc_dock) else None)
        return self.fsc

    def show_postprocess(self, star: str | Path) -> FscPlot:
        """A post-processing STAR opened as a file: its FSC curves (titled with its job) and the map beside it
        (postprocess_masked.mrc, else postprocess.mrc), and a line saying what was shown, or why the map was not;
        InputError saying why when the STAR cannot be shown."""
        snap = postprocess_snapshot(star)
        label = job_label(Path(star).parent)
        self.begin(label)
        for event in snapshot_events(snap, Path(star).parent.name):
            self.handle(self.prepare_event(event, label))
        self.flush()
        self.flush()  # a first map switches to the 3D view and comes at the next turn
        found = snap.images[0].name if snap.images else None
        fsc = self.fsc.last_event if self.fsc is not None else None
        res = f" ({fsc.resolution_A:.2f} Å at FSC {fsc.threshold:g})" if fsc is not None and np.isfinite(
            fsc.resolution_A) else ""
        message = (f"{label}: FSC curves{res} and {found} shown" if found else
                   f"{label}: FSC curves{res} shown; no map beside {Path(star).name} (postprocess_masked.mrc or "
                   "postprocess.mrc) to show")
        self.last_message = message
        show_info(message)
        return self.fsc

    def _dock_plot(self, widget: Any, name: str) -> Any:
        """Dock a result plot into the plot group under the plugin's panel (widgets/dock_layout.py): the plots are
        tabs of one group there, never a column beside the job dock (which left the canvas no room)."""
        return dock_layout.dock_plot(self.viewer.window, widget, name)

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

    def _store_picks(self, event: MicrographPicked) -> None:
        """Put one micrograph's picks into the model (after taking in the user's edits, so they are not lost)."""
        self.pick_model().set_micrograph(event.index, event.name, event.coords, event.scores)

    def _apply_picks(self) -> Any:
        """Show the model in the picks layer (created on first use), point i being row i."""
        if self._view_is_due(2):
            self._to_2d_view(park=True)  # picking after a 3D job: the viewer follows the kind of job
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
                self._to_2d_view()
                layer = self._add_picks_layer(data, features, names)
            else:
                if (layer.metadata or {}).pop(PREPARED_KEY, False):
                    self._fill_prepared_picks(layer)
                layer.data = data  # features are padded here; the full table is assigned right after
                layer.features = features
                layer.metadata["micrograph_names"] = names
            layer.feature_defaults = _manual_pick_defaults()  # assigning features resets them
        finally:
            self._applying_picks = False
        self._watch_picks(layer)
        self._show_threshold(layer)
        self._show_colours(layer)
        self._emit("picks", layer)
        return layer

    def _add_picks_layer(self, data: np.ndarray, features: pd.DataFrame, names: list[str]) -> Any:
        """A new picks layer (mic, y, x) in Å at the micrographs' pixel size, FOM-coloured borders."""
        kwargs = points_kwargs(3, self._micrograph_pixel_size(), features, PICKS_LAYER, self.pick_size,
                               {"micrograph_names": names})
        kwargs["border_color"] = MANUAL_PICK_COLOR  # the picks' own colours come from _show_colours
        kwargs["border_width"] = PICK_BORDER_WIDTH
        layer = self.viewer.add_points(data, **kwargs)
        layer.selected_data = set()
        layer.current_border_color = MANUAL_PICK_COLOR  # what a point added by hand is drawn with
        return layer

    def prepare_picks_layer(self) -> Any:
        """Create the (empty) picks layer ahead of the picks, once the micrographs' pixel size is known and the
        2D view is shown (the picking dock asks for it when it opens): napari's layer creation and the first draw
        of its points (shader compilation, 0.1-0.2 s each with software OpenGL) then do not fall among the
        arriving results, which only update the layer in place. Points added by hand meanwhile are manual picks.
        Returns the picks layer (None when it is not made now: it is then made with the first picks)."""
        viewer = self.viewer
        if viewer is None:
            return None
        layer = self.picks_layer()
        if layer is not None or viewer.dims.ndisplay != 2 or PICKS_LAYER in viewer.layers \
                or not self._micrograph_pixel_size():
            return layer
        columns = {"fom": float, "class": np.int64, "psi": float, "mic": np.int64, "manual": bool}
        features = pd.DataFrame({k: np.empty(0, dtype=t) for k, t in columns.items()})
        self._applying_picks = True
        try:
            layer = self._add_picks_layer(np.empty((0, 3)), features, [])
            layer.feature_defaults = _manual_pick_defaults()
        finally:
            self._applying_picks = False
        layer.metadata[PREPARED_KEY] = True
        self._watch_picks(layer)
        return layer

    def _fill_prepared_picks(self, layer: Any) -> None:
        """First picks into a layer made ahead (:meth:`prepare_picks_layer`): what a new layer would get, i.e. the
        current pixel size (Å scale), the 2D view, a place above the images opened since, the active layer."""
        viewer = self.viewer
        apix = self._micrograph_pixel_size()
        if apix and layer.metadata.get("pixel_size") != apix and not len(layer.data):
            kwargs = points_kwargs(3, apix, {}, PICKS_LAYER)
            layer.scale, layer.units = kwargs["scale"], kwargs["units"]
            layer.metadata["pixel_size"] = apix
        self._to_2d_view()
        index, top = viewer.layers.index(layer), len(viewer.layers) - 1
        if any(type(la).__name__ == "Image" and not _is_map(la) for la in list(viewer.layers)[index + 1:]):
            viewer.layers.move(index, top + 1)  # above micrographs opened after the layer was made
        viewer.layers.selection.active = layer

    def _show_threshold(self, layer: Any) -> None:
        """``layer.shown`` from the model (when the layer holds the model's rows)."""
        shown = self._picks.shown
        if len(shown) == len(layer.data):
            layer.shown = shown

    def _show_colours(self, layer: Any) -> None:
        """Ring colours from the model (PickModel.border_colours: the FOM over the automatic picks' range, picks
        added by hand in their own colour), when the layer holds the model's rows."""
        if len(self._picks) == len(layer.data) and len(layer.data):
            layer.border_color = self._picks.border_colours()

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
        """(lowest, upper end) of the FOM threshold slider (PickModel.slider_range); None without picks."""
        return self.pick_model().slider_range()

    # -- angular distribution ----------------------------------------------------------------------------

    def show_angular_distribution(self, rot: np.ndarray, tilt: np.ndarray, source: Path | None = None,
                                  weights: np.ndarray | None = None) -> AngularDistributionPlot:
        """Histogram the viewing directions (RELION rot/tilt, degrees) on an equal-area grid and draw it in
        the "Angular distribution" dock (created on first use, re-created if the user closed it)."""
        return self.show_angular_histogram(angular_histogram(rot, tilt, weights), source)

    def show_angular_histogram(self, hist: Any, source: Path | None = None, rendered: Any = None) -> Any:
        """Show an angular histogram (drawn to ``rendered`` off the GUI thread, else here) in the "Angular
        distribution" dock (created on first use, re-created if the user closed it)."""
        if self.angdist is None or not _alive(self.angdist.widget):
            self.angdist = AngularDistributionPlot(self.viewer)
            self._angdist_dock = self._dock_plot(self.angdist.widget, ANGDIST_DOCK)
        self.angdist.update(hist, source, rendered)
        return self.angdist

    @property
    def plot_colors(self) -> tuple[str, str]:
        """(foreground, background) of the plots: the viewer's theme when the display was made."""
        return self._plot_colors


class _Strong:
    """A strong reference with the call signature of a weak one (for plain functions)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __call__(self) -> Any:
        return self._obj


def _surface_data(ev: PreparedMap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vertices, faces, values) of a map's iso-surface layer: one value, one colour, unless the surface is coloured
    by a second map (its value at each vertex)."""
    if ev.vertex_values is not None:
        return ev.vertices, ev.faces, np.asarray(ev.vertex_values, np.float32)
    return ev.vertices, ev.faces, np.ones(len(ev.vertices), np.float32)


def _colour_limits(ev: PreparedMap) -> tuple[float, float]:
    """The surface layer's contrast limits: the coloured surface's colour range, else (0, 1) (one colour)."""
    return tuple(float(v) for v in ev.value_limits) if ev.vertex_values is not None else (0.0, 1.0)


def _is_map(layer: Any) -> bool:
    """A 3D map (ours, or one the plugin's reader opened)."""
    md = getattr(layer, "metadata", None) or {}
    return md.get("kind") == "map" and getattr(layer, "ndim", 0) == 3


def _text_overlay(viewer: Any) -> Any:
    """The canvas's text overlay (None without a viewer)."""
    if viewer is None:
        return None
    try:
        return viewer.canvas.overlays.text
    except AttributeError:  # napari before 0.9
        return getattr(viewer, "text_overlay", None)


def _scale_bar_on(viewer: Any) -> None:
    """Show napari's scale bar (every layer of the plugin is in Å, so it reads in Å)."""
    try:
        viewer.canvas.overlays.scale_bar.visible = True
    except AttributeError:  # napari before 0.9
        viewer.scale_bar.visible = True


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

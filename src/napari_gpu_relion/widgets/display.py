"""Job events -> napari layers and plots, updated in place (never one new layer per iteration).

* :class:`~napari_gpu_relion.jobs.events.MapUpdated`: one 3D Image layer per ``event.name``, created once
  (Å scale, iso-surface rendering, threshold by Otsu's method), then ``layer.data = volume``.
* :class:`~napari_gpu_relion.jobs.events.FscUpdated`: one matplotlib dock widget "FSC", redrawn.
* :class:`~napari_gpu_relion.jobs.events.MicrographPicked`: one Points layer "picks" (mic, y, x) over the
  micrograph stack, scores in ``features['fom']``, a threshold that hides picks through ``shown``.

Updates are coalesced (newest map per name, newest FSC, all new picks) and applied one item per event-loop
turn, at most every MIN_REFRESH_INTERVAL seconds and at most about a third of the GUI thread's time, so a
fast job cannot flood the GUI thread. All methods run in the GUI thread
(the runner dispatches events there).
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .._reader import map_kwargs, points_kwargs
from ..jobs.events import ClassAveragesUpdated, FscUpdated, MapUpdated, MicrographPicked

if TYPE_CHECKING:
    import napari

__all__ = ["LiveDisplay", "FscPlot"]

PICKS_LAYER = "picks"
FSC_DOCK = "FSC"
#: Seconds between two display refreshes while a job streams results.
MIN_REFRESH_INTERVAL = 0.1
#: Smallest pause (s) between two items of one refresh, so that queued GUI events get their turn.
MIN_TICK_GAP = 0.02


class FscPlot:
    """A matplotlib FSC plot in a napari dock widget: curves against resolution (1/Å), threshold line,
    resolution in the title. Build once, call :meth:`update` for every new FscUpdated."""

    def __init__(self, viewer: napari.viewer.Viewer):
        from matplotlib.backends.backend_qtagg import FigureCanvasQTAgg
        from matplotlib.figure import Figure
        from qtpy.QtWidgets import QVBoxLayout, QWidget

        self.widget = QWidget()
        self.widget.setObjectName("gpu_relion_fsc_plot")
        self.figure = Figure(figsize=(4, 3))
        self.figure.subplots_adjust(left=0.16, right=0.97, bottom=0.16, top=0.88)
        self.canvas = FigureCanvasQTAgg(self.figure)
        self.canvas.setMinimumHeight(200)
        self.axes = self.figure.add_subplot(111)
        layout = QVBoxLayout(self.widget)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.canvas)
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
        self._picks: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}
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
            self._picks[int(event.index)] = (event.name, np.asarray(event.coords, dtype=np.float64).reshape(-1, 2),
                                             np.asarray(event.scores, dtype=np.float64).ravel())
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
        std), with a Points layer "<name> labels" that writes "class: distribution, resolution" on each tile."""
        viewer = self.viewer
        imgs = np.asarray(event.images, dtype=np.float32)
        K, N = imgs.shape[0], imgs.shape[-1]
        order = np.argsort(-np.asarray(event.distribution), kind="stable")
        ncol = int(np.ceil(np.sqrt(K)))
        nrow = int(np.ceil(K / ncol))
        grid = np.zeros((nrow * N, ncol * N), np.float32)
        pos = np.zeros((K, 2))
        for i, k in enumerate(order):  # K tiles (a display copy, not a hot path)
            r, c = divmod(i, ncol)
            im = imgs[k]
            grid[r * N:(r + 1) * N, c * N:(c + 1) * N] = (im - im.mean()) / (im.std() or 1.0)
            pos[i] = (r * N + 1, c * N + 1)
        scale = (float(event.pixel_size or 1.0),) * 2
        layer = _find_layer(viewer, event.name, "Image")
        if layer is not None and layer.data.shape != grid.shape:
            viewer.layers.remove(layer)
            layer = None
        if layer is None:
            layer = viewer.add_image(grid, name=event.name, scale=scale, colormap="gray",
                                     metadata={"kind": "classes", "path": event.path})
        else:
            layer.data = grid
        layer.metadata["order"] = order  # tile i shows class order[i] (0-based)
        text = [f"{k + 1}: {100 * event.distribution[k]:.1f}% {event.resolution_A[k]:.0f} Å" for k in order]
        lname = f"{event.name} labels"
        labels = _find_layer(viewer, lname, "Points")
        if labels is not None:
            viewer.layers.remove(labels)
        viewer.add_points(pos, name=lname, scale=scale, size=0, features={"label": text},
                          text={"string": "{label}", "anchor": "upper_left", "size": 8, "color": "yellow"})
        self.map_updates[event.name] = self.map_updates.get(event.name, 0) + 1
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
        self._picks[int(event.index)] = (event.name, np.asarray(event.coords, dtype=np.float64).reshape(-1, 2),
                                         np.asarray(event.scores, dtype=np.float64).ravel())
        return self._apply_picks()

    def _apply_picks(self) -> Any:
        mics = sorted(self._picks)
        data = np.concatenate([
            np.column_stack([np.full(len(self._picks[m][1]), float(m)), self._picks[m][1][:, ::-1]])
            for m in mics
        ]) if mics else np.empty((0, 3))
        fom = np.concatenate([self._picks[m][2] for m in mics]) if mics else np.empty(0)
        mic_col = np.concatenate([np.full(len(self._picks[m][2]), m, dtype=np.int64) for m in mics])
        features = pd.DataFrame({"fom": fom, "class": np.full(len(fom), -999, np.int64),
                                 "psi": np.full(len(fom), -999.0), "mic": mic_col})
        names = [""] * (max(mics) + 1)
        for m in mics:
            names[m] = self._picks[m][0]
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
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
        layer.shown = fom >= self.pick_threshold
        return layer

    def set_pick_threshold(self, threshold: float) -> None:
        """Hide picks whose figure of merit is below ``threshold`` (no re-picking; the writer skips them)."""
        self.pick_threshold = float(threshold)
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is not None and "fom" in layer.features:
            layer.shown = layer.features["fom"].to_numpy() >= self.pick_threshold

    def reset_picks(self) -> None:
        """Forget picks of a previous run (the layer is emptied in place)."""
        self._picks.clear()
        self._picks_dirty = False
        layer = _find_layer(self.viewer, PICKS_LAYER, "Points")
        if layer is not None:
            layer.data = np.empty((0, layer.ndim))


def _unwrap(viewer: Any) -> Any:
    """The viewer itself when napari handed us its PublicOnlyProxy (a new proxy object per widget)."""
    return getattr(viewer, "__wrapped__", viewer)


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

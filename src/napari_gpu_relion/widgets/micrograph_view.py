"""Display-only binning and low-pass of the micrographs shown in the viewer (the picking dock's "Display" controls).

RELION's manual picker and cryoSPARC's pick inspection show micrographs binned and low-passed so that particles
stand out. Here the micrograph layers (metadata kind "micrographs" or "micrograph", as the reader makes them) are
re-rendered: binned by a factor (block means) and/or low-passed at a resolution in Å
(widgets/display_model.display_micrograph), computed in a thread worker, never on the GUI thread. Only the layer's
data, scale and shift change: the binned layer keeps its place in Å, so picks (in Å) still lie on their
particles, and the picker, the extraction and every file keep reading the original micrographs. Binning 1 and
low-pass 0 show the original data again.

Limitation: the whole micrograph stack is transformed at once and held in memory (binned, smaller): fine for the
tutorial's and a screen's worth of micrographs, heavy for hundreds of 4k micrographs at binning 1.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
from magicgui.widgets import Container, FloatSpinBox, Label, SpinBox
from napari.qt.threading import create_worker
from qtpy.QtCore import QTimer

from .display_model import display_micrograph
from .layers import robust_limits

if TYPE_CHECKING:
    import napari

__all__ = ["MicrographDisplay", "SOURCE_KEY", "micrograph_layers"]

log = logging.getLogger(__name__)

#: Metadata key of a re-rendered micrograph layer: its original data, scale and translate.
SOURCE_KEY = "display_source"
#: Milliseconds without a change before the micrographs are re-rendered (spin boxes step quickly).
DEBOUNCE_MS = 300


def micrograph_layers(viewer: Any) -> list[Any]:
    """The Image layers of micrographs (the reader's metadata kind "micrographs" or "micrograph")."""
    return [layer for layer in viewer.layers if type(layer).__name__ == "Image"
            and (getattr(layer, "metadata", None) or {}).get("kind") in ("micrographs", "micrograph")]


def _source(layer: Any) -> dict:
    """The layer's original data, scale and translate (remembered the first time it is re-rendered)."""
    src = layer.metadata.get(SOURCE_KEY)
    if src is None:
        src = {"data": layer.data, "scale": tuple(layer.scale), "translate": tuple(layer.translate),
               "contrast_limits": tuple(layer.contrast_limits)}
        layer.metadata[SOURCE_KEY] = src
    return src


def _render(data: Any, pixel_size: float, bin_factor: int, lowpass_A: float) -> tuple[np.ndarray, float, float]:
    """Worker thread: each micrograph of ``data`` ((n,) ny, nx; lazy or not) read and transformed in turn."""
    arr = data
    if arr.ndim == 2:
        return display_micrograph(np.asarray(arr), pixel_size, bin_factor, lowpass_A)
    shown = [display_micrograph(np.asarray(arr[i]), pixel_size, bin_factor, lowpass_A) for i in range(arr.shape[0])]
    return np.stack([s[0] for s in shown]), shown[0][1], shown[0][2]


class MicrographDisplay(Container):
    """Two controls, "Display binning" and "Display low-pass (Å)", that re-render the viewer's micrograph layers
    for the eye only (see the module docstring). ``apply()`` starts the worker now; :attr:`busy` is True until
    its result is shown."""

    def __init__(self, viewer: napari.viewer.Viewer) -> None:
        self.bin_factor = SpinBox(value=1, min=1, max=16, name="display_bin", label="Display binning")
        self.bin_factor.tooltip = ("Show the micrographs binned by this factor (block means), for the eye only: "
                                   "picking and extraction use the original micrographs. 1: not binned")
        self.lowpass = FloatSpinBox(value=0.0, min=0.0, max=1000.0, step=5.0, name="display_lowpass",
                                    label="Display low-pass (Å)")
        self.lowpass.tooltip = ("Show the micrographs low-passed at this resolution (Å), for the eye only "
                                "(RELION's manual picker does the same). 0: not filtered")
        self.info = Label(value="", name="display_info", label="")
        super().__init__(widgets=[self.bin_factor, self.lowpass, self.info], labels=True, name="micrograph_display")
        self.margins = (0, 0, 0, 0)
        self._viewer_ref = weakref.ref(viewer)
        self._worker: Any = None
        self._again = False
        self.renders = 0  # finished re-renderings (tests)
        self._timer = QTimer()
        self._timer.setSingleShot(True)
        self._timer.setInterval(DEBOUNCE_MS)
        self._timer.timeout.connect(self.apply)
        self.bin_factor.changed.connect(self._schedule)
        self.lowpass.changed.connect(self._schedule)

    @property
    def busy(self) -> bool:
        return self._worker is not None or self._timer.isActive()

    def _schedule(self, *_: Any) -> None:
        self._timer.start()

    def apply(self) -> None:
        """Re-render every micrograph layer with the current settings, in a thread worker (one at a time: a
        change during a rendering starts another when it is done)."""
        self._timer.stop()
        viewer = self._viewer_ref()
        if viewer is None:
            return
        if self._worker is not None:
            self._again = True
            return
        jobs = []
        for layer in micrograph_layers(viewer):
            pixel = float(layer.metadata.get("pixel_size") or _source(layer)["scale"][-1] or 1.0)
            jobs.append((weakref.ref(layer), _source(layer)["data"], pixel))
        if not jobs:
            self.info.value = "no micrographs open"
            return
        f, res = int(self.bin_factor.value), float(self.lowpass.value)
        self.info.value = "rendering..."
        worker = create_worker(_render_all, jobs, f, res, _start_thread=False)
        worker.returned.connect(self._show)
        worker.errored.connect(self._failed)
        worker.finished.connect(self._done)
        self._worker = worker
        worker.start()

    def _show(self, results: list) -> None:
        """GUI thread: hand the finished arrays to their layers (data, scale and shift in Å)."""
        f, res = int(self.bin_factor.value), float(self.lowpass.value)
        for ref, shown, apix, shift in results:
            layer = ref()
            if layer is None:
                continue
            src = _source(layer)
            n_index = len(src["scale"]) - 2
            if shown is None:  # the original
                layer.data = src["data"]
                layer.scale, layer.translate = src["scale"], src["translate"]
                layer.contrast_limits = src["contrast_limits"]
                continue
            layer.data = shown
            layer.scale = tuple(src["scale"][:n_index]) + (apix, apix)
            layer.translate = tuple(src["translate"][:n_index]) + tuple(t + shift for t in src["translate"][-2:])
            layer.contrast_limits = robust_limits(shown[(0,) * (shown.ndim - 2)])
        parts = ([f"binned {f}x"] if f > 1 else []) + ([f"low-passed at {res:g} Å"] if res > 0 else [])
        self.info.value = ("shown " + ", ".join(parts) + " (display only)") if parts else ""
        self.renders += 1

    def _failed(self, exc: BaseException) -> None:
        log.error("could not re-render the micrographs", exc_info=(type(exc), exc, exc.__traceback__))
        self.info.value = f"could not re-render: {exc}"

    def _done(self) -> None:
        self._worker = None
        if self._again:
            self._again = False
            self.apply()


def _render_all(jobs: list, bin_factor: int, lowpass_A: float) -> list:
    """Worker thread: (layer ref, display data or None for the original, pixel size Å, shift Å) per layer."""
    out = []
    for ref, data, pixel in jobs:
        if bin_factor <= 1 and lowpass_A <= 0:
            out.append((ref, None, pixel, 0.0))
            continue
        shown, apix, shift = _render(data, pixel, bin_factor, lowpass_A)
        out.append((ref, shown, apix, shift))
    return out

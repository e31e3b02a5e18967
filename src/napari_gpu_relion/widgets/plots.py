"""The matplotlib docks of the live display (widgets/display.py): the FSC plot and the angular distribution.

matplotlib's Qt backend is imported on first use (:func:`prepare` imports it ahead, when a job widget is built),
so that importing this module stays cheap and matplotlib follows the Qt binding that qtpy already loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from napari.utils.theme import get_theme
from qtpy.QtWidgets import QVBoxLayout, QWidget

from ..compute.angular_distribution import AngularHistogram
from ..jobs.events import FscUpdated

if TYPE_CHECKING:
    import napari

__all__ = ["FscPlot", "AngularDistributionPlot", "prepare"]


def prepare() -> None:
    """Import the plotting modules now (about 0.15 s the first time) rather than at the first FSC."""
    import matplotlib.backends.backend_qtagg  # noqa: F401
    import matplotlib.figure  # noqa: F401


def _matplotlib_dock(object_name: str, figsize: tuple[float, float]) -> tuple[Any, Any, Any]:
    """(QWidget, Figure, canvas): an empty matplotlib figure filling a widget for a napari dock."""
    from matplotlib.backends.backend_qtagg import FigureCanvasQTAgg  # lazy: see the module docstring
    from matplotlib.figure import Figure

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

"""The plot docks of the live display (widgets/display.py): the FSC plot and the angular distribution; the
picking dock's FOM histogram (:class:`FomHistogramView`) and the local-resolution dock's colour bar
(:class:`ColourBarView`), both drawn with QPainter, not matplotlib.

A matplotlib figure takes 0.05-0.3 s to draw with Agg on a 2-core machine (the angular distribution with its
colour bar the most), so the GUI thread never draws one (issue 18: no freezes). :func:`render_fsc` and
:func:`render_angular_distribution` draw a figure to an RGBA image with matplotlib's Agg canvas in any thread
(the job's worker thread through the runner's ``prepare``, or a short-lived worker); a dock only shows that
image, scaled to its size. One lock serialises the drawing (matplotlib's font cache is shared between threads).
The figure and its axes are kept with the image (titles, labels and curves can be read back).

A plot says whose it is: the FSC's title starts with the job it belongs to ("Refine3D/job012", a line above
"Resolution 12.00 Å (FSC = 0.143)"), the angular distribution's names its STAR; :meth:`FscPlot.clear` (a new job
followed) leaves a line that says which job's curves are awaited instead of the former job's curves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from napari.utils.theme import get_theme
from qtpy.QtCore import Qt
from qtpy.QtGui import QImage, QPixmap
from qtpy.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from ..compute.angular_distribution import AngularHistogram
from ..events import FscUpdated

if TYPE_CHECKING:
    import napari

__all__ = ["FscPlot", "AngularDistributionPlot", "FomHistogramView", "ColourBarView", "RenderedPlot", "render_fsc",
           "render_angular_distribution", "theme_colors", "prepare"]

#: Pixel size of a rendered plot (it is scaled to the dock, keeping its aspect).
PLOT_SIZE_PX = (400, 300)
PLOT_DPI = 100
_DRAW_LOCK = threading.Lock()


def prepare() -> None:
    """Import matplotlib's Agg canvas now (about 0.15 s the first time) rather than at the first plot."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401


@dataclass(frozen=True)
class RenderedPlot:
    """A figure drawn to an RGBA image (height, width, 4) uint8, with the figure and its main axes."""

    image: np.ndarray
    figure: Any
    axes: Any
    colorbar: Any = None


def _figure(colors: tuple[str, str]) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(PLOT_SIZE_PX[0] / PLOT_DPI, PLOT_SIZE_PX[1] / PLOT_DPI), dpi=PLOT_DPI)
    FigureCanvasAgg(figure)
    figure.set_facecolor(colors[1])
    return figure, figure.canvas


def _style(ax: Any, fg: str, bg: str) -> None:
    ax.set_facecolor(bg)
    ax.tick_params(colors=fg)
    for spine in ax.spines.values():
        spine.set_color(fg)


def _draw(figure: Any) -> np.ndarray:
    figure.canvas.draw()
    return np.array(figure.canvas.buffer_rgba(), dtype=np.uint8)


def render_fsc(event: FscUpdated, colors: tuple[str, str] = ("black", "white"), source: str = "") -> RenderedPlot:
    """FSC curves against resolution (1/Å), the threshold line, the job ``source`` and the resolution in the title;
    any thread."""
    fg, bg = colors
    with _DRAW_LOCK:
        figure, _ = _figure(colors)
        figure.subplots_adjust(left=0.15, right=0.97, bottom=0.16, top=0.84 if source else 0.9)
        ax = figure.add_subplot(111)
        _style(ax, fg, bg)
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
            title = f"{source}\n{title}" if source else title  # the job on a line of its own: it fits a narrow dock
        else:
            title = f"FSC of {source}" if source else "FSC"
        ax.set_title(title, color=fg, fontsize=10)
        ax.set_xlabel("resolution (1/Å)", color=fg)
        ax.set_ylabel("FSC", color=fg)
        ax.set_ylim(-0.1, 1.05)
        if len(x):
            ax.set_xlim(0, float(np.nanmax(x)))
        if event.curves:
            ax.legend(fontsize=8, frameon=False, labelcolor=fg)
        return RenderedPlot(_draw(figure), figure, ax)


def render_angular_distribution(hist: AngularHistogram, source: Path | None = None,
                                colors: tuple[str, str] = ("black", "white")) -> RenderedPlot:
    """Particles per equal-area bin of viewing direction, rot (°) across, tilt (°) down, with a colour bar (bins
    drawn at their true tilt edges, so equal-area bins look taller near the poles); any thread."""
    fg, bg = colors
    with _DRAW_LOCK:
        figure, _ = _figure(colors)
        figure.subplots_adjust(left=0.15, right=0.98, bottom=0.16, top=0.9)
        ax = figure.add_subplot(111)
        _style(ax, fg, bg)
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
        cbar = figure.colorbar(mesh, ax=ax)
        cbar.set_label("particles", color=fg)
        cbar.ax.tick_params(colors=fg)
        return RenderedPlot(_draw(figure), figure, ax, cbar)


def theme_colors(viewer: Any) -> tuple[str, str]:
    """(foreground, background) colours of the viewer's theme, so that plots match the dark/light UI."""
    try:
        theme = get_theme(viewer.theme)
        return theme.text.as_hex(), theme.background.as_hex()
    except Exception:  # noqa: BLE001 - cosmetic only
        return "black", "white"


class _ImageLabel(QLabel):
    """Shows an image scaled to its size, keeping the aspect ratio (smooth scaling)."""

    def __init__(self) -> None:
        super().__init__()
        self._pixmap: QPixmap | None = None
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Ignored)
        self.setMinimumSize(200, 110)  # three result docks and the Jobs dock stacked must fit a 768 px screen

    def set_message(self, text: str) -> None:
        """No image: ``text`` instead (a plot cleared for another job)."""
        self._pixmap = None
        self.clear()
        self.setWordWrap(True)
        self.setText(text)

    def set_image(self, rgba: np.ndarray) -> None:
        self.setText("")
        h, w = rgba.shape[:2]
        data = np.ascontiguousarray(rgba)
        image = QImage(data.data, w, h, 4 * w, QImage.Format.Format_RGBA8888).copy()  # owns its pixels
        self._pixmap = QPixmap.fromImage(image)
        self._rescale()

    def _rescale(self) -> None:
        if self._pixmap is not None:
            self.setPixmap(self._pixmap.scaled(self.size(), Qt.AspectRatioMode.KeepAspectRatio,
                                               Qt.TransformationMode.SmoothTransformation))

    def resizeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self._rescale()

    def sizeHint(self):  # noqa: N802 - Qt's name
        from qtpy.QtCore import QSize

        return QSize(*PLOT_SIZE_PX) * 0.7


def _image_dock(object_name: str) -> tuple[QWidget, _ImageLabel]:
    widget = QWidget()
    widget.setObjectName(object_name)
    label = _ImageLabel()
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(label)
    return widget, label


class FscPlot:
    """The FSC dock. :meth:`show` takes a figure rendered elsewhere (:func:`render_fsc`); :meth:`update` renders
    one here (for callers outside a job)."""

    def __init__(self, viewer: napari.viewer.Viewer):
        self.widget, self._label = _image_dock("gpu_relion_fsc_plot")
        self.colors = theme_colors(viewer)
        self.figure: Any = None
        self.axes: Any = None
        self.last_event: FscUpdated | None = None
        self.source = ""  # the job the curves belong to ("Refine3D/job012"; "" unknown)
        self.message = ""  # shown instead of curves after clear()
        self.draw_count = 0

    def update(self, event: FscUpdated, rendered: RenderedPlot | None = None, source: str = "") -> None:
        rendered = rendered or render_fsc(event, self.colors, source)
        self._label.set_image(rendered.image)
        self.figure, self.axes = rendered.figure, rendered.axes
        self.last_event, self.source, self.message = event, source, ""
        self.widget.setToolTip(f"FSC of {source}" if source else "FSC")
        self.draw_count += 1

    def clear(self, source: str) -> None:
        """No curves: the job ``source`` is shown now and has none yet (the former job's are gone)."""
        self._label.set_message(f"FSC of {source}: none yet" if source else "FSC: none yet")
        self.figure = self.axes = self.last_event = None
        self.source, self.message = source, self._label.text()
        self.widget.setToolTip(self.message)


class AngularDistributionPlot:
    """The angular distribution dock; :meth:`update` shows a histogram (rendered here unless given)."""

    def __init__(self, viewer: napari.viewer.Viewer):
        self.widget, self._label = _image_dock("gpu_relion_angular_distribution")
        self.colors = theme_colors(viewer)
        self.figure: Any = None
        self.axes: Any = None
        self.colorbar: Any = None
        self.histogram: AngularHistogram | None = None
        self.source: Path | None = None
        self.message = ""
        self.draw_count = 0

    def clear(self, job: str) -> None:
        """No histogram: the job ``job`` is shown now and has none yet."""
        self._label.set_message(f"Angular distribution of {job}: none yet" if job else "No angular distribution")
        self.figure = self.axes = self.colorbar = self.histogram = self.source = None
        self.message = self._label.text()

    def update(self, hist: AngularHistogram, source: Path | None = None,
               rendered: RenderedPlot | None = None) -> None:
        rendered = rendered or render_angular_distribution(hist, source, self.colors)
        self.message = ""
        self._label.set_image(rendered.image)
        self.figure, self.axes, self.colorbar = rendered.figure, rendered.axes, rendered.colorbar
        self.histogram, self.source = hist, source
        self.draw_count += 1


class FomHistogramView(QWidget):
    """The picking dock's FOM histogram (model: :meth:`PickModel.fom_histogram`), drawn with QPainter (cheap
    enough to follow the threshold slider in the GUI thread): every pick's bin in grey, the shown part of each
    bin in the accent colour, the threshold as a vertical line, the FOM range under the axis."""

    def __init__(self) -> None:
        super().__init__()
        self.setObjectName("gpu_relion_fom_histogram")
        self.setMinimumSize(200, 90)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(110)
        self.histogram: Any = None
        self.draw_count = 0

    def set_histogram(self, hist: Any) -> None:
        """Show ``hist`` (a FomHistogram, or None for "no picks yet")."""
        self.histogram = hist
        self.update()

    def paintEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        from qtpy.QtGui import QColor, QPainter, QPen

        painter = QPainter(self)
        try:
            fg = self.palette().windowText().color()
            w, h = self.width(), self.height()
            text_h = painter.fontMetrics().height()
            left, right, top, bottom = 4, w - 4, 4, h - text_h - 4
            hist = self.histogram
            if hist is None:
                painter.setPen(fg)
                painter.drawText(left, top, right - left, bottom - top, int(Qt.AlignmentFlag.AlignCenter),
                                 "FOM histogram: no picks yet")
                return
            n = hist.n_bins
            peak = max(int(hist.counts.max()), 1)
            bw = (right - left) / n
            for i in range(n):
                x0 = left + i * bw
                for value, color in ((hist.counts[i], QColor(128, 128, 128)), (hist.shown[i], QColor(70, 160, 240))):
                    bh = (bottom - top) * float(value) / peak
                    painter.fillRect(int(x0), int(bottom - bh), max(1, int(bw) - 1), int(bh), color)
            painter.setPen(QPen(fg, 1))
            painter.drawLine(left, bottom, right, bottom)
            if hist.threshold_position is not None:
                x = int(left + hist.threshold_position * (right - left))
                painter.setPen(QPen(QColor(230, 60, 60), 2))
                painter.drawLine(x, top, x, bottom)
            painter.setPen(fg)
            lo, hi = float(hist.edges[0]), float(hist.edges[-1])
            painter.drawText(left, bottom + 2, right - left, text_h, int(Qt.AlignmentFlag.AlignLeft), f"{lo:.3g}")
            painter.drawText(left, bottom + 2, right - left, text_h, int(Qt.AlignmentFlag.AlignRight), f"{hi:.3g}")
            painter.drawText(left, bottom + 2, right - left, text_h, int(Qt.AlignmentFlag.AlignHCenter),
                             "FOM" if hist.threshold_position is None else f"threshold {hist.threshold:.3g}")
        finally:
            painter.end()
            self.draw_count += 1


class ColourBarView(QWidget):
    """A colour bar for a coloured surface (the local resolution): its title with the unit, the colormap from the
    low to the high end of the colour range, and labels under it (locres_model.legend_ticks / tick_label), drawn
    with QPainter. Before :meth:`set_range` it says that nothing is coloured yet."""

    def __init__(self, empty_text: str = "no coloured surface yet") -> None:
        super().__init__()
        self.setObjectName("gpu_relion_colour_bar")
        self.setMinimumSize(200, 60)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(72)
        self.empty_text = empty_text
        self.title = ""
        self.limits: tuple[float, float] | None = None
        self.colours: np.ndarray | None = None  # (n, 3) uint8, low -> high
        self.unit = "Å"
        self.draw_count = 0

    def set_range(self, low: float, high: float, title: str, colours: np.ndarray, unit: str = "Å") -> None:
        """Show the colormap ``colours`` ((n, 3) or (n, 4) in 0..1 or 0..255) over ``low`` .. ``high``."""
        c = np.asarray(colours, dtype=np.float64)[:, :3]
        if c.max() <= 1.0:
            c = c * 255.0
        self.colours = np.clip(np.round(c), 0, 255).astype(np.uint8)
        self.limits, self.title, self.unit = (float(low), float(high)), title, unit
        self.update()

    #: Margin (pixels) left and right of the bar, and the room one label needs.
    MARGIN = 6
    LABEL_ROOM = 70

    def ticks(self, width: int | None = None) -> list[tuple[float, str]]:
        """(position along the bar, 0..1; label) of the labels drawn at ``width`` pixels (default: the widget's):
        as many as fit, 2 to 5, from the low to the high end. [] before :meth:`set_range`."""
        from .locres_model import legend_ticks, tick_label

        if self.limits is None:
            return []
        span = (self.width() if width is None else width) - 2 * self.MARGIN
        values = legend_ticks(*self.limits, int(np.clip(span // self.LABEL_ROOM, 2, 5)))
        last = max(len(values) - 1, 1)
        return [(k / last, tick_label(v, self.unit)) for k, v in enumerate(values)]

    @property
    def labels(self) -> list[str]:
        """The labels under the bar at the widget's width."""
        return [text for _, text in self.ticks()]

    def paintEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        from qtpy.QtGui import QColor, QPainter, QPen

        painter = QPainter(self)
        try:
            fg = self.palette().windowText().color()
            painter.setPen(fg)
            w, h = self.width(), self.height()
            text_h = painter.fontMetrics().height()
            left, right = self.MARGIN, w - self.MARGIN
            if self.limits is None or self.colours is None:
                painter.drawText(0, 0, w, h, int(Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap),
                                 self.empty_text)
                return
            painter.drawText(left, 0, right - left, text_h, int(Qt.AlignmentFlag.AlignLeft), self.title)
            top, bottom = text_h + 2, h - text_h - 6
            n = len(self.colours)
            span = max(right - left, 1)
            for x in range(left, right):
                r, g, b = self.colours[min(n - 1, int((x - left) / span * n))]
                painter.fillRect(x, top, 1, bottom - top, QColor(int(r), int(g), int(b)))
            painter.setPen(QPen(fg, 1))
            painter.drawRect(left, top, right - left - 1, bottom - top)
            ticks = self.ticks(w)
            box_w = self.LABEL_ROOM
            for k, (position, label) in enumerate(ticks):
                x = int(left + (span - 1) * position)
                painter.drawLine(x, bottom, x, bottom + 3)
                first, last = k == 0, k == len(ticks) - 1
                align = (Qt.AlignmentFlag.AlignLeft if first else Qt.AlignmentFlag.AlignRight if last
                         else Qt.AlignmentFlag.AlignHCenter)
                x0 = x if first else x - box_w if last else x - box_w // 2
                painter.drawText(x0, bottom + 4, box_w, text_h, int(align), label)
        finally:
            painter.end()
            self.draw_count += 1

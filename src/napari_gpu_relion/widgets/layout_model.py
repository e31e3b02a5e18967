"""The sizes of the plugin's dock area (no Qt, no napari): how wide the right-hand panel of job docks may be and
how tall its plots, so that napari's canvas keeps the room on a laptop screen (issue 49).

The plugin's docks share one right-hand area (widgets/dock_layout.py places them): the Jobs dock and the job docks
as tabs of one panel, the result plots (FSC, angular distribution) as tabs of one group under it. Its width is
:data:`PANEL_WIDTH` where the window has room, narrowed until the canvas keeps :data:`CANVAS_FRACTION` of the
window's width, never below :data:`PANEL_MIN_WIDTH` (every job dock is usable at that width: nothing of it is cut
off, its labels wrap). The plots get :data:`PLOT_FRACTION` of the area's height (at least :data:`PLOT_MIN_HEIGHT`
pixels), less where the panel above would fall below its minimum height.

The panel's tabs read RELION's job-type names (:func:`tab_title`: "Refine3D", "Class2D", the names of the job
folders the Jobs dock lists), whole, never elided: the dock names ("3D auto-refine", "Particle extraction") elided
to "3D..." and "Pa..." in the 291 px of a 1366 px window, where eight tutorial docks and the Jobs dock share the
tab bar. Tabs that do not fit are reached by the bar's scroll arrows; each tab's tooltip and the title bar above
the dock in front give the dock's full name.
"""

from __future__ import annotations

import math

from .jobs_model import JOB_TYPES

__all__ = ["CANVAS_FRACTION", "PANEL_WIDTH", "PANEL_MIN_WIDTH", "PLOT_FRACTION", "PLOT_MIN_HEIGHT", "panel_width",
           "plot_height", "tab_title"]

#: Least share of the window's width the canvas keeps when the plugin's panel is docked.
CANVAS_FRACTION = 0.55
#: Width (pixels) the panel asks for where the window has room.
PANEL_WIDTH = 360
#: Narrowest (pixels) the panel may be: every job dock is usable at this width.
PANEL_MIN_WIDTH = 260
#: Share of the dock area's height the plot group under the panel gets, where there is room.
PLOT_FRACTION = 0.38
#: Lowest (pixels) the plot group may be.
PLOT_MIN_HEIGHT = 150


def panel_width(window_width: int, canvas_width: int, current_width: int, *, preferred: int = PANEL_WIDTH,
                minimum: int = PANEL_MIN_WIDTH, fraction: float = CANVAS_FRACTION) -> int:
    """The panel's width so that the canvas keeps ``fraction`` of the window: what the panel gives up, the canvas
    gains (the other docks keep their widths). At most ``preferred``, at least ``minimum`` (then the canvas may
    keep less)."""
    room = current_width + canvas_width - math.ceil(fraction * window_width)
    return int(max(minimum, min(preferred, room)))


def plot_height(area_height: int, panel_minimum: int, *, fraction: float = PLOT_FRACTION,
                minimum: int = PLOT_MIN_HEIGHT) -> int:
    """The plot group's height in a dock area ``area_height`` pixels tall whose panel needs ``panel_minimum``:
    ``fraction`` of the area, at least ``minimum``, less (not below ``minimum``) where the panel needs the room."""
    preferred = max(minimum, round(fraction * area_height))
    return int(max(minimum, min(preferred, area_height - panel_minimum)))


def tab_title(job: str) -> str:
    """The panel's tab of job ``job`` ("refine3d"): RELION's job type ("Refine3D", as its job folders are named);
    a job without one in jobs_model.JOB_TYPES its name's words run together ("ctf_refine" -> "CtfRefine")."""
    return JOB_TYPES.get(job) or "".join(word[:1].upper() + word[1:] for word in job.split("_"))

"""Dock widget "Auto-picking" (napari.yaml): the generic job widget of jobs.autopick. Each micrograph's picks
arrive as MicrographPicked (one Points layer over the micrographs, FOM in features)
(widgets/display.py)."""

from ..jobs import autopick
from .job_widget import job_widget_class

widget = job_widget_class(autopick)

"""Dock widget "3D classification" (napari.yaml): the generic job widget of jobs.class3d. Each iteration's class
maps arrive as MapUpdated (one volume layer per class, updated in place)
(widgets/display.py)."""

from ..jobs import class3d
from .job_widget import job_widget_class

widget = job_widget_class(class3d)

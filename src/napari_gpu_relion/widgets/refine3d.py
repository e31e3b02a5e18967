"""Dock widget "3D auto-refine" (napari.yaml): the generic job widget of jobs.refine3d. Each iteration's half
maps arrive as MapUpdated (updated in place) and the FSC as FscUpdated (widgets/display.py)."""

from ..jobs import refine3d
from .job_widget import job_widget_class

widget = job_widget_class(refine3d)

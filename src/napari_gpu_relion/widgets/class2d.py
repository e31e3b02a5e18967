"""Dock widget "2D classification" (napari.yaml): the generic job widget of jobs.class2d. Each iteration's class
averages arrive as ClassAveragesUpdated and are shown as one labelled grid, largest class first
(widgets/display.py)."""

from ..jobs import class2d
from .job_widget import job_widget_class

widget = job_widget_class(class2d)

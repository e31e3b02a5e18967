"""Dock widget "Class selection" (napari.yaml): the generic job widget of jobs.select (by class numbers or the
model's class table). The clickable class grid of 2D classification will call the same select_particles."""

from ..jobs import select
from .job_widget import job_widget_class

widget = job_widget_class(select)

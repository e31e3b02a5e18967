"""Dock widget "3D initial model" (napari.yaml): the generic job widget of jobs.initial_model. Every iteration's
class map arrives as MapUpdated (one surface layer per class, updated in place; widgets/display.py), so the map
is seen forming from the first blob."""

from ..jobs import initial_model
from .job_widget import job_widget_class

widget = job_widget_class(initial_model)

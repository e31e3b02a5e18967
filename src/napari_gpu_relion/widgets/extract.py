"""Dock widget "Particle extraction" (napari.yaml): the generic job widget of jobs.extract. Writes the particle
stacks and particles STAR; progress per micrograph
(widgets/display.py)."""

from ..jobs import extract
from .job_widget import job_widget_class

widget = job_widget_class(extract)

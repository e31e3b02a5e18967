"""Dock widget "Reconstruct" (napari.yaml): the generic job widget of jobs.reconstruct.

``widget(viewer)`` builds it; it is a class so that napari passes the viewer when it docks it.
"""

from ..jobs import reconstruct
from .job_widget import job_widget_class

widget = job_widget_class(reconstruct)

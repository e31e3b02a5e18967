"""Dock widget "Post-process" (napari.yaml): the generic job widget of jobs.postprocess.

``widget(viewer)`` builds it; it is a class so that napari passes the viewer when it docks it.
"""

from ..jobs import postprocess
from .job_widget import job_widget_class

widget = job_widget_class(postprocess)

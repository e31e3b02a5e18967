"""Dock widget "Mask creation" (napari.yaml): the generic job widget of jobs.mask_create.

``widget(viewer)`` builds it; it is a class so that napari passes the viewer when it docks it.
"""

from ..jobs import mask_create
from .job_widget import job_widget_class

widget = job_widget_class(mask_create)

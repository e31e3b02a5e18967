"""One object per napari viewer (the live display, the folder follower), kept only while the viewer lives."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def one_per_viewer(instances: dict[int, tuple[weakref.ref, T]], viewer: Any, make: Callable[[Any], T]) -> T:
    """The object ``instances`` holds for ``viewer`` (napari's PublicOnlyProxy unwrapped), made with
    ``make(viewer)`` the first time; entries of viewers that are gone are dropped (ids can be reused)."""
    real = getattr(viewer, "__wrapped__", viewer)
    for key, (ref, _) in list(instances.items()):
        if ref() is None:
            del instances[key]
    entry = instances.get(id(real))
    if entry is not None and entry[0]() is real:
        return entry[1]
    obj = make(real)
    instances[id(real)] = (weakref.ref(real), obj)
    return obj

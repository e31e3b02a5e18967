"""Cancel points: a front end asks a job running in one of its threads to stop; the job (and the compute
functions it calls, which take a plain ``check_cancel`` callable) raise JobCancelled at the next cancel point.
A cancel point never lies inside the writing of a file, so what a job already wrote stays complete."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from .errors import JobCancelled

_cancel = threading.local()


@contextlib.contextmanager
def cancel_scope(is_cancelled: Callable[[], bool]) -> Iterator[None]:
    """While the block runs, :func:`check_cancel` called in this thread raises JobCancelled once
    ``is_cancelled()`` is true (the widgets' job runner wraps every job it runs in one)."""
    previous = getattr(_cancel, "is_cancelled", None)
    _cancel.is_cancelled = is_cancelled
    try:
        yield
    finally:
        _cancel.is_cancelled = previous


def check_cancel() -> None:
    """A cancel point: raise JobCancelled if the front end running this job in this thread asked it to stop
    (a no-op outside a :func:`cancel_scope`, e.g. on the command line). Cheap enough to call per chunk."""
    is_cancelled = getattr(_cancel, "is_cancelled", None)
    if is_cancelled is not None and is_cancelled():
        raise JobCancelled("cancelled")


def bound_check() -> Callable[[], None]:
    """check_cancel bound to this thread's cancel scope: a cancel point that also works when called from other
    threads (the NumPy path's chunks run in a pool, compute/host_threads)."""
    is_cancelled = getattr(_cancel, "is_cancelled", None)

    def check() -> None:
        if is_cancelled is not None and is_cancelled():
            raise JobCancelled("cancelled")

    return check

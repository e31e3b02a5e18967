"""A job's output files written by one background thread, in the order they were handed over.

An EM iteration writes maps, model, data and optimiser STARs (0.5 s of a 3.2 s box-256 iteration on the H100
machine, issue 15) while the next iteration could already compute. The job hands each write to the queue with
arrays that nothing changes afterwards (its own copies) and goes on; one worker thread writes them one after the
other, so the optimiser STAR, handed over last, still appears only after the files it names. Each write is atomic
(io/atomic.py). A failed write is raised, with its own message, in the job's thread at the next ``put`` or at
``drain``; ``drain`` (the end of a job, a cancel, an error) returns only when everything handed over is on disk,
so a job never reports itself finished, or stops, before its files are whole.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class WriteQueue:
    """Writes handed over with ``put(fn, *args)`` run on one worker thread, in order."""

    def __init__(self, name: str = "file writer"):
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._name = name

    def put(self, fn: Callable, *args, **kwargs) -> None:
        """Hand over ``fn(*args, **kwargs)``; first raises the error of an earlier write, if one failed."""
        self._raise_error()
        if self._thread is None:
            # a daemon: a job abandoned without its drain must not keep the interpreter from exiting (each write is
            # atomic, so one cut short leaves the old file or none, never a partial one)
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((fn, args, kwargs))

    def drain(self) -> None:
        """Wait until every write handed over is done; raise the first error of one that failed."""
        if self._thread is not None:
            self._jobs.join()
        self._raise_error()

    def close(self) -> None:
        """drain, then stop the worker thread."""
        try:
            self.drain()
        finally:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread.join()
                self._thread = None

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure the rest is skipped: the job stops at its next put
                    fn, args, kwargs = item
                    fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - handed to the job's thread
                self._error = err
            finally:
                self._jobs.task_done()

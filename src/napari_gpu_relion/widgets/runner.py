"""Run job generators in background threads and hand their events to the GUI thread.

A job is any callable returning an iterator of :mod:`~napari_gpu_relion.events` (``job.run(params)``).
:class:`JobRunner` wraps it in a napari generator worker and:

* dispatches each event to callbacks registered per event type, in the GUI thread (queued Qt signals);
* cancels within a second or two: ``Job.cancel()`` sets a flag that the wrapper checks after every event the job
  yields, and that the job's own cancel points check inside its long loops (the job runs in
  :func:`~napari_gpu_relion.jobs.common.cancel_scope`; ``check_cancel()`` raises JobCancelled inside the
  E-step's chunks, between micrographs, ...); the job generator is then closed in the worker thread, so the
  job's ``finally`` clean-up runs there, and ``worker.quit()`` is called; files a job already wrote stay valid
  (jobs write atomically, and no cancel point lies inside the writing of a file);
* turns ``RuntimeError`` (CuPy's CUDA and cuFFT errors are RuntimeErrors, which superqt would swallow from
  generator workers, leaving the UI "running" forever) into :class:`JobError`, connects ``errored`` itself,
  and reports every failure with ``show_error`` and a persistent status line;
* runs one job at a time per device: a job submitted while another runs waits in a FIFO queue and starts
  when the previous one finishes (use :func:`get_runner` to share the runner of a device);
* applies back-pressure: at most ``max_in_flight`` events wait for the GUI; a job producing events faster
  than the GUI can display them is paused in its thread, and bursts of Progress events are thinned (the
  latest is always delivered), so the viewer stays responsive;
* freezes the garbage collector's view of the objects that exist when a job starts (``gc.freeze()``, undone
  when the last job ends): a full collection over napari's hundreds of thousands of long-lived objects
  stalls the GUI for 0.1-0.2 s, while the job's own garbage is still collected normally.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from napari.qt.threading import GeneratorWorker, create_worker
from napari.utils.notifications import show_error
from qtpy.QtCore import QTimer
from qtpy.QtWidgets import QApplication

from ..cancel import cancel_scope
from ..errors import InputError, JobCancelled, os_error_line
from ..events import Finished, IterationFinished, Message, Progress, Started

__all__ = ["JobError", "JobState", "Job", "JobRunner", "get_runner", "close_all_runners", "error_message", "frozen_gc",
           "note_gui_busy", "wait_after_collection"]

log = logging.getLogger(__name__)

EventCallback = Callable[[Any], None]


class JobError(Exception):
    """A job failed with an error that superqt would otherwise swallow (RuntimeError, e.g. CUDA errors)."""


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


_DONE = (JobState.FINISHED, JobState.CANCELLED, JobState.FAILED)


#: Modules that napari imports on the GUI thread the first time a job's result is shown (the 3D camera's
#: scipy.spatial.transform when a map turns the view to 3D: 0.3 s of the event loop on a busy 2-core machine,
#: benchmarks/event_loop.py --load); imported in the job's worker thread first.
GUI_IMPORTS = ("scipy.spatial.transform", "scipy.ndimage")


def warm_gui_imports() -> None:
    """Import GUI_IMPORTS here (a worker thread), so that the GUI thread finds them loaded."""
    import importlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    for name in GUI_IMPORTS:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def error_message(exc: BaseException) -> str:
    """What a user reads: the message of our own errors, one line naming the path(s) for an operating-system
    error (read-only folder, full disk, a file where a folder should be), type and message of anything else."""
    if isinstance(exc, InputError | JobError):
        return str(exc)
    if isinstance(exc, OSError):
        return os_error_line(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _guarded(events: Iterable[Any]) -> Iterator[Any]:
    """Re-yield ``events``; a RuntimeError becomes a JobError so that the worker reports it."""
    try:
        yield from events
    except RuntimeError as exc:
        raise JobError(f"{type(exc).__name__}: {exc}") from exc


class _JobWorker(GeneratorWorker):
    """A napari generator worker that closes its generator in the worker thread when it stops.

    After ``quit()`` superqt stops calling the generator but keeps it; closing it here runs the job's
    ``finally`` blocks (free GPU memory, close files) in the worker thread rather than at garbage collection.
    """

    def work(self):  # noqa: D102 - see the class docstring
        try:
            return super().work()
        finally:
            try:
                self._gen.close()
            except Exception:  # noqa: BLE001 - clean-up of an already stopped job must not mask its result
                log.exception("error while closing a stopped job")


_job_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One submitted job: its event source, its callbacks and its state (read it in the GUI thread)."""

    name: str
    factory: Callable[[], Iterable[Any]]
    runner: JobRunner
    handlers: dict[type, list[EventCallback]] = field(default_factory=dict)
    state_callbacks: list[Callable[[Job], None]] = field(default_factory=list)
    state: JobState = JobState.QUEUED
    error: BaseException | None = None
    worker: GeneratorWorker | None = None
    last_progress: Progress | None = None
    #: Called in the worker thread on every event before it goes to the GUI (display preparation).
    prepare: Callable[[Any], Any] | None = None
    id: int = field(default_factory=lambda: next(_job_ids))
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _slots: threading.Semaphore | None = field(default=None, repr=False)
    _froze_gc: bool = field(default=False, repr=False)

    @property
    def done(self) -> bool:
        return self.state in _DONE

    @property
    def running(self) -> bool:
        return self.state in (JobState.RUNNING, JobState.CANCELLING)

    @property
    def cancel_requested(self) -> bool:
        """Cancel asked for: by :meth:`cancel`, or by ``worker.quit()`` (napari's task list, window close)."""
        if self._cancel.is_set():
            return True
        worker = self.worker
        return worker is not None and bool(worker.abort_requested)

    def cancel(self) -> None:
        """Stop this job at its next event (or drop it from the queue if it has not started)."""
        self.runner.cancel(self)

    def on(self, event_type: type, callback: EventCallback) -> Job:
        """Call ``callback(event)`` in the GUI thread for every event of ``event_type`` (subclasses too)."""
        self.handlers.setdefault(event_type, []).append(callback)
        return self


class JobRunner:
    """Runs jobs of one device, one at a time, in background threads (see the module docstring).

    Parameters
    ----------
    device:
        A name for the device the jobs use ("default", "gpu0", ...): only used in messages.
    max_in_flight:
        Events a job may have yielded that the GUI has not handled yet before the job waits.
    progress_interval:
        Minimum seconds between two Progress events sent to the GUI (the last one is always sent).
    freeze_gc:
        ``gc.freeze()`` while this runner's jobs run (see the module docstring).
    """

    def __init__(self, device: str = "default", *, max_in_flight: int = 4, progress_interval: float = 0.03,
                 freeze_gc: bool = True):
        self.device = device
        self.freeze_gc = freeze_gc
        self.max_in_flight = max(1, int(max_in_flight))
        self.progress_interval = float(progress_interval)
        self._queue: deque[Job] = deque()
        self._current: Job | None = None
        self._workers: list[GeneratorWorker] = []  # references kept until the worker finished
        self._handlers: dict[type, list[EventCallback]] = {}
        self.status: str = "idle"
        self.status_callbacks: list[Callable[[str], None]] = []

    # -- public API --------------------------------------------------------------------------------------

    @property
    def current(self) -> Job | None:
        """The job running now (or being cancelled), if any."""
        return self._current

    @property
    def queued(self) -> list[Job]:
        """Jobs waiting to start, in order."""
        return list(self._queue)

    @property
    def busy(self) -> bool:
        return self._current is not None or bool(self._queue)

    def on(self, event_type: type, callback: EventCallback) -> None:
        """Call ``callback(event)`` for events of ``event_type`` of every job of this runner."""
        self._handlers.setdefault(event_type, []).append(callback)

    def submit(self, name: str, factory: Callable[[], Iterable[Any]], *,
               handlers: dict[type, EventCallback | list[EventCallback]] | None = None,
               on_state: Callable[[Job], None] | None = None,
               prepare: Callable[[Any], Any] | None = None) -> Job:
        """Queue ``factory()`` (called in the worker thread, returns the event iterator); start it if idle.

        ``handlers`` maps event types to callbacks; ``on_state(job)`` is called on every state change;
        ``prepare(event)`` runs in the worker thread on every event and returns what the handlers get (heavy
        display work: binning maps, iso levels, composing class grids). Returns the Job (cancel it with
        ``job.cancel()``).
        """
        job = Job(name=name, factory=factory, runner=self, prepare=prepare)
        for etype, cbs in (handlers or {}).items():
            for cb in cbs if isinstance(cbs, list | tuple) else [cbs]:
                job.on(etype, cb)
        if on_state is not None:
            job.state_callbacks.append(on_state)
        self._queue.append(job)
        if self._current is None:
            self._start_next()
        else:
            self._set_status(f"{name}: queued after {self._current.name} on {self.device}")
            self._notify_state(job)
        return job

    def cancel(self, job: Job | None = None) -> None:
        """Cancel ``job`` (default: the running one). A queued job is removed without running."""
        job = job or self._current
        if job is None or job.done:
            return
        if job in self._queue:
            self._queue.remove(job)
            self._set_state(job, JobState.CANCELLED)
            self._set_status(f"{job.name}: cancelled before it started")
            return
        if job is self._current and job.state is JobState.RUNNING:
            job._cancel.set()
            if job.worker is not None:
                job.worker.quit()
            self._set_state(job, JobState.CANCELLING)
            self._set_status(f"{job.name}: cancelling (stops at the next step)")

    def cancel_all(self) -> None:
        """Empty the queue and cancel the running job."""
        for job in list(self._queue):
            self.cancel(job)
        self.cancel()

    def close(self, timeout: float = 10.0) -> bool:
        """Cancel everything and wait (up to ``timeout`` s) for the worker thread to stop; True if it did."""
        self.cancel_all()
        deadline = time.monotonic() + timeout
        while any(w.is_running for w in self._workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        return not any(w.is_running for w in self._workers)

    def wait(self, job: Job | None = None, timeout: float = 60.0) -> bool:
        """Process Qt events until ``job`` (default: all jobs) is done; True if it finished in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (job.done if job is not None else not self.busy):
                return True
            QApplication.processEvents()
            time.sleep(0.002)
        return job.done if job is not None else not self.busy

    # -- internals (GUI thread) ---------------------------------------------------------------------------

    def _start_next(self) -> None:
        while self._queue and self._current is None:
            job = self._queue.popleft()
            try:
                self._start(job)
            except Exception as exc:  # noqa: BLE001 - a job that cannot even start is reported like a failure
                self._current = None
                self._fail(job, exc)

    def _start(self, job: Job) -> None:
        if self.freeze_gc:
            _gc_freeze()
            job._froze_gc = True
        job._slots = threading.Semaphore(self.max_in_flight)
        worker = create_worker(self._events, job, _worker_class=_JobWorker, _start_thread=False,
                               _ignore_errors=True)
        job.worker = worker
        worker.yielded.connect(lambda ev, j=job: self._dispatch(j, ev))
        worker.errored.connect(lambda exc, j=job: self._on_errored(j, exc))
        worker.finished.connect(lambda j=job, w=worker: self._on_finished(j, w))
        self._workers.append(worker)
        self._current = job
        self._set_state(job, JobState.RUNNING)
        self._set_status(f"{job.name}: starting on {self.device}")
        worker.start()

    def _events(self, job: Job) -> Iterator[Any]:
        """The generator run in the worker thread: guarded, cancellable (the job's cancel points raise
        JobCancelled once Cancel was asked for), throttled, with back-pressure."""
        warm_gui_imports()
        with cancel_scope(lambda: job.cancel_requested):
            yield from self._cancellable_events(job)

    def _cancellable_events(self, job: Job) -> Iterator[Any]:
        slots = job._slots
        assert slots is not None
        interval = self.progress_interval
        last_sent = 0.0
        pending: Progress | None = None
        gen = iter(job.factory())
        try:
            for ev in _guarded(gen):
                if job.cancel_requested:
                    return
                if isinstance(ev, Progress) and ev.done < ev.total:
                    now = time.monotonic()
                    if now - last_sent < interval:
                        pending = ev
                        continue
                    last_sent, pending = now, None
                elif pending is not None:
                    if not self._acquire(job):
                        return
                    yield pending
                    pending = None
                if not self._acquire(job):
                    return
                yield self._prepared(job, ev)
            if pending is not None and not job.cancel_requested and self._acquire(job):
                yield pending
        except JobCancelled:
            job._cancel.set()
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    @staticmethod
    def _prepared(job: Job, event: Any) -> Any:
        """``job.prepare(event)`` (worker thread); the event itself if there is none or it fails."""
        if job.prepare is None:
            return event
        try:
            return job.prepare(event)
        except Exception:  # noqa: BLE001 - a display problem must not stop the job; the GUI prepares it then
            log.exception("could not prepare %s of job %s for display", type(event).__name__, job.name)
            return event

    def _acquire(self, job: Job) -> bool:
        """Wait (in the worker thread) for a free event slot; False if the job was cancelled meanwhile."""
        slots = job._slots
        assert slots is not None
        while not slots.acquire(timeout=0.05):
            if job.cancel_requested:
                return False
        return not job.cancel_requested

    def _dispatch(self, job: Job, event: Any) -> None:
        try:
            if job is not self._current or job.cancel_requested:
                return  # a cancelled job's late events are dropped
            if isinstance(event, Progress):
                job.last_progress = event
            self._status_from_event(job, event)
            callbacks: list[EventCallback] = []
            for etype in type(event).__mro__:
                callbacks.extend(self._handlers.get(etype, ()))
                callbacks.extend(job.handlers.get(etype, ()))
            for cb in callbacks:
                try:
                    cb(event)
                except Exception as exc:  # noqa: BLE001 - a display bug must not kill the job or the GUI
                    log.exception("error handling %s of job %s", type(event).__name__, job.name)
                    show_error(f"{job.name}: could not display {type(event).__name__}: {error_message(exc)}")
        finally:
            if job._slots is not None:
                job._slots.release()

    def _status_from_event(self, job: Job, event: Any) -> None:
        if isinstance(event, Started):
            extra = f" ({event.message})" if event.message else ""
            self._set_status(f"{job.name}: running on {event.backend}{extra}")
        elif isinstance(event, Progress):
            stage = f"{event.stage} " if event.stage else ""
            self._set_status(f"{job.name}: {stage}{event.done}/{event.total}")
        elif isinstance(event, Message):
            self._set_status(f"{job.name}: {event.text}")
        elif isinstance(event, IterationFinished) and event.summary:
            self._set_status(f"{job.name}: iteration {event.iteration}: {event.summary}")
        elif isinstance(event, Finished):
            self._set_status(f"{job.name}: finished" + (f": {event.summary}" if event.summary else ""))

    def _on_errored(self, job: Job, exc: BaseException) -> None:
        if isinstance(exc, JobCancelled):
            return
        job.error = exc
        log.error("job %s failed", job.name, exc_info=(type(exc), exc, exc.__traceback__))

    def _on_finished(self, job: Job, worker: GeneratorWorker) -> None:
        if job._froze_gc:
            job._froze_gc = False
            _gc_unfreeze()
        if worker in self._workers:
            self._workers.remove(worker)
        if self._current is job:
            self._current = None
        if job.error is not None:
            self._fail(job, job.error)
        elif job._cancel.is_set() or worker.abort_requested:  # our Cancel, or napari's task list
            job._cancel.set()
            self._set_state(job, JobState.CANCELLED)
            self._set_status(f"{job.name}: cancelled")
        else:
            self._set_state(job, JobState.FINISHED)
            if not self.status.startswith(f"{job.name}: finished"):
                self._set_status(f"{job.name}: finished")
        self._start_next()

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.error = exc
        message = f"{job.name} failed: {error_message(exc)}"
        self._set_state(job, JobState.FAILED)
        self._set_status(message)
        show_error(message)

    def _set_state(self, job: Job, state: JobState) -> None:
        job.state = state
        self._notify_state(job)

    def _notify_state(self, job: Job) -> None:
        for cb in list(job.state_callbacks):
            try:
                cb(job)
            except Exception:  # noqa: BLE001
                log.exception("error in a state callback of job %s", job.name)

    def _set_status(self, text: str) -> None:
        self.status = text
        for cb in list(self.status_callbacks):
            try:
                cb(text)
            except Exception:  # noqa: BLE001
                log.exception("error in a status callback")


_gc_depth = 0
_gc_threshold: tuple[int, ...] | None = None
_gc_timer: Any = None
_gui_busy_until = 0.0
_collected_at = 0.0
_gc_put_off_since: float | None = None

#: While jobs run, full collections run on the GUI thread every this many seconds, in an event-loop turn of their
#: own (s).
GC_INTERVAL = 0.25
#: A collection waits this long after the display's last update, and the display this long after a collection,
#: so that the two never follow each other in one stall (s).
GC_GAP_AFTER_UPDATE = 0.06
#: A collection put off by display updates in a row waits at most this long (s).
GC_MAX_DELAY = 1.0
_NO_AUTOMATIC_FULL_COLLECTION = 1 << 30


def _gc_freeze() -> None:
    """Move all objects alive now out of the collector's reach while jobs run (nested, GUI thread only), and
    take full collections out of CPython's hands: the viewer's updates leave tens of thousands of objects in
    reference cycles per second, and an automatic full collection frees them wherever it happens to start, on
    top of a display update (20-90 ms more on a 2-core machine). Here a GUI timer looks every ``GC_INTERVAL``
    and makes the collection CPython would have made, in an event-loop turn of its own, not right after a
    display update (see :func:`note_gui_busy`, :func:`_collect_turn`). Young collections stay automatic."""
    global _gc_depth, _gc_threshold, _gc_timer
    if _gc_depth == 0:
        gc.freeze()
        _gc_threshold = gc.get_threshold()
        gc.set_threshold(_gc_threshold[0], _gc_threshold[1], _NO_AUTOMATIC_FULL_COLLECTION)
        if _gc_timer is None and QApplication.instance() is not None:
            _gc_timer = QTimer()
            _gc_timer.setSingleShot(True)
            _gc_timer.timeout.connect(_collect_turn)
        if _gc_timer is not None:
            _gc_timer.start(int(GC_INTERVAL * 1000))
    _gc_depth += 1


def _gc_unfreeze() -> None:
    global _gc_depth, _gc_threshold, _gc_put_off_since
    _gc_depth = max(0, _gc_depth - 1)
    if _gc_depth == 0:
        if _gc_timer is not None:
            _gc_timer.stop()
        _gc_put_off_since = None
        if _gc_threshold is not None:
            gc.set_threshold(*_gc_threshold)
            _gc_threshold = None
        gc.unfreeze()


def note_gui_busy(seconds: float = 0.0) -> None:
    """Tell the collector that the GUI thread has just done (or is about to do, for ``seconds``) heavy work: the
    next full collection waits ``GC_GAP_AFTER_UPDATE`` after it."""
    global _gui_busy_until
    _gui_busy_until = max(_gui_busy_until, time.monotonic() + seconds)


def _collect_turn() -> None:
    """The timer's turn: a full collection of the objects made since the jobs started (the rest are frozen) when
    CPython's own rule with a last threshold of 1 would have made one by now (a middle-generation collection since
    the last full one), unless the display has just updated, then a little later; but never later than
    ``GC_MAX_DELAY`` after it was first put off (display updates in a row must not starve it)."""
    global _collected_at, _gc_put_off_since
    if _gc_depth == 0 or _gc_timer is None:
        return
    now = time.monotonic()
    wait = _gui_busy_until + GC_GAP_AFTER_UPDATE - now
    if wait > 0:
        if _gc_put_off_since is None:
            _gc_put_off_since = now
        if now - _gc_put_off_since < GC_MAX_DELAY:
            _gc_timer.start(max(1, int(min(wait, GC_MAX_DELAY - (now - _gc_put_off_since)) * 1000)))
            return
    _gc_put_off_since = None
    if gc.get_count()[2] > 0:  # a middle-generation collection since the last full one: CPython would collect now
        gc.collect()
        _collected_at = time.monotonic()
    _gc_timer.start(int(GC_INTERVAL * 1000))


def wait_after_collection() -> float:
    """Seconds a display update should still wait so as not to follow the last full collection at once (s)."""
    return max(0.0, _collected_at + GC_GAP_AFTER_UPDATE - time.monotonic())


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """``gc.freeze()`` for the block: napari runs a full ``gc.collect()`` for every layer it removes (0.3 s in a
    viewer with a few layers on a 2-core machine); with the long-lived objects frozen it takes milliseconds, and
    the removed layer's garbage goes with the next ordinary collection."""
    _gc_freeze()
    try:
        yield
    finally:
        _gc_unfreeze()


_runners: dict[str, JobRunner] = {}


def get_runner(device: str = "default") -> JobRunner:
    """The shared runner of ``device``: every widget submitting to it runs its jobs one after another."""
    runner = _runners.get(device)
    if runner is None:
        runner = _runners[device] = JobRunner(device)
        _close_on_quit()
    return runner


def close_all_runners(timeout: float = 10.0) -> None:
    """Cancel all jobs of all shared runners and wait for their threads (called when Qt quits)."""
    for runner in list(_runners.values()):
        runner.close(timeout)


_quit_hooked = False


def _close_on_quit() -> None:
    global _quit_hooked
    if _quit_hooked:
        return
    app = QApplication.instance()
    if app is not None:
        app.aboutToQuit.connect(close_all_runners)
        _quit_hooked = True

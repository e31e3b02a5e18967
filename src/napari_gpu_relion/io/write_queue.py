"""A job's output files written by one background thread, in the order they were handed over.

An EM iteration writes maps, model, data and optimiser STARs (0.5 s of a 3.2 s box-256 iteration on the H100
machine, issue 15) while the next iteration could already compute. The job hands each write to the queue with
arrays that nothing changes afterwards (its own copies) and goes on; one worker thread writes them one after the
other, so the optimiser STAR, handed over last, still appears only after the files it names. Each write is atomic
(io/atomic.py). A failed write is raised, with its own message, in the job's thread at the next ``put`` or at
``drain``; ``drain`` (the end of a job, a cancel, an error) returns only when everything handed over is on disk,
so a job never reports itself finished, or stops, before its files are whole.

With ``helper_process`` the worker thread hands each write to a helper process (started at the first write) and
waits for its answer. Formatting a STAR holds Python's lock (NumPy's casts of numbers to text, pandas' string
methods): a 100,000-row data STAR takes ~1 s of it, during which a job's thread, which launches GPU kernels from
Python, hardly runs (a loop of small NumPy operations ran at 13-17 % of its speed beside such writes on the
2-core VM, at 89-100 % beside the helper's: benchmarks/writer_lock.py). Arrays travel out of band (pickle
protocol 5), without a copy on this side. Where the helper cannot start, or stops, the writes run on the worker
thread, as without it; so does a write whose function or arguments do not pickle.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

#: A job with at least this many particles writes through a helper process (below it a data STAR takes < 0.1 s).
HELPER_FROM_PARTICLES = 10_000
_LEN = struct.Struct("<Q")


class WriteQueue:
    """Writes handed over with ``put(fn, *args)`` run on one worker thread, in order (through a helper process
    with ``helper_process``: ``fn`` then must be a module-level function and the arguments picklable)."""

    def __init__(self, name: str = "file writer", helper_process: bool = False):
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._name = name
        self._want_helper = helper_process
        self._helper: _Helper | None = None
        self.helper_note: str | None = None  # why writes that were to go through the helper ran on the thread

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
        """drain, then stop the worker thread (and the helper process)."""
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

    def _run(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        """One write: through the helper process when there is one, else here."""
        if self._want_helper and self._helper is None and self.helper_note is None:
            try:
                self._helper = _Helper()
            except (OSError, ValueError) as exc:
                self.helper_note = f"the file-writing helper could not start ({exc})"
        if self._helper is not None:
            try:
                self._helper.run(fn, args, kwargs)
                return
            except _CannotTake as why:  # this write on the thread; the helper takes the next ones
                self.helper_note = self.helper_note or str(why)
            except _HelperLost as lost:  # every write from now on on the thread
                self.helper_note = str(lost)
                self._helper.close()
                self._helper = None
        fn(*args, **kwargs)

    def _work(self) -> None:
        try:
            while True:
                item = self._jobs.get()
                try:
                    if item is None:
                        return
                    if self._error is None:  # after a failure the rest is skipped: the job stops at its next put
                        self._run(*item)
                except BaseException as err:  # noqa: BLE001 - handed to the job's thread
                    self._error = err
                finally:
                    self._jobs.task_done()
        finally:
            if self._helper is not None:
                self._helper.close()
                self._helper = None


class _HelperLost(Exception):
    """The helper process stopped before answering."""


class _CannotTake(Exception):
    """A write the helper process cannot take (its function or arguments do not pickle); nothing was sent."""


class _Helper:
    """The helper process (``serve``): each write a framed pickle on its stdin, each answer one on its stdout."""

    def __init__(self):
        self._err = tempfile.TemporaryFile()
        root = str(Path(__file__).resolve().parents[2])  # this package's folder first: the child runs this code
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from napari_gpu_relion.io.write_queue import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        """Run ``fn(*args, **kwargs)`` in the helper; its exception is raised here. _CannotTake when the write
        does not pickle (nothing was sent), _HelperLost when no answer comes back."""
        buffers: list = []
        try:
            head = pickle.dumps((fn, args, kwargs), protocol=5, buffer_callback=buffers.append)
        except Exception as exc:  # noqa: BLE001 - a closure, a lock, ...: written on the thread instead
            raise _CannotTake(f"a write the file-writing helper cannot take ({type(exc).__name__}: {exc})") from exc
        try:
            _send(self._proc.stdin, head, [b.raw() for b in buffers])
            status, value = pickle.loads(_receive(self._proc.stdout)[0])
        except (OSError, EOFError, pickle.UnpicklingError, struct.error) as exc:
            raise _HelperLost(f"the file-writing helper stopped ({self._stderr_tail() or exc})") from exc
        if status != "ok":
            raise value

    def _stderr_tail(self) -> str:
        self._err.seek(0)
        return " / ".join(self._err.read().decode(errors="replace").strip().splitlines()[-3:])

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
        self._err.close()


def _send(fh, head: bytes, buffers: list) -> None:
    """One message: the pickle's length and bytes, the number of out-of-band buffers, each one's length and bytes."""
    fh.write(_LEN.pack(len(head)) + head + _LEN.pack(len(buffers)))
    for b in buffers:
        fh.write(_LEN.pack(b.nbytes))
        fh.write(b)
    fh.flush()


def _read_exactly(fh, n: int) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = fh.readinto(view[got:])
        if not k:
            raise EOFError("the pipe closed")
        got += k
    return out


def _receive(fh) -> tuple[bytes, list]:
    """One message of _send: (pickle bytes, out-of-band buffers)."""
    head = bytes(_read_exactly(fh, _LEN.unpack(_read_exactly(fh, 8))[0]))
    n = _LEN.unpack(_read_exactly(fh, 8))[0]
    return head, [_read_exactly(fh, _LEN.unpack(_read_exactly(fh, 8))[0]) for _ in range(n)]


def serve() -> None:
    """The helper process: run each write read from stdin, answer ("ok", None) or ("error", exception) on stdout,
    until stdin closes. Niced, so that on a machine of few cores the job's own work goes first."""
    if hasattr(os, "nice"):
        os.nice(10)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries the answers only
    while True:
        try:
            head, buffers = _receive(inp)
        except EOFError:
            return
        try:
            fn, args, kwargs = pickle.loads(head, buffers=buffers)
            fn(*args, **kwargs)
            answer = ("ok", None)
        except BaseException as exc:  # noqa: BLE001 - raised again in the job's thread
            answer = ("error", exc)
        try:
            data = pickle.dumps(answer, protocol=5)
            pickle.loads(data)  # what the job's side will do with it
        except Exception:  # noqa: BLE001 - an exception that does not travel: its type and text
            data = pickle.dumps(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")), protocol=5)
        _send(out, data, [])

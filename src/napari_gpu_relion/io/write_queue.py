"""A job's output files written in the background, in the order they were handed over (per lane, below).

An EM iteration writes maps, model, data and optimiser STARs (0.5 s of a 3.2 s box-256 iteration on the H100
machine, issue 15) while the next iteration could already compute. The job hands each write to the queue with
arrays that nothing changes afterwards (its own copies) and goes on; one worker thread writes them one after the
other, so the optimiser STAR, handed over last, still appears only after the files it names. Each write is atomic
(io/atomic.py). A failed write is raised, with its own message, in the job's thread at the next ``put`` or at
``drain``; ``drain`` (the end of a job, a cancel, an error) returns only when everything handed over is on disk,
so a job never reports itself finished, or stops, before its files are whole.

With ``helper_process`` the writes marked ``formats_text`` (the STAR files) go to a helper process (started at the
first one) through a second worker thread, which waits for its answer; the others (MRC files) stay on the first
thread, so the two kinds are written beside each other, each kind in its order (``put_after_all`` for a file
that must come after all the others). Formatting a STAR holds Python's lock (NumPy's casts of numbers to text,
pandas' string methods): a 100,000-row data STAR takes ~1 s of it, during which a job's thread, which launches
GPU kernels from Python, hardly runs (a loop of small NumPy operations ran at 13-17 % of its speed beside such
writes on the 2-core VM, at 89-100 % beside the helper's: benchmarks/writer_lock.py). Arrays travel out of band
(pickle protocol 5), without a copy on this side. Where the helper cannot start, or stops, the writes run on the
worker thread, as without it; so does a write whose function or arguments do not pickle. One iteration's files of
100,000 particles at box 256 (six maps, a data STAR) were whole 2.07-2.31 s after they were handed over on one
thread, 4.0-4.5 s when all went through the helper, 1.46-1.58 s in the two lanes (the 2-core VM).
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

#: A job with at least this many particles writes through a helper process (below it a data STAR takes < 0.1 s).
HELPER_FROM_PARTICLES = 10_000
_LEN = struct.Struct("<Q")


def formats_text(fn: Callable) -> Callable:
    """Mark a module-level write function whose work is mostly Python formatting (a STAR file): a WriteQueue with
    a helper process runs it there. Other writes (an MRC file: NumPy's statistics and one large write, which let
    go of Python's lock) run on a thread of the job's process, beside the helper's, and need no copy through the
    pipe (six box-256 maps took 2.4-2.9 s through it on the 2-core VM, 0.6-1.5 s written here)."""
    fn.formats_text = True
    return fn


class WriteQueue:
    """Writes handed over with ``put(fn, *args)`` run in the order handed over, on one worker thread; with
    ``helper_process`` the ``formats_text`` ones in a helper process (``fn`` then must be a module-level function
    and the arguments picklable) and the others on a second thread, each lane in its own order, the two beside
    each other. ``put_after_all`` runs a write after every write handed over before it, in either lane (an
    optimiser STAR that names the files before it)."""

    def __init__(self, name: str = "file writer", helper_process: bool = False):
        self._name = name
        self._want_helper = helper_process
        self._lanes: dict[str, _Lane] = {}
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # for _error and _skip_below (two lanes and the job's thread)
        self._skip_below = 0  # writes numbered below this are skipped: handed over before a failure was reported
        self._helper: _Helper | None = None
        self.helper_note: str | None = None  # why writes that were to go through the helper ran on the thread
        self.handed = 0  # writes handed over so far (the next one's number)
        self.durations: list[tuple[int, str, float]] = []  # (number, file name, seconds) of each write done

    def put(self, fn: Callable, *args, **kwargs) -> None:
        """Hand over ``fn(*args, **kwargs)``; first raises the error of an earlier write, if one failed."""
        self._hand(fn, args, kwargs, after_all=False)

    def put_after_all(self, fn: Callable, *args, **kwargs) -> None:
        """put, but ``fn`` starts only after every write handed over before it, in both lanes."""
        self._hand(fn, args, kwargs, after_all=True)

    def _hand(self, fn: Callable, args: tuple, kwargs: dict, after_all: bool) -> None:
        self._raise_error()
        mine = self._lane_of(fn)
        marks = []  # after_all: one set by each other lane when it reaches it
        for name, lane in self._lanes.items():
            if after_all and name != mine:
                marks.append(threading.Event())
                lane.jobs.put(marks[-1])
        self._lane(mine).jobs.put((fn, args, kwargs, tuple(marks), self.handed))
        self.handed += 1

    def slowest_since(self, number: int, n: int = 3) -> str:
        """The ``n`` slowest writes numbered ``number`` or later, as 'name 1.20 s, ...' (a job's log: what its
        last iteration's files waited for)."""
        done = sorted((d for d in self.durations if d[0] >= number), key=lambda d: -d[2])[:n]
        return ", ".join(f"{name} {s:.2f} s" for _, name, s in done)

    def pending(self) -> int:
        """Writes handed over and not yet done (all lanes)."""
        return sum(lane.jobs.unfinished_tasks for lane in self._lanes.values())

    def drain(self) -> None:
        """Wait until every write handed over is done; raise the first error of one that failed."""
        for lane in list(self._lanes.values()):
            lane.jobs.join()
        self._raise_error()

    def close(self) -> None:
        """drain, then stop the worker threads (and the helper process)."""
        try:
            self.drain()
        finally:
            for lane in self._lanes.values():
                lane.jobs.put(None)
                lane.thread.join()
            self._lanes = {}
            if self._helper is not None:
                self._helper.close()
                self._helper = None

    def _lane_of(self, fn: Callable) -> str:
        return "helper" if self._want_helper and getattr(fn, "formats_text", False) else "here"

    def _lane(self, name: str) -> _Lane:
        if name not in self._lanes:
            # a daemon: a job abandoned without its drain must not keep the interpreter from exiting (each write is
            # atomic, so one cut short leaves the old file or none, never a partial one)
            jobs: queue.Queue = queue.Queue()
            lane = _Lane(jobs, threading.Thread(target=self._work, args=(jobs, name == "helper"), daemon=True,
                                                name=f"{self._name} ({name})"))
            self._lanes[name] = lane
            lane.thread.start()
        return self._lanes[name]

    def _raise_error(self) -> None:
        """Raise a failed write's error once; every write handed over before now is skipped (in either lane), the
        ones handed over after it run."""
        with self._lock:
            err, self._error = self._error, None
            if err is not None:
                self._skip_below = self.handed
        if err is not None:
            raise err

    def _skipped(self, number: int) -> bool:
        with self._lock:
            return self._error is not None or number < self._skip_below

    def _run(self, fn: Callable, args: tuple, kwargs: dict, through_helper: bool) -> None:
        """One write: through the helper process in the helper lane when there is one, else on this thread."""
        if through_helper and self._helper is None and self.helper_note is None:
            try:
                self._helper = _Helper()
            except (OSError, ValueError) as exc:
                self.helper_note = f"the file-writing helper could not start ({exc})"
        if through_helper and self._helper is not None:
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

    def _work(self, jobs: queue.Queue, through_helper: bool) -> None:
        while True:
            item = jobs.get()
            try:
                if item is None:
                    return
                if isinstance(item, threading.Event):  # another lane's put_after_all: set even after a failure
                    item.set()
                    continue
                fn, args, kwargs, marks, number = item
                for mark in marks:
                    mark.wait()
                if not self._skipped(number):  # after a failure the rest is skipped: the job stops at its next put
                    t = time.monotonic()
                    self._run(fn, args, kwargs, through_helper)
                    paths = [a for a in args if isinstance(a, (str, os.PathLike))]  # the last: a copy's target
                    name = Path(paths[-1]).name if paths else fn.__name__
                    self.durations.append((number, name, time.monotonic() - t))
            except BaseException as err:  # noqa: BLE001 - handed to the job's thread
                with self._lock:
                    self._error = self._error or err
            finally:
                jobs.task_done()


class _Lane(NamedTuple):
    """One worker thread of a WriteQueue and the writes handed to it."""
    jobs: queue.Queue
    thread: threading.Thread


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
        # long STAR loops formatted in processes of the helper's own (io/star.FORMAT_WORKERS_ENV): a quarter of
        # the cores, at most 8 (a data STAR of 100,000 rows took longer than an iteration on two H200s)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env.setdefault("NAPARI_GPU_RELION_FORMAT_WORKERS", str(max(1, min(8, cores // 4))))
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
        """End the helper: its stdin closed, it ends by itself (every write it took was answered: nothing of the
        job's is left in it). Its end (its formatting processes' shutdown: 0.9 s on the 2-core VM) is waited for
        on a thread, not by the job: a job finished once its files were whole, not once the helper had gone."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        threading.Thread(target=self._reap, daemon=True, name="file-writing helper's end").start()

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        finally:
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
    # the writes come from, and the answers go to, copies of the stdin and stdout pipes (descriptors that processes
    # started here do not inherit); descriptors 0 and 1 become /dev/null and stderr before anything starts, so that
    # io/star's formatting processes neither write into the answers nor keep the pipes open after this process
    # dies (the job then sees the pipes' end: _HelperLost, not a hang)
    inp, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
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

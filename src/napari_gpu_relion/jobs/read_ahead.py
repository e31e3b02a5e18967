"""Particle images read from their stacks in background threads, block by block in the order the job will ask for
them, so that the first iteration's disk reading overlaps the job's start and its computing (issue 15: reading
took 0.55 s of a 3.3 s first iteration of a box-128 auto-refine of 5,000 particles on an H100).

The threads read (files to NumPy arrays, with the jobs' value checks) and, once the job's image store is on its
GPU, copy each block there (``then``: the copy is queued on the job's stream, so its work on the block follows
it); the job's own thread puts the blocks into its store (ParticleSet.images). Rows the job asks for
(``request``) in the reader's order within reach (the bound ahead plus as many blocks as the rows would fill) are
left to the threads, which may then read past the bound up to them; rows asked for out of order are the job's to read
(``claim``). A request takes the blocks ready when it came and those its rows are in, not every block the threads
read meanwhile.

Several threads read consecutive blocks at once (the positioned reads and the value checks release Python's
lock): one thread read ~3 GB/s from the page cache on the H200 host, so a rank's 50,000 box-256 images took
4.2-4.6 s of auto-refine's first iteration (issue 47). How far ahead a reader may read is the memory policy's
(runtime.memory.read_ahead_bytes: a share of the host's memory, so that a GPU node reads whole batches ahead).
The blocks are handed over in their order whatever thread read them, as ctf_refine's batches need.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from ..runtime.device import usable_cores

#: Rows per block the reader reads at once.
BLOCK_ROWS = 128
#: Most threads one reader uses (fewer on a machine of few cores: read_threads).
READ_THREADS = 4


def read_threads(ranks_on_host: int = 1) -> int:
    """Reader threads for one rank: READ_THREADS, or fewer so that the ranks of a host together use at most half
    the cores (the job's threads and the other ranks' need the rest); at least one."""
    return max(1, min(READ_THREADS, usable_cores() // (2 * max(1, int(ranks_on_host)))))


class ImageReadAhead:
    """Reads ``read(rows)`` for consecutive blocks of ``order`` (rows of a set of ``n``; blocks of ``block`` rows,
    or the caller's ``blocks``, which split ``order``) in ``threads`` daemon threads, at most ``ahead_blocks``
    blocks beyond the last one taken (more for a ``request``). ``claim(rows)`` hands the rows no thread has started
    to the caller; ``request(rows)`` leaves those within reach to the threads and claims the others;
    ``next(wait)`` gives the next block in order, (rows, images), or None (it is not read yet and ``wait`` is
    false, or the reader ``finished``); with ``then``, (rows, then(images)) (the method then changes it later). An
    error of a thread (InputError for a bad image, OSError, or then's) is raised by the ``next`` call that reaches
    its block, in the caller's thread."""

    def __init__(self, read: Callable[[np.ndarray], np.ndarray], order: np.ndarray, n: int, block: int,
                 ahead_blocks: int, blocks: list[np.ndarray] | None = None, threads: int = 1,
                 then: Callable | None = None):
        self._read = read
        self._ahead = max(2, int(ahead_blocks))
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the row flags and the block counters
        self._ready = threading.Condition(self._lock)  # a block read, a block taken, or a stop
        self._todo = np.zeros(n, dtype=bool)  # nobody has started the row
        self._todo[order] = True
        self._in_flight = np.zeros(n, dtype=bool)  # a thread has started it and the caller not taken it
        self._target = -1  # threads may start every block up to this one, past the bound (a request's rows)
        self._then = then  # applied by the threads to each block they read from now on (the method then)
        self.finished = False
        if blocks is None:  # fixed blocks of ``block`` rows; a caller's own blocks (``order`` split) otherwise
            step = max(1, int(block))
            blocks = [order[i:i + step] for i in range(0, len(order), step)]
        self._blocks = blocks
        self._block_of = np.full(n, -1, dtype=np.int64)  # the block a row of ``order`` is in
        self._block_rows = max(1, -(-len(order) // max(1, len(blocks))))  # rows per block (the caller's: on average)
        for k, rows in enumerate(blocks):
            self._block_of[rows] = k
        self._started = 0  # blocks a thread has started
        self._taken = 0  # blocks handed to the caller (or skipped: every row claimed)
        self._done: dict[int, object] = {}  # block number -> (rows, images), None (nothing to read) or an error
        self._threads = [threading.Thread(target=self._run, name=f"particle images {k}", daemon=True)
                         for k in range(max(1, int(threads)))]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            with self._ready:
                while (not self._stop.is_set() and self._started < len(self._blocks)
                       and self._started - self._taken >= self._ahead and self._started > self._target):
                    self._ready.wait(0.1)
                if self._stop.is_set() or self._started >= len(self._blocks):
                    return
                number, rows, then = self._started, self._blocks[self._started], self._then
                self._started += 1
                mine = rows[self._todo[rows]]
                self._todo[mine] = False
                self._in_flight[mine] = True
            item: object = None
            if mine.size:
                try:
                    data = self._read(mine)
                    item = (mine, data if then is None else then(data))
                except BaseException as exc:  # noqa: BLE001 - handed to the job's thread, which raises it
                    item = exc
            with self._ready:
                if self._stop.is_set():
                    return
                self._done[number] = item
                self._ready.notify_all()
                if isinstance(item, BaseException):
                    self._started = len(self._blocks)  # no thread starts another block
                    return

    def raise_ahead(self, ahead_blocks: int) -> None:
        """Let the threads hold up to ``ahead_blocks`` blocks beyond the last one taken from now on (never fewer than
        now): a job raises the bound once its images have their final store (on the GPU)."""
        with self._ready:
            if int(ahead_blocks) > self._ahead:
                self._ahead = int(ahead_blocks)
                self._ready.notify_all()

    def then(self, step: Callable | None) -> None:
        """From the next block a thread starts on, the thread hands over step(images) instead of the images (the
        upload to the job's GPU, once the job's store is there: ParticleSet.read_ahead); blocks read before keep
        their host arrays."""
        with self._lock:
            self._then = step

    def claim(self, rows: np.ndarray) -> None:
        """The rows of ``rows`` no thread has started become the caller's: the threads skip them."""
        with self._lock:
            self._todo[rows] = False

    def request(self, rows: np.ndarray) -> None:
        """The caller will want ``rows`` next: those no thread has started whose blocks lie within the bound plus
        as many blocks as these rows would fill, counted from the last block taken, are left to the threads, which
        may start every block up to the last of them (the threads read a request in order faster than the caller
        alone: four threads against one); the others (asked out of order, or never the reader's) become the
        caller's."""
        rows = np.asarray(rows, dtype=np.int64)
        with self._ready:
            todo = rows[self._todo[rows]]
            blocks = self._block_of[todo]
            # as many blocks as the rows would fill, not the blocks they touch: a scattered request (the initial
            # model's 1,000 rows touched ~560 of 780 blocks) would let the threads read most of the set
            reach = self._taken + self._ahead + -(-todo.size // self._block_rows)
            near = blocks < reach  # a row still to read is in a block of the order
            self._todo[todo[~near]] = False
            if near.any():
                self._target = max(self._target, int(blocks[near].max()))
                self._ready.notify_all()

    def coming(self, rows: np.ndarray) -> bool:
        """Whether a row of ``rows`` is being read, read and not taken, or left to the threads by ``request``."""
        rows = np.asarray(rows, dtype=np.int64)
        with self._lock:
            left = self._todo[rows] & (self._block_of[rows] <= self._target)  # left to the threads by request
            return bool(self._in_flight[rows].any() or left.any())

    def ready(self) -> int:
        """Blocks read and ready to be taken now, in order (the next ``next`` calls that do not wait)."""
        with self._lock:
            k = self._taken
            while k in self._done:
                k += 1
            return k - self._taken

    def exhausted(self) -> bool:
        """Whether nothing is left for the caller: every row was claimed or taken (the blocks left are empty)."""
        with self._lock:
            return not (self._todo.any() or self._in_flight.any())

    def next(self, wait: bool):
        """The next block read, (rows, images), in the blocks' order; None when it is not read yet and ``wait`` is
        false, or when the reader has finished. Raises a thread's error."""
        with self._ready:
            while not self.finished:
                if self._taken >= len(self._blocks):
                    self.finished = True
                    break
                if self._taken not in self._done:
                    if not wait or self._stop.is_set():
                        return None
                    if not self.alive:  # every thread ended without handing this block over
                        self.finished = True
                        raise RuntimeError(f"the image reader's threads ended before block {self._taken} of "
                                           f"{len(self._blocks)} was read")
                    self._ready.wait(0.1)
                    continue
                item = self._done.pop(self._taken)
                self._taken += 1
                self._ready.notify_all()
                if item is None:  # every row of the block was claimed before a thread started it
                    continue
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self._in_flight[item[0]] = False
                return item
        return None

    def stop(self) -> None:
        """Stop reading (after the blocks in hand) and end the threads."""
        with self._ready:
            self._stop.set()
            self.finished = True
            self._done.clear()
            self._ready.notify_all()
        self.join(10.0)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the threads to end (all blocks read, an error, or stop)."""
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

"""Particle images read from their stacks in a background thread, block by block in the order the job will ask for
them, so that the first iteration's disk reading overlaps the job's start and its computing (issue 15: reading
took 0.55 s of a 3.3 s first iteration of a box-128 auto-refine of 5,000 particles on an H100).

Only the reading (files to NumPy arrays, with the jobs' value checks) runs in the thread; the job's own thread
takes the blocks into its image store (ParticleSet.images), so no device work leaves it. Rows the job asks for
before the reader has started them are the job's to read (``claim``): the job never waits for the reader to reach
a row, only for a block the reader is reading.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np

#: Rows per block the reader reads at once.
BLOCK_ROWS = 128
#: Bytes of blocks read and not yet taken that the reader may hold (at least two blocks).
AHEAD_BYTES = 256 << 20
_DONE = object()


class ImageReadAhead:
    """Reads ``read(rows)`` for consecutive blocks of ``order`` (rows of a set of ``n``; blocks of ``block`` rows,
    or the caller's ``blocks``, which split ``order``) in a daemon thread.
    ``claim(rows)`` hands the rows it has not started to the caller; ``next(wait)`` gives the next block read,
    (rows, images), or None (none ready and ``wait`` false, or the reader ``finished``). An error of the reader
    (InputError for a bad image, OSError) is raised by the ``next`` call that reaches it, in the caller's thread."""

    def __init__(self, read: Callable[[np.ndarray], np.ndarray], order: np.ndarray, n: int, block: int,
                 ahead_blocks: int, blocks: list[np.ndarray] | None = None):
        self._read = read
        self._queue: queue.Queue = queue.Queue(maxsize=max(2, int(ahead_blocks)))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._todo = np.zeros(n, dtype=bool)  # nobody has started the row
        self._todo[order] = True
        self._in_flight = np.zeros(n, dtype=bool)  # the reader has started it and the caller not taken it
        self.finished = False
        if blocks is None:  # fixed blocks of ``block`` rows; a caller's own blocks (``order`` split) otherwise
            step = max(1, int(block))
            blocks = [order[i:i + step] for i in range(0, len(order), step)]
        self._thread = threading.Thread(target=self._run, args=(blocks,), name="particle images", daemon=True)
        self._thread.start()

    def _run(self, blocks) -> None:
        for rows in blocks:
            if self._stop.is_set():
                return
            with self._lock:
                mine = rows[self._todo[rows]]
                self._todo[mine] = False
                self._in_flight[mine] = True
            if mine.size == 0:
                continue
            try:
                item = (mine, self._read(mine))
            except BaseException as exc:  # noqa: BLE001 - handed to the job's thread, which raises it
                self._put(exc)
                return
            if not self._put(item):
                return
        self._put(_DONE)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def claim(self, rows: np.ndarray) -> None:
        """The rows of ``rows`` the reader has not started become the caller's: the reader skips them."""
        with self._lock:
            self._todo[rows] = False

    def in_flight(self, rows: np.ndarray) -> bool:
        """Whether a row of ``rows`` is being read (or read and not yet taken) by the reader."""
        with self._lock:
            return bool(self._in_flight[rows].any())

    def next(self, wait: bool):
        """The next block read, (rows, images); None when none is ready and ``wait`` is false, or when the reader
        has finished. Raises the reader's error."""
        if self.finished:
            return None
        try:
            item = self._queue.get() if wait else self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is _DONE:
            self.finished = True
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        with self._lock:
            self._in_flight[item[0]] = False
        return item

    def stop(self) -> None:
        """Stop reading (after the block in hand) and end the thread."""
        self._stop.set()
        self.finished = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10.0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

"""Threads for the NumPy path's chunked loops (projection and insertion on the CPU).

NumPy runs one array operation on one core, and the E-step's projections and the insertions on the CPU are loops
over independent chunks of orientations (memory_model.orientations_per_chunk: cache-sized for projections, at
least an eighth of the grid's points for insertions). NumPy
releases Python's lock inside its array operations, so chunks run in threads take the cores a laptop has.
Every chunk is the same as in one thread and results are taken in chunk order, so the numbers are identical
whatever the thread count (insertion's adds stay in chunk order in the caller's thread).

The count belongs to the thread that runs the job (a job sets it for its run with ``using``; 1, no threads, unless
set), so two jobs of one napari session, each in its own thread, do not change each other's. The GPU path never
uses it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
#: .threads: this thread's count; .worker: this thread is one of the pool's (a loop inside a chunk runs alone in it)
_local = threading.local()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def host_threads() -> int:
    """Threads this thread's NumPy chunked loops use now: 1 inside a chunk that runs in the pool (a loop nested in
    a chunk would otherwise wait for workers that wait for it)."""
    return 1 if getattr(_local, "worker", False) else getattr(_local, "threads", 1)


def _in_worker(fn: Callable[[T], R], item: T) -> R:
    _local.worker = True
    return fn(item)


@contextmanager
def using(threads: int) -> Iterator[int]:
    """This thread's chunked NumPy loops in ``threads`` threads (at least 1) inside the block; the previous count
    after it."""
    previous = getattr(_local, "threads", 1)
    _local.threads = max(1, int(threads))
    try:
        yield _local.threads
    finally:
        _local.threads = previous


def _executor(n: int) -> ThreadPoolExecutor:
    """The shared pool, replaced by a larger one when it has fewer than ``n`` workers. The old one is not shut down
    (a loop of another thread may still submit to it); its idle workers cost nothing."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            _pool, _pool_size = ThreadPoolExecutor(n, thread_name_prefix="ngr-chunks"), n
        return _pool


def map_ordered(fn: Callable[[T], R], items: Iterable[T], ahead: int | None = None) -> Iterator[R]:
    """fn(item) for each item, yielded in the items' order; with host_threads() > 1 up to that many (at most
    ``ahead`` when given: results that are large) are made at once in the shared pool, the next ones while the
    caller handles a result. An exception of fn is raised when its result's turn comes; the chunks after it that
    had started are waited for and their results dropped, as when the caller stops early."""
    n = host_threads() if ahead is None else min(host_threads(), max(1, int(ahead)))
    if n <= 1:
        for item in items:
            yield fn(item)
        return
    pool = _executor(n)
    pending: list[Future] = []
    it = iter(items)
    try:
        for item in it:
            pending.append(pool.submit(_in_worker, fn, item))
            if len(pending) >= n:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for f in pending:  # an error or a caller that stopped early: nothing left running on shared arrays
            f.cancel()
        for f in pending:
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass


def for_each(fn: Callable[[T], object], items: Iterable[T], threads: bool = True) -> None:
    """fn(item) for each item, for what it writes (map_ordered's threads; in this thread alone when ``threads`` is
    false: a GPU array's chunks)."""
    for _ in map_ordered(fn, items) if threads else map(fn, items):
        pass

"""An exclusive lock on a job's output rootname, held for the job's whole run (issue 50).

Two jobs started on one ``--o`` would otherwise run side by side and leave a folder with iterations of both. A job
takes :class:`RunLock` on its rootname before it reads its inputs (under MPI rank 0 alone, the rank that writes)
and gives it back at its end, after an error and after a cancel. The lock is ``<rootname>.lock``
(``Class2D/job005/run.lock``): ``fcntl.flock`` on it decides, and the holder's host, process id, start time and job
kind are written in it, so that a job refused names who holds it::

    --o Class2D/job005/run is in use by node7:41234 (started 2025-05-02 14:03:11): a class2d job

The kernel lets go of a flock when its process ends, however it ends: a lock file left by a job that was killed
is taken over (its process id is dead on this host). Where the file system has no flock (some network file
systems), the file's content decides: a holder on this host whose process is gone is taken over, a live one
refuses. A lock file written on another host that nobody holds here is not taken over (a host-local lock cannot
tell whether that job still runs): the message says which file to remove once that job has ended.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .atomic import pid_alive

try:  # not on Windows: the content of the lock file decides there
    import fcntl
except ImportError:  # pragma: no cover - POSIX everywhere we run
    fcntl = None

__all__ = ["LOCK_SUFFIX", "Holder", "RunLock", "lock_path", "read_holder"]

log = logging.getLogger(__name__)

#: The lock of rootname ``R`` is the file ``R.lock``.
LOCK_SUFFIX = ".lock"
#: Attempts when the lock file is replaced under us (a holder that releases removes it).
_ATTEMPTS = 20
#: The locks this process holds (resolved lock file -> holder): where there is no flock, jobs of one process (a
#: front end runs them in threads) still exclude each other.
_HELD: dict[str, Holder] = {}
_HELD_MUTEX = threading.Lock()


def lock_path(root: str | os.PathLike) -> Path:
    """The lock file of a rootname: ``Class2D/job005/run`` -> ``Class2D/job005/run.lock``."""
    r = Path(root)
    return r.with_name(r.name + LOCK_SUFFIX)


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: as written in the lock file."""

    host: str
    pid: int
    started: float
    job: str = ""

    def describe(self) -> str:
        """``host:pid (started 2025-05-02 14:03:11)``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.host}:{self.pid} (started {when})"

    def text(self) -> str:
        return f"host={self.host}\npid={self.pid}\nstarted={self.started!r}\njob={self.job}\n"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether the holder's process still runs (only meaningful on this host)."""
        return pid_alive(self.pid)


def _parse(text: str) -> Holder | None:
    kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    try:
        return Holder(kv["host"], int(kv["pid"]), float(kv.get("started", "0")), kv.get("job", ""))
    except (KeyError, ValueError):
        return None


def read_holder(root_or_lock: str | os.PathLike) -> Holder | None:
    """The holder written in a lock file (given the rootname or the lock file); None if there is none."""
    p = Path(root_or_lock)
    if not p.name.endswith(LOCK_SUFFIX):
        p = lock_path(p)
    try:
        return _parse(p.read_text(errors="replace"))
    except OSError:
        return None


def _flock(fd: int) -> bool | None:
    """Try an exclusive flock without waiting: True taken, False held by another, None no flock here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


def _read_fd(fd: int) -> Holder | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
            if len(data) > 65536:
                break
    except OSError:
        return None
    return _parse(data.decode(errors="replace"))


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a holder that releases removes it; one that waited for it
    would otherwise hold a lock on a file nobody else opens)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _make_folders(folder: Path) -> list[Path]:
    """mkdir -p, returning the folders made (outermost first), so that a release can remove them again."""
    missing = []
    q = folder
    while not q.exists():
        missing.append(q)
        if q.parent == q:
            break
        q = q.parent
    made = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        made.append(d)
    return made


class RunLock:
    """An exclusive lock on a rootname; :meth:`take` it, :meth:`release` it (or use it as a context manager)."""

    def __init__(self, root: Path, path: Path, fd: int, holder: Holder, made: list[Path], key: str):
        self.root, self.path, self.holder = root, path, holder
        self._fd: int | None = fd
        self._made, self._key = made, key
        self._mutex = threading.Lock()
        # a job dropped without its release (never run to its end) still gives the lock back when collected
        self._finalizer = weakref.finalize(self, _release, fd, path, made, key)

    @classmethod
    def take(cls, root: str | os.PathLike, job: str = "", flag: str = "--o") -> RunLock:
        """Take the lock of ``root`` or raise InputError naming its holder. Makes the rootname's folder if needed
        (removed again at the release when the job wrote nothing there)."""
        root = Path(root)
        path = lock_path(root)
        made = _make_folders(path.parent)
        try:
            return cls._take(root, path, job, flag, made)
        except BaseException:
            _remove_folders(made)
            raise

    @classmethod
    def _take(cls, root: Path, path: Path, job: str, flag: str, made: list[Path]) -> RunLock:
        me = Holder(socket.gethostname(), os.getpid(), time.time(), job)
        for _ in range(_ATTEMPTS):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                locked = _flock(fd)
                held = _read_fd(fd)
                if locked is False:
                    raise InputError(_busy(flag, root, held, path, foreign=False))
                if locked and not _same_file(fd, path):
                    os.close(fd)
                    fd = -1
                    continue  # the holder released it and removed the file meanwhile: take the new one
                key = str(path.resolve())
                with _HELD_MUTEX:
                    if key in _HELD:  # another job of this process (a front end runs jobs in threads)
                        raise InputError(_busy(flag, root, held or _HELD[key], path, foreign=False))
                    if held is not None:
                        if not held.on_this_host():
                            raise InputError(_busy(flag, root, held, path, foreign=True))
                        if locked is None and held.pid != os.getpid() and held.alive():
                            raise InputError(_busy(flag, root, held, path, foreign=False))
                        log.info("%s %s: taking over the lock %s left by %s, which no longer holds it", flag, root,
                                 path, held.describe())
                    _HELD[key] = me
                try:
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    os.write(fd, me.text().encode())
                except BaseException:
                    _forget(key)
                    raise
                return cls(root, path, fd, me, made, key)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
        raise InputError(f"{flag} {root}: could not take the lock {path} (it was replaced {_ATTEMPTS} times while "
                         "taking it)")

    def release(self) -> None:
        """Give the lock back: remove the lock file, close it, and remove the folders :meth:`take` made if the job
        left them empty. Idempotent."""
        self._finalizer.detach()
        with self._mutex:
            fd, self._fd = self._fd, None
            if fd is not None:
                _release(fd, self.path, self._made, self._key)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLock({str(self.path)!r}, {'held' if self.held else 'released'})"


def _release(fd: int, path: Path, made: list[Path], key: str) -> None:
    try:
        if _same_file(fd, path):
            with contextlib.suppress(OSError):
                path.unlink()  # before the close: one waiting for this file sees it replaced and retries
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)  # gives the flock back
        _forget(key)
    _remove_folders(made)


def _forget(key: str) -> None:
    with _HELD_MUTEX:
        _HELD.pop(key, None)


def _remove_folders(made: list[Path]) -> None:
    """Remove the folders a take made, innermost first, as long as they are empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            return


def _busy(flag: str, root: Path, held: Holder | None, path: Path, foreign: bool) -> str:
    who = held.describe() if held is not None else "another job (its lock file names no holder yet)"
    kind = f": a {held.job} job" if held is not None and held.job else ""
    if foreign:
        return (f"{flag} {root} is in use by {who}{kind}; this host cannot tell whether that job still runs: "
                f"remove {path} once it has ended, or choose another {flag}")
    return f"{flag} {root} is in use by {who}{kind}; wait for it to end or choose another {flag}"

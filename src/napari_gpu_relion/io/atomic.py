"""Atomic file writes: a job's output either appears complete or not at all.

Writers fill a hidden temporary file in the destination folder and rename it onto the final name only when
writing succeeded, so a crash or a cancelled job never leaves a half-written STAR or MRC file behind, and an
existing file is never damaged by a failed rewrite.

A process killed while writing (SIGKILL, power loss) leaves its temporary file behind: the temporary's name
carries the writer's host and process id, so that :func:`remove_stale_temporaries` (called when a job starts)
removes those whose writer is gone and leaves alone those a running job is still filling.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import InputError

__all__ = ["atomic_path", "copy_atomically", "ensure_not_input", "remove_stale_temporaries"]

#: Our temporaries: ``.<stem>-tmp-<host tag>-<pid>-<random><suffix>``; older versions wrote ``-tmp-<12 hex>``.
_TEMP = re.compile(r"^\..*-tmp-(?:(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-[0-9a-f]{8}|[0-9a-f]{12})(?:\.[^.]*)?$")
#: A temporary of another host (a shared file system) is stale only when it has not changed for this long (s).
_FOREIGN_AGE_S = 24 * 3600


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def _temp_name(final: Path) -> Path:
    """Hidden sibling of ``final`` that keeps its suffix (mrcfile and starfile look at suffixes) and names its
    writer (host tag and process id), so that a stale one can be told from one being written."""
    token = uuid.uuid4().hex[:8]
    return final.with_name(f".{final.stem}-tmp-{_host_tag()}-{os.getpid()}-{token}{final.suffix}")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _is_stale(path: Path, now: float) -> bool:
    """A temporary of ours whose writer has gone: a process of this host that no longer runs, an older
    version's temporary (no writer recorded), or one of another host unchanged for a day."""
    m = _TEMP.match(path.name)
    if m is None:
        return False
    if m.group("pid") is None:
        return True
    if m.group("host") == _host_tag():
        pid = int(m.group("pid"))
        return pid != os.getpid() and not pid_alive(pid)
    try:
        return now - path.stat().st_mtime > _FOREIGN_AGE_S
    except OSError:
        return False


def remove_stale_temporaries(folder: str | os.PathLike, depth: int = 3) -> list[Path]:
    """Delete the temporary files that writers killed mid-write left in ``folder`` and its subfolders (down to
    ``depth`` levels); returns what was removed. Only files named as :func:`atomic_path` names them are touched,
    and none that a running process on this host is still writing."""
    root = Path(folder)
    if not root.is_dir():
        return []
    now = time.time()
    removed: list[Path] = []
    base_depth = len(root.parts)
    for here, dirs, files in os.walk(root):
        if len(Path(here).parts) - base_depth >= depth:
            dirs[:] = []
        for name in files:
            q = Path(here) / name
            if name.startswith(".") and "-tmp-" in name and _is_stale(q, now):
                try:
                    q.unlink()
                except FileNotFoundError:
                    continue
                removed.append(q)
    return removed


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``, on error delete it.

    The temporary file lives in the same folder so that the final ``os.replace`` is an atomic rename on
    one filesystem. Missing parent folders are created (as RELION does for job outputs). The yielded path
    does not exist yet; the caller creates it.
    """
    final = Path(path)
    if final.name in ("", ".", ".."):
        raise InputError("output path has no file name", path=str(final))
    if final.is_dir():
        raise InputError("output path is a folder, not a file", path=str(final))
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(final)
    try:
        yield tmp
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is None or Path(exc.filename) == tmp:  # e.g. a full disk reported by write(): name
            raise OSError(exc.errno, exc.strerror or str(exc), str(final)) from exc  # the file being written
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not tmp.exists():
        raise RuntimeError(f"atomic write of {final}: the writer did not create {tmp}")
    try:
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def copy_atomically(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy the file ``src`` onto ``dst`` atomically (``dst`` appears whole or not at all); returns ``dst``."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dst)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """The same file: equal resolved paths (symlinks, ``..``), or, both existing, the same inode (hard links)."""
    a, b = Path(a), Path(b)
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def ensure_not_input(out_path: str | os.PathLike, *input_paths: str | os.PathLike | None) -> None:
    """Raise InputError if ``out_path`` is the same file as one of ``input_paths`` (None entries skipped;
    :func:`same_file`)."""
    for inp in input_paths:
        if inp is not None and same_file(out_path, inp):
            raise InputError(f"output would overwrite an input file ({Path(inp)}); choose another output name",
                             path=str(Path(out_path)))

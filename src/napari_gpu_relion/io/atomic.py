"""Atomic file writes: a job's output either appears complete or not at all.

Writers fill a hidden temporary file in the destination folder and rename it onto the final name only when
writing succeeded, so a crash or a cancelled job never leaves a half-written STAR or MRC file behind, and an
existing file is never damaged by a failed rewrite.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import InputError

__all__ = ["atomic_path", "ensure_not_input"]


def _temp_name(final: Path) -> Path:
    """Hidden sibling of ``final`` that keeps its suffix (mrcfile and starfile look at suffixes)."""
    token = uuid.uuid4().hex[:12]
    return final.with_name(f".{final.stem}-tmp-{token}{final.suffix}")


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


def ensure_not_input(out_path: str | os.PathLike, *input_paths: str | os.PathLike | None) -> None:
    """Raise InputError if ``out_path`` is the same file as one of ``input_paths`` (None entries skipped).

    Compares resolved paths (symlinks, ``..``) and, when both files exist, their inode (hard links).
    """
    out = Path(out_path)
    out_resolved = out.resolve()
    for inp in input_paths:
        if inp is None:
            continue
        inp_path = Path(inp)
        same = inp_path.resolve() == out_resolved
        if not same and out.exists() and inp_path.exists():
            try:
                same = os.path.samefile(out, inp_path)
            except OSError:
                same = False
        if same:
            raise InputError(f"output would overwrite an input file ({inp_path}); choose another output name",
                             path=str(out))

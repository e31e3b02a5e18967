"""Plumbing shared by jobs: parameter fields with RELION flags, backend choice, note.txt, OOM-safe batching."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import Any

from ..compute.backend import Backend, free_cached_memory, is_out_of_memory, select_backend
from ..errors import InputError
from ..parallel import gpu_for_rank, world
from .events import Message


def param(default: Any = MISSING, flag: str | None = None, help: str = "", mode: str | None = None,  # noqa: A002
          **kw) -> Any:
    """A Params field carrying its command-line flag (RELION's name) and help text (shown as tooltip).
    ``mode`` tells a front end how to ask for a path: 'r' input file, 'w' output file, 'd' folder, 'root' a
    relion_refine output rootname (the widget asks for the job folder and passes <folder>/run)."""
    md = {"flag": flag, "help": help}
    if mode is not None:
        md["mode"] = mode
    if default is MISSING:
        return field(metadata=md, **kw)
    return field(default=default, metadata=md, **kw)


def flag_of(f) -> str:
    return f.metadata.get("flag") or f"--{f.name}"


def command_line(job: str, params) -> str:
    """The command that reproduces a job with these parameters (written to note.txt, like RELION)."""
    parts = ["napari-gpu-relion", job]
    for f in fields(params):
        v = getattr(params, f.name)
        if v is None or v is False:
            continue
        if f.default is not MISSING and v == f.default:
            continue
        fl = flag_of(f)
        parts += [fl] if v is True else [fl, str(v)]
    return shlex.join(parts)


def write_note(out_dir: Path, job: str, params) -> Path:
    """Append the reproducing command to ``out_dir/note.txt``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / "note.txt"
    with open(p, "a") as fh:
        fh.write(f"++++ with the following command(s):\n{command_line(job, params)}\n")
        if sys.argv and Path(sys.argv[0]).name.startswith("napari-gpu-relion"):
            fh.write(f"# invoked as: {shlex.join(sys.argv)}\n")
    return p


def backend_for(params) -> Backend:
    """The backend --cpu / --gpu ask for; an InputError when that GPU is not there (never a silent CPU run).
    --gpu takes RELION's syntax: "0:1:2:3" maps the MPI ranks of a host to these GPUs in turn (several ranks
    may share one); without --gpu the ranks of a host take its GPUs in turn. The chosen GPU becomes the
    current CUDA device of this process."""
    cpu, spec = bool(getattr(params, "cpu", False)), getattr(params, "gpu", None)
    try:
        comm = world()
        gpu = gpu_for_rank(spec, comm.local_rank)
        if gpu is None and comm.size > 1 and not cpu:
            be = select_backend(cpu=False, gpu=None)
            if be.is_gpu:
                gpu = gpu_for_rank(None, comm.local_rank, be.xp.cuda.runtime.getDeviceCount())
        be = select_backend(cpu=cpu, gpu=gpu)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if be.is_gpu:
        be.xp.cuda.Device(be.device).use()
    return be


def require_file(path: Path | None, what: str, suffixes: tuple[str, ...] | None = None) -> None:
    if path is None:
        raise InputError(f"{what} is required")
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} does not exist or is not a file", path=str(p))
    if suffixes and p.suffix.lower() not in suffixes:
        raise InputError(f"{what} should end in {' or '.join(suffixes)}, got '{p.suffix}'", path=str(p))


def batched_with_oom_retry(n: int, batch: int, work: Callable[[int, int], None],
                           backend: Backend) -> Iterator[tuple[int, int] | Message]:
    """Call ``work(start, stop)`` over [0, n) in batches; on out-of-memory, free cached blocks, halve the batch
    and retry the same range (never fails for memory unless one item alone does not fit).

    Yields (done, n) after each batch, and a Message when the batch shrinks."""
    i = 0
    b = max(1, int(batch))
    while i < n:
        j = min(n, i + b)
        try:
            work(i, j)
        except Exception as exc:  # noqa: BLE001 - only memory errors are handled here
            if not is_out_of_memory(exc) or b == 1:
                raise
            free_cached_memory(backend)
            b = max(1, b // 2)
            yield Message(f"out of memory with a batch of {j - i}; retrying with {b}", "warning")
            continue
        i = j
        yield (i, n)

"""Plumbing shared by jobs: parameter fields with RELION flags, note.txt, checks of output folders and disk space."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from dataclasses import MISSING, field, fields
from pathlib import Path
from typing import Any

from ..errors import InputError, os_error_line
from ..events import Message
from ..io.atomic import remove_stale_temporaries, same_file
from ..io.jobdir import job_number, note_commands
from ..io.paths import is_star_path
from ..io.run_lock import RunLock
from ..runtime.distributed import world

#: Bytes of an MRC header, and a margin for the small files of a job (note.txt, STAR headers).
_MRC_HEADER = 1024
_SMALL_FILES = 64 * 1024
#: A data STAR row gains about this many bytes of refined columns (angles, offsets, class, norm, ...).
_DATA_STAR_ROW = 256


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
        if v is False and f.default is True:  # an option on by default, turned off
            parts.append("--no-" + flag_of(f)[2:])
            continue
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


def require_file(path: Path | None, what: str, suffixes: tuple[str, ...] | None = None) -> None:
    if path is None:
        raise InputError(f"{what} is required")
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} does not exist or is not a file", path=str(p))
    suffix = ".star" if is_star_path(p) else p.suffix.lower()  # STAR files are read gzip-compressed too
    if suffixes and suffix not in suffixes:
        raise InputError(f"{what} should end in {' or '.join(suffixes)}, got '{p.suffix}'", path=str(p))


def check_pixel_size(value: float, flag: str, source: str) -> None:
    """A pixel size option is a positive number of Å, or -1 (its default): take it from ``source``. Zero or
    another negative value is a typo, not a request, so it is refused rather than read as "not given"."""
    if value == -1:
        return
    if not value > 0:  # also NaN
        raise InputError(f"{flag} must be a positive pixel size in Å, or -1 to take it from {source}; got {value:g}")


def check_output_folder(folder: str | os.PathLike, flag: str) -> None:
    """The output folder can be made and written: no file stands where it or one of its parent folders should
    be, and the nearest existing folder on its path is writable (not read-only, not on a read-only file system).
    Cheap (a few stat calls): the Params checks call it, so a front end hears of it before anything starts."""
    target = Path(folder)
    for q in (target, *target.parents):
        try:
            exists = q.exists()
        except OSError as exc:  # e.g. a parent folder without permission to look inside
            raise InputError(f"{flag}: cannot look at this path ({os_error_line(exc)})", path=str(q)) from exc
        if exists:
            if not q.is_dir():
                if q == target:
                    raise InputError(f"{flag} names an existing file, not a folder", path=str(q))
                raise InputError(f"{flag} {target} needs a folder here, but this is an existing file", path=str(q))
            if not os.access(q, os.W_OK | os.X_OK):
                raise InputError(f"{flag}: cannot write in this folder (read-only: its permissions or a read-only "
                                 "file system)", path=str(q))
            return


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """An output file can be written there: it is not an existing folder, and its folder can be made and written
    (:func:`check_output_folder`)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag}: the output file is an existing folder; give a file name", path=str(p))
    check_output_folder(p.parent, flag)


#: The jobs whose --o is a relion_refine rootname (their files are ``<rootname>_...``); a RELION note.txt names the
#: program (``relion_refine``).
ROOTNAME_JOBS = ("class2d", "class3d", "refine3d", "initial_model", "relion_refine")


def check_no_spaces(path: str | os.PathLike, flag: str, why: str) -> None:
    """An output path that goes into STAR files has no white space: STAR values are separated by white space (our
    writer refuses such values; RELION's pipeline never makes such names and many readers split them). Refused at
    the start, not when the first STAR file that names it is written (after an iteration's maps, say)."""
    text = os.fspath(path)
    if any(c.isspace() for c in text):
        raise InputError(f"{flag} {text!r} contains a space: {why}, and STAR values cannot hold spaces; choose a "
                         "name without spaces")


def check_outputs_not_inputs(outputs, inputs, flag: str = "--o") -> None:
    """No output file the job will write is one of its input files. ``outputs``: paths; ``inputs``: (option,
    path or None) pairs. The message names both."""
    for out in outputs:
        for opt, inp in inputs:
            if inp is not None and same_file(out, inp):
                raise InputError(f"{flag} would write {out} over the input {opt} {inp}: choose another {flag} (or "
                                 "move the input)")


def _note_rootname(o: str, folder: Path) -> str:
    """The rootname's name an --o of a note.txt in ``folder`` meant: ``run`` where it named the folder itself (a
    trailing separator, the folder's own name, a RELION job folder ``jobNNN``), else its last part."""
    q = Path(o)
    if o.endswith(("/", os.sep)) or q.name == folder.name or job_number(q) is not None:
        return "run"
    return q.name


def check_not_another_jobs_files(folder: str | os.PathLike, job: str, existing, flag: str = "--o",
                                 rootname: str | None = None, without_note: bool = True) -> None:
    """A job never writes over another job's files. ``existing``: the files this job would write that are there
    already (nothing to check when empty). Who wrote them comes from the folder's note.txt: with ``rootname``, the
    last command whose --o names that rootname (a relion_refine-style run); without, the last command of a job that
    writes fixed names into the folder (not a rootname job). Refused when that is another kind of job, and, unless
    ``without_note``, when none is recorded (the files are someone's own)."""
    existing = list(existing)
    if not existing:
        return
    folder = Path(folder)
    commands = [(c.program, c.args.get("--o") or c.args.get("--odir") or None) for c in note_commands(folder)
                if c.program is not None]
    if rootname is not None:
        writers = [k for k, o in commands if k in ROOTNAME_JOBS and o is not None
                   and _note_rootname(o, folder) == rootname]
    else:
        writers = [k for k, _ in commands if k not in ROOTNAME_JOBS]
    shown = ", ".join(q.name for q in existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
    if writers and writers[-1] != job:
        raise InputError(f"{flag}: {folder} holds {shown} written by {_a(writers[-1])} job (its note.txt); "
                         f"{_a(job)} job does not write over another job's files: choose another {flag}")
    if not writers and not without_note:
        why = "its note.txt names no job that wrote them" if (folder / "note.txt").is_file() else "it has no note.txt"
        raise InputError(f"{flag}: {folder} holds {shown}, not written by {_a(job)} job ({why}); {_a(job)} job "
                         f"would write over it: choose another {flag} (or move the file)")


def _a(word: str) -> str:
    """'a class2d', 'an extract', 'an initial_model'."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def input_paths(params, skip: tuple[str, ...] = ("o",)) -> list[tuple[str, Path]]:
    """(option, path) of each path a job's Params was given, but the outputs in ``skip``: its input files."""
    return [(flag_of(f), Path(v)) for f in fields(params) if f.name not in skip
            and isinstance(v := getattr(params, f.name), os.PathLike)]


def check_run_output(files, job: str, inputs, continued: bool, flag: str = "--o") -> None:
    """The checks of a relion_refine-style job's rootname (``files``: its RunFiles) when it starts, before it reads
    its inputs: the rootname is not an existing file (``--o in/reference.mrc``), has no spaces (its paths go into
    the optimiser and model STARs), a new run writes over none of its ``inputs`` ((option, path) pairs: an input
    that is a file of this rootname, e.g. ``--i run_it025_data.star`` of ``--o run``), and the files of this
    rootname already in its folder were written by a job of the same kind (note.txt)."""
    root = Path(files.root)
    if root.exists() and not root.is_dir():
        raise InputError(f"{flag} {root} is an existing file; {flag} is a rootname (e.g. Class2D/job005/run writes "
                         "Class2D/job005/run_it001_data.star, ...) or a folder (<folder>/run)")
    check_no_spaces(root, flag, "the rootname is written into the optimiser and model STAR files "
                    "(rlnOutputRootName, the maps' names)")
    if not continued:
        for opt, inp in inputs:
            if inp is not None and files.owns(inp):
                raise InputError(f"{flag} {root} would write over the input {opt} {inp} (a file of this rootname): "
                                 f"choose another {flag}")
    check_not_another_jobs_files(files.folder, job, files.existing_files(), flag, rootname=files.name)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; for messages about disk space."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def mrc_bytes(*shape: int, itemsize: int = 4) -> int:
    """Bytes of one MRC file of this shape (float32 unless told): the header and the data."""
    n = 1
    for s in shape:
        n *= int(s)
    return _MRC_HEADER + n * itemsize


def em_iteration_bytes(n_maps: int, box: int, ndim: int, n_particles: int, input_star: str | os.PathLike,
                       n_models: int = 1) -> int:
    """Bytes of one relion_refine iteration's files: ``n_maps`` references (box^ndim float32), the data STAR
    (the input's rows plus the refined columns), ``n_models`` model STARs (per-class curves and spectra) and the
    optimiser STAR."""
    try:
        star = Path(input_star).stat().st_size
    except OSError:
        star = 0
    maps = n_maps * mrc_bytes(*([box] * ndim))
    models = n_models * (_SMALL_FILES + n_maps * (box // 2 + 1) * 128)
    return maps + star + n_particles * _DATA_STAR_ROW + models + _SMALL_FILES


def prepare_output(folder: str | os.PathLike, needed_bytes: int, what: str, flag: str = "--o") -> list[Message]:
    """Just before a job starts: its output folder can be written (:func:`check_output_folder`), the disk has room
    for ``needed_bytes`` (an estimate of ``what``: the first iteration's files, or all of a job's outputs), and
    temporary files that a job killed while writing left there are removed. Returns messages for the log."""
    target = Path(folder)
    check_output_folder(target, flag)
    existing = next(q for q in (target, *target.parents) if q.exists())
    free = shutil.disk_usage(existing).free
    if needed_bytes > free:
        raise InputError(f"not enough free disk space: {what} need about {format_bytes(needed_bytes)} "
                         f"({needed_bytes} bytes) but only {format_bytes(free)} ({free} bytes) is free",
                         path=str(existing))
    removed = remove_stale_temporaries(target)
    if not removed:
        return []
    names = ", ".join(q.name for q in removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
    return [Message(f"removed {len(removed)} temporary file(s) left by an interrupted job in {target}: {names}")]


def holding_lock(events: Iterator, root: Path, job: str, flag: str) -> Iterator:
    """``events`` (a job's generator, not yet started) run while this process holds the lock of ``root``
    (io/run_lock.py; rank 0 only under MPI): a second job on the same output is refused, naming the holder,
    before it writes anything; the lock is given back at the end, after an error and after a cancel."""
    lock = RunLock.take(root, job, flag) if world().is_root else None
    try:
        yield from events
    finally:
        if lock is not None:
            lock.release()

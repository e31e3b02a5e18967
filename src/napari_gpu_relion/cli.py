"""Command line: ``napari-gpu-relion <job> [RELION-style options]``.

Every job's options come from its Params dataclass (flag and help in the field metadata), so the CLI, the
napari widgets and note.txt agree. Progress is printed from the same events the viewer receives.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

from .errors import InputError, os_error_line, user_error_line
from .events import Finished, FscUpdated, IterationFinished, Message, Progress, Started
from .jobs.common import flag_of
from .mpi_child import event_sender
from .runtime.distributed import launched_by_mpi, launcher_rank, rank_error, rank_prefix, start_up, world
from .runtime.kernel_preload import start_early, stop_early

__all__ = ["JOBS", "build_parser", "console_main", "main", "os_error_line", "run_job"]

JOBS = {
    "simulate": ("napari_gpu_relion.jobs.simulate", "simulate particles, micrographs and maps with ground truth"),
    "reconstruct": ("napari_gpu_relion.jobs.reconstruct", "reconstruct a map from particles with known angles"),
    "postprocess": ("napari_gpu_relion.jobs.postprocess", "FSC, masking correction and sharpening of half maps"),
    "local_resolution": ("napari_gpu_relion.jobs.local_resolution", "local resolution (relion_postprocess --locres)"),
    "mask_create": ("napari_gpu_relion.jobs.mask_create", "make a soft mask from a map"),
    "ctf_refine": ("napari_gpu_relion.jobs.ctf_refine", "per-particle CTF, beam tilt, aberrations (relion_ctf_refine)"),
    "refine3d": ("napari_gpu_relion.jobs.refine3d", "3D auto-refine with gold-standard FSC (relion_refine)"),
    "initial_model": ("napari_gpu_relion.jobs.initial_model", "3D initial model from the particles alone "
                      "(relion_refine --grad --denovo_3dref)"),
    "class3d": ("napari_gpu_relion.jobs.class3d", "3D classification into K classes (relion_refine, no halves)"),
    "class2d": ("napari_gpu_relion.jobs.class2d", "2D classification into K classes (relion_refine, 2D)"),
    "select": ("napari_gpu_relion.jobs.select", "keep the particles of chosen classes (RELION's Select job)"),
    "autopick": ("napari_gpu_relion.jobs.autopick", "pick particles with LoG or templates (relion_autopick)"),
    "extract": ("napari_gpu_relion.jobs.extract", "extract particle boxes from micrographs (relion_preprocess)"),
    "demo": ("napari_gpu_relion.jobs.demo", "run the whole pipeline that exists on the sample data"),
    "warmup": ("napari_gpu_relion.jobs.warmup", "compile the GPU kernels once, ahead of the first job on a "
               "machine"),
}


def _base_type(tp):
    """The non-None member of an Optional type (``Path | None`` -> Path); other types unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _escape(text: str) -> str:
    """Help text as argparse wants it: it %-formats help strings, so a literal % must be %%."""
    return text.replace("%", "%%")


def _rootname(text: str) -> Path:
    """A relion_refine output rootname; one that ends in "/" names a folder: its rootname is <folder>/run (Path
    drops the slash, which put a job's files beside the folder instead of into it)."""
    return Path(text, "run") if text.endswith(("/", "\\")) else Path(text)


def add_params_arguments(parser: argparse.ArgumentParser, params_cls) -> None:
    hints = typing.get_type_hints(params_cls)  # the annotations evaluated in the Params' own module
    for f in fields(params_cls):
        tp = _base_type(hints[f.name])
        flag = flag_of(f)
        hlp = f.metadata.get("help", "")
        required = f.default is MISSING
        if tp is bool and f.default is True:  # on by default: --no-<flag> turns it off
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=True,
                                help=_escape(hlp))
        elif tp is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", help=_escape(hlp))
        else:
            conv = {Path: Path, int: int, float: float, str: str}.get(tp, str)
            if tp is Path and f.metadata.get("mode") == "root":
                conv = _rootname
            default = None if required else f.default
            extra = "" if required or default is None else f" (default: {default})"
            parser.add_argument(flag, dest=f.name, type=conv, default=default, required=required,
                                help=_escape(hlp + extra),
                                metavar=tp.__name__.upper() if hasattr(tp, "__name__") else "X")


class _StartUpError(Exception):
    """A command-line error under MPI: its one line goes through the ranks' collective start-up check."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors (unknown option, a value of the wrong type, a missing option) as one line, like
    every other error of the command line: what is wrong, the option, the value, and where the help is. Under
    MPI the line names the rank and host and is raised (``_StartUpError``), so that main ends every rank with
    it (a rank that exits alone leaves the others waiting for it)."""

    def error(self, message: str):  # noqa: D102 - see the class docstring
        line = f"{self.prog}: error: {rank_prefix()}{' '.join(message.splitlines())} (see {self.prog} --help)"
        if launched_by_mpi():
            raise _StartUpError(line)
        self.exit(2, line + "\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``only`` (a job's name) the options of that job alone: every job is still
    listed, but only that job's module is imported (each job module imports its own compute stack: importing all
    of them took 0.13-0.3 s of every command's start on a 2-core machine)."""
    p = _Parser(prog="napari-gpu-relion",
                description="RELION-style cryo-EM processing on the GPU (CPU fallback).")
    p.add_argument("--verbose", action="store_true", help="more log output")
    p.add_argument("--events", metavar="SOCKET", help="also send the job's events to this Unix socket (the napari "
                   "widgets run MPI jobs so)")
    sub = p.add_subparsers(dest="job", metavar="<job>")
    for name, (mod, desc) in JOBS.items():
        sp = sub.add_parser(name, help=_escape(desc), description=desc)
        sp.set_defaults(_module=mod)
        if only is None or name == only:
            add_params_arguments(sp, importlib.import_module(mod).Params)
    return p


def _job_named(argv: list[str]) -> str | None:
    """The job a command line names (its first word that is not a global option), None if it names none of JOBS
    (then the whole parser reports the mistake as before)."""
    k = 0
    while k < len(argv):
        a = argv[k]
        if a == "--events":
            k += 2
            continue
        if a.startswith("-"):
            k += 1
            continue
        return a if a in JOBS else None
    return None


def run_job(module, params, out=None, sink=None) -> Finished | None:
    """Iterate a job, printing progress bars and messages (to ``out``, by default the current sys.stdout) and
    passing each event to ``sink``, if given; returns the Finished event."""
    out = sys.stdout if out is None else out
    t0 = time.time()
    last = None
    for ev in module.run(params):
        if sink is not None:
            sink(ev)
        if isinstance(ev, Started):
            print(f"[{ev.job}] {ev.message} on {ev.backend}", file=out)
        elif isinstance(ev, Progress):
            width = 30
            k = int(width * ev.done / max(ev.total, 1))
            end = "\n" if ev.done >= ev.total else ""
            print(f"\r  {ev.stage:<18} [{'#' * k}{'.' * (width - k)}] {ev.done}/{ev.total}", end=end, file=out)
        elif isinstance(ev, Message):
            print(("WARNING: " if ev.level == "warning" else "  ") + ev.text, file=out)
        elif isinstance(ev, FscUpdated):
            print(f"  FSC 0.143 resolution: {ev.resolution_A:.2f} Å", file=out)
        elif isinstance(ev, IterationFinished):
            print(f"  iteration {ev.iteration}: {ev.summary}", file=out)
        elif isinstance(ev, Finished):
            print(f"[done in {time.time() - t0:.1f} s] {ev.summary}", file=out)
            last = ev
        out.flush()
    return last


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc; None elsewhere): the interpreter, the imports and the
    option checks before a job, which more GPUs do not shorten (issue 47's fixed costs)."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's name
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    job = _job_named(argv)
    if job is not None:  # a GPU job's kernels start compiling now on a machine where they never were
        start_early(job, argv)
    try:
        return _main(argv, job)
    finally:
        stop_early()  # if the job did not take it over (it failed its checks, or is not an EM job)


def _main(argv: list[str], job: str | None) -> int:
    parser = build_parser(only=job)
    mpi = launched_by_mpi()
    if mpi:  # MPI_Init on every rank before any check can fail on one alone (see start_up)
        try:
            world()
        except RuntimeError as exc:  # no mpi4py: nothing to tell the other ranks with
            print(f"napari-gpu-relion: error: {rank_prefix()}{exc}", file=sys.stderr, flush=True)
            return 1
    try:
        args = parser.parse_args(argv)
    except _StartUpError as exc:  # under MPI only; single-process runs exit in parse_args
        return start_up((str(exc), 2))
    quiet = launcher_rank() not in (None, 0)  # MPI: the other ranks log warnings only (rank 0 prints the job)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
                        format="%(message)s")
    if not args.job:
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    kw = {f.name: getattr(args, f.name) for f in fields(module.Params)}
    failure = None  # this rank's start-up failure: (line, exit code)
    try:
        params = module.Params(**kw)  # the checks of the options and input files
    except (InputError, OSError) as exc:
        failure = (f"napari-gpu-relion {args.job}: error: {rank_prefix()}{user_error_line(exc)}", 2)
    except Exception as exc:
        if not mpi:
            raise
        traceback.print_exc()
        failure = (f"napari-gpu-relion {args.job}: {rank_prefix()}failed: {type(exc).__name__}: {exc}; "
                   "stopping all ranks", 1)
    if (code := start_up(failure)) != 0:  # under MPI every rank's checks, together: one rank fails, all end
        return code
    age = process_age_s()
    if age is not None and not quiet:  # benchmarks/scaling.py reads it
        print(f"  the process started {age:.2f} s before the job (Python, imports, option checks"
              f"{', MPI' if mpi else ''})", flush=True)
    try:
        run_job(module, params, sink=event_sender(args.events) if args.events else None)
    except (InputError, OSError) as exc:  # bad input, or a read-only folder, a full disk, ...: one line, the path
        return rank_error(f"napari-gpu-relion {args.job}: error: {rank_prefix()}{user_error_line(exc)}", 2)
    except Exception as exc:  # under MPI: name the rank and host, stop every rank (never a hang in a collective)
        if not mpi:
            raise
        traceback.print_exc()
        return rank_error(f"napari-gpu-relion {args.job}: {rank_prefix()}failed: {type(exc).__name__}: {exc}; "
                          "stopping all ranks", 1)
    except KeyboardInterrupt:
        print("\ninterrupted; files already written are complete", file=sys.stderr)
        return 130
    return 0


#: Set to 0 for the interpreter's own exit after a job (its teardown first; benchmarks compare the two).
FAST_EXIT_ENV = "NAPARI_GPU_RELION_FAST_EXIT"


def console_main() -> None:
    """The command line's entry point (``napari-gpu-relion``, ``python -m napari_gpu_relion.cli``): main(), then
    the process ends without the interpreter's teardown once main returned (its files are whole by then: a job
    drains its writes before it returns): logging and the output streams flushed, MPI finalized (an Open MPI rank
    that exits without it fails the whole launch), then os._exit. The teardown frees every CuPy block, NCCL
    communicator and pool of a GPU job one by one, which more GPUs do not shorten (issue 47: a class3d of 10,000
    particles on one H200 ended 0.72-0.79 s after its job with the teardown, 0.48-0.54 s without it,
    benchmarks/scaling_calls.sh fastexit; 0.13-0.15 s and 0.02 s on the 2-core CPU machine). An exception from
    main leaves as before, and so does every exit _may_end_at_once declines."""
    code = main()
    if not _may_end_at_once():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say through it
            pass
    try:  # what C libraries (NCCL's debug lines, ...) still hold in their stdio buffers
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask (not Linux/macOS)
        pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(code)


def _may_end_at_once() -> bool:
    """The fast exit unless it is turned off, a profiler or tracer runs (cProfile, coverage: they write their
    files at the interpreter's exit), or child processes of multiprocessing are still alive (a compile-ahead
    pool stopped before its end, formatting processes of this process: the interpreter's exit waits for and
    cleans up after them, which os._exit would skip, leaving a half-compiled module or a resource warning)."""
    if os.environ.get(FAST_EXIT_ENV, "1") == "0" or sys.gettrace() is not None or sys.getprofile() is not None:
        return False
    mp = sys.modules.get("multiprocessing")
    return mp is None or not mp.active_children()


if __name__ == "__main__":
    console_main()

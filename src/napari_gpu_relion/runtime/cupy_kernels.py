"""CuPy's own kernel modules that the EM jobs use, shipped as a list, and compiled ahead in parallel processes.

CuPy compiles each of its kernels (ufuncs, ``take``, scatters, CUB reductions) for the dtypes, the number of
dimensions left after merging contiguous axes and the reduction's length of each call, at its first use: a
machine's first class3d at box 128 compiled 211-261 modules, 63-77 s on an H200, serially, inside the job
(benchmarks/README.md). The sizes that decide these specialisations are the data's, so every new box size,
class count or batch shape could compile more. ``cupy_kernels.json.gz`` lists the modules that the EM jobs compiled
at box 128, 256 and 360 (class3d K=4 and K=6, class2d K=200, auto-refine with its final iteration:
benchmarks/record_kernels.sh, merged by benchmarks/ship_kernels.py) with the CuPy version they were recorded with:
each module's source and the options CuPy compiled it with.

``compile_ahead`` fills CuPy's disk cache with them in several processes (NVRTC compiles on one core each), through
CuPy's public ``RawModule(code=..., options=...).compile()``: CuPy keys its disk cache by the source, the options
and its headers, and a raw module goes through the same compile path with the same headers as CuPy's own kernels,
so the job that later asks for such a kernel finds it compiled. ``napari-gpu-relion warmup`` compiles all of them,
and a GPU job on a machine where its kind's have not been compiled yet compiles them in the background while it
starts (runtime/kernel_preload.py). With another CuPy version the list is not used (its kernels' sources differ).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

log = logging.getLogger("napari_gpu_relion")

SHIPPED = Path(__file__).with_name("cupy_kernels.json.gz")
#: Stands for the recording machine's Python packages folder in the include options.
SITE = "<site-packages>"
#: Modules per task of a worker process (small, so that the modules a job uses first, first in the list, are
#: compiled first, and so that a cancelled job's pool stops soon).
TASK_MODULES = 2
#: How much lower the worker processes' CPU priority is than the job's (``os.nice``): on a new machine the job's
#: own thread, which waits for these kernels, is not slowed by the compiles beside it.
WORKER_NICE = 5
#: CuPy's compile path adds its include folders (``-I``) to every module's options itself: a module's own options
#: are the others, in their order.
INCLUDE = "-I"


@functools.cache
def _data() -> dict | None:
    """The shipped list, read once per process (every GPU command line asks it for its job's kind; do not mutate)."""
    try:
        return json.loads(gzip.decompress(SHIPPED.read_bytes()))
    except (OSError, ValueError):
        return None


@functools.cache
def _digest() -> str:
    return hashlib.sha1(SHIPPED.read_bytes()).hexdigest()[:12] if SHIPPED.exists() else "none"


def own_options(options) -> list[str]:
    """A module's own compile options: the recorded ones less the include folders CuPy adds itself."""
    return [str(o) for o in options if not str(o).startswith(INCLUDE)]


def entry_key(source: str, options) -> str:
    """One string per distinct module (its source and own options)."""
    return json.dumps([source, own_options(options)])


#: The kernel name that marks CuPy's CUB block reductions (``cupy_cub_sum``, ``cupy_cub_any_pass1``, ...).
CUB_REDUCTION = "cupy_cub_"
#: The key that marks a module recorded only with CuPy's reductions without CUB (CuPy's own reduction kernels in
#: place of CUB's): compiled ahead only where CuPy does not use CUB.
WITHOUT_CUB = "without_cub"


def cub_reductions() -> bool:
    """Whether CuPy makes its reductions with CUB: its public CUPY_ACCELERATORS setting names "cub" (unset:
    CuPy's default, CUB; the package sets it empty unless the user set it, napari_gpu_relion/__init__.py). These
    25 modules of the class3d list take 65 % of NVRTC's time (benchmarks/nvrtc_costs.py): where CuPy will not use
    them, nothing compiles them ahead."""
    setting = os.environ.get("CUPY_ACCELERATORS")
    return setting is None or "cub" in [s.strip() for s in setting.split(",")]


def installed_cupy_version() -> str | None:
    """CuPy's version, without importing CuPy where it is not imported yet (its ``_version.py``; an import takes
    most of a second, which the command line's compile ahead does not wait for); None without CuPy. A CuPy being
    imported in another thread (in sys.modules, its ``__version__`` not set yet) is read from the file too."""
    version = getattr(sys.modules.get("cupy"), "__version__", None)
    if version:
        return str(version)
    try:
        try:  # any finder (an editable install's too); a module being imported has its spec already
            spec = importlib.util.find_spec("cupy")
        except ValueError:  # in sys.modules without a spec
            spec = importlib.machinery.PathFinder.find_spec("cupy")  # the file on sys.path
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        text = (Path(folders[0]) / "_version.py").read_text() if folders else ""
    except (ImportError, OSError, ValueError):
        return None
    found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    return found.group(1) if found else None


def shipped_entries(job: str | None = None) -> list[dict]:
    """The shipped modules of job kind ``job`` (every kind: None) as {"source", "options"} with the module's own
    options, less CuPy's CUB block reductions where CuPy is set not to use CUB and less the modules only a CuPy
    without CUB uses where it uses CUB; [] without CuPy, without the list, or when it was recorded with another CuPy
    version. It does not import CuPy."""
    data = _data()
    if data is None or data.get("cupy") != installed_cupy_version():
        return []
    cub = cub_reductions()
    return [{"source": e["source"], "options": own_options(e["options"])}
            for e in data["modules"] if (job is None or job in e["jobs"])
            and (CUB_REDUCTION not in e["source"] if not cub else not e.get(WITHOUT_CUB))]


def shipped_kinds() -> set[str]:
    """The job kinds the shipped list has modules of (without importing CuPy)."""
    data = _data()
    return set() if data is None else {j for e in data.get("modules", []) for j in e.get("jobs", [])}


def _marker(job: str | None, cache_dir: Path) -> Path:
    cub = "" if cub_reductions() else "_without_cub"
    return cache_dir / "napari_gpu_relion_preload" / f"compiled_{job or 'all'}{cub}_{_digest()}.done"


def compiled(job: str, cache_dir: Path) -> bool:
    """Whether the shipped modules of ``job`` were compiled into ``cache_dir`` (by warmup or an earlier job)."""
    return _marker(job, cache_dir).exists() or _marker(None, cache_dir).exists()


#: After a compile ahead in which no module compiled (a broken NVRTC, no usable GPU), the next jobs of the kind
#: start none for this long (seconds): they would start the workers only to fail again.
FAILED_RETRY_S = 3600.0


def _failed_marker(job: str | None, cache_dir: Path) -> Path:
    """Per host: a cache on a shared filesystem keeps one node's failure to itself."""
    return _marker(job, cache_dir).with_suffix(f".{socket.gethostname()}.failed")


def note_failed(job: str | None, cache_dir: Path, why: str) -> None:
    """Keep ``job``'s compile ahead off for FAILED_RETRY_S (see failed_recently)."""
    try:
        _failed_marker(job, cache_dir).parent.mkdir(parents=True, exist_ok=True)
        _failed_marker(job, cache_dir).write_text(why + "\n")
    except OSError as exc:  # a read-only cache: the next job tries again
        log.debug("compile ahead marker: %s", exc)


def failed_recently(job: str, cache_dir: Path) -> bool:
    """Whether a compile ahead of ``job``'s modules into ``cache_dir`` compiled none within FAILED_RETRY_S."""
    try:
        return time.time() - _failed_marker(job, cache_dir).stat().st_mtime < FAILED_RETRY_S
    except OSError:
        return False


def cache_files(cache_dir: Path) -> int:
    """How many compiled modules CuPy's disk cache holds (0 when it does not exist)."""
    try:
        return sum(1 for q in os.scandir(cache_dir) if q.name.endswith(".cubin") and q.is_file())
    except OSError:
        return 0


#: A kernel's entry in a compiled module: the ELF section ".text.<name>" of its code.
_ENTRY = re.compile(rb"\.text\.([A-Za-z_][A-Za-z0-9_]{0,120})")


def new_module_names(cache_dir: Path, since: float) -> list[str]:
    """The kernels of each module CuPy's disk cache got at or after ``since`` (time.time()), oldest first: its entry
    names joined by "+" (a job's log names what it compiled, so that the shipped list can take it in)."""
    try:
        files = [(q.stat().st_mtime, q.path) for q in os.scandir(cache_dir)
                 if q.name.endswith(".cubin") and q.is_file()]
    except OSError:
        return []
    new = sorted(f for f in files if f[0] >= since)
    out = []
    for _, path in new:
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue
        names = dict.fromkeys(m.decode() for m in _ENTRY.findall(data))
        out.append("+".join(names) or Path(path).name)
    return out


def compile_module(source: str, options) -> None:
    """Compile one module into CuPy's disk cache (or find it there), through CuPy's public RawModule."""
    import cupy  # noqa: PLC0415

    cupy.RawModule(code=source, options=tuple(options)).compile()


#: In a worker process: True when its parent said not to compile (its context failed, an exclusive compute mode,
#: the compile stopped) or did not say within CONTEXT_WAIT_S.
_SKIP = False


def _compile_task(entries: list[dict], device: int) -> int:
    """In a worker process: compile (or find in the disk cache) each module; returns how many succeeded."""
    if _SKIP:
        return 0
    import cupy  # noqa: PLC0415

    from ..compute.backend import use_device  # noqa: PLC0415 - the command line's first step imports this module

    done = 0
    use_device(cupy, device)  # the worker's, for good (compute.backend.use_device)
    for e in entries:
        try:
            compile_module(e["source"], e["options"])
            done += 1
        except Exception as exc:  # noqa: BLE001 - a module that does not compile here compiles at its use
            log.debug("compile ahead: %s", exc)
    return done


#: How long a worker waits for its parent's CUDA context before it starts compiling anyway (seconds).
CONTEXT_WAIT_S = 30.0
#: Workers that make their CUDA context at once. The driver serialises the start of contexts: 12 processes starting
#: together all waited 1.48 s, one alone 0.2-0.34 s (benchmarks/worker_start.py, an H200 host), so a pool whose
#: workers all started together compiled nothing for ~1.5 s; two at a time, the first workers compile a job's
#: first modules while the others start.
CUDA_STARTS_AT_ONCE = 2


def _worker_start(parent_context=None, starting=None, device: int = 0) -> None:
    """A worker process's start: below the job's priority, deaf to Ctrl-C (the terminal's interrupt reaches the
    whole process group; the job decides, and the worker ends with it), and a watch on the process that started it
    (a worker whose parent is gone, by an MPI rank's abort with os._exit or a kill, would otherwise wait on the
    pool's queue for ever holding its CUDA context: it exits with its parent). ``parent_context``: (made, abort),
    events of the parent: the worker waits for ``made`` (set once the parent's own CUDA context is made, or when
    the parent gives up) before its first compile makes a context (on a GPU in an exclusive compute mode the first
    context holds the GPU: it must be the job's), and compiles nothing when ``abort`` is set or ``made`` did not
    come within CONTEXT_WAIT_S. ``starting``: a semaphore of the pool (CUDA_STARTS_AT_ONCE) held while the worker
    makes its context on ``device``, after CuPy's import (which needs no context, so it overlaps the wait)."""
    global _SKIP  # noqa: PLW0603 - this worker process's own
    try:
        os.nice(WORKER_NICE)
    except (OSError, AttributeError):  # not allowed or not here: the same priority
        pass
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread or no signals here
        pass
    import multiprocessing  # noqa: PLC0415
    from multiprocessing.connection import wait as wait_for  # noqa: PLC0415

    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch() -> None:
            wait_for([parent.sentinel])  # ready when the parent is gone
            os._exit(0)

        threading.Thread(target=watch, name="parent watch", daemon=True).start()
    try:
        import cupy  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - the first compile meets and logs it
        log.debug("compile ahead worker: %s", exc)
        return
    if parent_context is not None:
        made, abort = parent_context
        _SKIP = not made.wait(CONTEXT_WAIT_S) or abort.is_set()
    if starting is not None and not _SKIP:
        from ..compute.backend import make_context  # noqa: PLC0415

        with starting:
            try:
                make_context(cupy, device)
            except Exception as exc:  # noqa: BLE001 - the first compile meets it again and logs it
                log.debug("compile ahead worker context: %s", exc)


def default_workers() -> int:
    """Worker processes: the cores less two (the job's thread and its image reader), at most 12, at least 1;
    NAPARI_GPU_RELION_COMPILE_WORKERS sets another number (to measure: CUDA's start in N processes at once is
    serialised by the driver, 0.41 s for 4 and 1.48 s for 12 on an H200 host, benchmarks/worker_start.py)."""
    asked = os.environ.get("NAPARI_GPU_RELION_COMPILE_WORKERS", "").strip()
    if asked.isdigit() and int(asked) > 0:
        return int(asked)
    return max(1, min(12, (os.cpu_count() or 1) - 2))


def compile_ahead(entries: list[dict], device: int, cache_dir: Path, job: str | None = None,
                  workers: int | None = None, stop: threading.Event | None = None, parent_context=None) -> dict:
    """Compile ``entries`` into CuPy's disk cache in ``workers`` spawned processes; when all were handled and at
    least one compiled (or was found), write the marker of ``job`` (None: every kind). ``stop`` set: the tasks not
    started are cancelled and the call returns without waiting for those running (at most TASK_MODULES modules per
    worker). ``parent_context``: (made, abort), ``multiprocessing`` events of the spawn context that the workers
    wait for before compiling (_worker_start); a stop sets both, so that workers still waiting compile nothing.
    Returns the modules compiled or found, and the seconds. Processes, not threads: NVRTC compiles one program at a
    time in a process (279 modules took 18-20 s in 6, 12 or 14 threads of one process against 6.2 s in 12 processes
    on an H200 host; processes forked from a server that imported CuPy once were no faster than spawned ones:
    benchmarks/compile_ahead_pools.py)."""
    import multiprocessing  # noqa: PLC0415

    t0 = time.perf_counter()
    if stop is not None and stop.is_set():  # stopped before it began: no pool
        return {"modules": 0, "of": len(entries), "seconds": 0.0, "stopped": True}
    tasks = [entries[i:i + TASK_MODULES] for i in range(0, len(entries), TASK_MODULES)]
    # in the list's order (a job kind's modules in the order a job first used them), so that a job running beside
    # the pool finds its first kernels compiled first
    done, stopped, errors = 0, False, 0  # errors: tasks lost with a broken pool
    if tasks:
        ctx = multiprocessing.get_context("spawn")
        ex = ProcessPoolExecutor(workers or default_workers(), mp_context=ctx, initializer=_worker_start,
                                 initargs=(parent_context, ctx.Semaphore(CUDA_STARTS_AT_ONCE), device))
        pending: set = set()
        try:
            pending = {ex.submit(_compile_task, t, device) for t in tasks}
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                done += sum(f.result() for f in finished if f.exception() is None)
                errors += sum(isinstance(f.exception(), BrokenProcessPool) for f in finished)
                if stop is not None and stop.is_set():
                    stopped = True
                    break
        finally:
            if stopped and parent_context is not None:  # workers still waiting for the parent: nothing to do
                parent_context[1].set()
                parent_context[0].set()
            # the tasks not started are cancelled here, each: shutdown's own cancel reaches the pool's manager
            # thread only while the executor object lives, and a pool that misses it compiles the whole list (and
            # the interpreter's exit waits for that)
            for f in pending:
                f.cancel()
            ex.shutdown(wait=not stopped, cancel_futures=True)
    if not stopped and entries and not done and not errors:  # none compiled (no GPU, no compiler), and the pool
        # itself did not fail (an interrupted or killed worker breaks it): not again for a while
        note_failed(job, cache_dir, f"0 of {len(entries)} compiled")
    if not stopped and (done or not entries):
        marker = _marker(job, cache_dir)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{done} of {len(entries)}\n")
        except OSError as exc:  # a read-only cache: the next job compiles again
            log.debug("compile ahead marker: %s", exc)
    return {"modules": done, "of": len(entries), "seconds": time.perf_counter() - t0, "stopped": stopped}

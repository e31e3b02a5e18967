"""Get the GPU kernels a job will use ready while it starts up, instead of one by one at their first use.

On a machine where the CuPy kernel modules the package ships for a job kind (runtime/cupy_kernels.py) were never
compiled, the command line starts compiling them, in parallel processes, into CuPy's disk cache as its first step
(``start_early``: before its imports, the option checks and the CUDA context, which it makes in a thread beside),
and the EM job takes that over (ctf_refine, which has shipped modules but no preload, runs beside it until it
ends). An EM job started otherwise (the viewer, the demo) compiles them in its own background thread
(``Preload``). Beside the compile, each in its own thread, while the job reads its particles and prepares its
references:

1. it builds the fused ops of the registry (runtime/kernels.py: ours, declared with their specialisations and built
   through CuPy's public API), so that they are loaded in the process;
2. it makes a few sorts and matrix products, which load the thrust and cuBLAS kernels that CuPy's own first sorts
   and products would otherwise load in iteration 1 (``_warm_libraries``; on a new machine the driver compiles
   thrust's kernels from their PTX here).

A new machine's first class3d at box 128 (one H200, fresh caches, paired runs on one machine, forty-first session,
benchmarks/README.md): 11.2-11.7 s with the three one after another from the job's start, 9.9-10.6 s with the
compile started by the command line and the other two beside it (1.6-1.8x the job run again; 1.9-2.1x before);
starting the other two after the compile instead: 11.0 s.

CuPy's own kernels (ufuncs, take, scatters, CUB reductions) are then read from the disk cache at their first use in
the process (a few milliseconds each); only CuPy's private compile function could hand them over loaded, and the
package uses none of CuPy's private names. The job's log says how many modules the job itself compiled (new files
in CuPy's disk cache while it ran): after ``napari-gpu-relion warmup`` that is the measure of kernels built ahead
(issue 46), 0 when nothing was left to compile.

NAPARI_GPU_RELION_KERNEL_PRELOAD=0 turns the background thread off (to measure what it saves).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..compute.backend import make_context, use_device
from . import cupy_kernels

log = logging.getLogger("napari_gpu_relion")

#: How long a job that ends waits for the preload thread to stop (seconds).
FINISH_WAIT_S = 0.5


def enabled() -> bool:
    """Whether jobs preload (the environment may turn it off for measurements)."""
    return os.environ.get("NAPARI_GPU_RELION_KERNEL_PRELOAD", "1").strip() not in ("0", "false", "no", "off")


def kernel_cache_dir() -> Path:
    """CuPy's on-disk kernel cache (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


def _on_device(device: int) -> None:
    """A preload thread's first step: the job's device made the thread's own (compute.backend.use_device)."""
    try:
        import cupy  # noqa: PLC0415

        use_device(cupy, device)
    except Exception as exc:  # noqa: BLE001 - no CuPy or no device: the thread's work meets it and logs it
        log.debug("kernel preload, device: %s", exc)


def _build_registry(device: int, stop: threading.Event, report: dict) -> None:
    from . import kernels  # noqa: PLC0415 - the compute stack: the command line imports this module first

    _on_device(device)
    try:
        report["registry"] = kernels.build(device, stop.is_set)
    except Exception as exc:  # noqa: BLE001 - an op that does not build here builds at its first use
        log.debug("kernel preload, registry: %s", exc)


def _libraries(device: int, stop: threading.Event, report: dict) -> None:
    _on_device(device)
    if not stop.is_set():
        report["libraries_s"] = _warm_libraries(device, stop)


#: The preload's parts that run beside the compile ahead, each in a thread of its own (name, function).
BESIDE = (("registry", _build_registry), ("libraries", _libraries))


class CompileAhead:
    """The shipped modules of job kind ``job`` compiled into CuPy's disk cache in a thread (cupy_kernels'
    ``compile_ahead`` and its processes), where they never were. The command line starts it as soon as it knows the
    job (``start_early``); the job's preload takes it over, or starts its own."""

    def __init__(self, job: str, device: int):
        self.job, self.device = job, device
        self.stop = threading.Event()
        self.report: dict = {}
        self.t0 = time.perf_counter()
        self.cache_before = cupy_kernels.cache_files(kernel_cache_dir())
        self.thread = threading.Thread(target=self._run, name=f"kernel compile ahead ({job})", daemon=True)
        # with_context: the events the workers wait for (made: their parent's CUDA context; abort: compile nothing)
        self.context_made: tuple | None = None

    def _run(self) -> None:
        try:
            shipped = cupy_kernels.shipped_entries(self.job)
        except Exception as exc:  # noqa: BLE001 - no shipped list: CuPy compiles at first use
            log.debug("kernel preload, shipped list: %s", exc)
            shipped = []
        if (not shipped or cupy_kernels.compiled(self.job, kernel_cache_dir())
                or cupy_kernels.failed_recently(self.job, kernel_cache_dir())):
            return
        if self.context_made is None and not _workers_allowed(self.device, self.job):  # the job's context exists
            return
        if self.stop.is_set():  # (the command line's GPU start may have stopped it meanwhile)
            return
        try:
            self.report["compiled_ahead"] = cupy_kernels.compile_ahead(shipped, self.device, kernel_cache_dir(),
                                                                       self.job, stop=self.stop,
                                                                       parent_context=self.context_made)
        except RuntimeError as exc:  # the interpreter is ending (a pool cannot start then): nothing to do
            log.debug("kernel preload, compile ahead: %s", exc)

    def start(self, with_context: bool = False) -> CompileAhead:
        """Start compiling; ``with_context``: also import CuPy and make the GPU's CUDA context in a thread of this
        process now (the job's own start then finds both made), while the worker processes start; they make theirs
        after it (_make_context). Where the kind's modules are compiled already (or failed lately) no events are
        made (a semaphore costs a resource-tracker process)."""
        to_compile = not (cupy_kernels.compiled(self.job, kernel_cache_dir())
                          or cupy_kernels.failed_recently(self.job, kernel_cache_dir()))
        if with_context and to_compile:
            import multiprocessing  # noqa: PLC0415

            ctx = multiprocessing.get_context("spawn")
            self.context_made = (ctx.Event(), ctx.Event())
        if with_context:
            threading.Thread(target=_make_context, args=(self,), name="GPU start", daemon=True).start()
        self.thread.start()  # (finds nothing to do where the modules are compiled)
        return self


def _workers_allowed(device: int, job: str) -> bool:
    """Whether other processes may make a context on GPU ``device`` beside this one's: not in an exclusive or
    prohibited compute mode (clusters often set EXCLUSIVE_PROCESS, where a worker's context would hold the GPU).
    Where they may not, the kind's compile ahead stays off for a while (cupy_kernels.note_failed)."""
    try:
        import cupy as cp  # noqa: PLC0415

        mode = int(cp.cuda.runtime.getDeviceProperties(device).get("computeMode", 0))
    except Exception as exc:  # noqa: BLE001 - no answer: the compile ahead goes on (its workers fail alone)
        log.debug("kernel preload, compute mode: %s", exc)
        return True
    if mode != 0:
        cupy_kernels.note_failed(job, kernel_cache_dir(), f"GPU {device} in compute mode {mode}: no workers")
    return mode == 0


def _make_context(ahead: CompileAhead) -> None:
    """The command line's GPU start: CuPy imported and the device's context made, before the compile workers make
    theirs (they wait for ``ahead.context_made``). Where the context fails or the GPU is in an exclusive compute
    mode, the compile ahead stops and its workers compile nothing."""
    go = False
    try:
        import cupy as cp  # noqa: PLC0415

        make_context(cp, ahead.device)
        ahead.report["context_s"] = time.perf_counter() - ahead.t0
        go = ahead.context_made is None or _workers_allowed(ahead.device, ahead.job)
    except Exception as exc:  # noqa: BLE001 - the job's own start meets and reports it
        log.debug("kernel preload, GPU start: %s", exc)
    finally:
        if not go:
            ahead.stop.set()
        if ahead.context_made is not None:
            made, abort = ahead.context_made
            if not go:
                abort.set()
            made.set()


#: The compile ahead the command line started (start_early), until a job's preload takes it over.
_early: CompileAhead | None = None


def _names(arg: str, flag: str) -> bool:
    """Whether command-line word ``arg`` names option ``flag``: argparse takes unambiguous abbreviations ("--cp" for
    --cpu, "--gp" for --gpu) and "--flag=value"."""
    name = arg.split("=", 1)[0]
    return len(name) >= 4 and flag.startswith(name)


def _option_value(argv: list[str], flag: str) -> str | None:
    for k, a in enumerate(argv):
        if _names(a, flag):
            if "=" in a:
                return a.split("=", 1)[1]
            return argv[k + 1] if k + 1 < len(argv) else None
    return None


#: The NVIDIA driver's control device on Linux: without it there is no GPU to compile for (the job runs on the CPU).
NVIDIA_CONTROL = Path("/dev/nvidiactl")


def _nvidia_driver() -> bool:
    """Whether this machine may have an NVIDIA GPU (Linux: the driver's control device; elsewhere: yes), checked
    without importing CuPy."""
    return not sys.platform.startswith("linux") or NVIDIA_CONTROL.exists()


def start_early(job: str, argv: list[str]) -> CompileAhead | None:
    """Start compiling the shipped modules of ``job`` now, from its command line ``argv``, before the job's imports
    and checks (the command line's first step), and make the GPU's context beside it. Only a GPU job (one with
    shipped modules; no ``--cpu``; not for ``--help``) of the host's first rank (the ranks of a host share one disk
    cache), on the GPU its ``--gpu`` names first; a host's other MPI ranks only make their own GPU's context
    (_start_rank_gpu); nothing when preloading is off. It decides nothing: a bad --gpu or a missing GPU is left to
    the job to report (its thread finds no shipped list without CuPy). ``stop_early`` stops it if no job took it
    over."""
    global _early  # noqa: PLW0603 - one per process: the command line's job
    from .device import parse_gpu  # noqa: PLC0415
    from .distributed import launched_by_mpi, launcher_rank, local_rank  # noqa: PLC0415

    host_rank = local_rank()
    rank = (launcher_rank() or 0) if host_rank is None else host_rank  # no host rank given: the first rank of all
    if (not enabled() or any(_names(a, "--cpu") or a in ("-h", "--help") for a in argv) or not _nvidia_driver()
            or job not in cupy_kernels.shipped_kinds()):
        return None
    if rank != 0:
        # an MPI rank's GPU follows from the launcher's host rank as backend_for will choose it; a process the
        # launcher started with MPI off (NAPARI_GPU_RELION_MPI=0) is a single run, on --gpu's first GPU
        if host_rank is not None and launched_by_mpi():
            _start_rank_gpu(_option_value(argv, "--gpu"), host_rank)
        return None
    if _early is not None:
        return None
    try:
        gpus = parse_gpu(_option_value(argv, "--gpu"))
    except ValueError:
        return None
    _early = CompileAhead(job, gpus[0] if gpus else 0).start(with_context=True)
    return _early


def _start_rank_gpu(spec: str | None, host_rank: int) -> threading.Thread:
    """A host's other rank (``host_rank`` > 0) imports CuPy and makes its GPU's context in a thread now, before its
    imports and MPI's start, as the first rank does beside its compile: the GPU backend_for will choose for it
    (runtime.device.gpu_for_rank of --gpu ``spec``, or the host's GPUs in turn). Without this, a second rank made its
    context in the job's start-up, 0.35-0.45 s that the first rank waited for at the first collective (2 H200s,
    100,000-particle class3d and auto-refine, forty-third session). It decides nothing: errors are backend_for's."""
    from .device import make_rank_context  # noqa: PLC0415

    def start() -> None:
        try:
            import cupy  # noqa: PLC0415

            make_rank_context(cupy, spec, host_rank, several_ranks=True)
        except Exception as exc:  # noqa: BLE001 - a bad --gpu or no GPU: the job's start reports it
            log.debug("kernel preload, a rank's GPU start: %s", exc)

    thread = threading.Thread(target=start, name="GPU start", daemon=True)
    thread.start()
    return thread


def stop_early() -> None:
    """Stop the command line's compile ahead if it is still running (the job ended, failed its checks, or is not
    one that takes it over, as ctf_refine): its tasks not started are cancelled; the process's exit waits for those
    its workers are compiling (a few tenths of a second)."""
    global _early  # noqa: PLW0603
    if _early is not None:
        _early.stop.set()
        _early = None


def _take_early(job: str) -> CompileAhead | None:
    """The command line's compile ahead for ``job``, handed over (None when it started none); one for another kind
    is stopped."""
    global _early  # noqa: PLW0603
    got, _early = _early, None
    if got is not None and got.job != job:
        got.stop.set()
        return None
    return got


def _load(job: str, device: int, stop: threading.Event, report: dict, ahead: CompileAhead | None,
          compile_ahead: bool = True) -> None:
    """The preload thread: the registry's fused ops built and the libraries' kernels loaded, each in a thread of its
    own, while the shipped modules are compiled where they never were (``ahead``: the command line's, already
    running; None: this thread's own, unless ``compile_ahead`` is False). The three at once: NVRTC and the driver's
    compiler each take one core, and a new machine's job waits for whichever of them it needs first."""
    beside = [threading.Thread(target=fn, args=(device, stop, report), name=f"kernel preload ({name})",
                               daemon=True) for name, fn in BESIDE]
    try:
        for t in beside:
            t.start()
        if ahead is not None and not compile_ahead:  # not the rank that compiles for the host
            ahead.stop.set()
        elif ahead is not None:
            while ahead.thread.is_alive() and not stop.is_set():
                ahead.thread.join(0.1)
            if stop.is_set():
                ahead.stop.set()
        elif compile_ahead:
            ahead = CompileAhead(job, device)
            ahead.stop = stop
            ahead._run()  # noqa: SLF001 - in this thread
        if ahead is not None and "compiled_ahead" in ahead.report:
            report["compiled_ahead"] = ahead.report["compiled_ahead"]
            report.update({k: ahead.report[k] for k in ("context_s",) if k in ahead.report})
    finally:
        for t in beside:
            t.join()
        report["finished"] = time.perf_counter()


def _warm_libraries(device: int, stop: threading.Event) -> float:
    """The first use of CuPy's sorts (thrust) and of cuBLAS's products loads their kernels into the process (CUDA
    loads a library's kernels at their first launch): about 0.2 s each in a class3d's first iteration on an H200
    (benchmarks/README.md, "Twenty-third session"). Sorts and products of the kinds the E-step makes (keys of
    each dtype, flat and along rows, at small and large sizes; float32 products, flat and batched, of small and
    large shapes) run here once, so that the job's first ones find those kernels loaded. Only what loads in the
    process is shared: cuBLAS handles and FFT plans are per thread, and TF32 (a process-wide setting of CuPy's)
    is left alone. Returns the seconds it took."""
    import cupy as cp  # noqa: PLC0415

    t = time.perf_counter()
    try:
        with cp.cuda.Device(device):
            for dt in (np.float32, np.float64, np.int64, np.int32, np.uint64):  # uint64: row-sort keys
                if stop.is_set():
                    return time.perf_counter() - t
                for shape in ((300,), (400_000,), (64, 700)):
                    a = cp.arange(int(np.prod(shape)), dtype=dt)[::-1].reshape(shape)
                    cp.sort(a, axis=-1)
                    cp.argsort(a, axis=-1, kind="stable")
            cp.unique(cp.arange(5000) % 77, return_inverse=True)
            for m, k, n in ((64, 64, 64), (300, 1000, 40), (4096, 1600, 4096), (50_000, 128, 96), (8, 2000, 3000)):
                cp.matmul(cp.ones((m, k), np.float32), cp.ones((k, n), np.float32))
            for b, m, k, n in ((700, 1, 400, 900), (700, 100, 940, 600), (64, 24, 2000, 40), (16, 300, 64, 300)):
                cp.matmul(cp.ones((b, m, k), np.float32), cp.ones((b, k, n), np.float32))
            cp.einsum("itk,tk->ik", cp.ones((50, 24, 500), np.float32), cp.ones((24, 500), np.float32))
            warm_scans(cp)
            cp.cuda.Device(device).synchronize()
    except Exception as exc:  # noqa: BLE001 - whatever does not warm here warms at its first use
        log.debug("kernel preload, libraries: %s", exc)
    return time.perf_counter() - t


#: Row lengths of the running sums that warm_scans makes: CuPy scans rows longer than its block (512) in blocks and
#: then scans the blocks' strided totals, with kernel variants for strided arrays that short rows never compile.
SCAN_LENGTHS = (300, 700, 300_000)


def warm_scans(cp) -> None:
    """The cumulative sums the E-step's significance threshold makes (float32 weights summed in float64, along
    rows and flat; int64 counts), at short and long row lengths, so that CuPy's size-dependent variants are
    compiled (or read from the disk cache) here and not in a later iteration. CuPy's variants depend on the
    dtypes, the contiguity and whether a row exceeds 512, not on the exact length (cupy/_core/_routines_math.pyx,
    _batch_scan_op). In a class2d K=200 at box 360, whose candidate rows exceed 512, the threshold's first call in
    iteration 2 spent 1.68 s on the host (of a 1.90 s E-step on an H200, benchmarks/README.md), with the first
    strided scan and the first sort of uint64 keys in it (CuPy's thrust carries no H200 code: the driver compiles
    its PTX at first use); the two were not told apart, and both are warmed now."""
    for n in SCAN_LENGTHS:
        rows = 2 if n > 1000 else 5
        cp.cumsum(cp.ones((rows, n), np.float32), axis=1, dtype=np.float64)
        cp.cumsum(cp.ones((rows, n), np.float64), axis=1)
        cp.cumsum(cp.ones(n, np.float32), dtype=np.float64)
        cp.cumsum(cp.ones(n, np.int64))
    # the packed candidates' positions (cp.nonzero of an (I, n) mask): CuPy scans the flat mask in int32, and past
    # about a million elements its scan adds a level of block sums (cupy_bsum_shfl on int) that smaller ones never
    # compile (the warmed-scans GPU test named it, thirty-fourth session)
    big = cp.ones(1 << 22, dtype=bool)
    cp.nonzero(big)
    cp.cumsum(big.astype(np.int32))


#: The compile ahead's moments its summary names (report key, words).
STARTS = (("context_s", "the job's context made"),)

#: A job's log names the modules it compiled when they are this few (after `warmup`, the ones the shipped list
#: lacks: benchmarks/record_kernels.sh records them).
NAMED_MODULES = 5


class Preload:
    """The background preparation of one job's kernels: ``start`` when the job starts, ``finish`` when it ends."""

    def __init__(self, job: str, device: int | None, compile_ahead: bool = True):
        self.job, self.device = job, device
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.t0, self.report = time.perf_counter(), {}
        # the command line's compile ahead, when it started one for this job: its modules count as the job's
        self.ahead = _take_early(job) if device is not None else None
        self.compile_ahead = compile_ahead  # False: the host's other ranks (its first rank compiles for them)
        self.cache_before = (self.ahead.cache_before if self.ahead is not None else
                             cupy_kernels.cache_files(kernel_cache_dir()) if device is not None else 0)
        self.compiled: int | None = None
        self.since = time.time()  # the modules the job compiles are named when few (NAMED_MODULES)
        self.names: list[str] = []

    def start(self) -> Preload:
        if self.device is not None and enabled():
            self.thread = threading.Thread(target=_load, args=(self.job, self.device, self.stop, self.report,
                                                               self.ahead, self.compile_ahead),
                                           name=f"kernel preload ({self.job})", daemon=True)
            self.thread.start()
        elif self.ahead is not None:
            self.ahead.stop.set()
        return self

    def finish(self) -> None:
        """Stop the thread (between two modules; one being compiled on a new machine is not waited for beyond
        FINISH_WAIT_S, so that a cancelled job ends at once; the process's exit waits for the few modules its
        compile workers hold) and count the modules compiled while the job ran."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(FINISH_WAIT_S)
        if self.device is not None:
            self.compiled = cupy_kernels.cache_files(kernel_cache_dir()) - self.cache_before
            if 0 < self.compiled <= NAMED_MODULES:
                self.names = cupy_kernels.new_module_names(kernel_cache_dir(), self.since)[:NAMED_MODULES]

    def summary(self) -> str | None:
        """One line of what the preload did and what the job compiled (after finish; None on the CPU)."""
        if self.device is None or self.compiled is None:
            return None
        r, parts = self.report, []
        if (ahead := r.get("compiled_ahead")) is not None:
            starts = [f"{what} {r[k]:.2f} s after it began" for k, what in STARTS if k in r]
            parts.append(f"{ahead['modules']} of {ahead['of']} shipped CuPy modules compiled ahead in "
                         f"{cupy_kernels.default_workers()} processes ({ahead['seconds']:.2f} s"
                         + "".join(f"; {x}" for x in starts) + ")")
        if (reg := r.get("registry")) is not None:
            parts.append(f"{reg['ops']} fused ops built ({reg['seconds']:.2f} s)")
        if r.get("libraries_s") is not None:
            parts.append(f"sorts and matrix products warmed ({r['libraries_s']:.2f} s)")
        if r.get("finished") is not None:
            parts.append(f"done {r['finished'] - self.t0:.2f} s after the job started")
        ahead = "" if not parts else f" (background: {', '.join(parts)})"
        where = "the compile ahead and the job" if r.get("compiled_ahead") is not None else "the job"
        named = f" [{', '.join(self.names)}]" if self.names else ""
        return f"GPU kernels: {self.compiled} modules compiled into CuPy's cache by {where}{named}{ahead}"

"""Load the GPU kernels a job will use while it starts up, instead of one by one at their first use.

First the fused ops of the registry (runtime/kernels.py: ours, declared with their specialisations and built
through CuPy's public API), then the modules of CuPy's own kernels that the last job of this kind used (below)
and those the package ships for this kind (runtime/cupy_kernels.py; on a machine where they were not compiled
yet, they are compiled first, in parallel processes).

CuPy builds each kernel the first time a process uses it: it makes the kernel's source, finds the compiled code in
its on-disk cache (``napari-gpu-relion warmup`` fills that cache), hashes, reads and loads it; the sorts (thrust) and
matrix products (cuBLAS) it calls load their kernels at their first launch. RELION's kernels are linked into its
binary and loaded once. Every job paid these again in its first iteration, because what is loaded lives only as long
as the process: a class3d's iteration 1 on an H200 took 2.37 s in a fresh process and 1.90 s when the same job ran
again in that process, ~0.2 s of it in the first sorts and ~0.2 s in the first products (benchmarks/README.md,
"Twenty-third session").

CuPy's own kernels (ufuncs, take, scatters, CUB reductions) have no public way to be built ahead: here every
module a job loads through CuPy's compile path is recorded (this wraps CuPy's private ``_compile_module_with_cache``:
one of two uses of CuPy's private names left, the other is TF32's compute type in compute/backend.py), with its
source and options, and, when the job
ends, written to a manifest per job kind beside CuPy's kernel cache. The next job of that kind starts a background
thread that loads those modules (and fetches their functions) while the job reads its particles and prepares its
references; a module the job then asks for is handed over already loaded. A module the thread has not reached yet
is loaded by the job as before, so the manifest changes when, never what, a job computes. Then the thread makes a few
sorts and matrix products, which load the thrust and cuBLAS kernels that CuPy's own first sorts and products would
otherwise load in iteration 1 (_warm_libraries). Without CuPy, or with a CuPy whose compile path differs
(``install`` returns False), nothing happens; without a manifest only the libraries are warmed.

NAPARI_GPU_RELION_KERNEL_PRELOAD=0 turns the background loading off (to measure what it saves); recording stays on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import numpy as np

from ..io.atomic import atomic_path
from . import cupy_kernels, kernels
from .kernel_entries import HEADERS as _HEADERS  # noqa: F401 - the placeholder of CuPy's headers in an entry
from .kernel_entries import call_args as _call_args
from .kernel_entries import entry as _entry
from .kernel_entries import header_source as _headers
from .kernel_entries import key as _key
from .kernel_entries import read_manifest as _read_manifest

log = logging.getLogger("napari_gpu_relion")

#: At most this many modules per manifest: the last run's, in the order it first used them, then older runs' (a
#: run with other options may use others); what the thread has not loaded when iteration 1 starts it loads during
#: it, in the gaps the job leaves while it waits on the GPU.
MAX_ENTRIES = 1000
#: The compile function of CuPy 13-15 that every kernel (elementwise, reduction, raw module) goes through.
_TARGET = "_compile_module_with_cache"
#: How long a job that ends waits for the preload thread to stop (seconds).
FINISH_WAIT_S = 0.5
_GLOBAL = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+(\w+)')

_lock = threading.Lock()
_state: dict = {"installed": None, "original": None}
_stats = {"handed": 0, "job_loads": 0, "job_s": 0.0, "ahead": 0, "ahead_s": 0.0}  # this process's, cumulative
_thread = threading.local()  # .preloading: this thread is a preload thread (its loads are not the job's)
_used: dict = {}  # key -> manifest entry of every module this process loaded, in first-use order
_ready: dict = {}  # (device, key) -> Module loaded ahead by a preload thread, not yet handed over


def enabled() -> bool:
    """Whether jobs preload (the environment may turn it off for measurements)."""
    return os.environ.get("NAPARI_GPU_RELION_KERNEL_PRELOAD", "1").strip() not in ("0", "false", "no", "off")


def kernel_cache_dir() -> Path:
    """CuPy's on-disk kernel cache (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache)."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


def manifest_path(job: str) -> Path:
    return kernel_cache_dir() / "napari_gpu_relion_preload" / f"{job}.json"


def install() -> bool:
    """Wrap CuPy's compile function (once per process): record every module, hand over preloaded ones. False
    when CuPy is not there or has no such function."""
    with _lock:
        if _state["installed"] is not None:
            return _state["installed"]
        try:
            import cupy  # noqa: PLC0415
            from cupy.cuda import compiler  # noqa: PLC0415

            original = getattr(compiler, _TARGET)
        except Exception:  # noqa: BLE001 - no CuPy, or one without this function: no preloading
            _state["installed"] = False
            return False

        def compile_module(source, options=(), **kw):
            if getattr(_thread, "preloading", False):  # the registry's build in a preload thread: not the job's
                return original(source, options, **kw)
            e = _entry(source, options, kw, _headers(cupy))
            key = None if e is None else _key(e)
            if key is not None:
                _used.setdefault(key, e)
                mod = _ready.pop((cupy.cuda.runtime.getDevice(), key), None)
                if mod is not None:
                    _stats["handed"] += 1
                    return mod
            t = time.perf_counter()
            try:
                return original(source, options, **kw)
            finally:
                _stats["job_loads"] += 1
                _stats["job_s"] += time.perf_counter() - t

        _state["original"] = original
        setattr(compiler, _TARGET, compile_module)
        _state["installed"] = True
        return True


def _load(job: str, device: int, stop: threading.Event, report: dict) -> None:
    """The preload thread: every fused op of the registry (runtime/kernels.py, built through CuPy's public API),
    then every module of the job's manifest not yet loaded in this process, in first-use order, with its functions
    fetched (CUDA loads a function's code at its first fetch), then the libraries' kernels."""
    try:
        try:
            shipped = cupy_kernels.shipped_entries(job)
        except Exception as exc:  # noqa: BLE001 - no shipped list: the job's own manifest only
            log.debug("kernel preload, shipped list: %s", exc)
            shipped = []
        # on a machine where this kind's modules were never compiled, compile them first, in parallel processes
        # (the registry's raw modules among them), while the job reads its particles
        if shipped and not stop.is_set() and not cupy_kernels.compiled(job, kernel_cache_dir()):
            report["compiled_ahead"] = cupy_kernels.compile_ahead(shipped, device, kernel_cache_dir(), job,
                                                                  stop=stop)
        _thread.preloading = True
        try:
            report["registry"] = kernels.build(device, stop.is_set)
        except Exception as exc:  # noqa: BLE001 - an op that does not build here builds at its first use
            log.debug("kernel preload, registry: %s", exc)
        finally:
            _thread.preloading = False
        _load_entries(_read_manifest(manifest_path(job)) + shipped, device, stop)
        if not stop.is_set():
            report["libraries_s"] = _warm_libraries(device, stop)
    finally:
        report["finished"] = time.perf_counter()


def _load_entries(entries: list[dict], device: int, stop: threading.Event) -> None:
    import cupy  # noqa: PLC0415

    headers = _headers(cupy)
    with cupy.cuda.Device(device):
        for e in entries:
            if stop.is_set():
                return
            try:
                key = _key(e)
                if key in _used or (device, key) in _ready:
                    continue
                source, options, kw = _call_args(e, headers)
                t = time.perf_counter()
                mod = _state["original"](source, options, **kw)
                if not kw.get("name_expressions"):
                    for name in _GLOBAL.findall(source):
                        mod.get_function(name)
                if key not in _used:  # the job may have loaded it meanwhile
                    _ready[(device, key)] = mod
                _stats["ahead"] += 1
                _stats["ahead_s"] += time.perf_counter() - t
            except Exception as exc:  # noqa: BLE001 - a module that does not load here is loaded at its use
                log.debug("kernel preload: %s", exc)


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
            for dt in (np.float32, np.float64, np.int64, np.int32):
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
            cp.cuda.Device(device).synchronize()
    except Exception as exc:  # noqa: BLE001 - whatever does not warm here warms at its first use
        log.debug("kernel preload, libraries: %s", exc)
    return time.perf_counter() - t


class Preload:
    """The background loading of one job's kernels: ``start`` when the job starts, ``finish`` when it ends."""

    def __init__(self, job: str, device: int | None):
        self.job, self.device = job, device
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.t0, self.before, self.done, self.report = time.perf_counter(), dict(_stats), None, {}

    def start(self) -> Preload:
        if self.device is not None and install() and enabled():
            self.thread = threading.Thread(target=_load, args=(self.job, self.device, self.stop, self.report),
                                           name=f"kernel preload ({self.job})", daemon=True)
            self.thread.start()
        return self

    def finish(self, save: bool) -> None:
        """Stop the thread; with ``save``, write the manifest: the modules this process used, then the older
        manifest's others. The thread stops between two modules; one being compiled (a new machine) is not
        waited for beyond FINISH_WAIT_S, so that a cancelled job ends at once (the thread ends on its own)."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(FINISH_WAIT_S)
        self.done = {k: _stats[k] - self.before[k] for k in _stats}
        if save and self.device is not None and _state["installed"]:
            save_manifest(self.job)

    def summary(self) -> str | None:
        """One line of what the preload did for this job (after finish; None where nothing was loaded)."""
        d = self.done
        if not d or not (d["handed"] or d["job_loads"] or d["ahead"]):
            return None
        r = self.report
        parts = [f"{d['ahead_s']:.2f} s in the background"]
        if (ahead := r.get("compiled_ahead")) is not None:
            parts.append(f"{ahead['modules']} of {ahead['of']} shipped CuPy modules compiled in "
                         f"{cupy_kernels.default_workers()} processes ({ahead['seconds']:.2f} s)")
        if (reg := r.get("registry")) is not None:
            parts.append(f"{reg['ops']} fused ops built ({reg['seconds']:.2f} s)")
        if r.get("libraries_s") is not None:
            parts.append(f"sorts and matrix products warmed ({r['libraries_s']:.2f} s)")
        if r.get("finished") is not None:
            parts.append(f"done {r['finished'] - self.t0:.2f} s after the job started")
        return (f"GPU kernels: {d['ahead']} modules loaded ahead ({', '.join(parts)}), {d['handed']} of them used; "
                f"{d['job_loads']} loaded at their first use ({d['job_s']:.2f} s)")


def save_manifest(job: str) -> Path | None:
    """Write the manifest of ``job`` (None when this process used no module)."""
    mine = list(_used.values())
    if not mine:
        return None
    path = manifest_path(job)
    seen = set(_used)
    merged = mine + [e for e in _read_manifest(path) if _key(e) not in seen]
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"modules": merged[:MAX_ENTRIES]}))
    except OSError as exc:  # a read-only cache: the next job loads its kernels at their first use, as before
        log.debug("kernel preload manifest not written: %s", exc)
        return None
    return path

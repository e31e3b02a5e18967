"""The device a job runs on: the array backend (CuPy on a usable GPU, NumPy otherwise), chosen once per process,
and RELION's ``--gpu`` syntax, parsed in one place (:func:`parse_gpu`).

A job calls :func:`backend_for` once with its parameters; the widgets name a job's device with :func:`device_key`
(the same parsing). Compute functions never ask for a backend: they take arrays (``compute.backend``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from ..compute.backend import _set_tf32, _try_cupy, make_context, to_host
from ..errors import InputError
from .distributed import world

log = logging.getLogger("napari_gpu_relion")


@dataclass(frozen=True)
class Backend:
    """The chosen array module and device. ``xp`` is numpy or cupy."""

    xp: ModuleType
    device: int | None  # CUDA device index, None on the CPU
    name: str  # human-readable, e.g. "GPU 0 (NVIDIA H200, 139.8 GiB)" or "CPU (NumPy, 2 threads)"

    @property
    def is_gpu(self) -> bool:
        return self.device is not None

    def asarray(self, a, dtype=None):
        """Move ``a`` to this backend's device."""
        if self.is_gpu:
            with self.xp.cuda.Device(self.device):
                return self.xp.asarray(a, dtype=dtype)
        return np.asarray(to_host(a), dtype=dtype)

    def free_bytes(self) -> int:
        """Free memory for arrays on this device (bytes): device free memory plus CuPy's cached pool,
        or available host memory on the CPU."""
        if self.is_gpu:
            with self.xp.cuda.Device(self.device):
                free, _total = self.xp.cuda.runtime.memGetInfo()
                pool = self.xp.get_default_memory_pool()
                return int(free + pool.free_bytes())
        return host_available_bytes()

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device(self.device).synchronize()


#: Most threads one rank gives the NumPy path's chunked loops (compute/host_threads): a bound for many-core hosts,
#: where the chunks' gathers will wait on memory rather than on cores (measured only on 2 cores so far).
COMPUTE_THREADS_MAX = 8


def usable_cores() -> int:
    """The cores this process may run on (a batch system's or a container's share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compute_threads(ranks_on_host: int = 1) -> int:
    """Threads for one rank's NumPy projections and insertions: its share of the host's usable cores (the ranks
    of a host split them), at most COMPUTE_THREADS_MAX, at least one. On 2 cores the projections alone run
    1.7-2x faster in 2 threads than in one (the whole job less: the adds of the insertion stay in one thread)."""
    return max(1, min(COMPUTE_THREADS_MAX, usable_cores() // max(1, int(ranks_on_host))))


def set_matmul_tf32(be: Backend, on: bool) -> bool:
    """Let float32 matrix products of the calling thread run on tensor cores in TF32 (inputs rounded to a 10-bit
    mantissa, float32 accumulation: about 8x the float32 rate of an H100), or back to full float32. cuBLAS handles
    are per thread and device, so a job sets it in the thread that runs its E-steps. Covers both of CuPy's paths:
    the handle's math mode (batched products, cublasGemmStridedBatchedEx) and CuPy's compute type for float32
    (2-D products and einsum, cublasGemmEx), which is one setting per process: two jobs of one process that
    run at once with different --tf32 share the last one's for their 2-D products. Returns whether TF32 is now
    on (never on the CPU: NumPy has no TF32)."""
    if not be.is_gpu:
        return False
    with be.xp.cuda.Device(be.device):
        _set_tf32(be.xp, on)
    return on


#: The files of a memory cgroup: limit, use, and the key of its inactive page cache in memory.stat (v2, v1).
_CGROUP_FILES = {"v2": ("memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def _cgroup_room(folder: Path, kind: str) -> int | None:
    """Bytes one memory cgroup (``kind`` "v2" or "v1", its files in ``folder``) still allows: its limit minus its
    use less its inactive page cache (which the kernel reclaims: a stack just read would otherwise count as used);
    None without a limit or its files."""
    limit_file, use_file, cache_key = _CGROUP_FILES[kind]
    try:
        limit = (folder / limit_file).read_text().strip()
        use = int((folder / use_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes a huge number for none
        return None
    cache = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - max(0, use - cache))


def _own_cgroups(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")
                 ) -> list[tuple[Path, str]]:
    """The folders of this process's memory cgroup and of every cgroup above it, v2 and v1 (a SLURM job's limit
    sits on the job's cgroup, above the step and task the process runs in; a container's cgroup namespace shows
    its own cgroup as the root)."""
    paths = {"v2": "/", "v1": "/"}
    try:
        for line in proc.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                paths["v2"] = path
            elif "memory" in controllers.split(","):
                paths["v1"] = path
    except (OSError, ValueError):
        pass
    base = {"v2": root, "v1": root / "memory"}
    return [(base[kind] / str(a).lstrip("/"), kind) for kind, path in paths.items()
            for a in (Path(path), *Path(path).parents)]


def host_available_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path | None = None) -> int:
    """Host memory this process may still use (bytes): the node's MemAvailable, or less where a memory cgroup of
    this process or above it (a SLURM job's, a container's limit) leaves less; 4 GiB when nothing can be read.
    ``cgroup``: one cgroup folder to read instead (its v2 files, and v1's under ``memory/``)."""
    avail = None
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    folders = _own_cgroups() if cgroup is None else [(Path(cgroup), "v2"), (Path(cgroup) / "memory", "v1")]
    rooms = [r for r in (_cgroup_room(f, kind) for f, kind in folders) if r is not None]
    values = [v for v in (avail, *rooms) if v is not None]
    return min(values) if values else 4 * 1024**3


_selected: dict[tuple[bool, int | None], Backend] = {}


def select_backend(cpu: bool = False, gpu: int | None = None) -> Backend:
    """Choose the backend once: ``cpu=True`` forces NumPy; ``gpu=N`` asks for device N (an error if there is
    no such GPU); neither: the first GPU when CuPy sees one, else NumPy. Logs one line saying which."""
    key = (cpu, gpu)
    if key in _selected:
        return _selected[key]
    if cpu:
        be = Backend(np, None, f"CPU (NumPy, {os.cpu_count()} cores)")
    else:
        cp = _try_cupy()
        if cp is None:
            if gpu is not None:
                raise ValueError(
                    f"--gpu {gpu} was asked for, but no usable CUDA GPU with CuPy was found "
                    "(install napari-gpu-relion[cuda12] or [cuda13], or run with --cpu)")
            be = Backend(np, None, f"CPU (NumPy, {os.cpu_count()} cores; no usable GPU found)")
        else:
            n = cp.cuda.runtime.getDeviceCount()
            dev = 0 if gpu is None else int(gpu)
            if not 0 <= dev < n:
                raise ValueError(f"--gpu {dev}: there are {n} GPU(s), numbered 0..{n - 1}")
            props = cp.cuda.runtime.getDeviceProperties(dev)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            total = props["totalGlobalMem"] / 1024**3
            be = Backend(cp, dev, f"GPU {dev} ({name}, {total:.1f} GiB)")
    log.info("napari-gpu-relion compute backend: %s", be.name)
    _selected[key] = be
    return be


def parse_gpu(spec: str | int | None) -> tuple[int, ...]:
    """RELION's ``--gpu``: GPU numbers separated by ':' ("0:1:2:3"; the ranks of a host take them in turn); an
    entry "0,1" (RELION's threads of a rank) stands for its first GPU. Empty or None: () (no GPU named). A
    ValueError names the value when it is not of that form."""
    if spec is None or str(spec).strip() == "":
        return ()
    out = []
    for entry in (f for f in str(spec).strip().split(":") if f.strip()):
        first = entry.split(",")[0].strip()
        if not first.isdigit():
            raise ValueError(f"--gpu {spec!r}: expected GPU numbers separated by ':' (RELION's syntax, e.g. 0:1:2:3)")
        out.append(int(first))
    return tuple(out)


def gpu_for_rank(spec: str | int | None, local: int, n_devices: int | None = None) -> int | None:
    """The GPU of the rank with index ``local`` on its host: entry ``local % len`` of :func:`parse_gpu`
    ("0:1:2:3": GPUs 0, 1, 2, 3 in turn; "2" puts every rank on GPU 2); none named: GPU ``local % n_devices``
    when ``n_devices`` is given, else None (the backend's default)."""
    gpus = parse_gpu(spec)
    if gpus:
        return gpus[local % len(gpus)]
    return None if not n_devices else local % n_devices


def device_key(params) -> str:
    """The name of the device a job with these parameters runs on ("cpu", "gpu0", ...), for front ends that keep
    one runner per device: the GPU of this process's first rank."""
    if getattr(params, "cpu", False) or not hasattr(params, "gpu") or _try_cupy() is None:
        return "cpu"
    return f"gpu{gpu_for_rank(getattr(params, 'gpu', None), 0) or 0}"


def backend_for(params) -> Backend:
    """The backend --cpu / --gpu ask for; an InputError when that GPU is not there (never a silent CPU run).
    --gpu takes RELION's syntax (:func:`parse_gpu`); without --gpu the ranks of a host take its GPUs in turn. The
    chosen GPU becomes the current CUDA device of this process (CuPy's calls in the job's thread follow it)."""
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


def make_rank_context(cp: ModuleType, spec: str | int | None, local_rank: int, several_ranks: bool) -> None:
    """The CUDA context of the GPU backend_for chooses for the rank ``local_rank`` of its host (--gpu ``spec``'s
    entries in turn; without one, GPU 0, or the host's GPUs in turn for ``several_ranks``), made now and the calling
    thread's for good (compute.backend.make_context); nothing where that GPU is not there (backend_for says so)."""
    count = cp.cuda.runtime.getDeviceCount()
    dev = gpu_for_rank(spec, local_rank, count if several_ranks else None)
    dev = 0 if dev is None else dev
    if 0 <= dev < count:
        make_context(cp, dev)


def warm_device(params) -> threading.Thread | None:
    """CuPy imported and the CUDA context of the GPU :func:`backend_for` will choose made in a background thread, so
    that a job can overlap them with reading its inputs (join it before backend_for, which then finds both done).
    It decides nothing: an error (no CuPy, no GPU, a bad --gpu) is left to backend_for to report. None with --cpu."""
    if getattr(params, "cpu", False):
        return None

    def start() -> None:
        try:
            cp = _try_cupy()
            if cp is None:
                return
            comm = world()
            make_rank_context(cp, getattr(params, "gpu", None), comm.local_rank, comm.size > 1)
        except Exception:  # noqa: BLE001, S110 - backend_for meets and reports it
            pass

    thread = threading.Thread(target=start, name="GPU start", daemon=True)
    thread.start()
    return thread

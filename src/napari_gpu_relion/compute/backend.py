"""Array backend: CuPy on a usable GPU, NumPy otherwise, chosen once per process with one log line.

Compute functions never ask for a backend themselves: they take arrays and use
``xp = get_array_module(x)``. Jobs call :func:`select_backend` once (honouring ``--cpu`` / ``--gpu N``)
and move their inputs with :func:`to_device`. Importing this module never imports CuPy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

log = logging.getLogger("napari_gpu_relion")

_cupy: ModuleType | None = None
_cupy_checked = False


def _try_cupy() -> ModuleType | None:
    """CuPy if it imports and sees at least one device, else None (checked once)."""
    global _cupy, _cupy_checked
    if _cupy_checked:
        return _cupy
    _cupy_checked = True
    if os.environ.get("NAPARI_GPU_RELION_CPU"):
        return None
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        _cupy = cupy
    except Exception:  # no CuPy, no driver, no device: all mean "CPU"
        _cupy = None
    return _cupy


def gpu_available() -> bool:
    return _try_cupy() is not None


def get_array_module(*arrays) -> ModuleType:
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    cp = _cupy
    if cp is not None:
        for a in arrays:
            if isinstance(a, cp.ndarray):
                return cp
    return np


def to_host(a):
    """A NumPy array (copies device arrays to the host; passes NumPy arrays and scalars through)."""
    cp = _cupy
    if cp is not None and isinstance(a, cp.ndarray):
        return cp.asnumpy(a)
    return np.asarray(a)


@dataclass(frozen=True)
class Backend:
    """The chosen array module and device. ``xp`` is numpy or cupy."""

    xp: ModuleType
    device: int | None  # CUDA device index, None on the CPU
    name: str  # human-readable, e.g. "GPU 0 (NVIDIA H200, 139.8 GiB)" or "CPU (NumPy, 2 threads)"

    @property
    def is_gpu(self) -> bool:
        return self.device is not None

    def release_cached(self, max_cached_fraction: float = 0.25) -> None:
        """Give the device memory that CuPy's pool caches but no array uses back to the driver once it exceeds
        ``max_cached_fraction`` of the device (between iterations: transient blocks of varying sizes pile up in
        the pool, GBs per iteration; releasing every time made the next E-steps up to 2x slower on the H100)."""
        if self.is_gpu:
            with self.xp.cuda.Device(self.device):
                pool = self.xp.get_default_memory_pool()
                _free, total = self.xp.cuda.runtime.memGetInfo()
                if pool.free_bytes() > max_cached_fraction * total:
                    pool.free_all_blocks()

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
        return _host_available_bytes()

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device(self.device).synchronize()


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3


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
                raise RuntimeError(
                    f"--gpu {gpu} was asked for, but no usable CUDA GPU with CuPy was found "
                    "(install napari-gpu-relion[cuda12] or [cuda13], or run with --cpu)")
            be = Backend(np, None, f"CPU (NumPy, {os.cpu_count()} cores; no usable GPU found)")
        else:
            n = cp.cuda.runtime.getDeviceCount()
            dev = 0 if gpu is None else int(gpu)
            if not 0 <= dev < n:
                raise RuntimeError(f"--gpu {dev}: there are {n} GPU(s), numbered 0..{n - 1}")
            props = cp.cuda.runtime.getDeviceProperties(dev)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            total = props["totalGlobalMem"] / 1024**3
            be = Backend(cp, dev, f"GPU {dev} ({name}, {total:.1f} GiB)")
    log.info("napari-gpu-relion compute backend: %s", be.name)
    _selected[key] = be
    return be


def batch_size(bytes_per_item: int, budget_bytes: int, *, lo: int = 1, hi: int = 1 << 20) -> int:
    """How many items of ``bytes_per_item`` fit in ``budget_bytes`` (at least ``lo``, at most ``hi``)."""
    n = budget_bytes // max(1, int(bytes_per_item))
    return int(max(lo, min(hi, n)))


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a GPU or host out-of-memory error (CuPy's OutOfMemoryError is a MemoryError)."""
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__name__ in ("OutOfMemoryError", "CUFFT_ALLOC_FAILED") or "out of memory" in str(exc).lower()


def free_cached_memory(be: Backend) -> None:
    """Give CuPy's cached blocks back to the driver (at job end)."""
    if be.is_gpu:
        be.xp.get_default_memory_pool().free_all_blocks()
        be.xp.get_default_pinned_memory_pool().free_all_blocks()

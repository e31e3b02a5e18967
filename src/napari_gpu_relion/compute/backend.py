"""The array module of compute's functions: ``xp = get_array_module(x)`` is CuPy for CuPy arrays, NumPy otherwise;
the fused kernels' launch helpers; TF32 for a block of matrix products. Importing this module never imports CuPy.

Compute functions never choose a device: the runtime does (``runtime.device.select_backend``), and jobs move
their inputs there. This module only finds out whether CuPy sees a GPU (once per process).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
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


def _cupy_of(arrays) -> ModuleType | None:
    """CuPy, when one of ``arrays`` is a CuPy array (only CuPy can have made it, so it imports)."""
    if any(type(a).__module__.split(".")[0] == "cupy" for a in arrays):
        return _try_cupy()
    return None


def get_array_module(*arrays) -> ModuleType:
    """``cupy`` if any argument is a CuPy array, else ``numpy`` (CuPy arrays are recognised also before any
    backend was selected in this process)."""
    cp = _cupy if _cupy is not None else _cupy_of(arrays)
    if cp is not None:
        for a in arrays:
            if isinstance(a, cp.ndarray):
                return cp
    return np


def to_host(a, pinned: bool = False):
    """A NumPy array (copies device arrays to the host; passes NumPy arrays and scalars through). ``pinned``: a
    device array comes back into page-locked memory from CuPy's pinned pool (a fast copy, and the pool's blocks
    are used again once the arrays that hold them are gone); pageable memory when none can be had."""
    cp = _cupy if _cupy is not None else _cupy_of((a,))
    if cp is not None and isinstance(a, cp.ndarray):
        if pinned and a.size:
            return a.get(out=host_empty(a.shape, a.dtype, pinned=True))  # pageable where none can be had
        return cp.asnumpy(a)
    return np.asarray(a)


def host_empty(shape: tuple, dtype, pinned: bool = False) -> np.ndarray:
    """An empty host array; ``pinned``: in page-locked memory from CuPy's pinned pool where CuPy is (to_host's
    kind of array: device copies into it are fast, and the pool's blocks are used again), pageable otherwise."""
    if pinned and _try_cupy() is not None and int(np.prod(shape)) > 0:
        try:
            import cupyx  # noqa: PLC0415

            return cupyx.empty_pinned(shape, dtype)
        except Exception:  # noqa: BLE001 - no page-locked memory to be had: pageable
            pass
    return np.empty(shape, dtype=dtype)


def use_device(cp: ModuleType, device: int) -> None:
    """Make CUDA ``device`` the calling thread's current device for the rest of the thread: the first step of a
    background thread's GPU work. Not ``with cupy.cuda.Device(device)`` there: leaving that block makes the thread's
    previous device current again, device 0 in a new thread, and cudaSetDevice initialises the primary context of
    the device it sets (CUDA 12), so a rank on GPU 1 would make a context on GPU 0 (its memory, and a failure where
    GPU 0 is in an exclusive compute mode). Inside a thread that did this, ``with`` blocks on the same device
    switch nothing."""
    cp.cuda.Device(device).use()


def make_context(cp: ModuleType, device: int) -> None:
    """``device`` made the calling thread's for good (use_device) and its CUDA context made now (a thread or process
    that starts the GPU ahead of the work that needs it)."""
    use_device(cp, device)
    cp.cuda.runtime.memGetInfo()  # needs (so makes) the device's context


def thread_upload(device: int) -> Callable[[np.ndarray], object] | None:
    """A function for background threads that copies a host array to CUDA ``device``: ``upload(a)`` -> the device
    array. The copy is queued on the stream that was current where thread_upload was called (the job's), so that
    the job's GPU work that uses the array, queued after the array is handed over, runs after the copy; the host
    side of the copy (into CuPy's page-locked staging block) then costs the background thread, not the job's: the
    job's thread spent 4.36 s of a 25 s first iteration (100,000 box-256 images) on it (2 H200s, forty-third
    session). Each calling thread makes ``device`` its own on its first call (use_device). Once the GPU is out of
    memory, every host array comes back as it was (the job's thread copies it when it takes it; CuPy frees all its
    cached blocks before it says so, which no later block should repeat). The staging blocks are page-locked host
    memory that CuPy's pinned pool keeps for reuse: up to the reader's bound ahead. None without a GPU, and where
    the calling thread's stream is CuPy's per-thread default stream (another thread's copies would not be ordered
    before this thread's work)."""
    cupy = _try_cupy()
    if cupy is None:
        return None
    stream = cupy.cuda.get_current_stream()
    if stream.ptr == cupy.cuda.runtime.streamPerThread:
        return None
    own = threading.local()
    full = threading.Event()

    def upload(a: np.ndarray) -> object:
        if full.is_set():
            return a
        if not getattr(own, "device_set", False):
            use_device(cupy, device)
            own.device_set = True
        try:
            with stream:
                return cupy.asarray(a)
        except cupy.cuda.memory.OutOfMemoryError:
            full.set()
            return a
    return upload


def warm_pinned(shape: tuple, dtype, count: int, device: int) -> None:
    """Put ``count`` page-locked blocks for arrays of ``shape`` and ``dtype`` into CuPy's pinned pool (made, then let
    go: the pool keeps them), so that later to_host(..., pinned=True) copies of such arrays find a block there
    instead of waiting for cudaHostAlloc: a first copy of six box-256 maps (403 MB) took 0.2-0.36 s on an H200 host,
    the later ones 0.01 s. ``device``: the CUDA device whose context makes them, made the calling thread's device
    (use_device: call it in a thread of its own). Nothing without a GPU."""
    cupy = _try_cupy()
    if cupy is None:
        return
    use_device(cupy, device)
    held = [host_empty(shape, dtype, pinned=True) for _ in range(int(count))]
    del held


@functools.cache
def raw_module(code: str):
    """The CuPy RawModule of CUDA source ``code``, compiled on first use and made once per process (CuPy also
    caches the compiled code on disk): the fused kernels of gpu_kernels and gpu_posterior."""
    import cupy  # noqa: PLC0415 - only reached with CuPy arrays

    return cupy.RawModule(code=code, options=("--std=c++14",))


def launch_grid_stride(code: str, name: str, n: int, args, block: int = 256) -> None:
    """Launch kernel ``name`` of ``code`` over ``n`` items with a grid-stride loop of ``block`` threads per block
    (at most 2^20 blocks); nothing when n is 0."""
    if n == 0:
        return
    blocks = int(min((n + block - 1) // block, 1 << 20))
    raw_module(code).get_function(name)((blocks,), (block,), args)


_tf32 = threading.local()  # what was last set in this thread (cuBLAS handles are per thread and device)


def _set_tf32(cp: ModuleType, on: bool) -> None:
    """TF32 on or off for the current device's cuBLAS handle of this thread. CuPy's float32 products call cuBLAS's
    GemmEx with the 32-bit compute type, which follows the handle's math mode: TF32_TENSOR_OP_MATH lets it use
    TF32 tensor cores (as PyTorch's allow_tf32 does); the default mode keeps float32."""
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    cublas.setMathMode(handle, getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3) if on
                       else getattr(cublas, "CUBLAS_DEFAULT_MATH", 0))
    _tf32.on = bool(on)


@contextlib.contextmanager
def matmul_tf32(xp: ModuleType, on: bool):
    """The block's float32 matrix products (arrays of module ``xp``, on the current device) in TF32 when ``on``,
    then float32 again; without ``on`` the thread keeps what it has (TF32 throughout a job run with --tf32).
    NumPy: nothing."""
    if xp is np or not on or getattr(_tf32, "on", False):
        yield
        return
    _set_tf32(xp, True)
    try:
        yield
    finally:
        _set_tf32(xp, False)


def free_pool(xp) -> None:
    """Give CuPy's cached device blocks back to the driver (nothing on the CPU): after an out-of-memory error,
    before the smaller retry."""
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()

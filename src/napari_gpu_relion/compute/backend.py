"""Array backend: CuPy on a usable GPU, NumPy otherwise, chosen once per process with one log line.

Compute functions never ask for a backend themselves: they take arrays and use
``xp = get_array_module(x)``. Jobs call :func:`select_backend` once (honouring ``--cpu`` / ``--gpu N``)
and move their inputs with :func:`to_device`. Importing this module never imports CuPy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
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


def to_host(a):
    """A NumPy array (copies device arrays to the host; passes NumPy arrays and scalars through)."""
    cp = _cupy if _cupy is not None else _cupy_of((a,))
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
        return host_available_bytes()

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device(self.device).synchronize()


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


_tf32 = threading.local()  # what was last set in this thread (cuBLAS handles are per thread and device)


def _set_tf32(cp: ModuleType, on: bool) -> None:
    """TF32 on or off for the current device's cuBLAS handle of this thread and CuPy's float32 compute type."""
    from cupy._core import _routines_linalg as linalg
    from cupy_backends.cuda.libs import cublas

    handle = cp.cuda.device.get_cublas_handle()
    cublas.setMathMode(handle, getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", 3) if on
                       else getattr(cublas, "CUBLAS_DEFAULT_MATH", 0))
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if on else linalg.COMPUTE_TYPE_DEFAULT)
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


def host_available_bytes() -> int:
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


# ----------------------------------------------------------------------------------------------------------
# The memory plan: the one place where batch and chunk sizes are decided
# ----------------------------------------------------------------------------------------------------------

#: Fraction of the free memory (after the references and accumulators) that one E-step batch may use. The E-step
#: allocates transient arrays beyond the counted ones (FFT work areas, CuPy's rounding of blocks); 0.15 left
#: room for them on the H100 and on 24 GB hosts without an out-of-memory retry.
BATCH_FRACTION = 0.15
#: Most particles per E-step batch. On the CPU 3D batches stop at 512. On a GPU each batch and fine chunk costs
#: a few hundred kernel launches from Python whatever its size, and a kernel trace of iteration 1 (flat
#: posteriors) showed the GPU busy 13-25 % of the time at 512 (benchmarks/README.md, twentieth session): 3D
#: batches go up to 2048 there, as far as the memory allows (BATCH_FRACTION). 2D classification (small images,
#: many classes) was 1.3x faster at 1024 than at 512.
MAX_BATCH_3D = 512
MAX_BATCH_3D_GPU = 2048
MAX_BATCH_2D = 1024
#: Bytes that one reconstruction chunk may use, and the smallest fine-pass chunk.
CHUNK_BYTES = 1 << 28
#: The fine-pass chunk: this fraction of the memory left after the references and accumulators, between
#: CHUNK_BYTES and MAX_FINE_CHUNK_BYTES. Fewer, larger chunks mean fewer launches and larger GEMMs: on the H100
#: a 2 GiB chunk made a refine3d iteration at HEALPix order 3 (box 128, 5,000 particles) 1.8x faster than
#: 256 MiB (3.8 -> 2.1 s) and iteration 1 1.2x (benchmarks/profile_job.py --fine_chunk_mib); with 2048-particle
#: batches up to 8 GiB (on an H200, about 5 GiB on an 80 GB H100). 2D classification keeps 3 % and 2 GiB (the
#: larger chunk was measured in 3D only).
FINE_CHUNK_FRACTION = 0.06
MAX_FINE_CHUNK_BYTES = 1 << 33
FINE_CHUNK_FRACTION_2D = 0.03
MAX_FINE_CHUNK_BYTES_2D = 1 << 31
#: Points per scatter-add call of the back-projection (bounds its index and weight arrays to ~400 MB).
INSERT_CHUNK_POINTS = 1 << 23


def estep_bytes_per_particle(rows: int, translations: int, box: int, coarse_pixels: int) -> int:
    """Device bytes one particle needs in an E-step batch: the coarse score, log-prior and weight blocks
    (float32, rows x translations, 3 arrays), the image in real and Fourier space at the full box (8 float32
    planes: masked and unmasked, complex), and the particle terms of the score GEMM (translations x coarse
    pixels, complex float32 stacked [Re, Im])."""
    return 4 * (rows * translations * 3 + 8 * box * box) + 8 * translations * coarse_pixels * 2


def fine_bytes_per_score(fine_translations: int) -> int:
    """Device bytes of one (particle, fine orientation) pair's scores in a fine-pass chunk: per fine translation
    the score, log prior and weight (float64 + float32 x 8 = 40 bytes)."""
    return int(fine_translations) * 40


def fine_bytes_per_slice(fine_pixels: int) -> int:
    """Device bytes of one fine orientation's slice in a fine-pass chunk: per pixel the gathered slice ([Re, Im]
    and |P|^2 float32) and its weighted sums ([Re, Im] and the weight, float32): 24 bytes."""
    return int(fine_pixels) * 24


def fine_bytes_per_sample(fine_translations: int, fine_pixels: int) -> int:
    """Device bytes of one (particle, fine orientation) pair in a fine-pass chunk whose particles each have their
    own slices (the gathered layout): its scores and its slice."""
    return fine_bytes_per_score(fine_translations) + fine_bytes_per_slice(fine_pixels)


#: Device bytes per (particle, fine translation, fine pixel) of a fine-pass chunk: the particle's image at every
#: fine translation, stacked [Re, Im] float32 (8), made and used one at a time (the score GEMMs' particle terms,
#: then the back-projection's C Xu e_t m, then the sums over orientations U), plus one float32 temporary (4) while
#: each is made or reduced (expectation.stacked_shifted, _sum_conj_shifted). tests/test_memory_plan.py measures it
#: with tracemalloc. At the full image size this is the largest part of a chunk: 84 fine translations x 103k
#: pixels x 12 bytes = 0.1 GB per particle at box 512.
FINE_BYTES_PER_TRANSLATION_PIXEL = 12


def fine_bytes_per_particle(fine_translations: int, fine_pixels: int) -> int:
    """Device bytes of one particle in a fine-pass chunk that do not depend on its orientations: its image at
    every fine translation (FINE_BYTES_PER_TRANSLATION_PIXEL per translation and pixel)."""
    return FINE_BYTES_PER_TRANSLATION_PIXEL * int(fine_translations) * int(fine_pixels)


#: Points per call of the projection's interpolation (projector.project_pixels), and the bytes per point of its
#: temporaries (rotated coordinates, corner indices and weights, gathered values: 175 measured with tracemalloc on
#: NumPy): a transient of up to 2.75 GiB while the E-step projects the slices of a union.
PROJECT_CHUNK_POINTS = 1 << 24
PROJECT_BYTES_PER_POINT = 176
#: Device bytes per fine pixel of one fine orientation of the E-step's union of significant orientations (per
#: batch, every oversampled child of every coarse row that some particle of the batch found significant): its
#: projected slice as the GEMMs use it (compute/expectation.SliceSet: [Re, Im] float32 and |P|^2 float32, 12) and
#: its weighted sums (estep._FineSums: [Re, Im] float32 and the weight float32, 12). While the slices are made,
#: the complex64 projection (8) exists beside the SliceSet, before the sums: 20 (expectation.as_slices makes
#: |P|^2 in place). tests/test_memory_plan.py measures it with tracemalloc: 24.1 in all.
UNION_BYTES_PER_FINE_PIXEL = 24


def union_bytes_per_orientation(fine_pixels: int) -> int:
    """Device bytes of one fine orientation of the union of significant orientations at ``fine_pixels`` pixels
    (UNION_BYTES_PER_FINE_PIXEL each): what estep.plan_union_groups bounds by the plan's ``union_bytes``."""
    return UNION_BYTES_PER_FINE_PIXEL * int(fine_pixels)


def union_budget(free_bytes: int, held_bytes: int, largest_transient: int, batch_bytes: int,
                 fine_chunk_bytes: int) -> int:
    """Most bytes the union of significant orientations of one group of particles may hold in the E-step (the
    fine slices and sums, union_bytes_per_orientation each). What the run's memory plan already allows at its peak
    (``largest_transient``: compute/memory_plan.JobMemory, e.g. the half-map FSC pooling) less the batch's own
    arrays and one fine chunk, so that the E-step adds no peak of its own; but never less than BATCH_FRACTION of
    the memory left after the references and accumulators (``held_bytes``), so that where the plan's transient is
    small beside the free memory (small boxes) the union stays as large as before; and never more than what is
    left after the batch and the chunk. The projection's temporaries (PROJECT_CHUNK_POINTS x
    PROJECT_BYTES_PER_POINT) come off the plan's part, as they come beside the slices while these are made."""
    left = max(0, int(free_bytes) - int(held_bytes))
    others = int(batch_bytes) + int(fine_chunk_bytes)
    planned = int(largest_transient) - others - PROJECT_CHUNK_POINTS * PROJECT_BYTES_PER_POINT
    return int(min(max(0, left - others), max(BATCH_FRACTION * left, planned)))


#: Fraction of the free memory that one batch of template-matching FFTs (autopick) may use, and most micrograph
#: crops per batch.
PICK_BATCH_FRACTION = 0.25
MAX_PICK_BATCH = 512


def template_pick_batch(free_bytes: int, width: int, total: int) -> int:
    """(reference, psi) pairs per template-matching batch on a ``width`` working grid: each needs its complex
    half-grid spectrum and products (8 bytes x 4) and its real FOM maps (4 bytes x 4)."""
    per = width * (width // 2 + 1) * 8 * 4 + width * width * 4 * 4
    return int(max(1, min(total, PICK_BATCH_FRACTION * free_bytes // per, MAX_PICK_BATCH)))


@dataclass(frozen=True)
class MemoryPlan:
    """What an E-step iteration holds and how it is cut: the free memory, the references and accumulators, the
    particle batch and the fine-pass chunk budget (bytes)."""

    free_bytes: int
    reference_bytes: int
    accumulator_bytes: int
    bytes_per_particle: int
    batch: int
    fine_chunk_bytes: int
    rows_per_particle: int
    translations: int
    union_bytes: int = 1 << 62  # most bytes of the union of significant orientations of one particle group

    def describe(self) -> str:
        gib = 1024.0**3
        return (f"memory plan: references {self.reference_bytes / gib:.2f} GiB, accumulators "
                f"{self.accumulator_bytes / gib:.2f} GiB, batch {self.batch} particles x {self.rows_per_particle} "
                f"orientations x {self.translations} translations ({self.batch * self.bytes_per_particle / gib:.2f} "
                f"GiB), fine chunks {self.fine_chunk_bytes / 2**20:.0f} MiB, union of significant orientations "
                f"at most {self.union_bytes / gib:.2f} GiB per particle group ({UNION_BYTES_PER_FINE_PIXEL} bytes "
                f"per fine pixel per fine orientation; a batch whose union is larger runs its fine passes in "
                f"groups of particles); free {self.free_bytes / gib:.1f} GiB")


def plan_memory(free_bytes: int, *, box: int, ndim: int, pad: int, n_references: int, rows_per_particle: int,
                translations: int, coarse_pixels: int, requested_batch: int = 0,
                adaptive_chunks: bool = True, largest_transient: int = 0) -> MemoryPlan:
    """The memory plan of one E-step iteration. ``n_references`` counts every padded Fourier reference held
    (classes x halves); each has an accumulator of the same grid (complex128 data + float64 weight) beside its
    complex64 reference. ``requested_batch`` (--batch) wins when positive; otherwise the batch is what
    BATCH_FRACTION of the memory left after the references and accumulators holds, at most MAX_BATCH_2D, or
    MAX_BATCH_3D_GPU on a GPU (``adaptive_chunks``) and MAX_BATCH_3D on the CPU.
    ``adaptive_chunks=False`` (the CPU) fixes the fine-pass chunk at CHUNK_BYTES instead of a fraction of the
    free memory: the chunks set the order of the sums, so a fixed chunk gives the same numbers on any host
    however busy (a GPU's atomics make the order vary anyway; there larger chunks are faster).
    ``largest_transient``: the run's largest planned transient (compute/memory_plan.JobMemory), which sets the
    budget of the union of significant orientations (:func:`union_budget`)."""
    grid = (pad * box) ** (ndim - 1) * (pad * box // 2 + 1)
    ref_bytes = n_references * grid * 8
    acc_bytes = n_references * grid * (16 + 8)
    per = estep_bytes_per_particle(rows_per_particle, translations, box, coarse_pixels)
    if requested_batch > 0:
        batch = int(requested_batch)
    else:
        left = max(0, free_bytes - ref_bytes - acc_bytes)
        cap = MAX_BATCH_2D if ndim == 2 else MAX_BATCH_3D_GPU if adaptive_chunks else MAX_BATCH_3D
        batch = int(max(1, min(cap, BATCH_FRACTION * left // max(per, 1))))
    left = max(0, free_bytes - ref_bytes - acc_bytes)
    fraction, most = (FINE_CHUNK_FRACTION_2D, MAX_FINE_CHUNK_BYTES_2D) if ndim == 2 else \
        (FINE_CHUNK_FRACTION, MAX_FINE_CHUNK_BYTES)
    fine = int(min(most, max(CHUNK_BYTES, fraction * left))) if adaptive_chunks else CHUNK_BYTES
    union = union_budget(free_bytes, ref_bytes + acc_bytes, largest_transient, batch * per, fine)
    return MemoryPlan(int(free_bytes), ref_bytes, acc_bytes, per, batch, fine, rows_per_particle, translations,
                      union)


class SumsAlreadyAddedError(RuntimeError):
    """Memory ran out after an E-step batch had added part of its sums: the batch cannot be run again with fewer
    particles (its first part would count twice), so the job stops with this line instead of a wrong result."""


def free_pool(xp) -> None:
    """Give CuPy's cached device blocks back to the driver (nothing on the CPU): after an out-of-memory error,
    before the smaller retry."""
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a GPU or host out-of-memory error (CuPy's OutOfMemoryError is a MemoryError), not for
    SumsAlreadyAddedError (which must not be retried)."""
    if isinstance(exc, SumsAlreadyAddedError):
        return False
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__name__ in ("OutOfMemoryError", "CUFFT_ALLOC_FAILED") or "out of memory" in str(exc).lower()


def device_pool_line(be: Backend) -> str:
    """CuPy's memory pool after an iteration ("" on the CPU): the bytes arrays use, the bytes the pool holds
    from the device (used + cached), and the device's free memory, in GiB. Flat from iteration 2 on means no
    creeping memory."""
    if not be.is_gpu:
        return ""
    with be.xp.cuda.Device(be.device):
        pool = be.xp.get_default_memory_pool()
        free, total = be.xp.cuda.runtime.memGetInfo()
        g = 1024.0**3
        return (f"device memory: arrays {pool.used_bytes() / g:.2f} GiB, pool {pool.total_bytes() / g:.2f} GiB, "
                f"device free {free / g:.2f} of {total / g:.1f} GiB")


def free_cached_memory(be: Backend) -> None:
    """Give CuPy's cached blocks back to the driver (at job end)."""
    if be.is_gpu:
        free_pool(be.xp)
        be.xp.get_default_pinned_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------------------------------------------
# Where the memory peak of an iteration comes from (benchmarks/large_boxes.py; issue 21)
# ----------------------------------------------------------------------------------------------------------

_trace: MemoryTrace | None = None


class MemoryTrace:
    """The most bytes in use between named marks of a job's steps: on the GPU the bytes CuPy's pool hands to
    arrays (a memory hook sees every allocation), on the CPU the bytes tracemalloc traces (NumPy's buffers).

    ``with MemoryTrace(be) as trace:`` makes it the active trace of the process (one at a time; the GPU hook
    sees the allocations of the thread that entered it, where the benchmarks run their jobs); every
    :func:`memory_mark` then closes the interval since the previous mark and gives its peak to that label (a
    step repeated within an iteration, such as the E-step's batches, keeps its largest peak); the EM driver
    calls :meth:`end_iteration` after each iteration, which files the rows under the iteration's number in
    ``by_iteration``. Off (no active trace), memory_mark costs one global lookup."""

    def __init__(self, be: Backend):
        self.be = be
        self.peak = 0
        self.rows: dict[str, dict] = {}
        self.by_iteration: dict[int, dict[str, dict]] = {}
        self._hook = None
        self._started_tracemalloc = False

    # ---- the bytes in use now, and the most since the last mark ----
    def _pool(self):
        return self.be.xp.get_default_memory_pool()

    def in_use(self) -> int:
        if self.be.is_gpu:
            return int(self._pool().used_bytes())
        import tracemalloc  # noqa: PLC0415

        return int(tracemalloc.get_traced_memory()[0])

    def _peak_and_reset(self) -> int:
        if self.be.is_gpu:
            peak, self.peak = self.peak, self.in_use()
            return max(peak, self.peak)
        import tracemalloc  # noqa: PLC0415

        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        return int(peak)

    def __enter__(self) -> MemoryTrace:
        global _trace
        if self.be.is_gpu:
            from cupy.cuda import memory_hook  # noqa: PLC0415

            pool, trace = self._pool(), self

            class _Peak(memory_hook.MemoryHook):
                name = "napari_gpu_relion_peak"

                def malloc_postprocess(self, **kw):
                    trace.peak = max(trace.peak, pool.used_bytes())

            self._hook = _Peak()
            self._hook.__enter__()
            self.peak = self.in_use()
        else:
            import tracemalloc  # noqa: PLC0415

            if not tracemalloc.is_tracing():
                tracemalloc.start()
                self._started_tracemalloc = True
            tracemalloc.reset_peak()
        _trace = self
        return self

    def __exit__(self, *exc) -> None:
        global _trace
        _trace = None
        if self._hook is not None:
            self._hook.__exit__(*exc)
            self._hook = None
        if self._started_tracemalloc:
            import tracemalloc  # noqa: PLC0415

            tracemalloc.stop()
            self._started_tracemalloc = False

    # ---- marks ----
    def mark(self, label: str) -> None:
        peak, used = self._peak_and_reset(), self.in_use()
        row = self.rows.setdefault(label, {"peak_GiB": 0.0, "in_use_after_GiB": 0.0, "times": 0})
        row["peak_GiB"] = max(row["peak_GiB"], round(peak / 1024**3, 3))
        row["in_use_after_GiB"] = round(used / 1024**3, 3)
        row["times"] += 1
        if self.be.is_gpu:
            row["pool_GiB"] = round(self._pool().total_bytes() / 1024**3, 3)

    def end_iteration(self, iteration: int) -> str:
        """Files the rows marked since the last call under ``iteration``; returns them as one line (GiB, the
        peak of each step and, in brackets, what was still in use after it)."""
        rows, self.rows = self.rows, {}
        self.by_iteration[int(iteration)] = rows
        top = max(rows, key=lambda k: rows[k]["peak_GiB"]) if rows else None
        return ("memory by step (GiB, peak [in use after]): "
                + ", ".join(f"{k} {r['peak_GiB']:.2f} [{r['in_use_after_GiB']:.2f}]" for k, r in rows.items())
                + (f"; the peak is in '{top}'" if top else ""))


def memory_mark(label: str) -> None:
    """End of a named step for the active MemoryTrace (nothing when none is active)."""
    if _trace is not None:
        _trace.mark(label)


def memory_trace_active() -> MemoryTrace | None:
    return _trace

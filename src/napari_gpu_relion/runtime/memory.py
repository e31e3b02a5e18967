"""The one memory policy of the jobs: how much of the free memory each batch, chunk and union may take, what a
whole EM job holds (planned before iteration 1, refused with the numbers when it cannot fit), what happens when
memory runs out (a smaller batch, never a crash), and the trace of where an iteration's peak comes from.

Compute's functions cut their temporaries into fixed slabs (``compute.memory_model``: the same order of sums on
every machine); every size that depends on the machine's free memory is decided here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from ..cancel import check_cancel
from ..compute.backend import free_pool
from ..compute.memory_model import (
    LOCAL_SLICE_BYTES_PER_PIXEL,
    LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE,
    PROJECT_BYTES_PER_POINT,
    PROJECT_CHUNK_POINTS,
    SLAB_BYTES,
    UNION_BYTES_PER_FINE_PIXEL,
    estep_bytes_per_particle,
    fine_bytes_per_particle,
    fine_bytes_per_sample,
)
from ..compute.sampling import angular_step
from ..errors import is_out_of_memory
from ..events import Message
from ..marks import memory_mark, set_mark_hook  # noqa: F401 - memory_mark: the marks the trace hears
from .device import Backend

# ----------------------------------------------------------------------------------------------------------
# Host memory: particle images read ahead of the job
# ----------------------------------------------------------------------------------------------------------

#: Bytes of images read ahead and not yet taken that one rank's background reader may hold: at least
#: READ_AHEAD_MIN_BYTES, a share READ_AHEAD_HOST_FRACTION of the host memory available to the ranks of the host,
#: at most READ_AHEAD_MAX_BYTES. 256 MB alone was less than one box-256 E-step batch (1,749 images, 458 MB), so
#: the threads stopped after half of the next batch and the job's thread waited for the rest: iteration 1 of a
#: 100,000-particle class3d read for 6.57 s on an H200, while four threads read 7.8 GB/s on their own
#: (bench_image_read.py, thirty-eighth session).
READ_AHEAD_MIN_BYTES = 256 << 20
READ_AHEAD_MAX_BYTES = 2 << 30
READ_AHEAD_HOST_FRACTION = 0.05


def read_ahead_bytes(available_host_bytes: int, ranks_on_host: int = 1) -> int:
    """What one rank's image reader may hold ahead of the job (bytes): 5 % of the host's available memory shared
    by its ranks, within [256 MiB, 2 GiB] (below 5 GiB available the old 256 MiB; a GPU node reads several
    batches ahead, so that the next batch's images are read while the current one computes)."""
    share = READ_AHEAD_HOST_FRACTION * max(0, int(available_host_bytes)) / max(1, int(ranks_on_host))
    return int(min(READ_AHEAD_MAX_BYTES, max(READ_AHEAD_MIN_BYTES, share)))


#: Page-locked host memory the M-step's maps may come back in, as a share of the host's available memory (shared
#: by its ranks), counted for PINNED_MAP_SETS sets of maps (those of the model, those the writer or the viewer still
#: hold, the new ones). Six box-256 maps came back in 0.10-0.13 s of every class3d iteration into fresh pageable
#: memory on an H200 host (thirty-ninth session; ~3 GB/s: the page faults of new arrays), a pinned copy runs at
#: ~50 GB/s (bench_image_read.py's pinned uploads), and CuPy's pinned pool hands a block back out once its arrays
#: are gone, so the same few blocks serve every iteration.
PINNED_MAPS_HOST_FRACTION = 0.02
PINNED_MAP_SETS = 3


def pinned_maps_ok(map_bytes: int, available_host_bytes: int, ranks_on_host: int = 1) -> bool:
    """Whether one set of an M-step's maps (``map_bytes``) may come back to the host in page-locked memory."""
    share = PINNED_MAPS_HOST_FRACTION * max(0, int(available_host_bytes)) / max(1, int(ranks_on_host))
    return 0 < PINNED_MAP_SETS * int(map_bytes) <= share


# ----------------------------------------------------------------------------------------------------------
# One E-step iteration: batches, fine chunks, the union of significant orientations
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
#: Bytes that one reconstruction chunk may use, and the smallest fine-pass chunk: compute's slab size (fixed, so
#: that the order of the sums is the same on every machine).
CHUNK_BYTES = SLAB_BYTES
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


#: The rotated template spectra of a template-matching job are kept between micrographs (same grid) when they take
#: less than this fraction of the free memory.
TEMPLATE_CACHE_FRACTION = 0.3


def keep_template_cache(cache_bytes: int, free_bytes: int) -> bool:
    """Whether the rotated template spectra (``cache_bytes``) are kept between micrographs."""
    return cache_bytes < TEMPLATE_CACHE_FRACTION * free_bytes


#: A job keeps its particle images on the GPU when they take at most 1/this of what its memory plan leaves free at
#: its peak.
DEVICE_IMAGES_FRACTION = 4
#: An MPI rank's store of its own images has room for this many times its first share of the particles (the shares
#: follow the ranks' measured speeds from iteration to iteration).
RANK_IMAGES_MARGIN = 1.25


def device_images_capacity(n_images: int, image_bytes: int, free_at_peak: int, own_rows: int | None = None
                           ) -> int:
    """Images of ``image_bytes`` each to keep on the GPU: every one of ``n_images`` in one process, or an MPI
    rank's ``own_rows`` with RANK_IMAGES_MARGIN; 0 when they would take more than 1/DEVICE_IMAGES_FRACTION of
    ``free_at_peak`` (bytes the run's plan leaves free)."""
    count = n_images if own_rows is None else min(n_images, int(np.ceil(own_rows * RANK_IMAGES_MARGIN)))
    return count if count * image_bytes <= free_at_peak // DEVICE_IMAGES_FRACTION else 0


def device_read_ahead_bytes(host_ahead_bytes: int, free_after_images: int) -> int:
    """How far ahead a reader that uploads its blocks to the GPU (ParticleSet.read_ahead with an upload) may read:
    the host's bound (read_ahead_bytes), at most 1/DEVICE_IMAGES_FRACTION of what the run's plan leaves free at its
    peak once the image store is made (``free_after_images``); 0 (no uploads by the reader) below
    READ_AHEAD_MIN_BYTES, which a reader started before the store keeps (a bound is never lowered). As much
    page-locked host memory stages the copies (compute.backend.thread_upload), kept by CuPy's pinned pool."""
    out = min(int(host_ahead_bytes), max(0, int(free_after_images)) // DEVICE_IMAGES_FRACTION)
    return out if out >= READ_AHEAD_MIN_BYTES else 0


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
                adaptive_chunks: bool = True, largest_transient: int = 0,
                gathered_slices: bool = False) -> MemoryPlan:
    """The memory plan of one E-step iteration. ``n_references`` counts every padded Fourier reference held
    (classes x halves); each has an accumulator of the same grid (complex128 data + float64 weight) beside its
    complex64 reference. ``requested_batch`` (--batch) wins when positive; otherwise the batch is what
    BATCH_FRACTION of the memory left after the references and accumulators holds, at most MAX_BATCH_2D, or
    MAX_BATCH_3D_GPU on a GPU (``adaptive_chunks``) and MAX_BATCH_3D on the CPU.
    ``adaptive_chunks=False`` (the CPU) fixes the fine-pass chunk at CHUNK_BYTES instead of a fraction of the
    free memory: the chunks set the order of the sums, so a fixed chunk gives the same numbers on any host
    however busy (a GPU's atomics make the order vary anyway; there larger chunks are faster).
    ``largest_transient``: the run's largest planned transient (compute/memory_plan.JobMemory), which sets the
    budget of the union of significant orientations (:func:`union_budget`). ``gathered_slices``: each particle
    scores its own rows (local searches), whose coarse slices count per particle
    (memory_model.LOCAL_SLICE_BYTES_PER_PIXEL on a GPU, ``adaptive_chunks``, where the fused projection makes
    them; LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE on the CPU)."""
    grid = (pad * box) ** (ndim - 1) * (pad * box // 2 + 1)
    ref_bytes = n_references * grid * 8
    acc_bytes = n_references * grid * (16 + 8)
    per = estep_bytes_per_particle(rows_per_particle, translations, box, coarse_pixels)
    slices = 0  # a local search's gathered coarse slices, freed before the fine passes
    if gathered_slices:
        slices = (LOCAL_SLICE_BYTES_PER_PIXEL if adaptive_chunks else LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE) \
            * rows_per_particle * coarse_pixels
        per += slices
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
    union = union_budget(free_bytes, ref_bytes + acc_bytes, largest_transient, batch * (per - slices), fine)
    return MemoryPlan(int(free_bytes), ref_bytes, acc_bytes, per, batch, fine, rows_per_particle, translations,
                      union)


#: Above this fraction of the device's memory held in CuPy's pool but used by no array, the cache is given back
#: between iterations (transient blocks of varying sizes pile up, GBs per iteration; releasing every time made the
#: next E-steps up to 2x slower on the H100).
MAX_CACHED_FRACTION = 0.25


def release_cached(be: Backend, max_cached_fraction: float = MAX_CACHED_FRACTION) -> None:
    """Give the device memory that CuPy's pool caches but no array uses back to the driver once it exceeds
    ``max_cached_fraction`` of the device (between iterations)."""
    if be.is_gpu:
        with be.xp.cuda.Device(be.device):
            pool = be.xp.get_default_memory_pool()
            _free, total = be.xp.cuda.runtime.memGetInfo()
            if pool.free_bytes() > max_cached_fraction * total:
                pool.free_all_blocks()


#: Fraction of the free memory that one batch of images may use where a job cuts its images into batches by
#: their size (extraction, reconstruction from known angles).
IMAGE_BATCH_FRACTION = 0.25


def image_batch(free_bytes: int, bytes_per_image: int, n_images: int, most: int | None = None) -> int:
    """Images per batch: what IMAGE_BATCH_FRACTION of ``free_bytes`` holds at ``bytes_per_image``, at least one,
    at most ``n_images`` (and ``most`` when given)."""
    n = min(int(n_images), int(IMAGE_BATCH_FRACTION * free_bytes // max(int(bytes_per_image), 1)))
    if most is not None:
        n = min(n, int(most))
    return int(max(1, n))


def batched_with_oom_retry(n: int, batch: int, work: Callable[[int, int], None],
                           backend: Backend) -> Iterator[tuple[int, int] | Message]:
    """Call ``work(start, stop)`` over [0, n) in batches; on out-of-memory, free cached blocks, halve the batch
    and retry the same range (never fails for memory unless one item alone does not fit). The OOM policy of the
    jobs that cut their items into batches (extraction, picking, reconstruction).

    Yields (done, n) after each batch, and a Message when the batch shrinks."""
    i = 0
    b = max(1, int(batch))
    while i < n:
        check_cancel()
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
# The whole job: what it holds, its largest transient, and whether it fits (issue 21)
# ----------------------------------------------------------------------------------------------------------

#: Bytes per half-grid voxel of what is held: the prepared reference (complex64) and the accumulator (real and
#: imaginary data and the weight, float64 each).
REFERENCE_BYTES_PER_VOXEL = 8
ACCUMULATOR_BYTES_PER_VOXEL = 24
#: Peak transient bytes per half-grid voxel, by padding factor (measured peaks of the NumPy code in brackets):
#: preparing one reference (projector.prepare_reference, slab-wise, one axis at a time: 17 at pad 2, 38 at pad 1,
#: the returned reference included), reconstructing one class (backprojector.reconstruct_grids, slab-wise with
#: cropped inverse FFTs: 12 at pad 2, 34-42 at pad 1, plus about twice its slab budget) and, in auto-refine, the
#: half-map FSC from the accumulators (maximization.fsc_from_backprojectors: both halves pooled onto the N grid;
#: 9.3 at pad 2, 73 at pad 1). The shell sums (sigma2_ref, SSNR, tau2) are slab-wise: under 1.
PREPARE_BYTES_PER_VOXEL = {1: 40, 2: 20}
RECONSTRUCT_BYTES_PER_VOXEL = {1: 48, 2: 16}
FSC_BYTES_PER_VOXEL = {1: 76, 2: 10}


def _by_pad(table: dict[int, int], pad: int) -> int:
    return table[min(max(pad, 1), 2)]  # pad > 2: at most pad 2's bytes per voxel (the box is a smaller part)


def prepare_bytes(box: int, pad: int, ndim: int = 3, slab_bytes: int = CHUNK_BYTES) -> int:
    """Peak transient of preparing one padded Fourier reference (bytes): its grid part plus twice the slab
    budget ``slab_bytes``."""
    return grid_voxels(box, pad, ndim) * _by_pad(PREPARE_BYTES_PER_VOXEL, pad) + 2 * slab_bytes


def mstep_bytes(box: int, pad: int, ndim: int = 3, slab_bytes: int = CHUNK_BYTES, n_halves: int = 1) -> int:
    """Peak transient of the M-step of one class (bytes): its reconstruction (grid part plus twice the slab
    budget ``slab_bytes``) or, with gold-standard halves, the half-map FSC if larger."""
    v = grid_voxels(box, pad, ndim)
    fsc = v * _by_pad(FSC_BYTES_PER_VOXEL, pad) + 2 * slab_bytes if n_halves == 2 else 0
    return max(v * _by_pad(RECONSTRUCT_BYTES_PER_VOXEL, pad) + 2 * slab_bytes, fsc)


GIB = 1024.0**3


def grid_voxels(box: int, pad: int, ndim: int) -> int:
    """Voxels of one padded half grid: P^(ndim-1) (P/2 + 1), P = pad x box."""
    P = pad * box
    return P ** (ndim - 1) * (P // 2 + 1)


def translation_count(offset_range: float, offset_step: float) -> int:
    """How many coarse translations compute.sampling.translation_grid makes (2D: the points i x step with
    x^2 + y^2 < range^2 + 0.001), counted without making them (a tiny step would make billions): exactly up to
    2 million points per axis, beyond that the disc's area."""
    if not offset_step > 0 or not offset_range >= 0:
        return 1
    m = math.ceil(offset_range / offset_step)
    if m > 1 << 20:
        return int(math.pi * (offset_range / offset_step) ** 2)
    ax = np.arange(-m, m + 1, dtype=np.float64) * offset_step
    sq = np.sort(ax * ax)
    return int(np.searchsorted(sq, offset_range**2 + 0.001 - ax * ax, side="left").sum())


#: Up to this HEALPix order the directions of an asymmetric unit are counted exactly (compute.sampling; at most
#: 12,288 pixels, milliseconds); beyond it as the sphere's pixels over the point group's order.
EXACT_DIRECTIONS_ORDER = 5


@dataclass(frozen=True)
class SearchSpace:
    """The coarse search of one particle in the E-step as a job's options give it (its first iteration's
    sampling: compute.sampling.Sampling in 3D, InPlaneSampling in 2D), counted without making it, for the memory
    plan of the whole run before any work."""

    ndim: int  # of the references: 3 = HEALPix directions x psi, 2 = psi only
    n_classes: int
    offset_range: float  # pixels
    offset_step: float  # pixels
    order: int = 0  # 3D: the HEALPix order
    sym: str = "C1"  # 3D: the point group (the directions are its asymmetric unit)
    sym_order: int = 1
    psi_step: float = 0.0  # 2D: the coarse in-plane step (degrees)
    local_sigma: float = 0.0  # > 0: local searches with this angular sigma (degrees)
    own_orientation: bool = False  # --skip_align: each particle at its own orientation and offset
    # the first iteration's image size, with the pixel size and particle diameter (Å) that set its coarse size
    # (0: not given, the coarse slices of a global search not counted)
    first_size: int = 0
    pixel_size: float = 1.0
    diameter_A: float = 0.0

    @property
    def angular_step(self) -> float:
        return angular_step(self.order) if self.ndim == 3 else self.psi_step

    @functools.cached_property
    def directions(self) -> int:
        if self.ndim != 3:
            return 1
        if self.order <= EXACT_DIRECTIONS_ORDER:
            from ..compute.sampling import asymmetric_unit_pixels  # noqa: PLC0415

            return int(asymmetric_unit_pixels(self.order, self.sym).size)
        return max(1, 12 * 4**self.order // max(1, self.sym_order))

    @property
    def psi(self) -> int:
        return math.ceil(360.0 / self.angular_step - 1e-9) if self.angular_step > 0 else 1

    @property
    def orientations(self) -> int:
        """Coarse orientations a particle is compared at (per class)."""
        if self.own_orientation:
            return 1
        if self.local_sigma > 0 and self.ndim == 3:
            from ..compute.sampling import local_search_rows  # noqa: PLC0415

            return min(self.directions * self.psi, local_search_rows(self.angular_step, self.local_sigma))
        return self.directions * self.psi

    @property
    def rows(self) -> int:
        return self.n_classes * self.orientations

    @property
    def translations(self) -> int:
        return 1 if self.own_orientation else translation_count(self.offset_range, self.offset_step)

    @property
    def n_children(self) -> int:
        """Fine orientations per coarse one (oversampling 1: 4 directions x 2 psi in 3D, 2 psi in 2D)."""
        return 1 if self.own_orientation else 8 if self.ndim == 3 else 2

    @property
    def fine_translations(self) -> int:
        return 1 if self.own_orientation else 4 * self.translations

    def coarse_pixels(self, box: int) -> int:
        """Fourier pixels of the first iteration's coarse image (RELION's coarse size: compute.maximization
        coarse_image_size, at most the first image size; the smallest a run uses), 0 when not given."""
        if self.first_size <= 0 or self.diameter_A <= 0:
            return 0
        from ..compute.expectation import pixel_set  # noqa: PLC0415
        from ..compute.maximization import coarse_image_size  # noqa: PLC0415

        size = coarse_image_size(box, self.pixel_size, self.angular_step, self.diameter_A, self.first_size,
                                 kappa=1.2 if self.ndim == 3 else 1.5)
        return int(pixel_set(box, size).npix)

    def slices_bytes(self, box: int) -> int:
        """What a global search holds through an E-step: the coarse slices of every (class, orientation) row at
        the first iteration's coarse size (compute.estep.EStepSetup.coarse_slices: [Re, Im] float32 padded to the
        GEMM width, and |P|^2 float32); 0 for local searches and --skip_align (their slices come per batch)."""
        if self.own_orientation or (self.local_sigma > 0 and self.ndim == 3):
            return 0
        from ..compute.expectation import gemm_width  # noqa: PLC0415

        npix = self.coarse_pixels(box)
        return self.rows * (4 * gemm_width(npix) + 4 * npix) if npix else 0

    def particle_bytes(self, box: int) -> tuple[int, int]:
        """(coarse, fine): the E-step's bytes for one particle at the full image size ``box``: its coarse scores,
        priors and weights over every (row, translation) with its image and score terms
        (memory_model.estep_bytes_per_particle), and its fine pass with a single significant coarse row (its
        image at every fine translation and that row's fine samples). A local search's coarse bytes include its own
        rows' gathered slices, at the array code's LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE (the larger of the two
        paths: this plan serves both devices)."""
        pixels = box * (box // 2 + 1)
        ft = self.fine_translations
        coarse = estep_bytes_per_particle(self.rows, self.translations, box, pixels)
        if self.local_sigma > 0 and self.ndim == 3 and not self.own_orientation:
            coarse += LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE * self.rows * pixels
        return coarse, fine_bytes_per_particle(ft, pixels) + self.n_children * fine_bytes_per_sample(ft, pixels)

    def describe(self) -> str:
        if self.own_orientation:
            what = "its own orientation and offset"
        elif self.ndim == 3:
            local = f", local searches of sigma {self.local_sigma:g}°" if self.local_sigma > 0 else ""
            what = (f"HEALPix order {self.order} ({self.angular_step:.3g}°{local}: {self.orientations:,} "
                    f"orientations)")
        else:
            what = f"psi step {self.angular_step:g}° ({self.orientations:,} orientations)"
        return (f"{self.n_classes} class(es) x {what} x {self.translations:,} translations (offset range "
                f"{self.offset_range:g} px, step {self.offset_step:g} px)")


@dataclass(frozen=True)
class JobMemory:
    """The memory plan of a whole EM job (bytes): what it holds, its largest transient, and the budget."""

    box: int
    ndim: int
    pad: int
    n_classes: int
    n_halves: int
    budget_bytes: int
    references: int
    accumulators: int
    prepare: int
    reconstruct: int
    estep_minimum: int
    search: SearchSpace | None = None  # the first iteration's search, when the job gave it
    estep_coarse: int = 0  # of estep_minimum: one particle's coarse scores (search given)
    estep_fine: int = 0  # its fine pass
    estep_slices: int = 0  # and the coarse slices of a global search

    @property
    def held(self) -> int:
        return self.references + self.accumulators

    @property
    def largest_transient(self) -> int:
        """The largest transient of the run (preparation, M-step or the smallest E-step): what the E-step's union
        of significant orientations may use besides its batch (backend.union_budget)."""
        return max(self.prepare, self.reconstruct, self.estep_minimum)

    @property
    def peak(self) -> int:
        """The least a run needs at its busiest moment: everything held plus the largest transient."""
        return self.held + self.largest_transient

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget_bytes

    @property
    def estep_fits(self) -> bool:
        """Whether one particle's E-step fits beside what is held (the grids may still not)."""
        return self.held + self.estep_minimum <= self.budget_bytes

    def table(self) -> str:
        """The plan as a few aligned lines (GiB)."""
        n = self.n_classes * self.n_halves
        what = f"{self.n_classes} class(es) x {self.n_halves} half(s)"
        rows = [(f"padded references ({what}, box {self.box}, pad {self.pad})", self.references),
                (f"accumulators ({n} x data + weight)", self.accumulators),
                ("preparing one reference (transient)", self.prepare),
                ("M-step of one class (transient)", self.reconstruct),
                ("E-step at one particle (a global search: with its coarse slices) and its fine chunk (transient)",
                 self.estep_minimum),
                ("needed at the peak (held + largest transient)", self.peak),
                ("budget (free memory or --memory_limit)", self.budget_bytes)]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"  {name:<{width}}  {b / GIB:9.2f} GiB" for name, b in rows)


def job_memory(*, box: int, ndim: int, pad: int, n_classes: int, n_halves: int, budget_bytes: int,
               rows_per_particle: int = 1, translations: int = 1, search: SearchSpace | None = None) -> JobMemory:
    """The plan of a job at the full image size (the last iterations reach it). ``rows_per_particle`` and
    ``translations`` size the one-particle E-step (classes x orientations of the coarsest search); ``search``,
    when given, sizes it instead, with the fine pass of that one particle (its chunk is at least the smallest
    fine chunk, CHUNK_BYTES, and more where one particle's fine pass needs more)."""
    v = grid_voxels(box, pad, ndim)
    n = n_classes * n_halves
    pixels = box * (box // 2 + 1)  # the Fourier half-plane of one image at the full size
    if search is not None:
        (coarse, fine), slices = search.particle_bytes(box), search.slices_bytes(box)
    else:
        coarse, fine, slices = estep_bytes_per_particle(rows_per_particle, translations, box, pixels), 0, 0
    return JobMemory(box, ndim, pad, n_classes, n_halves, int(budget_bytes), n * v * REFERENCE_BYTES_PER_VOXEL,
                     n * v * ACCUMULATOR_BYTES_PER_VOXEL, prepare_bytes(box, pad, ndim),
                     mstep_bytes(box, pad, ndim, n_halves=n_halves), slices + coarse + max(CHUNK_BYTES, fine),
                     search, coarse, fine, slices)


def choose_padding(requested_pad: int, **kw) -> tuple[JobMemory, str | None]:
    """The plan with ``requested_pad``, or with pad 1 when the requested padding does not fit and pad 1 does
    (RELION's advice for large boxes: interpolation is a little less accurate, the grids 2^ndim times smaller).
    Returns the plan and a note saying what was chosen (None when nothing changed)."""
    plan = job_memory(pad=requested_pad, **kw)
    if plan.fits or requested_pad <= 1:
        return plan, None
    one = job_memory(pad=1, **kw)
    if one.fits:
        return one, (f"--pad {requested_pad} needs {plan.peak / GIB:.1f} GiB but {plan.budget_bytes / GIB:.1f} "
                     f"GiB are available; running with --pad 1 ({one.peak / GIB:.1f} GiB)")
    return plan, None


def _replan(plan: JobMemory, search: SearchSpace) -> JobMemory:
    return job_memory(box=plan.box, ndim=plan.ndim, pad=plan.pad, n_classes=plan.n_classes, n_halves=plan.n_halves,
                      budget_bytes=plan.budget_bytes, search=search)


def _search_ideas(plan: JobMemory) -> list[str]:
    """What would make one particle's E-step fit: the finest HEALPix order (3D global searches) or in-plane step
    (2D) that does, else the finest translation step, else the two together."""
    s = plan.search
    angular: list[tuple[str, SearchSpace]] = []
    if not s.own_orientation and s.ndim == 3 and s.local_sigma <= 0:
        angular = [(f"--healpix_order {k}", replace(s, order=k)) for k in range(s.order - 1, -1, -1)]
    elif not s.own_orientation and s.ndim == 2:
        angular = [(f"--psi_step {s.psi_step * 2**k:g}", replace(s, psi_step=s.psi_step * 2**k)) for k in range(1, 12)
                   if s.psi_step * 2**k <= 180]
    steps = [s.offset_step * 2**k for k in range(1, 40) if s.offset_step * 2**k <= max(2 * s.offset_range, 1)]
    shifts = [] if s.translations <= 1 else [(f"--offset_step {step:g}", replace(s, offset_step=step))
                                              for step in steps]
    both = [(f"{a} with {b}", replace(sa, offset_step=sb.offset_step)) for a, sa in angular for b, sb in shifts]
    for candidates in (angular, shifts, both):
        for option, smaller in candidates:
            need = _replan(plan, smaller)
            if need.fits:
                return [f"{option} needs {need.peak / GIB:.1f} GiB"]
    return []


def refusal(plan: JobMemory, job: str) -> str:
    """One line: why ``plan`` cannot run and what would make it fit (numbers in GiB). When the grids fit but one
    particle's E-step does not (the search of plan.search), what that particle needs and which search would fit."""
    if plan.search is not None and not plan.estep_fits and plan.held + max(plan.prepare, plan.reconstruct) \
            <= plan.budget_bytes:
        ideas = _search_ideas(plan) or ["a machine with more memory"]
        slices = (f", {plan.estep_slices / GIB:.2f} GiB for the coarse slices of every orientation (at the "
                  f"first iteration's coarse size)" if plan.estep_slices else "")
        return (f"{job} cannot fit even one particle per E-step batch: {plan.search.describe()} need "
                f"{plan.estep_coarse / GIB:.1f} GiB per particle for the coarse scores, "
                f"{max(plan.estep_fine, CHUNK_BYTES) / GIB:.2f} GiB for its fine pass{slices} and "
                f"{plan.held / GIB:.2f} GiB of references and accumulators: {plan.peak / GIB:.1f} GiB, but "
                f"{plan.budget_bytes / GIB:.1f} GiB are available; " + "; ".join(ideas))
    kw = dict(box=plan.box, ndim=plan.ndim, n_halves=plan.n_halves, budget_bytes=plan.budget_bytes,
              search=plan.search)
    ideas = []
    if plan.pad > 1:
        one = job_memory(pad=1, n_classes=plan.n_classes, **kw)
        ideas.append(f"--pad 1 needs {one.peak / GIB:.1f} GiB")
    if plan.n_classes > 1:
        for k in range(plan.n_classes - 1, 0, -1):
            fewer = job_memory(pad=plan.pad, n_classes=k, **kw)
            if fewer.fits or k == 1:
                ideas.append(f"--K {k} needs {fewer.peak / GIB:.1f} GiB")
                break
    ideas.append("a GPU with more memory")
    return (f"{job} cannot fit: box {plan.box} with --pad {plan.pad}, {plan.n_classes} class(es) x "
            f"{plan.n_halves} half(s) needs {plan.peak / GIB:.1f} GiB (references {plan.references / GIB:.1f}, "
            f"accumulators {plan.accumulators / GIB:.1f}, largest transient "
            f"{(plan.peak - plan.held) / GIB:.1f}) but {plan.budget_bytes / GIB:.1f} GiB are available; "
            + "; ".join(ideas))


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
        set_mark_hook(self.mark)
        return self

    def __exit__(self, *exc) -> None:
        global _trace
        _trace = None
        set_mark_hook(None)
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


def memory_trace_active() -> MemoryTrace | None:
    return _trace

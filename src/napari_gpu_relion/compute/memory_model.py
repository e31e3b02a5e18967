"""What compute's arrays cost: the bytes of the E-step's batches, fine chunks and unions per particle, orientation
and pixel, and the fixed working-set sizes that compute's functions cut their temporaries into.

The sizes here are not a budget: they do not depend on the machine. A slab or chunk sets the order of the sums,
so a fixed size gives the same numbers on every machine. How much of the free memory a job uses, its batches and
its retries after an out-of-memory error are decided by the runtime (``runtime.memory``), from these models.
"""

from __future__ import annotations

#: Bytes of temporaries one slab of a grid operation may use (FFTs one axis at a time, reconstruction, shell sums,
#: the smallest fine-pass chunk, the chunks of a summed array between ranks).
SLAB_BYTES = 1 << 28
#: Points per scatter-add call of the back-projection (bounds its index and weight arrays to ~400 MB).
INSERT_CHUNK_POINTS = 1 << 23
#: Points per chunk of the projection's and the back-projection's array code on the CPU: their temporaries (a few
#: MB) then stay in the cache and are reused by the allocator, where chunks of 2^23-2^24 points made every
#: temporary fresh pages from the kernel. A class3d E-step at HEALPix order 2 (60 particles, box 32, 2 cores) took
#: 65 s with the large chunks (35 s of it in the kernel), 27 s with 2^15 points (benchmarks/README.md).
CPU_CHUNK_POINTS = 1 << 15
#: Bytes of the complex temporary per block of particles when NumPy makes the shifted particle terms
#: (expectation.stacked_shifted): a cache-sized block of one complex product, then its real and imaginary halves
#: copied out, instead of six passes of float32 products over the whole (particles, translations, pixels) array
#: (3x faster at 64 particles x 21 translations x 1,000 pixels on the 2-core VM).
CPU_SHIFT_BLOCK_BYTES = 1 << 20


def orientations_per_chunk(xp, chunk_points: int, npix: int, target_size: int = 0) -> int:
    """Orientations of ``npix`` pixels per chunk of the projection or back-projection: ``chunk_points`` points on a
    GPU; with NumPy (``xp``) at most CPU_CHUNK_POINTS, but for a back-projection at least an eighth of its
    ``target_size`` (the elements of the grid or stack it adds into: a float32 grid's bincount makes an array of
    that size for every chunk, which then costs no more than the chunk's eight corners per point; float64 grids add
    by numpy.add.at, as fast at that size); at least one."""
    points = chunk_points
    if xp.__name__ == "numpy":
        points = min(chunk_points, max(CPU_CHUNK_POINTS, int(target_size) // 8))
    return max(1, int(points) // max(int(npix), 1))


def estep_bytes_per_particle(rows: int, translations: int, box: int, coarse_pixels: int) -> int:
    """Device bytes one particle needs in an E-step batch: the coarse score, log-prior and weight blocks
    (float32, rows x translations, 3 arrays), the image in real and Fourier space at the full box (8 float32
    planes: masked and unmasked, complex), and the particle terms of the score GEMM (translations x coarse
    pixels, complex float32 stacked [Re, Im])."""
    return 4 * (rows * translations * 3 + 8 * box * box) + 8 * translations * coarse_pixels * 2


#: Device bytes per (particle, candidate row, coarse pixel) of a local search's coarse pass, whose particles each
#: score their own rows: the gathered slices ([Re, Im] and |P|^2 float32), made straight by the fused projection
#: on a GPU (estep._gathered_coarse_slices). A GPU batch whose distinct rows are fewer than half its pairs takes the
#: array code instead, up to 18 bytes per pair (12 per distinct row and 12 per pair): the batch fraction of the plan
#: (runtime.memory.BATCH_FRACTION) leaves room for that, and out-of-memory halves the batch.
LOCAL_SLICE_BYTES_PER_PIXEL = 12
#: The same where the array code makes them (the CPU; on a GPU a batch whose distinct rows are fewer than half its
#: pairs): the distinct rows' complex slices, |P|^2 and stacked copy (24 bytes per distinct row and pixel at the
#: peak), then the gathered copy (12) beside the distinct rows' slices (12): at most 24 bytes per pair, reached
#: when every pair has its own row. tests/test_memory_plan.py measures it with tracemalloc.
LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE = 24


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
#: each is made or reduced (expectation.stacked_shifted, sum_conj_shifted). tests/test_memory_plan.py measures it
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

"""The memory a relion_refine-style job holds for its whole run, planned before iteration 1 (issue 21).

What a job holds does not depend on the particles: per class and gold-standard half one padded Fourier reference
(complex64) and one accumulator (data and weight), each on the half grid of edge P = pad x box. Around them come
transients: preparing a reference (zero-padded map and its FFT), reconstructing a class (the M-step's grids and
inverse FFT), and the E-step's particle batch and fine-pass chunk, which shrink with the memory left (the batch
down to one particle, the chunk down to backend.CHUNK_BYTES). A job fits when the held arrays plus the largest
transient fit the budget (the free device memory, or less with --memory_limit). The bytes per grid voxel of the
transients are the measured peaks of the NumPy code (tracemalloc, tests/test_memory_plan.py keeps them true).
"""

from __future__ import annotations

from dataclasses import dataclass

from .backend import CHUNK_BYTES, estep_bytes_per_particle

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

    def table(self) -> str:
        """The plan as a few aligned lines (GiB)."""
        n = self.n_classes * self.n_halves
        what = f"{self.n_classes} class(es) x {self.n_halves} half(s)"
        rows = [(f"padded references ({what}, box {self.box}, pad {self.pad})", self.references),
                (f"accumulators ({n} x data + weight)", self.accumulators),
                ("preparing one reference (transient)", self.prepare),
                ("M-step of one class (transient)", self.reconstruct),
                ("E-step at one particle and the smallest fine chunk (transient)", self.estep_minimum),
                ("needed at the peak (held + largest transient)", self.peak),
                ("budget (free memory or --memory_limit)", self.budget_bytes)]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"  {name:<{width}}  {b / GIB:9.2f} GiB" for name, b in rows)


def job_memory(*, box: int, ndim: int, pad: int, n_classes: int, n_halves: int, budget_bytes: int,
               rows_per_particle: int = 1, translations: int = 1) -> JobMemory:
    """The plan of a job at the full image size (the last iterations reach it). ``rows_per_particle`` and
    ``translations`` size the one-particle E-step (classes x orientations of the coarsest search)."""
    v = grid_voxels(box, pad, ndim)
    n = n_classes * n_halves
    pixels = box * (box // 2 + 1)  # the Fourier half-plane of one image at the full size
    return JobMemory(box, ndim, pad, n_classes, n_halves, int(budget_bytes), n * v * REFERENCE_BYTES_PER_VOXEL,
                     n * v * ACCUMULATOR_BYTES_PER_VOXEL, prepare_bytes(box, pad, ndim),
                     mstep_bytes(box, pad, ndim, n_halves=n_halves),
                     estep_bytes_per_particle(rows_per_particle, translations, box, pixels) + CHUNK_BYTES)


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


def refusal(plan: JobMemory, job: str) -> str:
    """One line: why ``plan`` cannot run and what would make it fit (numbers in GiB)."""
    kw = dict(box=plan.box, ndim=plan.ndim, n_halves=plan.n_halves, budget_bytes=plan.budget_bytes)
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

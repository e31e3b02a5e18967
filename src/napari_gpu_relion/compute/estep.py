"""One E-step over a batch of particles: preprocessing, the coarse pass, the fine (oversampled) pass, the
per-particle results and the weighted sums for the M-step (relion_algorithm.md 2.4-3.7).

Orientation "rows" are (class, orientation) pairs, class-major. A global search scores every row with one
GEMM shared by all particles; a local search (or the fine pass) gathers each particle's own candidate rows and
uses batched GEMMs (compute/expectation.py). Fine candidates are the 8 orientation x 4 translation children of
each significant coarse sample; non-candidates are masked with a log-prior of -inf, so the products stay dense.

``expectation_batch`` runs these steps:

1. ``_coarse_pass``: scores of every (translation, row) at the coarse pixels, log priors, posterior weights and
   RELION's significance.
2. ``_significant_rows`` and ``_fine_particles``: the significant (particle, row) pairs sorted by particle, the
   union of their rows and the particles' fine pixels.
3. ``plan_union_groups``: groups of particles whose union of significant rows fits the memory plan's
   ``union_bytes`` (one group, the whole batch, unless the union is larger); per group:
   ``_with_union_slices`` (the slices of all children of the group's union), ``plan_fine_chunks`` (which
   particles form each fine-pass chunk, bounded by the memory budget), ``_fine_chunk`` (scores, weights, best
   samples and weighted sums of one chunk, into ``_FineSums``), ``_insert_summed_slices`` (one insertion per
   distinct fine orientation of the group into the class back-projectors) and ``_add_row_sums``. Out of memory
   in a group's fine passes (another process took the device memory after the plan was made): the group has
   added nothing yet, so it runs again with half the fine-chunk budget, then split in two, down to one particle.
   Out of memory once a group has added to the sums raises SumsAlreadyAddedError (a retry of the batch would
   count them twice).
4. ``_add_power_beyond_fine``: the image power of the shells beyond the fine size (noise and norm terms).
5. ``_best_poses`` and ``_add_mstep_sums``: the per-particle results and the sums for the M-step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import SumsAlreadyAddedError, is_out_of_memory
from ..marks import memory_mark
from . import gpu_kernels
from .backend import free_pool, get_array_module, matmul_tf32, to_host
from .backprojector import insert_by_class, insertion_orientations
from .ctf import CtfParams, ctf_from_frequencies, demodulation_factors, gamma_offsets
from .expectation import (
    PixelSet,
    SampleLogPrior,
    SliceSet,
    add_to_rows,
    as_slices,
    fine_sums,
    gather_pixels,
    gemm_width,
    grouped_sum,
    particle_terms,
    posterior_weights,
    project_as_slices,
    scores_gathered,
    scores_shared,
    segment_sum,
    segments_of,
    signal_products,
    translation_ramps,
)
from .fourier import (
    hermitian_unique_mask,
    irfft_centered,
    phase_shift_2d,
    rfft_centered,
    shell_grid,
    shell_sum,
)
from .geometry import magnified, magnified_frequencies
from .masks import soft_mask_outside
from .memory_model import (
    SLAB_BYTES,
    fine_bytes_per_particle,
    fine_bytes_per_score,
    fine_bytes_per_slice,
    union_bytes_per_orientation,
)
from .noise import counter_normal
from .projector import FourierReference, project_pixels, stack_references
from .sampling import GivenOrientations as GivenOrientations  # re-exported (the jobs still import them from here)
from .sampling import InPlaneSampling as InPlaneSampling
from .sampling import Sampling

# ----------------------------------------------------------------------------------------------------------
# Particle preprocessing
# ----------------------------------------------------------------------------------------------------------


@dataclass
class PreparedBatch:
    """Fourier data of a batch at the full box (RELION getFourierTransformsAndCtfs)."""

    F_masked: object  # (I, N, N//2+1) complex: masked image, pre-shifted by the rounded offset
    F_unmasked: object  # (I, N, N//2+1) complex: unmasked, pre-shifted (for the back-projection)
    rounded_offsets: np.ndarray  # (I, 2) integer pixels applied in real space


def prepare_batch(images, norm_factor, offsets_px, mask_radius_px: float, mask_edge_px: float = 5.0,
                  noise_sigma2=None, seed: int = 0, subpixel: bool = False, particle_ids=None) -> PreparedBatch:
    """images (I, N, N) float32 on the device; norm_factor (I,) = n_avg / n_i (1 without --norm);
    offsets_px (I, 2) current origin offsets. Steps: scale, shift by ROUND(offset) with zeros where nothing comes
    in (RELION's selfTranslate with DONT_WRAP: the zeros enter the outside mean of the mask), soft circular mask
    of ``mask_radius_px`` with a ``mask_edge_px`` raised-cosine edge filled with the outside mean (--zero_mask)
    or, given ``noise_sigma2`` (shells 0..N/2, one spectrum or one per particle (I, shells)), with coloured
    Gaussian noise of that spectrum, drawn per particle from (``seed``, ``particle_ids``) (default 0..I-1) so
    that it does not depend on the batch. ``subpixel``: afterwards also apply the fractional remainder as a
    Fourier phase shift, so the data sit at the exact offsets (--skip_align: the only translation is 0)."""
    xp = get_array_module(images)
    I, N = images.shape[0], images.shape[-1]
    rounded = np.sign(offsets_px) * np.floor(np.abs(offsets_px) + 0.5)
    x = images.astype(np.float32) * xp.asarray(norm_factor, dtype=np.float32)[:, None, None]
    xs = shift_zero_filled(x, rounded)
    Fu = rfft_centered(xs, 2)
    background = None
    if noise_sigma2 is not None:
        shells = xp.minimum(shell_grid(N, 2, xp), N // 2)
        s2 = xp.asarray(noise_sigma2, dtype=np.float64)
        s2 = s2[:, shells] if s2.ndim == 2 else s2[shells][None]  # (I or 1, N, N/2+1)
        ids = np.arange(I) if particle_ids is None else np.asarray(particle_ids)
        g = counter_normal(seed, xp.asarray(ids), (2, N, N // 2 + 1), xp)
        noise_F = (g[:, 0] + 1j * g[:, 1]) * xp.sqrt(s2)
        background = irfft_centered(noise_F, N, 2).astype(np.float32)
    xm = soft_mask_outside(xs, mask_radius_px, mask_edge_px, 2, background=background)
    Fm = rfft_centered(xm.astype(np.float32), 2)
    if subpixel:
        frac = xp.asarray(np.asarray(offsets_px, dtype=np.float64) - rounded)
        Fm, Fu = phase_shift_2d(Fm, frac, N), phase_shift_2d(Fu, frac, N)
        rounded = np.asarray(offsets_px, dtype=np.float64).copy()
    return PreparedBatch(Fm, Fu, rounded)


def shift_zero_filled(x, shifts_px):
    """Images x (I, N, N) moved by whole pixels ``shifts_px`` (I, 2) = (x, y) (pixel (r, c) of the result is
    pixel (r - y, c - x) of the image), zero where that lies outside the image (no wrapping)."""
    xp = get_array_module(x)
    I, N = x.shape[0], x.shape[-1]
    s = xp.asarray(np.asarray(shifts_px), dtype=np.int64)
    j = xp.arange(N, dtype=np.int64)
    src_x, src_y = j[None, :] - s[:, :1], j[None, :] - s[:, 1:2]  # (I, N) each
    inside = ((src_y >= 0) & (src_y < N))[:, :, None] & ((src_x >= 0) & (src_x < N))[:, None, :]
    out = x[xp.arange(I)[:, None, None], xp.clip(src_y, 0, N - 1)[:, :, None], xp.clip(src_x, 0, N - 1)[:, None, :]]
    return xp.where(inside, out, xp.zeros((), dtype=x.dtype))


def shell_power(F, nshells: int):
    """(I, nshells) sum of |F|^2 per shell over the unique half grid."""
    xp = get_array_module(F)
    N = F.shape[-2]
    sh = shell_grid(N, 2, xp)
    sh = xp.where(hermitian_unique_mask(N, 2, xp), sh, -1)
    return shell_sum((F.real * F.real + F.imag * F.imag).astype(np.float64), sh, nshells)


# ----------------------------------------------------------------------------------------------------------
# Accumulators of one E-step (per half / per class)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class EStepSums:
    """What the M-step needs, summed over the particles of one half (host float64 except the
    back-projectors, which stay on the device)."""

    backprojectors: list  # one BackProjector per class
    n_shells: int
    n_groups: int
    n_dirs: int
    sigma2: np.ndarray = None  # (G, n_shells) sum w |CP - X|^2 per shell
    sumw_group: np.ndarray = None  # (G,)
    pdf_class: np.ndarray = None  # (K,)
    pdf_direction: np.ndarray = None  # (K, n_dirs)
    sigma_offset: float = 0.0  # sum w |o - mu|^2, Å^2
    sum_weight: float = 0.0
    offset_sum: np.ndarray = None  # (K, 2) sum w (o + t) in Å per class (2D classification's class offset priors)
    n_scale_groups: int = 1
    xa: np.ndarray = None  # (n_scale_groups,) sum w Re(conj(CP) X) over shells with SSNR > 3
    aa: np.ndarray = None  # (n_scale_groups,) sum w |CP|^2 over the same shells
    log_likelihood: float = 0.0
    sum_pmax: float = 0.0
    n_particles: int = 0

    def __post_init__(self):
        K = len(self.backprojectors)
        self.sigma2 = np.zeros((self.n_groups, self.n_shells))
        self.sumw_group = np.zeros(self.n_groups)
        self.pdf_class = np.zeros(K)
        self.pdf_direction = np.zeros((K, self.n_dirs))
        self.offset_sum = np.zeros((K, 2))
        self.xa = np.zeros(self.n_scale_groups)
        self.aa = np.zeros(self.n_scale_groups)


@dataclass
class BatchResult:
    """Per-particle results of a batch (host arrays)."""

    matrices: np.ndarray  # (I, 3, 3) best orientation
    classes: np.ndarray  # (I,) 0-based
    offsets_px: np.ndarray  # (I, 2) new origin offsets (rounded + best fine translation)
    pmax: np.ndarray
    nr_significant: np.ndarray
    log_likelihood: np.ndarray
    residual_power: np.ndarray  # (I,) E_i for the norm correction
    union_groups: int = 1  # particle groups of the fine passes (more than 1: the union exceeded union_bytes)
    memory_note: str = ""  # what ran smaller after out-of-memory in the fine passes ("": nothing)


@dataclass
class EStepSetup:
    """Everything shared by the batches of one half in one iteration."""

    refs: list  # FourierReference per class
    sampling: Sampling
    pix_coarse: PixelSet
    pix_fine: PixelSet
    pixel_size: float
    sigma2: object  # (G, N/2+1) noise spectra on the device
    log_pdf_direction: object = None  # (K, n_dirs) device, for global searches (None -> uniform)
    sigma_offset_A: float = 10.0
    class_offset_prior_A: np.ndarray | None = None  # (K, 2) prior mean of the offsets per class (Å; 2D), else 0
    adaptive_fraction: float = 0.999
    max_significants: int = -1  # cap on the significant coarse samples per particle (RELION --maxsig; -1 = none)
    cc: bool = False
    #: The coarse pass's score GEMMs in TF32 on tensor cores (GPU): that pass only selects the samples that the
    #: fine pass scores again in float32, from which the weights and the best pose come.
    coarse_tf32: bool = False
    relion_offset_prior: bool = True  # RELION 5's offset-prior arithmetic (_log_trans_prior); False: Å throughout
    scale_shells: object = None  # (K classes, pixels of the fine set) bool: the class's SSNR > 3 (group scale sums)
    max_fine_bytes: int = SLAB_BYTES  # budget of one fine-pass chunk (plan_fine_chunks)
    max_union_bytes: int = 1 << 62  # budget of the union of significant orientations of a group (plan_union_groups)
    P_coarse: object = None  # SliceSet (K * R, Kc) of the coarse slices for global searches (made once)
    #: The last union's fine slices (_UnionSlices), kept for the next batch: a batch whose union is the same rows,
    #: or most of them, uses them instead of projecting its own (_union_from_cache). None frees them.
    union_cache: object = None
    #: Called between the steps of a batch and before every fine chunk; it raises (the jobs' JobCancelled) to stop
    #: the E-step when the user cancels. It must not change anything: results are the same with and without it.
    check_cancel: Callable[[], None] | None = None
    #: Each optics group's beam tilt and Zernike aberrations (compute.ctf.OpticsAberrations, by 0-based optics
    #: group; None: none): the images are demodulated (odd terms) and the CTFs carry the even terms, as RELION's.
    aberrations: tuple | None = None
    #: The images' anisotropic magnification (2x2, rlnMagMat; None: none): projections and insertions at
    #: geometry.magnified matrices, CTFs at mag k (RELION's); every particle of this setup has it.
    mag: np.ndarray | None = None
    _demodulation: object = field(default=None, init=False, repr=False)  # (box, (G, N, N/2+1) factors)
    ref_stack: FourierReference = field(init=False)  # all classes in one stack: one projection call for any rows

    def __post_init__(self):
        self.ref_stack = self.refs[0] if len(self.refs) == 1 else stack_references(self.refs)

    def coarse_slices(self):
        if self.P_coarse is None:
            R = self.sampling.n_orient
            self.P_coarse = _row_slices(self, np.arange(len(self.refs) * R), self.pix_coarse, False,
                                        gemm_width(self.pix_coarse.npix))
        return self.P_coarse


def _weights_for(sigma2_rows, pix: PixelSet, xp):
    """w = 1/(2 sigma2) per pixel (0 at DC) and m = 1/sigma2 (DC kept) for each particle's group rows."""
    s2 = sigma2_rows[:, pix.shell]  # (I, K)
    inv = xp.where(s2 > 0, 1.0 / xp.maximum(s2, 1e-30), 0.0)
    w = xp.where(pix.shell[None, :] >= 1, 0.5 * inv, 0.0).astype(np.float32)
    return w, inv.astype(np.float32)


def _log_trans_prior(offsets_round_px, trans_px, pixel_size: float, sigma_A: float, xp, prior_A,
                     relion_units: bool = True):
    """(I, T, K) log prior -|d|^2 / (2 sigma^2) of the coarse translations ``trans_px`` (T, 2) for prior means
    mu_k (K, 2) in Å (one per class in 2D classification; K = 1 and mu = 0 otherwise).

    ``relion_units`` (the default): RELION 5.0.1's arithmetic (ml_optimiser.cpp, the pdf_offset of
    convertAllSquaredDifferencesToWeights), d = (o + t pixel_size) pixel_size - mu: the translation in Å added to
    the old offset o in pixels, with ``trans_px`` the translations BEFORE the sampling's random perturbation
    (RELION evaluates the prior on its unperturbed grid and perturbs only the shifts of the images). Its prior on
    the translation is pixel_size times narrower than sigma says: it holds translations near their start, which
    RELION's results (and its classes: issue 16, benchmarks/README.md) depend on. ``relion_units=False``
    (--angstrom_offset_prior): d = (o + t) pixel_size - mu, one unit throughout as relion_algorithm 2.8
    documents it, at the searched (perturbed) translations."""
    t = xp.asarray(trans_px, dtype=np.float64)
    if relion_units:
        t = t * pixel_size
    o = xp.asarray(offsets_round_px, dtype=np.float64)[:, None, :] + t[None, :, :]
    d = o[:, :, None, :] * pixel_size - xp.asarray(prior_A, dtype=np.float64)[None, None, :, :]
    r2 = (d * d).sum(-1)
    if sigma_A ** 2 < 1e-4:
        return xp.where(r2 < 1e-8, 0.0, -np.inf)
    return -r2 / (2.0 * sigma_A**2)


# ----------------------------------------------------------------------------------------------------------
# One batch
# ----------------------------------------------------------------------------------------------------------


def expectation_batch(setup: EStepSetup, prep: PreparedBatch, ctf: CtfParams | None, groups, scale,
                      sums: EStepSums, candidates=None, candidate_log_prior=None,
                      scale_group_index=None, class_log_prior=None) -> BatchResult:
    """Coarse and fine passes for one batch; adds the weighted sums into ``sums`` and returns the
    per-particle results.

    groups (I,) 0-based optics group of each particle; scale (I,) group intensity scale s_g.
    candidates (I, n) coarse rows per particle (local searches; -1 pads) with their log priors, or None for
    a global search over every row with the direction prior ``setup.log_pdf_direction``. ``class_log_prior``
    (I, K) adds a per-particle class prior (-inf restricts a particle to some classes: 3D classification's
    random class seeding). A batch that fails drops the kept union slices (setup.union_cache): a retry after out
    of memory, a smaller batch, starts without them."""
    try:
        return _expectation_batch(setup, prep, ctf, groups, scale, sums, candidates, candidate_log_prior,
                                  scale_group_index, class_log_prior)
    except BaseException:
        setup.union_cache = None
        raise


def _expectation_batch(setup: EStepSetup, prep: PreparedBatch, ctf: CtfParams | None, groups, scale,
                       sums: EStepSums, candidates, candidate_log_prior, scale_group_index,
                       class_log_prior) -> BatchResult:
    check = setup.check_cancel or _no_cancel
    check()
    if setup.aberrations is not None:
        prep = demodulated(setup, prep, groups)
    batch = _Batch.make(setup, prep, ctf, groups, scale, class_log_prior)
    coarse = _coarse_pass(batch, candidates, candidate_log_prior)
    memory_mark("E-step: images and coarse pass")
    check()
    rows = _significant_rows(batch, coarse, candidate_log_prior)
    check()
    fine = _fine_particles(batch)
    acc = _FineSums.zeros(batch, sums.n_shells)
    n_children = setup.sampling.n_children
    n_fine_translations = fine.translations.shape[0] * fine.translations.shape[1]
    counts_sorted = rows.counts[rows.order]
    bytes_per_row = n_children * union_bytes_per_orientation(setup.pix_fine.npix)
    rows = _union_from_cache(setup, rows, bytes_per_row)
    union_groups = plan_union_groups(rows.start, rows.union_index, rows.n_union, bytes_per_row,
                                     setup.max_union_bytes)
    pending, done, fine_budget, halvings, splits = union_groups[::-1], 0, setup.max_fine_bytes, 0, 0
    failed: set[tuple[int, int, int]] = set()  # (g0, g1, budget) that ran out of memory once
    while pending:
        g0, g1 = pending.pop()
        done_group = _fine_passes(batch, rows, fine, acc, counts_sorted, g0, g1, fine_budget, n_fine_translations,
                                  check)
        if done_group is None:
            # out of memory before this group added anything: smaller fine chunks, else a smaller group, else
            # once more as it was (the freed pool may now have room), else give up
            chunks = plan_fine_chunks(counts_sorted[g0:g1], n_children, n_fine_translations,
                                      setup.pix_fine.npix, fine_budget, rows.group(g0, g1).n_union)
            if len(chunks) < g1 - g0:
                fine_budget, halvings = max(1, fine_budget // 2), halvings + 1
                pending.append((g0, g1))
            elif g1 - g0 > 1:
                mid, splits = (g0 + g1) // 2, splits + 1
                pending += [(mid, g1), (g0, mid)]
            elif (g0, g1, fine_budget) not in failed:
                failed.add((g0, g1, fine_budget))
                pending.append((g0, g1))
            elif done:  # earlier groups are in the sums: the batch must not be run again
                raise SumsAlreadyAddedError("memory ran out twice in the fine pass of one particle, after part of the "
                                            "batch was added to the sums; restart the job with a smaller --batch")
            else:  # nothing added yet: the batch loop may run a smaller batch
                raise MemoryError("out of memory in the fine pass of one particle alone, twice")
            continue
        try:  # from here on the batch adds to the sums: a retry of the whole batch would count them twice
            _insert_summed_slices(batch, *done_group, acc, sums)
            _add_row_sums(batch, done_group[0], acc, sums)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise SumsAlreadyAddedError(f"memory ran out while inserting particle group {done + 1} of a batch "
                                            f"({exc}); restart the job with a smaller --batch") from exc
            raise
        finally:  # the union's slices and sums go before the next group allocates its own
            acc.drop_union()
            done_group = None
        done += 1
        memory_mark("E-step: insertion")
    try:
        _add_power_beyond_fine(batch, acc, sums.n_shells)
        check()
        result = _best_poses(batch, fine, acc, coarse)
        result.union_groups = done
        if halvings or splits:
            result.memory_note = (f"fine-chunk budget halved {halvings} time(s) to {fine_budget / 1024**2:.2f} MiB, "
                                  f"{splits} particle group(s) split in two")
        _add_mstep_sums(batch, acc, sums, groups, scale_group_index)
    except Exception as exc:
        if is_out_of_memory(exc) and done:
            raise SumsAlreadyAddedError(f"memory ran out after a batch had added its slices ({exc}); restart the "
                                        "job with a smaller --batch") from exc
        raise
    return result


def _fine_passes(batch: _Batch, rows: _SignificantRows, fine: _FineData, acc: _FineSums, counts_sorted,
                 g0: int, g1: int, fine_budget: int, n_fine_translations: int, check: Callable[[], None]):
    """The fine chunks of the particles of ranks g0..g1-1 (one group) into ``acc``; returns the group and its
    union's slices for the insertion. None when memory ran out: the group added nothing
    anywhere (its particles' own sums are rewritten by a retry, the per-class offset moments are restored and
    the union dropped), so the caller can run it again smaller."""
    setup = batch.setup
    moments = acc.offset_moments.copy()
    try:
        group = rows.group(g0, g1)
        gfine = _with_union_slices(batch, fine, group.union_rows_host)
        acc.new_union(batch, group.n_union * gfine.n_children, group.n_union, setup.pix_fine.npix)
        memory_mark("E-step: fine slices and sums of the union of significant orientations")
        for a0, a1 in plan_fine_chunks(counts_sorted[g0:g1], gfine.n_children, n_fine_translations,
                                       setup.pix_fine.npix, fine_budget, group.n_union):
            check()  # a cancel stops the job: this batch's sums are not used
            _fine_chunk(batch, group, gfine, acc, g0 + a0, g0 + a1)
        check()
        memory_mark("E-step: fine passes")
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        acc.drop_union()
        acc.offset_moments[...] = moments
        group = gfine = setup.union_cache = None  # so that the pool can give their blocks back
        free_pool(batch.xp)
        return None
    return group, gfine


def demodulated(setup: EStepSetup, prep: PreparedBatch, groups) -> PreparedBatch:
    """The batch's Fourier data with each particle's optics group's antisymmetric aberrations taken off
    (compute.ctf.demodulation_factors, made once per box); unchanged when no group has any."""
    xp = get_array_module(prep.F_masked)
    N = prep.F_masked.shape[-2]
    if setup._demodulation is None or setup._demodulation[0] != N:
        setup._demodulation = (N, demodulation_factors(setup.aberrations, N, setup.pixel_size, xp))
    fac = setup._demodulation[1]
    if fac is None:
        return prep
    f = fac[xp.asarray(groups)]
    return replace(prep, F_masked=prep.F_masked * f, F_unmasked=prep.F_unmasked * f)


def _no_cancel() -> None:
    """The cancel check of an E-step nobody can cancel."""


@dataclass
class _Batch:
    """What the passes of one batch share: its setup and data, the sizes, each particle's noise spectrum, CTF
    and group scale, and the log priors that do not depend on the orientation."""

    setup: EStepSetup
    prep: PreparedBatch
    xp: object
    n_particles: int  # I
    n_orient: int  # R: coarse orientations per class (rows are class * R + orientation)
    n_classes: int  # K
    sigma2_rows: object  # (I, N/2+1) noise spectrum of each particle's optics group
    scale: object  # (I, 1) float32 group intensity scale s_g
    ctf: CtfParams | None
    prior_mean_A: np.ndarray  # (1 or K, 2) translation prior mean (Å): 0, or 2D classification's per class
    log_trans_prior: object  # (I, T, 1 or K) translation log prior at the coarse translations
    class_log_prior: object  # (I, K) or None
    groups: object = None  # (I,) 0-based optics group of each particle (device)

    @classmethod
    def make(cls, setup: EStepSetup, prep: PreparedBatch, ctf, groups, scale, class_log_prior) -> _Batch:
        xp = get_array_module(prep.F_masked)
        mu = np.zeros((1, 2)) if setup.class_offset_prior_A is None else np.asarray(setup.class_offset_prior_A)
        smp, relion = setup.sampling, setup.relion_offset_prior
        lp_trans = _log_trans_prior(prep.rounded_offsets, smp.grid_translations if relion else smp.translations,
                                    setup.pixel_size, setup.sigma_offset_A, xp, mu, relion_units=relion)
        return cls(setup, prep, xp, prep.F_masked.shape[0], setup.sampling.n_orient, len(setup.refs),
                   setup.sigma2[xp.asarray(groups)], xp.asarray(scale, dtype=np.float32)[:, None], ctf, mu, lp_trans,
                   class_log_prior, xp.asarray(groups))

    @property
    def box(self) -> int:
        return self.prep.F_masked.shape[-2]

    def ctf_at(self, pix: PixelSet):
        """(I, npix) float32: s_g x CTF of each particle at a pixel set (s_g alone without CTF)."""
        xp = self.xp
        if self.ctf is None:
            return xp.broadcast_to(self.scale, (self.n_particles, pix.npix)).astype(np.float32)
        N, p = self.box, self.setup.pixel_size
        fx, fy = magnified_frequencies(self.setup.mag, pix.kx / (N * p), pix.ky / (N * p))
        even = None if self.setup.aberrations is None else gamma_offsets(self.setup.aberrations, fx, fy, xp)
        offset = None if even is None else even[self.groups]
        return ctf_from_frequencies(self.ctf, fx, fy, xp, gamma_offset=offset) * self.scale

    def class_prior(self):
        """(I, K) float64 per-particle class log prior (None without one)."""
        return None if self.class_log_prior is None else self.xp.asarray(self.class_log_prior, dtype=np.float64)

    def trans_prior_of_rows(self, log_trans_prior, rows):
        """(i, T, n) translation log prior of global rows (i, n) (class-major): the prior of the row's class
        where the prior mean depends on the class, else the same for every row."""
        xp = self.xp
        shape = log_trans_prior.shape[:2] + (rows.shape[1],)
        if self.log_trans_prior.shape[2] == 1:
            return xp.broadcast_to(log_trans_prior, shape)
        cls = xp.broadcast_to((rows // self.n_orient)[:, None, :], shape)
        return xp.take_along_axis(log_trans_prior, cls, axis=2)


@dataclass
class _CoarseResult:
    """The coarse pass of a batch: which (translation, column) samples are significant. Columns are the
    global rows (global search) or the columns of ``candidates`` (local search)."""

    significant: object  # (I, T, n) bool
    candidates: object  # (I, n) global row of each column, or None (column = global row)
    nr_significant: object  # (I,) RELION's rlnNrOfSignificantSamples


def _coarse_pass(b: _Batch, candidates, candidate_log_prior) -> _CoarseResult:
    """Scores of every (translation, row) of each particle at the coarse pixels (one shared GEMM over all rows
    for a global search, gathered candidate rows for a local one), their log priors (orientation: the direction
    prior or the candidates' own; class; translation at the coarse grid), the posterior weights and RELION's
    significance."""
    xp, setup, smp = b.xp, b.setup, b.setup.sampling
    R, K, I = b.n_orient, b.n_classes, b.n_particles
    pix = setup.pix_coarse
    X = gather_pixels(b.prep.F_masked, pix)
    w, _ = _weights_for(b.sigma2_rows, pix, xp)
    ramps = translation_ramps(pix, smp.translations)
    terms = particle_terms(X, b.ctf_at(pix), w, ramps, cc=setup.cc, width=gemm_width(pix.npix))
    class_prior = b.class_prior()
    if candidates is None:
        P = setup.coarse_slices()
        with matmul_tf32(xp, setup.coarse_tf32):
            diff2 = scores_shared(P, terms, setup.check_cancel)  # (I, T, K R)
        lp_orient = xp.zeros(K * R) if setup.log_pdf_direction is None else \
            xp.repeat(xp.asarray(setup.log_pdf_direction).reshape(-1), smp.n_psi)
        table = b.log_trans_prior  # (I, T, 1 or K): per class where the prior mean is (columns are class-major)
        if class_prior is not None:
            table = table + class_prior[:, None, :]
        log_prior = SampleLogPrior(table, col_group=K * R // table.shape[2], column=lp_orient[None, :])
        cand = None
    else:
        cand = xp.asarray(candidates)
        valid = cand >= 0
        urows, pos = xp.unique(xp.where(valid, cand, 0), return_inverse=True)
        S = _gathered_coarse_slices(setup, to_host(urows), pos.reshape(cand.shape), pix)
        with matmul_tf32(xp, setup.coarse_tf32):
            diff2 = scores_gathered(S, terms, setup.check_cancel)
        del S
        lp_orient = xp.where(valid, xp.asarray(candidate_log_prior), -np.inf)
        if class_prior is not None:
            lp_orient = lp_orient + xp.take_along_axis(class_prior, xp.maximum(cand, 0) // R, axis=1)
        if b.log_trans_prior.shape[2] == 1:  # one translation prior for every column
            log_prior = SampleLogPrior(b.log_trans_prior, col_group=cand.shape[1], column=lp_orient)
        else:
            log_prior = SampleLogPrior(b.trans_prior_of_rows(b.log_trans_prior, xp.maximum(cand, 0)), column=lp_orient)
    W = posterior_weights(diff2, log_prior, setup.adaptive_fraction, cc=setup.cc, maxsig=setup.max_significants,
                          check=setup.check_cancel, weights=False)  # the coarse pass keeps only significance
    return _CoarseResult(W.significant.reshape(I, -1, diff2.shape[2]), cand, W.nr_significant)


@dataclass
class _SignificantRows:
    """The (particle, row) pairs with at least one significant coarse translation ("entries"), sorted by the
    particles' rank (ascending count of such rows, so that each chunk of ranks is one contiguous range of
    entries), then by column; and the union of their rows."""

    counts: np.ndarray  # (I,) host: significant rows per particle
    order: np.ndarray  # (I,) host: particles by ascending count (rank -> particle)
    rank: np.ndarray  # (I,) host: particle -> rank
    start: np.ndarray  # (I + 1,) host: first entry of each rank
    particle: object  # (E,) particle of each entry
    union_index: object  # (E,) the entry's row as an index into union_rows
    log_prior: object  # (E,) the entry's orientation (and class) log prior
    translations: object  # (E, T) bool: its significant coarse translations
    union_rows: object  # (U,) distinct global rows of all entries
    union_rows_host: np.ndarray  # (U,)

    @property
    def n_union(self) -> int:
        return int(self.union_rows_host.size)

    def group(self, g0: int, g1: int) -> _SignificantRows:
        """The entries of the particles of ranks g0..g1-1 with their own union (the rows those particles found
        significant, ascending as the batch's union); the entries of other ranks keep an index that means
        nothing in it. The whole batch is itself (the same union, to the bit)."""
        if g0 == 0 and g1 == self.order.size:
            return self
        e0, e1 = int(self.start[g0]), int(self.start[g1])
        xp = get_array_module(self.union_index)
        used, inverse = xp.unique(self.union_index[e0:e1], return_inverse=True)
        union_index = self.union_index.copy()
        union_index[e0:e1] = inverse.reshape(-1)
        return replace(self, union_index=union_index, union_rows=self.union_rows[used],
                       union_rows_host=self.union_rows_host[to_host(used)])


def _significant_rows(b: _Batch, coarse: _CoarseResult, candidate_log_prior) -> _SignificantRows:
    """The entries of the fine pass: each particle's rows with a significant coarse translation, in rank order,
    with their orientation and class log priors (taken at the coarse parent, relion_algorithm 3.5)."""
    xp, setup = b.xp, b.setup
    sig = coarse.significant
    cand = coarse.candidates
    n_cols = sig.shape[2]
    sig_rows = gpu_kernels.any_over_middle(sig) if gpu_kernels.any_over_middle_applies(sig) else sig.any(axis=1)
    counts = to_host(sig_rows.sum(axis=1))
    order = np.argsort(counts, kind="stable")
    rank = np.empty(b.n_particles, dtype=np.int64)
    rank[order] = np.arange(b.n_particles)
    particle, col = xp.nonzero(sig_rows)
    by_rank = xp.argsort(xp.asarray(rank)[particle] * n_cols + col)
    particle, col = particle[by_rank], col[by_rank]
    grow = col if cand is None else cand[particle, col]  # global row of each entry
    if cand is None:
        log_prior = xp.zeros(col.shape) if setup.log_pdf_direction is None else \
            xp.asarray(setup.log_pdf_direction).reshape(-1)[col // setup.sampling.n_psi]
    else:
        log_prior = xp.asarray(candidate_log_prior)[particle, col]
    class_prior = b.class_prior()
    if class_prior is not None:
        log_prior = log_prior + class_prior[particle, grow // b.n_orient]
    union_rows, union_index = xp.unique(grow, return_inverse=True)
    start = np.concatenate([[0], np.cumsum(counts[order])])
    return _SignificantRows(counts, order, rank, start, particle, union_index.reshape(-1), log_prior,
                            sig[particle, :, col], union_rows, to_host(union_rows))


@dataclass
class _UnionSlices:
    """The fine slices of every child of a union of rows, as _with_union_slices made them."""

    rows_host: np.ndarray  # (U,) ascending global rows
    rows: object  # (U,) on the device
    matrices: object  # (U * n_children, 3, 3)
    slices: SliceSet
    n_children: int


#: A batch whose union of significant rows lies within the previous batch's and holds at least this fraction of
#: it uses the previous union's slices (its other rows get zero weight: nothing is inserted for them), instead of
#: projecting its own: in early iterations consecutive batches share nearly all rows.
UNION_REUSE_FRACTION = 0.5


def _union_from_cache(setup: EStepSetup, rows: _SignificantRows, bytes_per_row: int) -> _SignificantRows:
    """``rows`` with the cached union (setup.union_cache) as its union when it contains the batch's own union,
    is at most 1 / UNION_REUSE_FRACTION times its size and fits the union budget in one group; else ``rows``.
    The entries keep their rows (their union indices are remapped), so scores, weights and sums are the same:
    the cached union's other rows get no entries, zero weight and no insertion."""
    c = setup.union_cache
    need = rows.union_rows_host
    if c is None or need.size == 0 or c.rows_host.size == need.size \
            or need.size < UNION_REUSE_FRACTION * c.rows_host.size \
            or c.rows_host.size * bytes_per_row > setup.max_union_bytes:
        return rows
    pos = np.searchsorted(c.rows_host, need)
    if pos[-1] >= c.rows_host.size or not np.array_equal(c.rows_host[pos], need):
        return rows
    xp = get_array_module(rows.union_index)
    return replace(rows, union_index=xp.asarray(pos)[rows.union_index], union_rows=c.rows,
                   union_rows_host=c.rows_host)


@dataclass
class _FineData:
    """The fine pass's orientations, translations and particle pixels: every oversampled child of the union of
    significant rows of a particle group (matrices and slices, child c of union row u at u * n_children + c; None
    in the particles' part that _fine_particles makes), the translation children of every coarse translation, and
    the particles' pixels, weights and CTF at the fine pixel set."""

    matrices: object  # (U * n_children, 3, 3): projection and insertion
    slices: SliceSet  # (U * n_children, Kf)
    n_children: int
    translations: np.ndarray  # (T, n_trans_children, 2) pixels
    ramps: object  # (T * n_trans_children, Kf)
    X: object  # (I, Kf) masked image
    X_unmasked: object  # (I, Kf) for the back-projection
    w: object  # (I, Kf) 1/(2 sigma2), 0 at DC: the score weights
    m: object  # (I, Kf) 1/sigma2, DC kept: the back-projection weights
    ctf: object  # (I, Kf) s_g x CTF


def _fine_particles(b: _Batch) -> _FineData:
    """The particles' part of the fine data (pixels, weights and CTF at the fine pixel set, the translation
    children), without orientations: _with_union_slices adds those of a union."""
    xp, setup, smp = b.xp, b.setup, b.setup.sampling
    pix = setup.pix_fine
    fine_t = smp.fine_translations()  # (T, 4, 2)
    ramps = translation_ramps(pix, fine_t.reshape(-1, 2))
    w, m = _weights_for(b.sigma2_rows, pix, xp)
    return _FineData(None, None, smp.n_children, fine_t, ramps, gather_pixels(b.prep.F_masked, pix),
                     gather_pixels(b.prep.F_unmasked, pix), w, m, b.ctf_at(pix))


def _with_union_slices(b: _Batch, fine: _FineData, union_rows_host: np.ndarray) -> _FineData:
    """``fine`` with every child of the union rows projected once (slices gathered by row afterwards), or the
    cached ones of the same rows (setup.union_cache, which then holds these)."""
    xp, setup = b.xp, b.setup
    c = setup.union_cache
    if c is not None and c.rows_host.size == union_rows_host.size and np.array_equal(c.rows_host, union_rows_host):
        return replace(fine, matrices=c.matrices, slices=c.slices, n_children=c.n_children)
    setup.union_cache = None  # its memory goes before the new projection
    A = magnified(xp.asarray(setup.sampling.fine_matrices(union_rows_host % b.n_orient).reshape(-1, 3, 3)), setup.mag)
    slices = _row_slices(setup, union_rows_host, setup.pix_fine, True, None, matrices=A)
    n_children = int(A.shape[0]) // max(1, int(union_rows_host.size)) or fine.n_children
    setup.union_cache = _UnionSlices(np.array(union_rows_host), xp.asarray(union_rows_host), A, slices, n_children)
    return replace(fine, matrices=A, slices=slices, n_children=n_children)


def plan_union_groups(start, union_index, n_union: int, bytes_per_row: int,
                      max_bytes: int) -> list[tuple[int, int]]:
    """Groups of a batch's particles for the fine passes, as rank ranges [g0, g1) (ranks as in
    _SignificantRows: ``start`` (I + 1,) the first entry of each rank, ``union_index`` (E,) each entry's row
    in the batch's union of ``n_union`` rows, on the host or the device). A group grows while its own union of
    significant rows at ``bytes_per_row`` (children x union_bytes_per_orientation) fits ``max_bytes``; every
    group holds at least one particle (one particle's own rows are never split: its weights are normalised over
    all of them). One group, the whole batch, when the batch's union fits (the E-step then runs as if there were
    no groups).

    Why groups inside the batch rather than a smaller batch: the union is known only after the coarse pass
    (a batch size from the previous iteration's counts would be an estimate, nothing at iteration 1 and wrong
    when the sampling becomes finer); groups bound it exactly and keep the coarse pass's large GEMMs. Particles
    of two groups that share a row project it twice and insert its children twice (sums in another order: float
    rounding)."""
    n = len(start) - 1
    if n_union * bytes_per_row <= max_bytes or n <= 1:
        return [(0, n)]
    union_index_host = to_host(union_index)
    seen = np.zeros(n_union, dtype=bool)
    groups, g0, size = [], 0, 0
    for r in range(n):
        own = union_index_host[start[r]:start[r + 1]]
        new = int(np.count_nonzero(~seen[own]))
        if r > g0 and (size + new) * bytes_per_row > max_bytes:
            groups.append((g0, r))
            seen[:] = False
            g0, size, new = r, 0, own.size
        seen[own] = True
        size += new
    groups.append((g0, n))
    return groups


def plan_fine_chunks(counts_sorted, n_children: int, n_fine_translations: int, n_fine_pixels: int,
                     max_bytes: int, n_union: int | None = None) -> list[tuple[int, int]]:
    """The fine pass's chunks as rank ranges [a0, a1) of the particles sorted by ascending number of
    significant rows ``counts_sorted`` (of a group whose union holds ``n_union`` rows, when known). A chunk grows
    while :func:`fine_chunk_bytes` fits ``max_bytes``; every chunk holds at least one particle."""
    per_score = fine_bytes_per_score(n_fine_translations)
    per_slice = fine_bytes_per_slice(n_fine_pixels)
    per_particle = fine_bytes_per_particle(n_fine_translations, n_fine_pixels)
    n = len(counts_sorted)
    chunks = []
    a0 = 0
    while a0 < n:
        a1 = a0 + 1  # counts ascend, so the last particle of a chunk has its largest count
        while a1 < n and fine_chunk_bytes(a1 + 1 - a0, int(counts_sorted[a1]), n_union, n_children, per_score,
                                          per_slice, per_particle) <= max_bytes:
            a1 += 1
        chunks.append((a0, a1))
        a0 = a1
    return chunks


def fine_chunk_bytes(n_particles: int, largest: int, n_union: int | None, n_children: int, per_score: int,
                     per_slice: int, per_particle: int) -> int:
    """Device bytes of a fine chunk of ``n_particles`` whose largest count of significant rows is ``largest``.
    Gathered layout (_chunk_layout): each particle its own rows padded to ``largest``, with their slices:
    particles x largest x children x (per_score + per_slice). When SHARED_LAYOUT_FACTOR x largest >= ``n_union``
    the chunk's distinct rows (at most the union) are certain to be within that factor, so _chunk_layout shares
    them: their slices once (union x children x per_slice) and every particle scores all of them (particles x
    union x children x per_score). That is iteration 1's case (flat posteriors, most rows significant), where
    counting the slices per particle made chunks of 2-4 particles. Plus ``per_particle`` per particle (its image
    at every fine translation)."""
    c = max(1, largest)
    if n_union is not None and SHARED_LAYOUT_FACTOR * c >= n_union:
        return n_union * n_children * per_slice + n_particles * (n_union * n_children * per_score + per_particle)
    return n_particles * (c * n_children * (per_score + per_slice) + per_particle)


@dataclass
class _FineSums:
    """What the fine chunks accumulate: per particle (best sample, Pmax, log-likelihood, noise and scale sums,
    total weight) and per fine orientation of the union (back-projection slices and weights)."""

    # per particle, on the device until _best_poses copies them once per batch (no copy, i.e. no wait for the
    # device, per fine chunk)
    best_row: object  # (I,) global coarse row of the best fine sample
    best_child: object  # (I,) its orientation child
    best_translation: object  # (I,) its fine translation (index into translations.reshape(-1, 2))
    pmax: object  # (I,)
    log_likelihood: object  # (I,)
    residual: object  # (I,) sum w |CP - X|^2 (+ the power beyond the fine size): E_i of the norm correction
    slices: object  # (U * n_children, 2 Kf) float32: sum w [Re, Im](C X_u e_t m)
    slice_weights: object  # (U * n_children, Kf) float32: sum w C^2 m
    row_weight: object  # (U,) sum of the weights of each union row's children
    sigma2: object  # (I, n_shells) sum w |CP - X|^2 per shell
    weight: object  # (I,) sum of the significant normalised weights
    offset_moments: object  # (K, 4) per class: sum w, sum w x, sum w y, sum w |o|^2 (o = offset + t, Å)
    xa: object  # (I,) sum w Re(conj(CP) X) over the scale shells
    aa: object  # (I,) sum w |CP|^2 over the scale shells

    @classmethod
    def zeros(cls, b: _Batch, n_shells: int) -> _FineSums:
        """The per-particle and per-class sums of a batch; the union's are made per group by new_union."""
        xp, I = b.xp, b.n_particles
        return cls(xp.zeros(I, dtype=np.int64), xp.zeros(I, dtype=np.int64), xp.zeros(I, dtype=np.int64),
                   xp.zeros(I), xp.zeros(I), xp.zeros(I), None, None, None,
                   xp.zeros((I, n_shells)), xp.zeros(I), xp.zeros((b.n_classes, 4)), xp.zeros(I), xp.zeros(I))

    def new_union(self, b: _Batch, n_fine_rows: int, n_union: int, n_pixels: int) -> None:
        """Zero sums for the fine orientations of a group's union (the previous group's are dropped first)."""
        xp = b.xp
        self.drop_union()
        self.slices = xp.zeros((n_fine_rows, 2 * n_pixels), dtype=np.float32)
        self.slice_weights = xp.zeros((n_fine_rows, n_pixels), dtype=np.float32)
        self.row_weight = xp.zeros(n_union)

    def drop_union(self) -> None:
        self.slices = self.slice_weights = self.row_weight = None


#: A fine chunk shares its rows (one GEMM over its distinct rows, non-parents masked) when they are at most this
#: many times its largest count; else each particle gathers its own (batched GEMMs over padded rows).
SHARED_LAYOUT_FACTOR = 2


@dataclass
class _ChunkLayout:
    """Which coarse parents each particle of a chunk scores. Shared: every particle scores the chunk's distinct
    union rows (one shared GEMM; non-parents are masked by the prior); gathered: each particle its own rows,
    padded to the chunk's largest count (batched GEMMs)."""

    shared: bool
    distinct: object  # (n_par,) the chunk's distinct union indices (shared layout)
    parents: object  # (ni, n_par) union index of each particle's parent columns
    entry_particle: object  # (e,) each entry's particle within the chunk
    entry_column: object  # (e,) each entry's parent column
    fine_rows: object  # indices into the fine slices: (n_par * n_children,) shared or (ni, n_par * n_children)
    # gathered: fine_rows with negative rows for the padding after each particle's own parents (scored as parent
    # 0, weight 0), which the sums onto the fine rows leave out (segments_of); None when shared
    sum_rows: object = None

    @property
    def n_parents(self) -> int:
        return self.parents.shape[1]


def _chunk_layout(b: _Batch, rows: _SignificantRows, a0: int, a1: int, n_children: int) -> _ChunkLayout:
    """The parent layout of the particles of ranks a0..a1-1: shared when the chunk's particles mostly share
    rows (at most SHARED_LAYOUT_FACTOR times its largest count distinct rows: early iterations), gathered
    otherwise."""
    xp = b.xp
    ni = a1 - a0
    e0, e1 = int(rows.start[a0]), int(rows.start[a1])
    entry_particle = xp.asarray(rows.rank)[rows.particle[e0:e1]] - a0
    union_index = rows.union_index[e0:e1]
    largest = int(rows.counts[rows.order[a1 - 1]])
    distinct, column = xp.unique(union_index, return_inverse=True)
    column = column.reshape(-1)
    shared = int(distinct.size) <= SHARED_LAYOUT_FACTOR * largest
    child = xp.arange(n_children)[None, :]
    if shared:
        parents = xp.broadcast_to(distinct[None, :], (ni, int(distinct.size)))
        fine_rows = (distinct[:, None] * n_children + child).reshape(-1)  # distinct
    else:
        starts = xp.asarray(rows.start[a0:a1] - rows.start[a0])
        column = xp.arange(e1 - e0) - starts[entry_particle]
        parents = xp.full((ni, largest), -1, dtype=np.int64)
        parents[entry_particle, column] = union_index
        sum_rows = (parents[:, :, None] * n_children + child[None]).reshape(ni, -1)  # < 0 for the padding
        parents = xp.maximum(parents, 0)  # the padding scores parent 0, masked by its -inf prior
        fine_rows = (parents[:, :, None] * n_children + child[None]).reshape(ni, -1)
        return _ChunkLayout(shared, distinct, parents, entry_particle, column, fine_rows, sum_rows)
    return _ChunkLayout(shared, distinct, parents, entry_particle, column, fine_rows)


def _fine_chunk(b: _Batch, rows: _SignificantRows, fine: _FineData, acc: _FineSums, a0: int, a1: int) -> None:
    """The fine pass of the particles of ranks a0..a1-1: scores of the orientation x translation children of
    their significant coarse samples, with the log priors of the coarse parents (non-significant parents
    masked), posterior weights and significance, the best sample, and the weighted sums."""
    xp, setup = b.xp, b.setup
    check = setup.check_cancel or _no_cancel
    lay = _chunk_layout(b, rows, a0, a1, fine.n_children)
    ni, n_par, nover = a1 - a0, lay.n_parents, fine.n_children
    T, ntov = fine.translations.shape[0], fine.translations.shape[1]
    pidx = xp.asarray(rows.order[a0:a1])
    e0, e1 = int(rows.start[a0]), int(rows.start[a1])
    li, col = lay.entry_particle, lay.entry_column
    sig_parent = xp.zeros((ni, T, n_par), dtype=bool)
    sig_parent[li, :, col] = rows.translations[e0:e1]
    lp_orient = xp.full((ni, n_par), -np.inf)
    lp_orient[li, col] = rows.log_prior[e0:e1]
    parent_rows = rows.union_rows[lay.parents]  # (ni, n_par) global coarse row of each parent
    lp_parent = xp.where(sig_parent, b.trans_prior_of_rows(b.log_trans_prior[pidx], parent_rows)
                         + lp_orient[:, None, :], -np.inf)
    P = fine.slices.take(lay.fine_rows)
    nn = n_par * nover
    terms = particle_terms(fine.X[pidx], fine.ctf[pidx], fine.w[pidx], fine.ramps, cc=setup.cc)
    check()
    diff2 = scores_shared(P, terms, check) if lay.shared else scores_gathered(P, terms, check)  # (ni, T*4, nn)
    x2 = terms.x2
    del terms  # (ni, T*4, 2Kf): freed before the weighted sums make theirs (FINE_BYTES_PER_TRANSLATION_PIXEL)
    check()
    lp_fine = SampleLogPrior(lp_parent, row_group=ntov, col_group=nover)  # (ni, T * ntov, nn) samples
    W = posterior_weights(diff2, lp_fine, setup.adaptive_fraction, cc=setup.cc, check=check)
    del diff2, lp_fine, lp_parent, sig_parent
    check()
    best_pos = W.best % nn
    best_parent = xp.take_along_axis(lay.parents, (best_pos // nover)[:, None], axis=1)[:, 0]
    acc.best_row[pidx] = rows.union_rows[best_parent]
    acc.best_child[pidx] = best_pos % nover
    acc.best_translation[pidx] = W.best // nn
    acc.pmax[pidx] = W.pmax
    acc.log_likelihood[pidx] = W.log_evidence - x2 if not setup.cc else W.log_evidence
    _accumulate_chunk(b, fine, acc, lay, pidx, parent_rows, W.w.reshape(ni, T * ntov, nn), P)


def _accumulate_chunk(b: _Batch, fine: _FineData, acc: _FineSums, lay: _ChunkLayout, pidx, parent_rows, w,
                      P) -> None:
    """The weighted sums of a chunk's normalised fine weights w (ni, T * 4, n_par * n_children): back-projection
    slices per fine orientation, weights per union row, offset moments per class, and per particle the noise
    per shell, the residual power, the total weight and the scale sums."""
    xp, setup = b.xp, b.setup
    ni, n_par, nover = w.shape[0], lay.n_parents, fine.n_children
    n_fine_rows, n_pixels = acc.slice_weights.shape
    check = setup.check_cancel or _no_cancel
    fs = fine_sums(w, P, fine.X[pidx], fine.X_unmasked[pidx], fine.ctf[pidx], fine.m[pidx], fine.ramps, check)
    check()
    rw_parent = fs.row_weight.reshape(ni, n_par, nover).sum(-1)  # (ni, n_par) per coarse parent
    if lay.shared:
        add_to_rows(acc.slices, lay.fine_rows, fs.slices)  # fine_rows: distinct and ascending (np.unique)
        add_to_rows(acc.slice_weights, lay.fine_rows, fs.slice_weights)
        acc.row_weight[lay.distinct] += rw_parent.sum(0)
    else:
        # summed onto the fine orientations the chunk touches, not onto a copy of the whole union's sums (12
        # bytes per pixel of every fine orientation of the union, per chunk): the same sums of the same values
        touched = segments_of(lay.sum_rows)  # one sort of the entries for the unique rows and both sums
        add_to_rows(acc.slices, touched.distinct, grouped_sum(touched, fs.slices.reshape(-1, 2 * n_pixels)))
        add_to_rows(acc.slice_weights, touched.distinct, grouped_sum(touched, fs.slice_weights.reshape(-1, n_pixels)))
        acc.row_weight += segment_sum(lay.parents.reshape(-1), rw_parent.reshape(-1, 1), acc.row_weight.size)[:, 0]
    # offset moments per class: sum w, sum w pos, sum w |pos|^2 (pos = o + t in Å) over each parent's children
    # and translations, then summed over the parents of each class
    wt = w.reshape(ni, w.shape[1], n_par, nover).sum(-1)  # (ni, T4, n_par)
    pos = (xp.asarray(b.prep.rounded_offsets)[pidx][:, None, :] + xp.asarray(fine.translations.reshape(-1, 2))[None]) \
        * setup.pixel_size  # (ni, T4, 2) Å
    m1 = xp.einsum("itp,itd->ipd", wt, pos)
    m2 = xp.einsum("itp,it->ip", wt, (pos * pos).sum(-1))
    moments = xp.concatenate([wt.sum(1)[..., None], m1, m2[..., None]], axis=-1).reshape(-1, 4)
    acc.offset_moments += segment_sum((parent_rows // b.n_orient).reshape(-1), moments, b.n_classes)
    acc.sigma2[pidx] = shell_sum(fs.noise, setup.pix_fine.shell, acc.sigma2.shape[1])
    acc.residual[pidx] = fs.noise.sum(axis=1)
    acc.weight[pidx] = fs.trans_weight.sum(axis=1)
    if setup.scale_shells is not None:
        acc.xa[pidx], acc.aa[pidx] = _scale_sums(b, fine, pidx, parent_rows, w, P, fs, nover, check)


def _scale_sums(b: _Batch, fine: _FineData, pidx, parent_rows, w, P, fs, nover: int, check):
    """Per particle of a chunk, RELION's group-scale sums (storeWeightedSums): sumXA and sumA2 over the pixels
    whose shell has the SSNR of the sample's class above 3 (setup.scale_shells (K, pixels)), divided by the
    particle's current group scale (once, squared), which the CTF of the sums carries. One class: fine_sums'
    products masked; several: the products of each class's columns (their GEMMs add up to one over all columns)."""
    xp, ss = b.xp, b.setup.scale_shells
    if ss.shape[0] == 1:
        xa, aa = (fs.xa * ss[0][None, :]).sum(1), (fs.aa * ss[0][None, :]).sum(1)
    else:
        column_class = xp.repeat(parent_rows // b.n_orient, nover, axis=1)[:, None, :]  # (ni, 1, n_par * nover)
        X, ctf = fine.X[pidx], fine.ctf[pidx]  # gathered once for all classes
        xa = xp.zeros(pidx.shape[0])
        aa = xp.zeros(pidx.shape[0])
        for k in range(ss.shape[0]):
            wk = xp.where(column_class == k, w, 0).astype(w.dtype)
            xk, ak = signal_products(wk, P, X, ctf, fine.ramps, check)
            xa += (xk * ss[k][None, :]).sum(1)
            aa += (ak * ss[k][None, :]).sum(1)
    s = b.scale[pidx, 0].astype(np.float64)
    return xa / s, aa / (s * s)


def _add_power_beyond_fine(b: _Batch, acc: _FineSums, n_shells: int) -> None:
    """Shells beyond the fine size: the masked image's own power, in the noise sums with the particle's total
    weight and in the residual of the norm correction (relion_algorithm 3.7)."""
    hi = shell_power(b.prep.F_masked, n_shells)
    hi[:, : b.setup.pix_fine.size // 2 + 1] = 0.0
    acc.sigma2 += hi * acc.weight[:, None]
    acc.residual += hi.sum(axis=1)


def _insert_summed_slices(b: _Batch, rows: _SignificantRows, fine: _FineData, acc: _FineSums,
                          sums: EStepSums) -> None:
    """Insert the batch's summed slice of every fine orientation with a non-zero weight into the
    back-projector of its class (one insertion per distinct fine orientation per batch).

    In pieces of the orientations that the back-projection inserts at once (insertion_orientations): the
    complex values and the gathered weights exist for one piece at a time, not for the whole union (at the full
    image size of a large box, 36 bytes per pixel of every fine orientation: the final iteration's peak at box
    800; issue 21). The scatter-adds are the same, in the same order."""
    xp, pix = b.xp, b.setup.pix_fine
    cls_rows = np.repeat(rows.union_rows_host // b.n_orient, fine.n_children)
    keep = np.flatnonzero(to_host(acc.slice_weights.sum(axis=1)) > 0)
    Kf = pix.npix
    step = insertion_orientations(sums.backprojectors, Kf)  # the back-projection's own pieces
    for a in range(0, keep.size, step):
        part = keep[a:a + step]
        kd = xp.asarray(part)
        vals = acc.slices[kd, :Kf].astype(np.complex64) + 1j * acc.slices[kd, Kf:]
        insert_by_class(sums.backprojectors, xp.asarray(cls_rows[part]), fine.matrices[kd], pix.kx, pix.ky, vals,
                        acc.slice_weights[kd], check=b.setup.check_cancel)
        del vals


def _best_poses(b: _Batch, fine: _FineData, acc: _FineSums, coarse: _CoarseResult) -> BatchResult:
    """The per-particle results: the best fine sample's orientation (perturbed), class and offset (rounded
    offset + fine translation), Pmax, the coarse significant count, log-likelihood and residual power."""
    R = b.n_orient
    for name in ("best_row", "best_child", "best_translation", "pmax", "log_likelihood"):
        setattr(acc, name, to_host(getattr(acc, name)))
    mats = b.setup.sampling.fine_matrices(acc.best_row % R)[np.arange(b.n_particles), acc.best_child]
    offsets = b.prep.rounded_offsets + fine.translations.reshape(-1, 2)[acc.best_translation]
    return BatchResult(mats, acc.best_row // R, offsets, acc.pmax, to_host(coarse.nr_significant),
                       acc.log_likelihood, to_host(acc.residual))


def _add_row_sums(b: _Batch, rows: _SignificantRows, acc: _FineSums, sums: EStepSums) -> None:
    """Add a group's weights per coarse row of its union to the M-step's class and direction sums."""
    R = b.n_orient
    urows = rows.union_rows_host
    row_weight = to_host(acc.row_weight)
    np.add.at(sums.pdf_direction, (urows // R, (urows % R) // b.setup.sampling.n_psi), row_weight)
    np.add.at(sums.pdf_class, urows // R, row_weight)


def _add_mstep_sums(b: _Batch, acc: _FineSums, sums: EStepSums, groups, scale_group_index) -> None:
    """Add the batch's sums for the M-step: noise per optics group and shell, weights per group, offset variance
    and mean offsets per class, scale sums per scale group, log-likelihood, Pmax (the class and direction sums
    were added per group by _add_row_sums)."""
    K, setup = b.n_classes, b.setup
    g = np.asarray(groups)
    np.add.at(sums.sigma2, g, to_host(acc.sigma2))
    weight = to_host(acc.weight)
    np.add.at(sums.sumw_group, g, weight)
    m = to_host(acc.offset_moments)  # sum_c w |o - mu_c|^2 = m2 - 2 mu.m1 + |mu|^2 m0
    mu = np.broadcast_to(b.prior_mean_A, (K, 2))
    sums.sigma_offset += float((m[:, 3] - 2.0 * (mu * m[:, 1:3]).sum(1) + (mu**2).sum(1) * m[:, 0]).sum())
    sums.offset_sum += m[:, 1:3]
    sums.sum_weight += float(weight.sum())
    if setup.scale_shells is not None and scale_group_index is not None:
        np.add.at(sums.xa, np.asarray(scale_group_index), to_host(acc.xa))
        np.add.at(sums.aa, np.asarray(scale_group_index), to_host(acc.aa))
    sums.log_likelihood += float(acc.log_likelihood.sum())
    sums.sum_pmax += float(acc.pmax.sum())
    sums.n_particles += b.n_particles


#: The coarse pass of a local search projects each particle's own rows straight into the GEMM's layout (one fused
#: kernel) when its batch's distinct rows are at least this fraction of the (particle, candidate) pairs: local
#: searches, where particles rarely share rows. Below it (many particles at the same orientations) the distinct
#: rows are projected once and copied to each particle.
DIRECT_PROJECTION_FRACTION = 0.5


def _gathered_coarse_slices(setup: EStepSetup, urows: np.ndarray, pos, pix: PixelSet) -> SliceSet:
    """The coarse slices (I, n, .) of the candidates of each particle, given as positions ``pos`` (I, n) in the
    distinct global rows ``urows``: as_slices of the rows' projections taken at ``pos``, made by
    gpu_kernels.project_stacked without the complex slices and the two copies where it applies (the same
    numbers)."""
    xp = get_array_module(pos)
    width = gemm_width(pix.npix)
    ref = setup.ref_stack
    direct = (ref.ndim == 3 and gpu_kernels.projection_applies(ref.data)
              and urows.size >= DIRECT_PROJECTION_FRACTION * pos.size)
    if not direct:  # (NumPy: each distinct row once, chunk by chunk, then the take: faster than each pair's row)
        return _row_slices(setup, urows, pix, False, width).take(pos)
    R = setup.sampling.n_orient
    A = magnified(xp.asarray(setup.sampling.coarse_matrices(urows % R)), setup.mag)
    stacked, power = gpu_kernels.project_stacked(
        ref.data, A, pix.kx, pix.ky, ref.pad, ref.pad * ref.r_max, pos, width,
        index=xp.asarray(urows // R) if ref.stacked else None, zero=pix.beyond_radius)
    return SliceSet(stacked.reshape(pos.shape + (width,)), power.reshape(pos.shape + (pix.npix,)))


def _rows_geometry(setup: EStepSetup, rows: np.ndarray, fine: bool, matrices=None):
    """The matrices (n * nover, 3, 3) of global rows (class-major; fine: their children), magnified, and for a
    stacked reference each matrix's reference index, on the references' device; ``matrices`` may pass the rows'
    matrices when the caller already has them (magnified already)."""
    xp = get_array_module(setup.refs[0].data)
    smp = setup.sampling
    R = smp.n_orient
    rows = np.asarray(rows, dtype=np.int64)
    if matrices is None:
        matrices = magnified(xp.asarray(smp.fine_matrices(rows % R).reshape(-1, 3, 3) if fine
                                        else smp.coarse_matrices(rows % R)), setup.mag)
    index = np.repeat(rows // R, smp.n_children if fine else 1) if setup.ref_stack.stacked else None
    return xp.asarray(matrices), None if index is None else xp.asarray(index)


def _project_rows(setup: EStepSetup, rows: np.ndarray, pix: PixelSet, fine: bool, matrices=None):
    """Slices of global rows (class-major) at a pixel set: coarse (n, K) or fine children (n * 8, K).
    ``matrices`` (n * nover, 3, 3) may pass the rows' matrices when the caller already has them."""
    matrices, index = _rows_geometry(setup, rows, fine, matrices)
    P = project_pixels(setup.ref_stack, matrices, pix.kx, pix.ky, index=index)
    # RELION's projector gives 0 beyond radius s/2 of the image size s in use (its r_max; the pixel set keeps the
    # corners of shell s/2, where ROUND(|k|) = s/2 but |k| > s/2): those pixels then score |X|^2 at every pose. Our
    # fine references are prepared with r_max = s/2 already; the coarse pass at its smaller size needs the cut.
    if pix.beyond_radius is not None:
        P[:, pix.beyond_radius] = 0
    return P


def _row_slices(setup: EStepSetup, rows: np.ndarray, pix: PixelSet, fine: bool, width: int | None,
                matrices=None) -> SliceSet:
    """as_slices(_project_rows(...), width): on the GPU the complex slices, then their GEMM form; with NumPy the
    same numbers a cache-sized chunk at a time in the host's threads (expectation.project_as_slices), without the
    complex slices of every row."""
    if get_array_module(setup.refs[0].data) is not np:
        return as_slices(_project_rows(setup, rows, pix, fine, matrices), width)
    A, index = _rows_geometry(setup, rows, fine, matrices)
    A = A.astype(np.float32, copy=False)
    return project_as_slices(setup.ref_stack, A, pix.kx, pix.ky, np.arange(A.shape[0]), width or 2 * pix.npix,
                             index=index, zero=pix.beyond_radius)

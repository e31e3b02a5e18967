"""The E-step as matrix products (DESIGN 4.3; relion_algorithm.md 3).

RELION's negative log-likelihood of particle i at orientation row r (a class and an orientation) and
translation t is, with w = 1/(2 sigma2) (0 at DC), C the particle's CTF (times its group scale), P_r the
reference slice and X the particle's Fourier pixels:

    diff2(i, t, r) = sum_k w C^2 |P_r|^2  -  2 Re sum_k conj(P_r) (w C X e_t)  +  sum_k w |X|^2

The first term is one GEMM [I x K] @ [K x R]; the cross term is one real GEMM [(I T) x 2K] @ [2K x R] with real
and imaginary parts stacked along K; the last term does not depend on (r, t) and is kept apart in float64.
Scores are laid out (I, T, R): each particle's block is contiguous, so the softmax and the significance sort
run over one axis. Where particles search different orientation sets (local searches, the fine pass) the
slices are gathered per particle and the same products become batched GEMMs ``(I, T, 2K) @ (I, 2K, n)``.

Everything takes NumPy or CuPy arrays and returns the same kind; nothing here loops over particles or
orientations in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix

from . import gpu_kernels, gpu_posterior
from .backend import get_array_module, to_host
from .fourier import round_half_away, signed_index
from .host_threads import for_each
from .memory_model import CPU_SHIFT_BLOCK_BYTES, PROJECT_CHUNK_POINTS, orientations_per_chunk
from .projector import FourierReference, project_pixels
from .sample_prior import SampleLogPrior

# ----------------------------------------------------------------------------------------------------------
# Fourier pixels used at one image size
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PixelSet:
    """The unique half-grid pixels of an N box with shell ROUND(|k|) <= s/2 (RELION's Mresol >= 0 at image
    size s, without the redundant kx = 0, ky < 0 half column). ``flat`` indexes the (N, N//2+1) half grid."""

    box: int  # N, the box of the images (Fourier pixels are 1/(N p))
    size: int  # s, the image size in use (coarse_size or current_size)
    kx: object  # (K,) float64
    ky: object  # (K,) float64
    flat: object  # (K,) int64 into the (N, N//2+1) half grid
    shell: object  # (K,) int64, ROUND(|k|)
    beyond_radius: object = None  # (K,) bool: |k| > s/2 (corners of shell s/2); None where there are none

    @property
    def npix(self) -> int:
        return int(self.kx.shape[0])


def pixel_set(box: int, size: int, xp=np) -> PixelSet:
    s = min(int(size), int(box))
    ky = signed_index(box, xp)[:, None] * xp.ones((1, box // 2 + 1), dtype=np.int64)
    kx = xp.arange(box // 2 + 1)[None, :] * xp.ones((box, 1), dtype=np.int64)
    shell = round_half_away(xp.sqrt((kx * kx + ky * ky).astype(np.float64))).astype(np.int64)
    keep = (shell <= s // 2) & ~((kx == 0) & (ky < 0))
    flat = xp.nonzero(keep.reshape(-1))[0]
    kx, ky = kx.reshape(-1)[flat].astype(np.float64), ky.reshape(-1)[flat].astype(np.float64)
    beyond = (kx * kx + ky * ky) > (s / 2.0) ** 2
    return PixelSet(box, s, kx, ky, flat, shell.reshape(-1)[flat], beyond if bool(beyond.any()) else None)


def gather_pixels(F, pix: PixelSet):
    """(I, N, N//2+1) half-grid FTs -> (I, K) values at the pixel set."""
    return F.reshape(F.shape[0], -1)[:, pix.flat]


def translation_ramps(pix: PixelSet, shifts_px):
    """e_t(k) = exp(-2 pi i k.t / N) for translations (T, 2) = (x, y) pixels: (T, K) complex64.
    Multiplying an FT by e_t moves its content by +t (RELION's origin convention)."""
    xp = get_array_module(pix.kx)
    t = xp.asarray(shifts_px, dtype=np.float64).reshape(-1, 2)
    phase = (-2.0 * np.pi / pix.box) * (t[:, 0:1] * pix.kx[None, :] + t[:, 1:2] * pix.ky[None, :])
    return xp.exp(1j * phase).astype(np.complex64)


#: The score GEMMs' contraction length 2K (real and imaginary parts of K pixels) is padded with zeros to a multiple
#: of this where the coarse pass makes its operands: cuBLAS's TF32 tensor-core kernels need 16-byte-aligned rows.
#: At 2K = 1598 (box 128, coarse size 44) TF32 ran at 119 TFLOP/s, padded to 1600 at 370 on an H200; float32 runs
#: at its limit either way (benchmarks/bench_gemm_align.py, benchmarks/README.md).
GEMM_ALIGN = 16


def gemm_width(npix: int) -> int:
    """2 npix rounded up to a multiple of GEMM_ALIGN: the padded [Re, Im] width of the score GEMMs."""
    return -(-2 * int(npix) // GEMM_ALIGN) * GEMM_ALIGN


def stack_complex(Z, width: int | None = None):
    """Complex (..., K) -> real (..., 2K) float32 = [Re, Im] (the GEMM form of Re sum conj(a) b); with ``width``
    > 2K, zeros after them up to that width (gemm_width)."""
    xp = get_array_module(Z)
    K = Z.shape[-1]
    if width is None or width <= 2 * K:
        return xp.concatenate([Z.real, Z.imag], axis=-1).astype(np.float32, copy=False)
    out = xp.zeros(Z.shape[:-1] + (width,), dtype=np.float32)
    out[..., :K] = Z.real
    out[..., K:2 * K] = Z.imag
    return out


def stacked_shifted(g, ramps, width: int | None = None):
    """[Re, Im] of g_i e_t for every particle i and translation t: (I, T, 2K) float32 from g (I, K) complex and
    ramps (T, K) complex, stack_complex(g[:, None] * ramps[None]) to float rounding (zeros after them up to
    ``width`` where that is larger: gemm_width). With NumPy exactly those complex products, one cache-sized block
    of particles at a time (CPU_SHIFT_BLOCK_BYTES); on a GPU the fused kernel, else written into its output half by
    half with one float32 (I, T, K) temporary at a time: 12 bytes per (particle, translation, pixel) at its peak
    instead of 16 (the complex product and its stacked copy), which bounds the fine pass's chunks at the full image
    size (backend.FINE_BYTES_PER_TRANSLATION_PIXEL)."""
    xp = get_array_module(g)
    g = g.astype(np.complex64, copy=False)
    ramps = ramps.astype(np.complex64, copy=False)
    I, K = g.shape
    if gpu_kernels.shifted_applies(g, ramps):  # one pass, the same numbers, no temporary
        return gpu_kernels.stacked_shifted(g, ramps, max(2 * K, width or 0))
    out = xp.empty((I, ramps.shape[0], max(2 * K, width or 0)), dtype=np.float32)
    out[..., 2 * K:] = 0.0
    if xp is np:  # one complex product per cache-sized block of particles (each element alone: no block effect)
        block = max(1, CPU_SHIFT_BLOCK_BYTES // max(1, ramps.shape[0] * K * 8))
        for a in range(0, I, block):
            prod = g[a:a + block, None, :] * ramps[None]
            out[a:a + block, :, :K] = prod.real
            out[a:a + block, :, K:2 * K] = prod.imag
        return out
    gr, gi = g.real[:, None, :], g.imag[:, None, :]
    rr, ri = ramps.real[None], ramps.imag[None]
    re, im = out[..., :K], out[..., K:2 * K]
    xp.multiply(gr, rr, out=re)
    tmp = gi * ri
    re -= tmp
    xp.multiply(gr, ri, out=im)
    xp.multiply(gi, rr, out=tmp)
    im += tmp
    return out


@dataclass(frozen=True)
class SliceSet:
    """Reference slices in the form the GEMMs use, made once and then gathered by row: ``stacked``
    (..., 2K) float32 = [Re, Im] and ``power`` (..., K) float32 = |P|^2. Shared slices are (n, .), gathered
    ones (I, n, .)."""

    stacked: object
    power: object

    @property
    def ndim(self) -> int:
        return self.stacked.ndim

    def take(self, idx) -> SliceSet:
        return SliceSet(self.stacked[idx], self.power[idx])


def as_slices(P, width: int | None = None) -> SliceSet:
    """Complex slices (..., K) -> SliceSet, ``stacked`` padded with zeros to ``width`` (a SliceSet is returned
    as it is)."""
    if isinstance(P, SliceSet):
        return P
    power = P.real * P.real  # summed in place and made before the stack: one temporary of the power at a time
    power += P.imag * P.imag
    power = power.astype(np.float32, copy=False)
    return SliceSet(stack_complex(P, width), power)


def project_as_slices(ref: FourierReference, A, kx, ky, source, width: int, index=None, zero=None) -> SliceSet:
    """NumPy: the rows ``source`` (I, n) (positions in the orientations A (U, d, d) and, for a stacked reference,
    their reference ``index`` (U,)) projected straight into the score GEMMs' form, a cache-sized chunk of rows at a
    time (in the host's threads), pixels where ``zero`` (npix,) is set zeroed: the numbers of
    as_slices(project_pixels(...) zeroed, width).take(source) without the complex slices of every orientation and
    the gathered copy (a local search, where particles rarely share rows: gpu_kernels.project_stacked on a GPU)."""
    src = np.asarray(source).reshape(-1)
    npix = int(np.size(kx))
    stacked = np.empty((src.size, int(width)), dtype=np.float32)
    power = np.empty((src.size, npix), dtype=np.float32)
    step = orientations_per_chunk(np, PROJECT_CHUNK_POINTS, npix)

    def chunk(r0: int) -> None:
        rows = src[r0:r0 + step]
        P = project_pixels(ref, A[rows], kx, ky, index=None if index is None else index[rows])
        if zero is not None:
            P[:, zero] = 0
        s = as_slices(P, width)
        stacked[r0:r0 + step] = s.stacked
        power[r0:r0 + step] = s.power

    for_each(chunk, range(0, src.size, step))
    shape = np.shape(source)
    return SliceSet(stacked.reshape(shape + (int(width),)), power.reshape(shape + (npix,)))


# ----------------------------------------------------------------------------------------------------------
# Scores
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ParticleTerms:
    """The particle side of the score GEMMs for a batch at one pixel set and translation set."""

    Yt: object  # (I, T, 2K) float32: [Re, Im] of w C X e_t
    wc2: object  # (I, K) float32: w C^2
    x2: object  # (I,) float64: sum_k w |X|^2 (independent of orientation and translation)
    cc: bool = False  # cross-correlation mode (w = 1; scores are -CC)
    xnorm: object = None  # (I,) float64, sqrt(sum |X|^2) in CC mode


def particle_terms(X, ctf, w, ramps, cc: bool = False, width: int | None = None) -> ParticleTerms:
    """X (I, K) complex particle pixels, ctf (I, K) real or None, w (I, K) = 1/(2 sigma2) (0 where excluded),
    ramps (T, K) translation phases. In CC mode w is replaced by 1 on the same pixels (w > 0). ``width``: Yt
    padded with zeros to it (gemm_width; the slices it meets must be padded alike)."""
    xp = get_array_module(X)
    if cc:
        w = (w > 0).astype(np.float32)
    c = xp.ones(X.shape, dtype=np.float32) if ctf is None else ctf.astype(np.float32)
    wc2 = (w * c * c).astype(np.float32)
    x2 = (w.astype(np.float64) * (X.real.astype(np.float64) ** 2 + X.imag.astype(np.float64) ** 2)).sum(-1)
    xnorm = xp.sqrt(x2) if cc else None
    return ParticleTerms(stacked_shifted((w * c) * X, ramps, width), wc2, x2, cc, xnorm)  # (I, T, 2K): w C X e_t


def _finish_scores(cross, pnorm, terms: ParticleTerms):
    """diff2 without the constant: pnorm - 2 cross; in CC mode -CC = -cross / (|C P| |X|)."""
    xp = get_array_module(cross)
    if terms.cc:
        den = xp.sqrt(xp.maximum(pnorm, 1e-30)) * terms.xnorm[:, None, None].astype(np.float32)
        return -cross / xp.maximum(den, 1e-30)
    if gpu_kernels.finish_scores_applies(cross, pnorm):
        return gpu_kernels.finish_scores(cross, pnorm)  # in place over the GEMM's output, one pass
    return pnorm - 2.0 * cross


def _slices_for(P, terms: ParticleTerms) -> SliceSet:
    """The slices P as a SliceSet of the particle terms' GEMM width (complex slices are padded to it); a
    SliceSet of another width is refused."""
    S = as_slices(P, terms.Yt.shape[-1])
    if S.stacked.shape[-1] != terms.Yt.shape[-1]:
        raise ValueError(f"slices of width {S.stacked.shape[-1]} against particle terms of width {terms.Yt.shape[-1]}")
    return S


def scores_shared(P, terms: ParticleTerms, check: Callable[[], None] | None = None):
    """Scores (I, T, R) float32 for orientation slices P (R, K) complex or SliceSet, shared by every
    particle: two GEMMs. ``check()`` (a cancel point) is called between them."""
    S = _slices_for(P, terms)
    I, T, K2 = terms.Yt.shape
    cross = (terms.Yt.reshape(I * T, K2) @ S.stacked.T).reshape(I, T, -1)
    if check is not None:
        check()
    pnorm = (terms.wc2 @ S.power.T)[:, None, :]  # (I, 1, R)
    if check is not None:
        check()
    return _finish_scores(cross, pnorm, terms).astype(np.float32, copy=False)


def scores_gathered(Pg, terms: ParticleTerms, check: Callable[[], None] | None = None):
    """Scores (I, T, n) for per-particle slices Pg (I, n, K) complex or SliceSet: batched GEMMs. ``check()`` (a
    cancel point) is called between them."""
    S = _slices_for(Pg, terms)
    xp = get_array_module(S.stacked)
    cross = batched_matmul(terms.Yt, S.stacked.transpose(0, 2, 1), check)  # (I, T, n)
    if check is not None:
        check()
    pnorm = xp.matmul(S.power, terms.wc2[:, :, None]).transpose(0, 2, 1)  # (I, 1, n)
    return _finish_scores(cross, pnorm, terms).astype(np.float32, copy=False)


# ----------------------------------------------------------------------------------------------------------
# Weights and significance
# ----------------------------------------------------------------------------------------------------------


def as_sample_log_prior(diff2, log_prior):
    """(diff2 as (I, R, C), log_prior as a SampleLogPrior) of scores of any shape (I, ...) and a log prior given
    either way: as a SampleLogPrior of the (I, R, C) scores, or as an array broadcastable to diff2 (made into a
    table of the full shape: tests and callers without a factored prior)."""
    I = diff2.shape[0]
    if isinstance(log_prior, SampleLogPrior):
        return diff2, log_prior
    xp = get_array_module(log_prior)
    table = xp.ascontiguousarray(xp.broadcast_to(log_prior, diff2.shape), dtype=np.float64)
    if diff2.ndim != 3:
        diff2, table = diff2.reshape(I, 1, -1), table.reshape(I, 1, -1)
    return diff2, SampleLogPrior(table)


@dataclass
class Weights:
    """Posterior weights of a batch over its (I, M) samples (M = T x rows, flattened)."""

    w: object  # (I, M) float32: w / S for significant samples (>= w_sig), 0 elsewhere (None if not asked for)
    significant: object  # (I, M) bool
    best: object  # (I,) int64 flat index of the best sample
    pmax: object  # (I,) float64: w_max / S
    nr_significant: object  # (I,) int64
    log_evidence: object  # (I,) float64: log sum_M exp(log prior - diff2) (without the constant x2)


def posterior_weights(diff2, log_prior, adaptive_fraction: float = 0.999, cc: bool = False,
                      maxsig: int = -1, check: Callable[[], None] | None = None, weights: bool = True) -> Weights:
    """Log-domain weights exp(log_prior - diff2) per particle over its samples (diff2 (I, R, C); log_prior a
    SampleLogPrior or an array broadcastable to diff2; invalid samples carry log_prior = -inf), normalised by
    their full sum S, then RELION's significance: sort descending, keep the samples until the running sum first
    exceeds ``adaptive_fraction`` x S (``maxsig`` caps the count). CC mode: a hard assignment to the best (lowest)
    score.

    The threshold: :func:`significance_threshold`. ``check()`` (a cancel point) is called between the steps.
    ``weights=False`` leaves ``w`` None (a pass that needs only which samples are significant: one (I, M) float32
    array less to write). On a GPU the fused kernels of gpu_posterior make p, the threshold's candidates and
    the mask (the same values).
    (A sort-free threshold by bisection over the float32 values was tried: 32 masked reductions with a host
    check each made the 2D E-step 1.5x slower on the H100, results/estep_class2d_bisect_rejected_h100.json.)"""
    xp = get_array_module(diff2)
    I = diff2.shape[0]
    diff2, log_prior = as_sample_log_prior(diff2, log_prior)
    shape = diff2.shape
    rows = xp.arange(I)
    if cc:  # hard assignment to the best score among the valid samples; priors do not enter
        lw = (log_prior.full(shape) - diff2.astype(np.float64)).reshape(I, -1)
        ok = xp.isfinite(lw)
        best = xp.argmax(xp.where(ok, -diff2.reshape(I, -1).astype(np.float64), -np.inf), axis=1)
        w = xp.zeros(lw.shape, dtype=np.float32)
        w[rows, best] = 1.0
        ones = xp.ones(I, dtype=np.int64)
        return Weights(w, w > 0, best, xp.ones(I), ones, -diff2.reshape(I, -1)[rows, best].astype(np.float64))
    check = check or _no_check
    check()
    n = shape[1] * shape[2]
    eps = candidate_floor(adaptive_fraction, n) if maxsig <= 0 else 0.0
    fused = gpu_posterior.applies(diff2, log_prior)
    if fused:
        p, best, top, S, counts, packed = gpu_posterior.fused_weights(diff2, log_prior, eps if eps > 0 else np.inf,
                                                                      n // 4 if eps > 0 else 1)
        candidates = (counts, packed) if eps > 0 else None
    else:
        p, best, top, S = normalised_weights(diff2, log_prior)
        candidates = None
    check()
    k, wsig = significance_threshold(p, adaptive_fraction, maxsig, candidates=candidates)
    check()
    pmax = p[rows, best].astype(np.float64)
    if fused:
        sig, wn = gpu_posterior.significant_weights(p, wsig, weights)
    else:
        sig = (p >= wsig[:, None]) & (p > 0)
        wn = xp.where(sig, p, np.float32(0.0)) if weights else None
    return Weights(wn, sig, best, pmax, k + 1, top + xp.log(S))


def normalised_weights(diff2, log_prior):
    """(p, best, top, S) per particle of lw = log_prior - diff2 over its samples (diff2 (I, R, C), log_prior a
    SampleLogPrior or an array broadcastable to it): p = exp(lw - top) / S float32 (I, R C), best the first index
    of the largest lw, top = lw[best] and S = sum exp(lw - top) float64 (I,). On a GPU the fused kernels of
    gpu_posterior (lw never stored; the same values, S summed in another order); elsewhere the array code."""
    I = diff2.shape[0]
    diff2, log_prior = as_sample_log_prior(diff2, log_prior)
    if gpu_posterior.applies(diff2, log_prior):
        return gpu_posterior.fused_weights(diff2, log_prior, np.inf, 1)[:4]
    xp = get_array_module(diff2)
    # one float64 array, changed in place (the same operations on the same values as lw - top, exp, / S with
    # fresh arrays; on the CPU a third of the time went to making and filling fresh temporaries)
    lw = xp.empty(diff2.shape, dtype=np.float64)
    xp.subtract(log_prior.full(diff2.shape), diff2, out=lw)  # float32 diff2 promoted exactly
    lw = lw.reshape(I, -1)
    best = xp.argmax(lw, axis=1)
    top = lw[xp.arange(I), best]  # a copy: kept as lw changes
    lw -= top[:, None]
    e = xp.exp(lw, out=lw)  # exp(-inf) = 0
    S = e.sum(axis=1)
    e /= S[:, None]
    return e.astype(np.float32), best, top, S


def candidate_floor(adaptive_fraction: float, n: int) -> float:
    """eps = (1 - f) / (2 n): only weights p >= eps (compared in float32) can lie before or at the significance
    crossing of a row of n samples (see significance_threshold). 0 (no floor: the callers then sort every sample)
    when there is nothing to cut: a row of no samples (n = 0: a batch whose particles found no significant coarse
    sample, which once divided by zero here), or a fraction of 1 or more (every sample counts)."""
    if n <= 0 or not adaptive_fraction < 1.0:
        return 0.0
    return 0.5 * (1.0 - adaptive_fraction) / n


def _sorted_descending(vals):
    """Each row of vals (I, m) float32 sorted descending, values <= 0 as 0 (the weights are >= 0; the packed
    candidates' -1 padding sorts last and adds nothing). On CuPy one radix sort of (row, value) keys
    (gpu_posterior.sort_rows_descending), the same values in the same order."""
    xp = get_array_module(vals)
    if xp is not np:
        from . import gpu_posterior  # noqa: PLC0415

        return gpu_posterior.sort_rows_descending(vals)
    return -np.sort(-np.maximum(vals, np.float32(0.0)), axis=1)


def _threshold_by_sort(p, adaptive_fraction: float, maxsig: int = -1):
    """RELION's significance by a full sort of each row of p (I, n): the index k of the sample (descending)
    where the running sum first reaches ``adaptive_fraction`` (capped by ``maxsig``) and its weight."""
    xp = get_array_module(p)
    srt = _sorted_descending(p)
    csum = xp.cumsum(srt, axis=1, dtype=np.float64)
    k = (csum < adaptive_fraction).sum(axis=1)  # samples before the crossing
    k = xp.minimum(k, p.shape[1] - 1)
    if maxsig > 0:
        k = xp.minimum(k, maxsig - 1)
    return k, srt[xp.arange(p.shape[0]), k]


def significance_threshold(p, adaptive_fraction: float, maxsig: int = -1, candidates=None):
    """(k, w_sig) per row of the normalised weights p (I, n) float32: the samples sorted descending are
    significant up to and including index k, where their running sum (float64) first reaches
    ``adaptive_fraction`` (RELION's significant_weight); w_sig = the k-th largest weight.

    Only samples with p >= eps = (1 - f) / (2 n) can lie before or at the crossing: all the others together
    weigh less than (1 - f) / 2, so the mass above any one of them exceeds f. So only those candidates are
    sorted (a few thousand of hundreds of thousands once the posteriors have sharpened), and the running sums
    over them are the same float64 additions in the same order as over the full sort: the result is identical.
    Rows whose candidates are most of their samples (more than n // 4: flat posteriors) are fully sorted, each
    row on its own path, so that a few flat particles do not make a whole batch of sharp ones sort every sample;
    so are rows whose candidates never reach f (rounding), and every row with a ``maxsig`` cap.
    ``candidates`` = (counts (I,), packed (I, >= n // 4)): the candidates found already (the GPU kernel), each
    row's first min(count, n // 4) entries of packed in any order; else they are found here."""
    xp = get_array_module(p)
    I, n = p.shape
    eps = candidate_floor(adaptive_fraction, n)
    if maxsig > 0 or eps <= 0 or I == 0:
        return _threshold_by_sort(p, adaptive_fraction, maxsig)
    if candidates is None:
        cand = p >= np.float32(eps)
        counts = cand.sum(axis=1)
    else:
        cand, (counts, packed) = None, candidates
    wide = (counts == 0) | (counts > n // 4)
    # one transfer for both numbers the host needs: how many rows are wide, the largest count of the others
    n_wide, m = (int(v) for v in to_host(xp.stack([wide.sum(), xp.where(wide, 0, counts).max()])))
    if n_wide == I:
        return _threshold_by_sort(p, adaptive_fraction)

    def packed_of(sel):  # the candidates of rows sel, packed into (rows, their largest count m), -1 after
        c = counts[sel]
        if cand is None:
            return xp.where(xp.arange(m)[None, :] < c[:, None], packed[sel, :m], np.float32(-1.0)), c
        return _pack_candidates(p[sel], cand[sel], c, m), c

    if n_wide == 0:
        return _threshold_of_candidates(p, *packed_of(slice(None)), adaptive_fraction)
    k = xp.empty(I, dtype=np.int64)
    wsig = xp.empty(I, dtype=p.dtype)
    w_rows, n_rows = xp.flatnonzero(wide), xp.flatnonzero(~wide)
    k[w_rows], wsig[w_rows] = _threshold_by_sort(p[w_rows], adaptive_fraction)
    k[n_rows], wsig[n_rows] = _threshold_of_candidates(p[n_rows], *packed_of(n_rows), adaptive_fraction)
    return k, wsig


def _pack_candidates(p, cand, counts, m: int):
    """Each row's candidates ``cand`` (``counts`` per row, at most m) packed into an (I, m) array, -1 after."""
    xp = get_array_module(p)
    I = p.shape[0]
    rows, cols = xp.nonzero(cand)
    pos = xp.arange(rows.size) - (xp.cumsum(counts) - counts)[rows]
    vals = xp.full((I, m), -1.0, dtype=p.dtype)
    vals[rows, pos] = p[rows, cols]
    return vals


def _threshold_of_candidates(p, vals, counts, adaptive_fraction: float):
    """significance_threshold over each row's candidates only, packed in ``vals`` (I, m) (``counts`` per row,
    all > 0, -1 after them); rows whose packed running sum never reaches f are sorted in full."""
    xp = get_array_module(p)
    I, m = vals.shape
    srt = _sorted_descending(vals)  # the -1 after each row's candidates as 0
    csum = xp.cumsum(srt, axis=1, dtype=np.float64)
    k = (csum < adaptive_fraction).sum(axis=1)
    found = k < counts
    k = xp.minimum(k, m - 1)
    wsig = srt[xp.arange(I), k]
    if not bool(found.all()):
        bad = xp.flatnonzero(~found)
        k[bad], wsig[bad] = _threshold_by_sort(p[bad], adaptive_fraction)
    return k, wsig


# ----------------------------------------------------------------------------------------------------------
# Weighted sums for the M-step (fine pass)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class FineSums:
    """Per-particle and per-row sums from the normalised fine weights of a batch.

    With slices shared by the batch (P of shape (n, K)) the back-projection data are already summed over the
    particles: ``slices`` (n, 2K) and ``slice_weights`` (n, K); with gathered slices (P of shape (I, n, K))
    they are per particle: (I, n, 2K) and (I, n, K), to be summed per distinct row by the caller."""

    slices: object  # sum_t w(i,t,row) [Re, Im](C X_u e_t m)
    slice_weights: object  # sum_t w(i,t,row) C^2 m
    row_weight: object  # (I, n) float32: sum_t w(i, t, row)
    trans_weight: object  # (I, T) float32: sum_row w(i, t, row)
    noise: object  # (I, K) float64: sum_{row,t} w |C P - X e_t|^2 per pixel (masked image)
    xa: object  # (I, K) float64: sum w Re(conj(C P) X e_t) per pixel
    aa: object  # (I, K) float64: sum w |C P|^2 per pixel


def sum_conj_shifted(U, ramps):
    """sum_t (U_re - i U_im)_t e_t for U (I, T, 2K) float32 = [Re, Im] of sum_r w P and ramps e_t (T, K): (I, K)
    complex64, as four real contractions over t (no complex conjugate of U and its product with the ramps: NumPy's
    einsum makes no temporary of U's size, measured with tracemalloc). On the GPU one fused kernel
    (gpu_kernels.sum_conj_shifted) reads U once: CuPy's einsum copied each half of U to a transposed layout first
    (in a local search at box 192 on an H200 those copies took about 1.3 s of a 7 s iteration)."""
    xp = get_array_module(U)
    K = ramps.shape[1]
    if gpu_kernels.ENABLED and xp is not np and U.dtype == np.float32:  # one pass over U, no transposed copies
        return gpu_kernels.sum_conj_shifted(U, ramps.astype(np.complex64, copy=False))
    ur, ui = U[..., :K], U[..., K:]
    rr, ri = ramps.real.astype(np.float32), ramps.imag.astype(np.float32)
    re = xp.einsum("itk,tk->ik", ur, rr)
    re += xp.einsum("itk,tk->ik", ui, ri)
    im = xp.einsum("itk,tk->ik", ur, ri)
    im -= xp.einsum("itk,tk->ik", ui, rr)
    return re.astype(np.complex64) + im.astype(np.complex64) * np.complex64(1j)  # (I, K): small


def fine_sums(w, P, X, Xu, ctf, m, ramps, check: Callable[[], None] | None = None) -> FineSums:
    """Weighted sums of a batch. w (I, T, n) normalised weights (0 where not significant); P the reference
    slices (complex or SliceSet), shared (n, K) or gathered per particle (I, n, K); X (I, K) masked and
    Xu (I, K) unmasked particle pixels; ctf (I, K) or None; m (I, K) = 1/sigma2 for the back-projection
    (RELION's Minvsigma2, DC kept); ramps (T, K).

    Every product is a GEMM (batched over particles for gathered slices): slices = w^T Z with
    Z = C Xu e_t m; the noise per pixel C^2 sum_r W_r |P_r|^2 - 2 Re(C X sum_t e_t sum_r w conj(P_r))
    + sum w |X|^2. ``check()`` (a cancel point that raises to stop) is called between the GEMMs."""
    check = check or _no_check
    S = as_slices(P)
    xp = get_array_module(S.stacked)
    I, T, n = w.shape
    K = X.shape[1]
    shared = S.ndim == 2
    c = xp.ones(X.shape, dtype=np.float32) if ctf is None else ctf.astype(np.float32)
    Z = stacked_shifted((c * m) * Xu, ramps)  # (I, T, 2K): [Re, Im] of C Xu e_t m
    row_w = w.sum(axis=1)  # (I, n)
    trans_w = w.sum(axis=2)  # (I, T)
    c2m = (c * c * m).astype(np.float32)
    check()
    if shared:
        slices = w.reshape(I * T, n).T @ Z.reshape(I * T, 2 * K)  # (n, 2K), summed over the batch
        slice_w = row_w.T @ c2m  # (n, K)
    else:
        slices = batched_matmul(w.transpose(0, 2, 1), Z, check)  # (I, n, 2K)
        slice_w = row_w[:, :, None] * c2m[:, None, :]
    del Z  # (I, T, 2K): freed before U, the other array of that size
    check()
    xa, aa = signal_products(w, S, X, c, ramps, check, row_w)
    wsum = row_w.sum(axis=1).astype(np.float64)[:, None]
    x2 = X.real.astype(np.float64) ** 2 + X.imag.astype(np.float64) ** 2
    noise = aa - 2.0 * xa + wsum * x2
    return FineSums(slices, slice_w, row_w, trans_w, noise, xa, aa)


def signal_products(w, P, X, ctf, ramps, check: Callable[[], None] | None = None, row_w=None):
    """Per particle and pixel, (xa, aa) float64 (I, K): xa = C Re(sum_{r,t} w conj(P_r) X e_t), the weighted
    product of the CTF-multiplied reference with the shifted image, and aa = C^2 sum_r W_r |P_r|^2, its weighted
    power (RELION's sumXA and sumA2 before the shell selection). w (I, T, n) weights; P slices (shared or
    gathered, as fine_sums); X (I, K) masked pixels; ctf (I, K) (the group scale included) or None; ramps (T, K).
    Two GEMMs: sum_r W_r |P_r|^2 and U = w P."""
    check = check or _no_check
    S = as_slices(P)
    xp = get_array_module(S.stacked)
    c = xp.ones(X.shape, dtype=np.float32) if ctf is None else ctf.astype(np.float32, copy=False)
    row_w = w.sum(axis=1) if row_w is None else row_w  # (I, n)
    a = batched_matmul(row_w[:, None, :], S.power, check)[:, 0, :].astype(np.float64)  # (I, K): sum_r W_r |P_r|^2
    check()
    U = batched_matmul(w, S.stacked, check)  # (I, T, 2K): sum_r w [Re P, Im P]
    check()
    b = sum_conj_shifted(U, ramps) * X  # (I, K): sum_{r,t} w conj(P) X e_t
    del U
    c64 = c.astype(np.float64)
    return c64 * b.real.astype(np.float64), c64 * c64 * a


#: Floating-point operations of one block of a batched product on the CPU (0.02-0.1 s): the cancel point
#: between two blocks stops a job within a second even while one product would take many seconds.
CPU_BLOCK_FLOPS = 1e9


def batched_matmul(a, b, check: Callable[[], None] | None = None):
    """``matmul(a, b)`` of an (I, m, k) stack and an (I, k, n) stack or one (k, n) matrix. On the CPU it runs
    in blocks of particles with ``check()`` between them; NumPy computes each particle's product alone, so the
    result is bit-identical to one call whatever the blocks (tests/test_cancel.py checks it). On the GPU: one
    batched GEMM."""
    xp = get_array_module(a)
    I = a.shape[0]
    if xp is not np or I < 2:
        return xp.matmul(a, b)
    flops = 2.0 * a.shape[1] * a.shape[2] * b.shape[-1]
    step = max(1, int(CPU_BLOCK_FLOPS // max(flops, 1.0)))
    if step >= I:
        return np.matmul(a, b)
    out = np.empty((I, a.shape[1], b.shape[-1]), dtype=np.result_type(a, b))
    for i0 in range(0, I, step):
        if check is not None and i0:
            check()
        np.matmul(a[i0:i0 + step], b if b.ndim == 2 else b[i0:i0 + step], out=out[i0:i0 + step])
    return out


def _no_check() -> None:
    """The cancel check of a computation nobody can cancel."""


@dataclass(frozen=True)
class Segments:
    """Entries grouped by an integer key: the distinct keys ascending, each entry's group (``inverse``), and on a
    GPU the entries in group order (a stable sort: within a group by ascending entry) with each group's first
    position in it (``start``, one more than the groups): gpu_kernels.segment_rows_sum's sort, made once for
    every array summed over the same groups."""

    distinct: object  # (n,) ascending keys
    inverse: object  # (E,) each entry's group
    order: object = None  # (E,) GPU only
    start: object = None  # (n + 1,) GPU only

    @property
    def n(self) -> int:
        return int(self.distinct.size)


def segments_of(keys) -> Segments:
    """The groups of the entries of ``keys`` (any shape, flattened): np.unique(keys, return_inverse=True) with,
    on a GPU, the one stable sort that finds them kept for segment_sum. Entries with a negative key belong to no
    group (inverse -1; the sums leave them out): a gathered chunk's padding, which would otherwise make one long
    group that a single GPU thread per value adds up one entry after another."""
    xp = get_array_module(keys)
    keys = keys.reshape(-1)
    if xp is np:
        valid = keys >= 0
        distinct, inv = np.unique(keys[valid], return_inverse=True)
        inverse = np.full(keys.size, -1, dtype=np.int64)
        inverse[valid] = inv.reshape(-1)
        return Segments(distinct, inverse)
    E = int(keys.size)
    if E == 0:
        none = xp.zeros(0, dtype=np.int64)
        return Segments(keys, none, none, xp.zeros(1, dtype=np.int64))
    order = xp.argsort(keys, kind="stable")
    ordered = keys[order]
    first = ordered >= 0  # the negative keys sort first, before every group's head: in no group
    first[1:] &= ordered[1:] != ordered[:-1]
    heads = xp.flatnonzero(first)
    inverse = xp.empty(E, dtype=np.int64)
    inverse[order] = xp.cumsum(first, dtype=np.int64) - 1
    start = xp.concatenate([heads, xp.asarray([E], dtype=heads.dtype)])
    return Segments(ordered[heads], inverse, order, start)


#: A run-by-run add (add_to_rows) when the rows fall in at most this fraction of runs of consecutive rows.
ROW_RUNS_FRACTION = 0.25


def add_to_rows(target, rows, values) -> None:
    """target[rows] += values for ``rows`` distinct and ascending (1-D). With NumPy, when the rows make few runs
    of consecutive rows (a chunk of the fine pass that shares the union's orientations), each run is added in
    place through a slice: a fancy-index add gathers the rows into a copy, adds and scatters them back (three
    passes over the block, a quarter of the CPU fine pass's sums at box 64). Every element gets the same one
    addition either way."""
    xp = get_array_module(target)
    n = int(rows.size)
    if xp is np and n > 1:
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        if breaks.size + 1 <= ROW_RUNS_FRACTION * n:
            bounds = np.concatenate([[0], breaks, [n]])
            for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                r = int(rows[a])
                target[r:r + b - a] += values[a:b]
            return
    target[rows] += values


def grouped_sum(groups: Segments, values):
    """(groups.n, ...) float32: the sum of the rows of ``values`` (E, ...) over each group: segment_sum with the
    groups' sort made once."""
    return _segment_sum(groups.inverse, values, groups.n, (groups.order, groups.start))


def segment_sum(rows, values, n: int):
    """out[r] = sum of values[j] with rows[j] == r, for r < n: (n, ...) float32. A sparse-matrix product on
    the CPU (NumPy's add.at is an order of magnitude slower). On the GPU, rows of at least
    gpu_kernels.SEGMENT_ROWS_MIN_COLUMNS values (the fine pass's slices and their weights) are summed by
    gpu_kernels.segment_rows_sum (entries sorted by row, each output element summed by one thread: 4x CuPy's
    scatter_add at a chunk's shapes on an H200, whose atomic adds into the orientations every particle shares
    serialise); narrower rows (a weight per row, the offset moments of K classes) keep scatter_add, since one
    thread per output element would add tens of thousands of entries one after another. Entries of a negative
    row are left out."""
    return _segment_sum(rows, values, n, None)


def _segment_sum(rows, values, n: int, sorted_entries):
    """segment_sum; ``sorted_entries`` (order, start): the entries' sort by row made already (grouped_sum)."""
    xp = get_array_module(values)
    vals = values.reshape(values.shape[0], int(np.prod(values.shape[1:])))  # not -1: no entries is an (0, C)
    if xp is np:
        rows = np.asarray(rows).reshape(-1)
        take = np.flatnonzero(rows >= 0)  # negative rows: entries in no group (segments_of); rows >= n raise
        S = csr_matrix((np.ones(take.size, np.float32), (rows[take], take)), shape=(n, rows.size))
        out = np.asarray(S @ vals, dtype=np.float32)
    elif gpu_kernels.ENABLED and vals.shape[1] >= gpu_kernels.SEGMENT_ROWS_MIN_COLUMNS:
        out = gpu_kernels.segment_rows_sum(rows, vals, n, sorted_entries)
    else:
        import cupyx  # noqa: PLC0415

        out = xp.zeros((n + 1, vals.shape[1]), dtype=np.float32)  # entries of a negative row into the extra one
        cupyx.scatter_add(out, xp.where(rows >= 0, rows, n), vals.astype(np.float32, copy=False))
        out = out[:n]
    return out.reshape((n,) + values.shape[1:])

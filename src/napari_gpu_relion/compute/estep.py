"""One E-step over a batch of particles: preprocessing, the coarse pass, the fine (oversampled) pass, the
per-particle results and the weighted sums for the M-step (relion_algorithm.md 2.4-3.7).

Orientation "rows" are (class, orientation) pairs, class-major. A global search scores every row with one
GEMM shared by all particles; a local search (or the fine pass) gathers each particle's own candidate rows and
uses batched GEMMs (compute/expectation.py). Fine candidates are the 8 orientation x 4 translation children of
each significant coarse sample; non-candidates are masked with a log-prior of -inf, so the products stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .backend import get_array_module, to_host
from .backprojector import insert_by_class
from .ctf import CtfParams, ctf_from_frequencies
from .expectation import (
    PixelSet,
    as_slices,
    fine_sums,
    gather_pixels,
    particle_terms,
    posterior_weights,
    scores_gathered,
    scores_shared,
    segment_sum,
    translation_ramps,
)
from .fourier import irfft_centered, phase_shift_2d, rfft_centered, shell_sum
from .geometry import euler_to_matrix
from .masks import soft_mask_outside
from .projector import FourierReference, project_pixels, stack_references
from .sampling import (
    angular_step,
    direction_grid,
    oversampled_directions,
    oversampled_psi,
    oversampled_translations,
    psi_angles,
    translation_grid,
)

# ----------------------------------------------------------------------------------------------------------
# Sampling of one iteration
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    """Coarse orientations and translations of one iteration, with RELION's random perturbation.

    Orientation index r = idir * n_psi + ipsi (direction-major). Translations in pixels. ``perturb`` is
    RELION's rho in [-0.5, 0.5]: angles are perturbed by rho x (angular step) about all three Euler axes,
    translations by rho x (offset step)."""

    order: int
    sym: str = "C1"
    psi_step: float | None = None
    offset_range: float = 5.0
    offset_step: float = 2.0
    perturb: float = 0.0
    oversampling: int = 1
    dir_pix: np.ndarray = field(init=False)
    rot: np.ndarray = field(init=False)
    tilt: np.ndarray = field(init=False)
    psi: np.ndarray = field(init=False)
    translations: np.ndarray = field(init=False)

    def __post_init__(self):
        self.dir_pix, self.rot, self.tilt = direction_grid(self.order, self.sym)
        self.psi = psi_angles(self.angular_step if self.psi_step is None else self.psi_step)
        t = translation_grid(self.offset_range, self.offset_step, 2)
        self.translations = t + self.perturb * self.offset_step

    @property
    def angular_step(self) -> float:
        return angular_step(self.order)

    @property
    def psi_step_actual(self) -> float:
        return 360.0 / self.psi.size

    @property
    def fine_angular_step(self) -> float:
        return self.angular_step / (1 << self.oversampling)

    @property
    def fine_offset_step(self) -> float:
        return self.offset_step / (1 << self.oversampling)

    @property
    def n_children(self) -> int:
        """Oversampled orientations per coarse one: 4^q directions x 2^q psi."""
        return 1 << (3 * self.oversampling)

    @property
    def n_dirs(self) -> int:
        return int(self.dir_pix.size)

    @property
    def n_psi(self) -> int:
        return int(self.psi.size)

    @property
    def n_orient(self) -> int:
        return self.n_dirs * self.n_psi

    def _perturbation(self) -> np.ndarray:
        d = self.perturb * self.angular_step
        return euler_to_matrix(d, d, d)

    def coarse_angles(self, r) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = np.asarray(r)
        return self.rot[r // self.n_psi], self.tilt[r // self.n_psi], self.psi[r % self.n_psi]

    def coarse_matrices(self, r=None) -> np.ndarray:
        """(n, 3, 3) perturbed matrices of coarse orientations r (default all)."""
        r = np.arange(self.n_orient) if r is None else np.asarray(r)
        return euler_to_matrix(*self.coarse_angles(r)) @ self._perturbation()

    def fine_matrices(self, r) -> np.ndarray:
        """(n, 8, 3, 3) perturbed matrices of the oversampled children of coarse orientations r
        (4^q directions x 2^q psi, psi innermost, as RELION's iover_rot)."""
        r = np.asarray(r)
        q = self.oversampling
        _, crot, ctilt = oversampled_directions(self.order, self.dir_pix[r // self.n_psi], q)  # (n, 4)
        cpsi = oversampled_psi(self.psi[r % self.n_psi], self.psi_step_actual, q)  # (n, 2)
        nd, npsi = crot.shape[-1], cpsi.shape[-1]
        rot = np.repeat(crot, npsi, axis=-1)
        tilt = np.repeat(ctilt, npsi, axis=-1)
        psi = np.tile(cpsi, (1, nd))
        return euler_to_matrix(rot, tilt, psi) @ self._perturbation()

    def fine_translations(self) -> np.ndarray:
        """(T, 4, 2) children of each coarse translation (pixels, x slowest)."""
        return oversampled_translations(self.translations, self.offset_step, self.oversampling)


@dataclass
class GivenOrientations:
    """The sampling of --skip_align: row r is orientation ``matrices[r]`` (one per particle of the data set),
    the only translation is 0 (the data are pre-shifted to their exact offsets) and there is no oversampling.
    Offers the parts of Sampling's interface that the E-step uses."""

    matrices: np.ndarray  # (R, 3, 3)
    order: int = 0
    perturb: float = 0.0
    oversampling: int = 0
    offset_step: float = 1.0
    translations: np.ndarray = field(default_factory=lambda: np.zeros((1, 2)))

    @property
    def n_orient(self) -> int:
        return int(self.matrices.shape[0])

    n_dirs = n_orient
    n_psi = 1
    n_children = 1
    angular_step = fine_angular_step = psi_step_actual = 0.0

    def coarse_matrices(self, r=None) -> np.ndarray:
        return self.matrices if r is None else self.matrices[np.asarray(r)]

    def fine_matrices(self, r) -> np.ndarray:
        return self.coarse_matrices(r)[:, None]

    def fine_translations(self) -> np.ndarray:
        return self.translations[:, None, :]


@dataclass
class InPlaneSampling:
    """The sampling of 2D classification: in-plane angles only (one "direction"), RELION's psi grid
    360/ceil(360/step), 2^q psi children per coarse psi, translations and perturbation as in Sampling. Rows
    are psi indices; matrices are Euler (0, 0, psi), whose upper-left 2x2 block rotates the 2D references."""

    psi_step: float = 10.0
    offset_range: float = 5.0
    offset_step: float = 2.0
    perturb: float = 0.0
    oversampling: int = 1
    order: int = 0
    sym: str = "C1"
    psi: np.ndarray = field(init=False)
    translations: np.ndarray = field(init=False)

    def __post_init__(self):
        self.psi = psi_angles(self.psi_step)
        self.translations = translation_grid(self.offset_range, self.offset_step, 2) + self.perturb * self.offset_step

    @property
    def psi_step_actual(self) -> float:
        return 360.0 / self.psi.size

    angular_step = psi_step_actual

    @property
    def fine_angular_step(self) -> float:
        return self.psi_step_actual / (1 << self.oversampling)

    @property
    def fine_offset_step(self) -> float:
        return self.offset_step / (1 << self.oversampling)

    @property
    def n_children(self) -> int:
        return 1 << self.oversampling

    n_dirs = 1

    @property
    def n_psi(self) -> int:
        return int(self.psi.size)

    n_orient = n_psi

    def coarse_angles(self, r) -> np.ndarray:
        """Perturbed psi (degrees) of coarse rows r."""
        return self.psi[np.asarray(r)] + self.perturb * self.psi_step_actual

    def coarse_matrices(self, r=None) -> np.ndarray:
        r = np.arange(self.n_orient) if r is None else np.asarray(r)
        psi = self.coarse_angles(r)
        return euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)

    def fine_matrices(self, r) -> np.ndarray:
        """(n, 2^q, 3, 3) matrices of the psi children of coarse rows r."""
        psi = oversampled_psi(self.coarse_angles(r), self.psi_step_actual, self.oversampling)
        return euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)

    def fine_translations(self) -> np.ndarray:
        return oversampled_translations(self.translations, self.offset_step, self.oversampling)


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
                  noise_sigma2=None, seed: int = 0, subpixel: bool = False) -> PreparedBatch:
    """images (I, N, N) float32 on the device; norm_factor (I,) = n_avg / n_i (1 without --norm);
    offsets_px (I, 2) current origin offsets. Steps: scale, shift by ROUND(offset) (a circular shift; the
    mask removes what wraps), soft circular mask of ``mask_radius_px`` with a ``mask_edge_px`` raised-cosine
    edge filled with the outside mean (--zero_mask) or, given ``noise_sigma2`` (shells 0..N/2), with
    coloured Gaussian noise of that spectrum. ``subpixel``: afterwards also apply the fractional remainder as
    a Fourier phase shift, so the data sit at the exact offsets (--skip_align: the only translation is 0)."""
    xp = get_array_module(images)
    I, N = images.shape[0], images.shape[-1]
    rounded = np.sign(offsets_px) * np.floor(np.abs(offsets_px) + 0.5)
    x = images.astype(np.float32) * xp.asarray(norm_factor, dtype=np.float32)[:, None, None]
    F = rfft_centered(x, 2)
    Fu = phase_shift_2d(F, xp.asarray(rounded), N)
    xs = irfft_centered(Fu, N, 2).astype(np.float32)
    background = None
    if noise_sigma2 is not None:
        from .fourier import shell_grid  # noqa: PLC0415

        shells = xp.minimum(shell_grid(N, 2, xp), N // 2)
        s2 = xp.asarray(noise_sigma2, dtype=np.float64)[shells]
        rs = xp.random.RandomState(seed) if xp is not np else np.random.RandomState(seed)
        g = rs.standard_normal((2, I, N, N // 2 + 1))
        noise_F = (g[0] + 1j * g[1]) * xp.sqrt(s2)
        background = irfft_centered(noise_F, N, 2).astype(np.float32)
    xm = soft_mask_outside(xs, mask_radius_px, mask_edge_px, 2, background=background)
    Fm = rfft_centered(xm.astype(np.float32), 2)
    if subpixel:
        frac = xp.asarray(np.asarray(offsets_px, dtype=np.float64) - rounded)
        Fm, Fu = phase_shift_2d(Fm, frac, N), phase_shift_2d(Fu, frac, N)
        rounded = np.asarray(offsets_px, dtype=np.float64).copy()
    return PreparedBatch(Fm, Fu, rounded)


def shell_power(F, nshells: int, unique_mask=None):
    """(I, nshells) sum of |F|^2 per shell over the unique half grid."""
    from .fourier import hermitian_unique_mask, shell_grid  # noqa: PLC0415

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
    cc: bool = False
    scale_shells: object = None  # (K,) per pixel of the fine set: True where SSNR_MAP > 3 (group scale sums)
    max_fine_bytes: int = 1 << 28
    P_coarse: object = None  # SliceSet (K * R, Kc) of the coarse slices for global searches (made once)
    ref_stack: FourierReference = field(init=False)  # all classes in one stack: one projection call for any rows

    def __post_init__(self):
        self.ref_stack = self.refs[0] if len(self.refs) == 1 else stack_references(self.refs)

    def coarse_slices(self):
        if self.P_coarse is None:
            R = self.sampling.n_orient
            self.P_coarse = as_slices(_project_rows(self, np.arange(len(self.refs) * R), self.pix_coarse, fine=False))
        return self.P_coarse


def _weights_for(sigma2_rows, pix: PixelSet, xp):
    """w = 1/(2 sigma2) per pixel (0 at DC) and m = 1/sigma2 (DC kept) for each particle's group rows."""
    s2 = sigma2_rows[:, pix.shell]  # (I, K)
    inv = xp.where(s2 > 0, 1.0 / xp.maximum(s2, 1e-30), 0.0)
    w = xp.where(pix.shell[None, :] >= 1, 0.5 * inv, 0.0).astype(np.float32)
    return w, inv.astype(np.float32)


def _log_trans_prior(offsets_round_px, trans_px, pixel_size: float, sigma_A: float, xp, prior_A):
    """(I, T, K) log prior -|o + t - mu_k|^2 / (2 sigma^2) in Å (one unit throughout, see relion_algorithm
    2.8) for prior means mu_k (K, 2) in Å (one per class in 2D classification; K = 1 and mu = 0 otherwise)."""
    o = xp.asarray(offsets_round_px, dtype=np.float64)[:, None, :] + xp.asarray(trans_px)[None, :, :]
    d = o[:, :, None, :] * pixel_size - xp.asarray(prior_A, dtype=np.float64)[None, None, :, :]
    r2 = (d * d).sum(-1)
    if sigma_A ** 2 < 1e-4:
        return xp.where(r2 < 1e-8, 0.0, -np.inf)
    return -r2 / (2.0 * sigma_A**2)


def expectation_batch(setup: EStepSetup, prep: PreparedBatch, ctf: CtfParams | None, groups, scale,
                      sums: EStepSums, candidates=None, candidate_log_prior=None,
                      scale_group_index=None, class_log_prior=None) -> BatchResult:
    """Coarse and fine passes for one batch; adds the weighted sums into ``sums`` and returns the
    per-particle results.

    groups (I,) 0-based optics group of each particle; scale (I,) group intensity scale s_g.
    candidates (I, n) coarse rows per particle (local searches; -1 pads) with their log priors, or None for
    a global search over every row with the direction prior ``setup.log_pdf_direction``. ``class_log_prior``
    (I, K) adds a per-particle class prior (-inf restricts a particle to some classes: 3D classification's
    random class seeding)."""
    xp = get_array_module(prep.F_masked)
    smp = setup.sampling
    R = smp.n_orient
    K = len(setup.refs)
    I, N = prep.F_masked.shape[0], prep.F_masked.shape[-2]
    pc, pf = setup.pix_coarse, setup.pix_fine
    sig2_rows = setup.sigma2[xp.asarray(groups)]
    scale_d = xp.asarray(scale, dtype=np.float32)[:, None]

    def ctf_at(pix):
        if ctf is None:
            return xp.broadcast_to(scale_d, (I, pix.npix)).astype(np.float32)
        c = ctf_from_frequencies(ctf, pix.kx / (N * setup.pixel_size), pix.ky / (N * setup.pixel_size), xp)
        return c * scale_d

    # ---- coarse pass ----
    Xc = gather_pixels(prep.F_masked, pc)
    wc, _ = _weights_for(sig2_rows, pc, xp)
    ramps_c = translation_ramps(pc, smp.translations)
    terms = particle_terms(Xc, ctf_at(pc), wc, ramps_c, cc=setup.cc)
    mu = np.zeros((1, 2)) if setup.class_offset_prior_A is None else np.asarray(setup.class_offset_prior_A)
    lp_trans = _log_trans_prior(prep.rounded_offsets, smp.translations, setup.pixel_size, setup.sigma_offset_A, xp,
                                mu)  # (I, T, 1 or K)
    per_class = lp_trans.shape[2] > 1

    def trans_prior_of_rows(lpt, rows):
        """(i, T, n) translation log prior of rows (i, n) (global row numbers, class-major)."""
        if not per_class:
            return xp.broadcast_to(lpt, lpt.shape[:2] + (rows.shape[1],))
        cls = xp.broadcast_to((rows // R)[:, None, :], lpt.shape[:2] + (rows.shape[1],))
        return xp.take_along_axis(lpt, cls, axis=2)

    if candidates is None:
        d2 = scores_shared(setup.coarse_slices(), terms)  # (I, T, K R)
        lp_rot = xp.zeros(K * R) if setup.log_pdf_direction is None else \
            xp.repeat(xp.asarray(setup.log_pdf_direction).reshape(-1), smp.n_psi)
        lp = trans_prior_of_rows(lp_trans, xp.arange(K * R)[None, :]) + lp_rot[None, None, :]
        if class_log_prior is not None:
            lp = lp + xp.repeat(xp.asarray(class_log_prior, dtype=np.float64), R, axis=1)[:, None, :]
        cand = None
    else:
        cand = xp.asarray(candidates)
        valid = cand >= 0
        urows, pos = xp.unique(xp.where(valid, cand, 0), return_inverse=True)
        pos = pos.reshape(cand.shape)
        Pu = _project_rows(setup, to_host(urows), pc, fine=False)
        d2 = scores_gathered(as_slices(Pu).take(pos), terms)
        lpr = xp.where(valid, xp.asarray(candidate_log_prior), -np.inf)
        if class_log_prior is not None:
            lpr = lpr + xp.take_along_axis(xp.asarray(class_log_prior, dtype=np.float64), xp.maximum(cand, 0) // R,
                                           axis=1)
        lp = trans_prior_of_rows(lp_trans, xp.maximum(cand, 0)) + lpr[:, None, :]
    Wc = posterior_weights(d2, lp, setup.adaptive_fraction, cc=setup.cc)
    n_rows = d2.shape[2]
    sig = Wc.significant.reshape(I, -1, n_rows)  # (I, T, n)
    del d2, terms

    # ---- fine pass over the children of the significant coarse samples ----
    # Particles are taken in order of their number of significant rows, in chunks that fit the memory budget.
    # A chunk whose particles mostly share rows (early iterations) scores the union of its rows with one
    # shared GEMM; otherwise each particle's own rows are gathered (batched GEMMs), padded to the chunk's
    # largest count only.
    sig_rot = sig.any(axis=1)  # (I, n)
    counts = to_host(sig_rot.sum(axis=1))
    porder = np.argsort(counts, kind="stable")
    rank = np.empty(I, dtype=np.int64)
    rank[porder] = np.arange(I)
    ii, jj = xp.nonzero(sig_rot)
    # entries sorted by particle rank (then row): each chunk's entries are one contiguous range
    esort = xp.argsort(xp.asarray(rank)[ii] * n_rows + jj)
    ii, jj = ii[esort], jj[esort]
    grow = jj if cand is None else cand[ii, jj]  # global row of each significant (particle, row)
    if cand is None:
        lpr_sig = xp.zeros(jj.shape) if setup.log_pdf_direction is None else \
            xp.asarray(setup.log_pdf_direction).reshape(-1)[jj // smp.n_psi]
    else:
        lpr_sig = xp.asarray(candidate_log_prior)[ii, jj]
    if class_log_prior is not None:
        lpr_sig = lpr_sig + xp.asarray(class_log_prior, dtype=np.float64)[ii, grow // R]
    sig_sig = sig[ii, :, jj]  # (E, T): which translations of each significant row are significant
    urows, upos = xp.unique(grow, return_inverse=True)
    upos = upos.reshape(-1)
    urows_h = to_host(urows)
    n_union = int(urows_h.size)
    Af = xp.asarray(smp.fine_matrices(urows_h % R).reshape(-1, 3, 3))  # (U * 8, 3, 3): projection and insertion
    Pf = _project_rows(setup, urows_h, pf, fine=True, matrices=Af)  # (U * 8, Kf)
    nover = Pf.shape[0] // max(1, n_union)
    Sf = as_slices(Pf)
    del Pf
    fine_t = smp.fine_translations()  # (T, 4, 2)
    T, ntov = fine_t.shape[0], fine_t.shape[1]
    ramps_f = translation_ramps(pf, fine_t.reshape(-1, 2))
    Xf = gather_pixels(prep.F_masked, pf)
    Xu = gather_pixels(prep.F_unmasked, pf)
    wf, mf = _weights_for(sig2_rows, pf, xp)
    cf = ctf_at(pf)

    best_row = np.zeros(I, dtype=np.int64)  # global coarse row of the best fine sample
    best_child = np.zeros(I, dtype=np.int64)
    best_t = np.zeros(I, dtype=np.int64)
    pmax = np.zeros(I)
    logev = np.zeros(I)
    resid = xp.zeros(I)
    bp_slices = xp.zeros((n_union * nover, 2 * pf.npix), dtype=np.float32)
    bp_weights = xp.zeros((n_union * nover, pf.npix), dtype=np.float32)
    row_w_union = xp.zeros(n_union)
    sig2_acc = xp.zeros((I, sums.n_shells))
    wtot = xp.zeros(I)
    off_moments = xp.zeros((K, 4))  # per class: sum w, sum w x, sum w y, sum w |o|^2 (Å)
    xa_i = xp.zeros(I)
    aa_i = xp.zeros(I)
    ecounts = counts[porder]
    estart = np.concatenate([[0], np.cumsum(ecounts)])
    a0 = 0
    while a0 < I:
        # grow the chunk while its padded size fits the budget (counts ascend, so the last one is the max)
        a1 = a0 + 1
        while a1 < I and (a1 + 1 - a0) * max(1, ecounts[a1]) * nover * (T * ntov * 40 + pf.npix * 24) \
                <= setup.max_fine_bytes:
            a1 += 1
        ni = a1 - a0
        pidx_h = porder[a0:a1]
        pidx = xp.asarray(pidx_h)
        e0, e1 = int(estart[a0]), int(estart[a1])
        li = xp.asarray(rank)[ii[e0:e1]] - a0  # particle within the chunk
        up = upos[e0:e1]
        n2 = int(ecounts[a1 - 1])
        cu, cpos = xp.unique(up, return_inverse=True)
        cpos = cpos.reshape(-1)
        shared = int(cu.size) <= 2 * n2
        if shared:
            n_par, par = int(cu.size), cpos
            par_union = xp.broadcast_to(cu[None, :], (ni, n_par))
        else:
            n_par = n2
            starts = xp.asarray(estart[a0:a1] - estart[a0])
            par = xp.arange(e1 - e0) - starts[li]
            par_union = xp.zeros((ni, n_par), dtype=np.int64)
            par_union[li, par] = up
        sig_parent = xp.zeros((ni, T, n_par), dtype=bool)
        sig_parent[li, :, par] = sig_sig[e0:e1]
        lpr = xp.full((ni, n_par), -np.inf)
        lpr[li, par] = lpr_sig[e0:e1]
        par_rows = urows[par_union]  # (ni, n_par) global coarse row of each parent
        lp_parent = xp.where(sig_parent, trans_prior_of_rows(lp_trans[pidx], par_rows) + lpr[:, None, :], -np.inf)
        child = xp.arange(nover)[None, :]
        if shared:
            rows_f = (cu[:, None] * nover + child).reshape(-1)  # (n_par * 8,) distinct
        else:
            rows_f = (par_union[:, :, None] * nover + child[None]).reshape(ni, -1)  # (ni, n_par * 8)
        P = Sf.take(rows_f)
        nn = n_par * nover
        tf = particle_terms(Xf[pidx], cf[pidx], wf[pidx], ramps_f, cc=setup.cc)
        d2f = scores_shared(P, tf) if shared else scores_gathered(P, tf)  # (ni, T*4, nn)
        lp_fine = xp.broadcast_to(lp_parent[:, :, None, :, None], (ni, T, ntov, n_par, nover))
        Wf = posterior_weights(d2f, lp_fine.reshape(ni, T * ntov, nn), setup.adaptive_fraction, cc=setup.cc)
        del d2f, lp_fine, lp_parent, sig_parent
        bpos = Wf.best % nn
        best_row[pidx_h] = urows_h[to_host(xp.take_along_axis(par_union, (bpos // nover)[:, None], axis=1)[:, 0])]
        best_child[pidx_h] = to_host(bpos % nover)
        best_t[pidx_h] = to_host(Wf.best // nn)
        pmax[pidx_h] = to_host(Wf.pmax)
        logev[pidx_h] = to_host(Wf.log_evidence - tf.x2 if not setup.cc else Wf.log_evidence)
        fs = fine_sums(Wf.w.reshape(ni, T * ntov, nn), P, Xf[pidx], Xu[pidx], cf[pidx], mf[pidx], ramps_f)
        rw_par = fs.row_weight.reshape(ni, n_par, nover).sum(-1)  # (ni, n_par) per coarse parent
        if shared:
            bp_slices[rows_f] += fs.slices
            bp_weights[rows_f] += fs.slice_weights
            row_w_union[cu] += rw_par.sum(0)
        else:
            flat = rows_f.reshape(-1)
            bp_slices += segment_sum(flat, fs.slices.reshape(-1, 2 * pf.npix), n_union * nover)
            bp_weights += segment_sum(flat, fs.slice_weights.reshape(-1, pf.npix), n_union * nover)
            row_w_union += segment_sum(par_union.reshape(-1), rw_par.reshape(-1, 1), n_union)[:, 0]
        # offset moments per class: sum w, sum w pos, sum w |pos|^2 (pos = o + t in Å) over each parent's
        # children and translations, then summed over the parents of each class
        wt = Wf.w.reshape(ni, T * ntov, n_par, nover).sum(-1)  # (ni, T4, n_par)
        pos = (xp.asarray(prep.rounded_offsets)[pidx][:, None, :] + xp.asarray(fine_t.reshape(-1, 2))[None]) \
            * setup.pixel_size  # (ni, T4, 2) Å
        m1 = xp.einsum("itp,itd->ipd", wt, pos)
        m2 = xp.einsum("itp,it->ip", wt, (pos * pos).sum(-1))
        moments = xp.concatenate([wt.sum(1)[..., None], m1, m2[..., None]], axis=-1).reshape(-1, 4)
        off_moments += segment_sum((par_rows // R).reshape(-1), moments, K)
        sig2_acc[pidx] = shell_sum(fs.noise, pf.shell, sums.n_shells)
        resid[pidx] = fs.noise.sum(axis=1)
        wtot[pidx] = fs.trans_weight.sum(axis=1)
        if setup.scale_shells is not None:
            ss = setup.scale_shells
            xa_i[pidx] = (fs.xa * ss[None, :]).sum(1)
            aa_i[pidx] = (fs.aa * ss[None, :]).sum(1)
        del fs, Wf, P
        a0 = a1

    # shells beyond the fine size: the image's own power, with the particle's total weight (RELION 3.7)
    hi = shell_power(prep.F_masked, sums.n_shells)
    hi[:, : pf.size // 2 + 1] = 0.0
    sig2_acc += hi * wtot[:, None]
    resid += hi.sum(axis=1)

    # ---- insert the summed slices (one per distinct fine orientation) into the class grids ----
    cls_rows = np.repeat(urows_h // R, nover)
    keep = np.flatnonzero(to_host(bp_weights.sum(axis=1)) > 0)
    if keep.size:
        kd, Kf = xp.asarray(keep), pf.npix
        vals = bp_slices[kd, :Kf].astype(np.complex64) + 1j * bp_slices[kd, Kf:]
        insert_by_class(sums.backprojectors, xp.asarray(cls_rows[keep]), Af[kd], pf.kx, pf.ky, vals, bp_weights[kd])

    # ---- per-particle results ----
    mats = smp.fine_matrices(best_row % R)[np.arange(I), best_child]
    t_best = fine_t.reshape(-1, 2)[best_t]
    new_off = prep.rounded_offsets + t_best

    # ---- sums for the M-step ----
    g_h = np.asarray(groups)
    np.add.at(sums.sigma2, g_h, to_host(sig2_acc))
    wsum_i = to_host(wtot)
    np.add.at(sums.sumw_group, g_h, wsum_i)
    rw_u = to_host(row_w_union)
    np.add.at(sums.pdf_direction, (urows_h // R, (urows_h % R) // smp.n_psi), rw_u)
    np.add.at(sums.pdf_class, urows_h // R, rw_u)
    m = to_host(off_moments)  # sum_c w |o - mu_c|^2 = m2 - 2 mu.m1 + |mu|^2 m0
    mu_k = np.broadcast_to(mu, (K, 2))
    sums.sigma_offset += float((m[:, 3] - 2.0 * (mu_k * m[:, 1:3]).sum(1) + (mu_k**2).sum(1) * m[:, 0]).sum())
    sums.offset_sum += m[:, 1:3]
    sums.sum_weight += float(wsum_i.sum())
    if setup.scale_shells is not None and scale_group_index is not None:
        np.add.at(sums.xa, np.asarray(scale_group_index), to_host(xa_i))
        np.add.at(sums.aa, np.asarray(scale_group_index), to_host(aa_i))
    sums.log_likelihood += float(logev.sum())
    sums.sum_pmax += float(pmax.sum())
    sums.n_particles += I
    return BatchResult(mats, best_row // R, new_off, pmax, to_host(Wc.nr_significant), logev, to_host(resid))


def _project_rows(setup: EStepSetup, rows: np.ndarray, pix: PixelSet, fine: bool, matrices=None):
    """Slices of global rows (class-major) at a pixel set: coarse (n, K) or fine children (n * 8, K).
    ``matrices`` (n * nover, 3, 3) may pass the rows' matrices when the caller already has them."""
    xp = get_array_module(setup.refs[0].data)
    smp = setup.sampling
    R = smp.n_orient
    rows = np.asarray(rows, dtype=np.int64)
    nover = smp.n_children if fine else 1
    if matrices is None:
        matrices = smp.fine_matrices(rows % R).reshape(-1, 3, 3) if fine else smp.coarse_matrices(rows % R)
    matrices = xp.asarray(matrices)
    ref = setup.ref_stack
    index = xp.asarray(np.repeat(rows // R, nover)) if ref.stacked else None
    return project_pixels(ref, matrices, pix.kx, pix.ky, index=index)

"""Local resolution as ``relion_postprocess --locres`` computes it (RELION 5.0.1, src/postprocessing.cpp,
``Postprocessing::run_locres``), with many windows at once on the device (docs/local_resolution.md).

RELION's method, step by step (what this module does, with RELION's arithmetic):

1. Sizes in pixels: ``step = ROUND(sampling / angpix)``, ``maskrad = ROUND(locres_maskrad / angpix)``,
   ``edge = ROUND(locres_edgwidth / angpix)`` (defaults: sampling 25 Å, maskrad 0.5 * sampling, edgwidth =
   sampling), and the shell from which phases are randomised, ``int(N * angpix / locres_randomize_at)`` (25 Å;
   a truncation, not ROUND).
2. Window centres: the logical coordinates -N/2, -N/2 + step, ... up to N/2 - 1 on each axis (so the physical
   voxel indices 0, step, 2 step, ...), kept where kk^2 + ii^2 + jj^2 < (N/2 - maskrad)^2. RELION's loop over
   (kk, ii, jj) (z, y, x) calls ``raisedCosineMask(locmask, maskrad, maskrad + edge, kk, ii, jj)`` whose arguments
   are (x, y, z): the window of loop point (kk, ii, jj) is centred at x = kk, y = ii, z = jj. The set of centres
   is symmetric under that swap, so the maps do not depend on it, but the blocks of the FSC STAR
   (``fsc_kkkkk_iiiii_jjjjj``) are named by the loop point: :func:`window_centres` keeps RELION's order and names.
3. Window mask: d = sqrt of the integer squared distance to the centre (no periodic wrap: the soft edge is cut
   at the box's faces); 1 for d < maskrad, 0 for d > maskrad + edge, 0.5 - 0.5 cos(pi (maskrad + edge - d) /
   edge) between.
4. Per window: the FSC of the two half maps times the mask (``getFSC``: full-box FFT, shells ROUND(|k|) 0..N/2,
   every stored half-complex element once), and the FSC of the two phase-randomised half maps (each half map's
   phases beyond the shell above replaced by uniform random ones, once for the whole map) times the mask.
5. ``calculateFSCtrue``: element 0 of each curve set to 1 where it is <= 0; FSC_true = FSC_masked below shell
   randomise + 2, (FSC_masked - FSC_random) / (1 - FSC_random) from there (no clamping at 0).
6. The window's resolution: walking up from shell 0, N angpix / i of the last shell i before FSC_true first drops
   below 0.143 (999 Å for shell 0), then at most ``locres_minres`` (50 Å); stored in single precision (a C float).
7. The locally filtered map: the average of the half maps, Fourier transformed once, with the ad-hoc B-factor
   (``applyBFactorToMap``: exp(-B s^2 / 4) up to Nyquist, 0 beyond); per window, FSC-weighted with that window's
   FSC_true (``applyFscWeighting``: sqrt(2 F / (1 + F)) per shell up to the last shell before F < 1e-4 from shell
   0, 0 where F <= 0 and beyond) and low-passed at the window's resolution (``lowPassFilterMap``: raised cosine
   from shell ROUND(N angpix / res) - 1 to + 1, filter_edge_width 2), transformed back.
8. No interpolation between sampling points: every voxel gets the mask-weighted harmonic mean of the windows'
   resolutions, ``sum_w m_w / sum_w (m_w / res_w)``, and the mask-weighted mean of the windows' filtered maps,
   ``sum_w m_w f_w / sum_w m_w``; 0 where no window reaches (sum_w m_w = 0).

What differs from RELION: the random phases (NumPy's generator with ``seed`` and ``seed + 1`` instead of RELION's
global one), and on the planes kx = 0 and kx = N/2 they are made Hermitian (phase(-k) = -phase(k)) so that the
randomised map is exactly real whichever inverse FFT makes it (RELION leaves those planes to FFTW's c2r); sums in
another order. The --mtf division of RELION's filtered map is not done here.

Speed: a batch of windows is one stacked array (B, N, N, N) of masks; each half-map pair times the masks is one
batched 3D FFT, the FSC's three shell sums are one binned sum per batch, and the filtered maps of a batch are one
batched inverse FFT. Memory per window of a batch: about :data:`BYTES_PER_WINDOW_VOXEL` bytes per box voxel;
the caller chooses the batch (jobs/local_resolution.py through runtime/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .backend import get_array_module, to_host
from .fourier import half_grid_indices, irfft_centered, rfft_centered, shell_sum

#: RELION's defaults (relion_postprocess --locres).
LOCRES_SAMPLING_A = 25.0
LOCRES_RANDOMIZE_AT_A = 25.0
LOCRES_MINRES_A = 50.0
FILTER_EDGE_WIDTH = 2
FSC_THRESHOLD = 0.143
#: Resolution RELION gives a window whose corrected FSC drops below the threshold at shell 0 or 1.
NO_RESOLUTION_A = 999.0
#: Bytes per box voxel of one window of a batch at the peak (float64 mask, the windowed map pair, their FTs,
#: shell-sum products, the filter, the filtered map and the FFT's work area), with a margin.
BYTES_PER_WINDOW_VOXEL = 96
#: Bytes per box voxel held for the whole run (the half maps and their phase-randomised copies in float64, the
#: FT of their average, the |k|^2 and shell grids, three float64 accumulators).
HELD_BYTES_PER_VOXEL = 80


def relion_round(x: float) -> int:
    """RELION's ROUND: half away from zero, to int."""
    return int(x + 0.5) if x > 0 else int(x - 0.5)


@dataclass(frozen=True)
class LocresGeometry:
    """Sizes in pixels and the window centres of RELION's --locres for a box and pixel size."""

    box: int
    angpix: float
    step: int  # ROUND(sampling / angpix)
    mask_radius: int  # ROUND(maskrad / angpix): the mask is 1 inside
    edge_width: int  # ROUND(edgwidth / angpix): the raised-cosine edge beyond mask_radius
    randomize_shell: int  # int(N angpix / randomize_at): phases randomised from this shell (|k| >= it)
    centres: np.ndarray  # (K, 3) int64 physical voxel indices (z, y, x) of the windows, in RELION's order
    names: tuple[str, ...] = field(default=())  # RELION's FSC block names, fsc_kkkkk_iiiii_jjjjj

    @property
    def n_windows(self) -> int:
        return int(len(self.centres))

    @property
    def n_shells(self) -> int:
        return self.box // 2 + 1


def window_centres(box: int, step: int, mask_radius: int) -> tuple[np.ndarray, tuple[str, ...]]:
    """RELION's sampling points: (K, 3) physical (z, y, x) centres in its loop order, and the block names.

    Loop point (kk, ii, jj), logical coordinates from -N/2 in steps of ``step``, kept where
    kk^2 + ii^2 + jj^2 < (N/2 - mask_radius)^2; its window is centred at x = kk, y = ii, z = jj (module docstring,
    point 2)."""
    if step < 1:
        raise ValueError(f"the local-resolution sampling is {step} pixels; it must be at least 1")
    half = box // 2
    myrad = half - mask_radius
    logical = np.arange(-half, box - half, step, dtype=np.int64)
    centres, names = [], []
    if myrad <= 0:
        return np.zeros((0, 3), np.int64), ()
    for kk in logical:
        for ii in logical:
            for jj in logical:
                if kk * kk + ii * ii + jj * jj < myrad * myrad:  # RELION: float sqrt(...) < myrad
                    centres.append((jj + half, ii + half, kk + half))
                    names.append(f"fsc_{kk:05d}_{ii:05d}_{jj:05d}")  # integerToString(v, 5): -0071, 00004
    return np.asarray(centres, np.int64).reshape(-1, 3), tuple(names)


def locres_geometry(box: int, angpix: float, sampling: float = LOCRES_SAMPLING_A, maskrad: float = -1.0,
                    edgwidth: float = -1.0, randomize_at: float = LOCRES_RANDOMIZE_AT_A) -> LocresGeometry:
    """RELION's sizes for --locres_sampling, --locres_maskrad (default 0.5 sampling), --locres_edgwidth (default
    sampling) and --locres_randomize_at (Å), and its window centres."""
    if not angpix > 0:
        raise ValueError(f"pixel size must be positive, got {angpix}")
    if not sampling > 0 or not randomize_at > 0:
        raise ValueError("the local-resolution sampling and the randomisation resolution must be positive (Å)")
    if maskrad < 0:
        maskrad = 0.5 * sampling
    if edgwidth < 0:
        edgwidth = sampling
    step = relion_round(sampling / angpix)
    mrad = relion_round(maskrad / angpix)
    edge = relion_round(edgwidth / angpix)
    ra = int(box * angpix / randomize_at)
    centres, names = window_centres(box, step, mrad)
    return LocresGeometry(box, float(angpix), step, mrad, edge, ra, centres, names)


# ----------------------------------------------------------------------------------------------------------
# Grids and per-window pieces
# ----------------------------------------------------------------------------------------------------------

def k2_grid(box: int, xp=np):
    """kz^2 + ky^2 + kx^2 (integers, int32) on the half grid: every Fourier filter of --locres depends on a
    component only through it (shell ROUND(sqrt), resolution sqrt / N), so filters are tables over it."""
    kz, ky, kx = half_grid_indices(box, 3, xp)
    return (kz.astype(np.int32) ** 2 + ky.astype(np.int32) ** 2 + kx.astype(np.int32) ** 2).astype(np.int32)


def max_k2(box: int) -> int:
    """The largest kz^2 + ky^2 + kx^2 on the half grid."""
    return 3 * (box // 2) ** 2


def shell_of_k2(k2):
    """ROUND(sqrt(k2)) (RELION's shell index) for non-negative integers."""
    xp = get_array_module(k2)
    return xp.floor(xp.sqrt(xp.asarray(k2, dtype=np.float64)) + 0.5).astype(np.int64)


def window_masks(centres, box: int, radius: float, radius_p: float, xp=np):
    """RELION's raisedCosineMask for each centre: (B, N, N, N) float64. ``centres`` (B, 3) physical (z, y, x)."""
    c = xp.asarray(np.asarray(centres, np.int64))
    idx = xp.arange(box, dtype=np.int64)
    sq = [((idx[None, :] - c[:, a:a + 1]) ** 2).astype(np.float64) for a in range(3)]  # (B, N) each
    d = sq[0][:, :, None, None] + sq[1][:, None, :, None]
    d = d + sq[2][:, None, None, :]
    xp.sqrt(d, out=d)
    width = radius_p - radius
    if width <= 0:  # RELION divides 0 by 0 at d == radius; a hard mask here
        return xp.where(d > radius_p, 0.0, 1.0)
    # 0.5 - 0.5 cos(pi (radius_p - d) / width), with the angle clipped to [0, pi]: 1 inside, 0 outside (exactly)
    xp.subtract(radius_p, d, out=d)
    d *= np.pi
    d /= width
    xp.clip(d, 0.0, np.pi, out=d)
    xp.cos(d, out=d)
    d *= -0.5
    d += 0.5
    return d


def randomize_phases(vol, shell: int, seed: int):
    """The map with the phase of every Fourier component with |k| >= ``shell`` replaced by a uniform random
    one (RELION's randomizePhasesBeyond), float64 on vol's device. Phases are NumPy's default_rng(seed) over the
    half grid in C order (host), made antisymmetric on the kx = 0 and kx = N/2 planes (phase(-k) = -phase(k)) so
    that the result is the same real map on any FFT library."""
    xp = get_array_module(vol)
    N = vol.shape[-1]
    F = rfft_centered(xp.asarray(vol).astype(np.float64), 3)
    phase = np.random.default_rng(seed).uniform(0.0, 2.0 * np.pi, F.shape)
    for p in (0, N // 2):
        plane = phase[:, :, p]
        mirrored = np.roll(plane[::-1, ::-1], 1, axis=(0, 1))  # value at (-kz, -ky)
        phase[:, :, p] = plane - mirrored
    sel = k2_grid(N, xp) >= shell * shell
    F = xp.where(sel, xp.abs(F) * xp.exp(1j * xp.asarray(phase)), F)
    return irfft_centered(F, N, 3)


def _fsc_sums(a, b, masks, shells, nsh: int):
    """The three shell sums of getFSC for each window: sum Re(A conj B), |A|^2, |B|^2 with A = FT(a m_w),
    B = FT(b m_w) ((3, B, nsh) float64 on the device)."""
    A = rfft_centered(masks * a[None], 3)
    Bf = rfft_centered(masks * b[None], 3)
    num = shell_sum(A.real * Bf.real + A.imag * Bf.imag, shells, nsh)
    d1 = shell_sum(A.real * A.real + A.imag * A.imag, shells, nsh)
    del A
    d2 = shell_sum(Bf.real * Bf.real + Bf.imag * Bf.imag, shells, nsh)
    return num, d1, d2


def fsc_from_sums(num, d1, d2):
    """getFSC's num / sqrt(d1 d2) (0 where a denominator is 0, where RELION would give NaN)."""
    xp = get_array_module(num)
    den = xp.sqrt(d1 * d2)
    return xp.where(den > 0, num / xp.where(den > 0, den, 1.0), 0.0)


def windowed_fsc(a, b, masks, shells=None):
    """FSC (B, N/2 + 1) of ``a * m_w`` and ``b * m_w`` for each window mask ``m_w`` of ``masks`` (B, N, N, N)."""
    xp = get_array_module(masks)
    N = masks.shape[-1]
    if shells is None:
        shells = shell_of_k2(k2_grid(N, xp))
    return fsc_from_sums(*_fsc_sums(xp.asarray(a, dtype=np.float64), xp.asarray(b, dtype=np.float64), masks,
                                     shells, N // 2 + 1))


def fsc_true(fsc_masked, fsc_random, randomize_shell: int) -> np.ndarray:
    """RELION's calculateFSCtrue for curves (..., nsh) (host float64): element 0 of each curve <= 0 set to 1;
    FSC_masked below shell randomize + 2, (FSC_masked - FSC_random) / (1 - FSC_random) from there."""
    fm = np.array(fsc_masked, dtype=np.float64)
    fr = np.array(fsc_random, dtype=np.float64)
    fm[..., 0] = np.where(fm[..., 0] <= 0, 1.0, fm[..., 0])
    fr[..., 0] = np.where(fr[..., 0] <= 0, 1.0, fr[..., 0])
    i = np.arange(fm.shape[-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        corrected = (fm - fr) / (1.0 - fr)
    return np.where(i < randomize_shell + 2, fm, corrected)


def window_resolution(curves, box: int, angpix: float, minres: float = LOCRES_MINRES_A,
                      threshold: float = FSC_THRESHOLD) -> np.ndarray:
    """RELION's local resolution of each corrected FSC curve (..., nsh): N angpix / i of the last shell i
    before the first value below ``threshold`` (walking from shell 0; 999 for shell 0), at most ``minres``, in
    single precision (RELION's float) returned as float64."""
    c = np.asarray(curves, dtype=np.float64)
    below = c < threshold  # NaN is not below: RELION's loop does not stop there either
    n = c.shape[-1]
    first = np.where(below.any(axis=-1), below.argmax(axis=-1), n)
    last = first - 1
    res = np.where(last >= 1, box * angpix / np.maximum(last, 1), NO_RESOLUTION_A).astype(np.float32)
    return np.minimum(np.float64(minres), res.astype(np.float64)).astype(np.float32).astype(np.float64)


def fsc_weight_per_shell(curves) -> np.ndarray:
    """applyFscWeighting's weight per shell (..., nsh): sqrt(2F / (1 + F)) up to the last shell before F first
    drops below 1e-4 (walking from shell 0; shell 0 kept even then), 0 where F <= 0 and beyond."""
    c = np.asarray(curves, dtype=np.float64)
    n = c.shape[-1]
    below = c < 1e-4
    first = np.where(below.any(axis=-1), below.argmax(axis=-1), n)
    ires_max = np.maximum(first - 1, 0)
    with np.errstate(invalid="ignore"):
        w = np.where(c > 0, np.sqrt(2 * c / (1 + c)), 0.0)
    return np.where(np.arange(n) <= ires_max[..., None], w, 0.0)


def window_filter_tables(curves, resolution, box: int, angpix: float,
                         filter_edge_width: int = FILTER_EDGE_WIDTH) -> np.ndarray:
    """Each window's Fourier filter as a table over k^2 = 0..max_k2 (B, max_k2 + 1) (host float64): the FSC
    weighting of its corrected curve (shell ROUND(sqrt k^2); 0 beyond N/2) times lowPassFilterMap at its
    resolution."""
    c = np.atleast_2d(np.asarray(curves, dtype=np.float64))
    res = np.atleast_1d(np.asarray(resolution, dtype=np.float64))
    w = fsc_weight_per_shell(c)  # (B, nsh)
    k2 = np.arange(max_k2(box) + 1)
    shell = shell_of_k2(k2)
    nsh = c.shape[-1]
    weight = np.where(shell[None, :] < nsh, w[:, np.minimum(shell, nsh - 1)], 0.0)
    # lowPassFilterMap(FT, N, res, angpix, filter_edge_width)
    ires = np.array([relion_round(box * angpix / r) for r in res], dtype=np.float64)
    half = filter_edge_width // 2
    lo = np.maximum(0.0, (ires - half) / box)[:, None]
    hi = np.minimum(float(box // 2 + 1), (ires + half) / box)[:, None]
    width = hi - lo
    r = (np.sqrt(k2.astype(np.float64)) / box)[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        edge = 0.5 + 0.5 * np.cos(np.pi * (r - lo) / np.where(width > 0, width, 1.0))
    low = np.where(r < lo, 1.0, np.where(r > hi, 0.0, np.where(width > 0, edge, 1.0)))
    return weight * low


def bfactor_table(box: int, angpix: float, bfactor: float) -> np.ndarray:
    """applyBFactorToMap as a table over k^2: exp(-(B / 4) s^2) for s = sqrt(k^2) / (N angpix) <= 1 / (2
    angpix), 0 beyond."""
    k2 = np.arange(max_k2(box) + 1)
    s = np.sqrt(k2.astype(np.float64)) / (box * angpix)
    return np.where(s <= 1.0 / (angpix * 2.0), np.exp(-(bfactor / 4.0) * s * s), 0.0)


# ----------------------------------------------------------------------------------------------------------
# The whole calculation
# ----------------------------------------------------------------------------------------------------------

@dataclass
class LocresResult:
    """The outputs of --locres: the local-resolution map and the locally filtered map (host float32), and per
    window (in the geometry's order) its FSC curves and resolution."""

    locres: np.ndarray
    filtered: np.ndarray
    geometry: LocresGeometry
    fsc_unmasked: np.ndarray  # (nsh,) of the whole half maps
    fsc_masked: np.ndarray  # (K, nsh)
    fsc_random: np.ndarray  # (K, nsh) of the phase-randomised half maps
    fsc_true: np.ndarray  # (K, nsh)
    resolution: np.ndarray  # (K,) Å


class LocalResolution:
    """RELION's --locres over the windows of ``geometry``, a batch at a time (:meth:`add_windows`), on the
    device of ``xp``. The half maps go there as float64; what is held for the run is about
    :data:`HELD_BYTES_PER_VOXEL` bytes per box voxel, a batch of B windows about B * :data:`BYTES_PER_WINDOW_VOXEL`.

    A batch adds to the sums only at its end, with in-place adds of arrays made before: a batch that fails
    (out of memory) can be run again, in smaller pieces, without counting twice."""

    def __init__(self, half1, half2, geometry: LocresGeometry, xp=np, *, bfactor: float = 0.0,
                 minres: float = LOCRES_MINRES_A, filter_edge_width: int = FILTER_EDGE_WIDTH, seed: int = 0,
                 randomized=None):
        N = geometry.box
        if half1.shape != (N, N, N) or half2.shape != (N, N, N):
            raise ValueError(f"half maps of shape {half1.shape} and {half2.shape} for a {N}^3 geometry")
        self.g, self.xp = geometry, xp
        self.minres, self.filter_edge_width = float(minres), int(filter_edge_width)
        self.nsh = N // 2 + 1
        self.h1 = xp.asarray(half1).astype(np.float64)
        self.h2 = xp.asarray(half2).astype(np.float64)
        self.k2 = k2_grid(N, xp)
        self.shells = shell_of_k2(self.k2)
        A = rfft_centered(self.h1, 3)
        B = rfft_centered(self.h2, 3)
        self.fsc_unmasked = to_host(fsc_from_sums(shell_sum(A.real * B.real + A.imag * B.imag, self.shells, self.nsh),
                                                  shell_sum(A.real * A.real + A.imag * A.imag, self.shells, self.nsh),
                                                  shell_sum(B.real * B.real + B.imag * B.imag, self.shells,
                                                            self.nsh)))
        # the average's FT (RELION: Isum = 0.5 (I1 + I2)), with the ad-hoc B-factor
        self.ft_sum = (A + B) * 0.5
        del A, B
        self.ft_sum *= xp.asarray(bfactor_table(N, geometry.angpix, bfactor))[self.k2]
        if randomized is None:
            ra = geometry.randomize_shell
            randomized = (randomize_phases(self.h1, ra, seed), randomize_phases(self.h2, ra, seed + 1))
        self.r1 = xp.asarray(randomized[0]).astype(np.float64)
        self.r2 = xp.asarray(randomized[1]).astype(np.float64)
        K = geometry.n_windows
        self.fsc_masked = np.zeros((K, self.nsh))
        self.fsc_random = np.zeros((K, self.nsh))
        self.fsc_true = np.zeros((K, self.nsh))
        self.resolution = np.zeros(K)
        self.sum_filtered = xp.zeros((N, N, N))
        self.sum_inverse_resolution = xp.zeros((N, N, N))
        self.sum_weight = xp.zeros((N, N, N))

    def add_windows(self, start: int, stop: int) -> None:
        """Windows [start, stop) of the geometry as one batch."""
        xp, g = self.xp, self.g
        N, nsh = g.box, self.nsh
        masks = window_masks(g.centres[start:stop], N, g.mask_radius, g.mask_radius + g.edge_width, xp)
        fm = to_host(fsc_from_sums(*_fsc_sums(self.h1, self.h2, masks, self.shells, nsh)))
        fr = to_host(fsc_from_sums(*_fsc_sums(self.r1, self.r2, masks, self.shells, nsh)))
        ft = fsc_true(fm, fr, g.randomize_shell)
        res = window_resolution(ft, N, g.angpix, self.minres)
        table = xp.asarray(window_filter_tables(ft, res, N, g.angpix, self.filter_edge_width))
        G = xp.take(table, self.k2, axis=1)  # (B, N, N, N/2 + 1) filters
        del table
        G = G * self.ft_sum[None]
        filtered = irfft_centered(G, N, 3)
        del G
        filtered *= masks
        add_f = filtered.sum(axis=0)
        del filtered
        add_w = masks.sum(axis=0)
        masks *= xp.asarray(1.0 / res)[:, None, None, None]  # (no GEMV: the job needs no cuBLAS)
        add_r = masks.sum(axis=0)
        del masks
        # only now the sums (in place: no allocation that could fail half-way)
        self.sum_filtered += add_f
        self.sum_inverse_resolution += add_r
        self.sum_weight += add_w
        self.fsc_masked[start:stop], self.fsc_random[start:stop] = fm, fr
        self.fsc_true[start:stop], self.resolution[start:stop] = ft, res

    def maps(self):
        """(local-resolution map, locally filtered map), float32 on the host: the weighted harmonic mean of the
        windows' resolutions and the weighted mean of their filtered maps, 0 where no window reaches."""
        xp = self.xp
        w = self.sum_weight
        some = w > 0
        safe_w = xp.where(some, w, 1.0)
        safe_r = xp.where(some, self.sum_inverse_resolution, 1.0)
        locres = xp.where(some, 1.0 / (safe_r / safe_w), 0.0)
        filtered = xp.where(some, self.sum_filtered / safe_w, 0.0)
        # rounded to float32 where they are (the same numbers as after the copy): half the bytes to copy
        return to_host(locres.astype(np.float32)), to_host(filtered.astype(np.float32))

    def result(self) -> LocresResult:
        locres, filtered = self.maps()
        return LocresResult(locres, filtered, self.g, self.fsc_unmasked, self.fsc_masked, self.fsc_random,
                            self.fsc_true, self.resolution)


def local_resolution(half1, half2, angpix: float, *, sampling: float = LOCRES_SAMPLING_A, maskrad: float = -1.0,
                     edgwidth: float = -1.0, randomize_at: float = LOCRES_RANDOMIZE_AT_A,
                     minres: float = LOCRES_MINRES_A, bfactor: float = 0.0,
                     filter_edge_width: int = FILTER_EDGE_WIDTH, seed: int = 0, batch: int = 8, xp=np,
                     randomized=None) -> LocresResult:
    """relion_postprocess --locres on two half maps (host or device arrays), ``batch`` windows at a time on the
    device of ``xp``. ``randomized``: the two phase-randomised half maps to use instead of drawing them (tests)."""
    g = locres_geometry(half1.shape[-1], angpix, sampling, maskrad, edgwidth, randomize_at)
    if g.n_windows == 0:
        raise ValueError(f"no local-resolution window fits the {g.box}^3 box: the mask radius {g.mask_radius} px "
                         "reaches the box edge")
    lr = LocalResolution(half1, half2, g, xp, bfactor=bfactor, minres=minres, filter_edge_width=filter_edge_width,
                         seed=seed, randomized=randomized)
    for a in range(0, g.n_windows, max(1, int(batch))):
        lr.add_windows(a, min(g.n_windows, a + max(1, int(batch))))
    return lr.result()

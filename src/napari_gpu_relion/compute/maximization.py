"""The M-step besides the reconstruction itself (relion_algorithm.md 4.3, 4.6-4.8): noise spectra, tau2 from
the gold-standard FSC, the half-map FSC from the accumulators, joining halves at low resolution, offsets,
class and direction priors, norm and scale corrections, resolution and image sizes.

Spectra are per shell 0..N/2 (Fourier pixels of the N box); sigma2 and tau2 are per real/imaginary component.
"""

from __future__ import annotations

import numpy as np

from .backend import get_array_module, to_host
from .backprojector import BackProjector, insertion_reach, support_index
from .fourier import (
    half_grid_box_slabs,
    half_grid_indices,
    hermitian_unique_mask,
    radial_average,
    rfft_centered,
    round_half_away,
    shell_count,
    shell_grid,
    shell_sum,
)
from .fsc import fsc_from_fts, resolution_shell
from .masks import soft_mask_outside


def shell_pixel_counts(box: int) -> np.ndarray:
    """Npix(r): unique half-grid pixels of an N x N FT in each shell 0..N/2 (kx = 0, ky < 0 excluded)."""
    sh = shell_grid(box, 2, np)
    sh = np.where(hermitian_unique_mask(box, 2, np), sh, -1).reshape(-1)
    sh = sh[(sh >= 0) & (sh <= box // 2)]
    return np.bincount(sh, minlength=box // 2 + 1).astype(np.float64)


def update_sigma2(wsum_sigma2: np.ndarray, sumw: np.ndarray, box: int) -> np.ndarray:
    """sigma2_o(r) = wsum_o(r) / (2 sumw_o Npix(r)); values below 1e-14 take the previous shell's value."""
    npix = shell_pixel_counts(box)
    out = wsum_sigma2 / (2.0 * np.maximum(sumw[:, None], 1e-300) * np.maximum(npix[None, :], 1))
    for r in range(1, out.shape[1]):  # shells (N/2 + 1 of them), not particles
        bad = out[:, r] < 1e-14
        out[bad, r] = out[bad, r - 1]
    return out


def initial_sigma2(power_each: np.ndarray, power_of_mean: np.ndarray) -> np.ndarray:
    """RELION's initial noise spectrum from particle images: (mean per-image power - power of the mean
    image) / 2, per shell, as mean |X|^2 per pixel. Non-positive values take the neighbour's."""
    s = (np.asarray(power_each, np.float64) - np.asarray(power_of_mean, np.float64)) / 2.0
    s = s.copy()
    for r in range(1, s.size):
        if s[r] <= 0:
            s[r] = s[r - 1]
    for r in range(s.size - 2, -1, -1):
        if s[r] <= 0:
            s[r] = s[r + 1]
    return s


def _grid_shell_sums(padded_size: int, pad: int, size: int, r_max: float, ndim: int, xp, values=None,
                     lead: int | None = None, inclusive: bool = False) -> tuple:
    """Per shell ROUND(|q|/pf), shells 0..N/2 (N = ``size``), over the voxels of a padded half grid within pf r_max
    (|q|^2 < ROUND(pf r_max)^2, or <= with ``inclusive``): the voxel count (n,) and, for ``values(index)`` (the
    grid's values at ``index``, with ``lead`` grids along a leading axis where it is given), their sums ((n,) or
    (lead, n)). Slab by slab over the box around that sphere: no grid-sized temporaries, and the shells of each
    slab are made once for every grid."""
    n = size // 2 + 1
    lim2 = float(round_half_away(np.float64(pad * r_max))) ** 2
    cnt = xp.zeros(n)
    tot = xp.zeros(n if lead is None else (lead, n))
    for sl, ks in half_grid_box_slabs(padded_size, np.sqrt(lim2), ndim, xp, bytes_per_voxel=64 * (lead or 1)):
        q2 = sum(k.astype(np.float64) ** 2 for k in ks)
        shells = round_half_away(xp.sqrt(q2) / pad).astype(np.int64)
        within = (q2 <= lim2) if inclusive else (q2 < lim2)
        sh = xp.where(within & (shells < n), shells, n)  # n: dropped
        cnt += shell_count(sh, n)
        if values is not None:
            v = values(sl if isinstance(sl, tuple) else (sl,))
            tot += shell_sum(xp.broadcast_to(v, v.shape[: v.ndim - q2.ndim] + q2.shape), sh, n)
    return cnt, tot


def _shell_sums(bp: BackProjector, values=None) -> tuple:
    """_grid_shell_sums over an accumulator's padded grid within pf r_max."""
    return _grid_shell_sums(bp.padded_size, bp.pad, bp.size, bp.r_max, bp.ndim, bp.xp, values)


def reference_sigma2(bp: BackProjector) -> np.ndarray:
    """sigma2_ref(r) = n_r / sum_{voxels in r} pf^ndim weight (shells 0..N/2) over the padded grid within
    pf r_max; 0 where the shell has no weight."""
    xp = bp.xp
    cnt, wsum = _shell_sums(bp, lambda sl: bp.weight[sl] * bp.pad**bp.ndim)
    out = xp.where(wsum > 0, cnt / xp.where(wsum > 0, wsum, 1.0), 0.0)
    return np.asarray(to_host(out), dtype=np.float64)


def tau2_from_fsc(fsc: np.ndarray, sigma2_ref: np.ndarray, tau2_fudge: float = 1.0, joined: bool = False
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Gold-standard tau2 and SSNR_MAP: f = max(FSC, 0.001) (sqrt(2f/(1+f)) for the joined final map),
    capped at 0.999; SNR = T f/(1-f); tau2 = SNR sigma2_ref."""
    f = np.maximum(np.asarray(fsc, np.float64), 0.001)
    if joined:
        f = np.sqrt(2.0 * f / (1.0 + f))
    f = np.minimum(f, 0.999)
    snr = tau2_fudge * f / (1.0 - f)
    return snr * sigma2_ref, snr


def pooled_average(bp: BackProjector):
    """sum data / sum weight per voxel of the unpadded N grid, pooling padded voxels at ROUND(q/pf)
    (RELION compareTwoHalves): an unregularised estimate on the (N, N, N//2+1) half grid. Slab by slab, over the
    box the accumulators can hold values in (insertion_reach of r_max; symmetrisation and the low-resolution join
    stay inside pf r_max): the rest is zero. Over the whole padded grid, the FSC of both halves took 0.41 s of
    every auto-refine iteration at box 256 on an H200 whatever the resolution (thirty-ninth session), while the
    early iterations fill a few per cent of the grid."""
    xp = bp.xp
    N, pf = bp.size, bp.pad
    size = N * N * (N // 2 + 1)
    d_re, d_im, w = xp.zeros(size + 1), xp.zeros(size + 1), xp.zeros(size + 1)
    for sl, (kz, ky, kx) in half_grid_box_slabs(bp.padded_size, insertion_reach(pf, bp.r_max), 3, xp):
        rz = round_half_away(kz / pf).astype(np.int64)
        ry = round_half_away(ky / pf).astype(np.int64)
        rx = round_half_away(kx / pf).astype(np.int64)
        ok = (rx <= N // 2) & (xp.abs(ry) <= N // 2) & (xp.abs(rz) <= N // 2)
        flat = xp.where(ok, ((rz % N) * N + (ry % N)) * (N // 2 + 1) + rx, size).reshape(-1)
        d_re += xp.bincount(flat, weights=bp.data_re[sl].reshape(-1), minlength=size + 1)
        d_im += xp.bincount(flat, weights=bp.data_im[sl].reshape(-1), minlength=size + 1)
        w += xp.bincount(flat, weights=bp.weight[sl].reshape(-1), minlength=size + 1)
    d_re, d_im, w = d_re[:size], d_im[:size], w[:size]
    z = xp.where(w > 0, (d_re + 1j * d_im) / xp.where(w > 0, w, 1.0), 0)
    return z.reshape(N, N, N // 2 + 1)


def fsc_from_backprojectors(bp1: BackProjector, bp2: BackProjector) -> np.ndarray:
    """Half-map FSC (shells 0..N/2) from the accumulators, as RELION compareTwoHalves; FSC(0) = 1 and shells
    beyond r_max are 0."""
    return fsc_from_pooled(pooled_average(bp1), pooled_average(bp2), bp1.r_max)


def fsc_from_pooled(z1, z2, r_max: float) -> np.ndarray:
    """fsc_from_backprojectors from the two halves' pooled_average (each half can be pooled where it was summed)."""
    f = np.asarray(to_host(fsc_from_fts(z1, z2, 3, r_max)), dtype=np.float64)
    f[0] = 1.0
    f[int(r_max) + 1:] = 0.0
    return f


def low_resolution_block(shape: tuple[int, ...], pad: int, r_join: float, xp=np) -> tuple[tuple, object]:
    """(index, selection) of the voxels join_low_resolution averages, as a block of a padded half grid of
    ``shape``: ``grid[index]`` is the block (support_index's), ``selection`` the bool array of its voxels with
    |q|^2 <= ROUND(pad r_join)^2. What one half's owner rank sends the other's (a small part of the grid)."""
    lim = float(round_half_away(np.float64(pad * r_join))) ** 2
    ix = support_index(shape, int(np.ceil(np.sqrt(lim))) + 1, xp)
    if ix is None:
        ix = xp.ix_(*(xp.arange(n) for n in shape))
    ks = half_grid_indices(shape[0], len(shape), xp)
    q2 = sum(k.reshape(-1)[i].astype(np.float64) ** 2 for k, i in zip(ks, ix, strict=True))
    return ix, q2 <= lim


def join_block(own: list, other: list, selection) -> list:
    """join_low_resolution of one half's low_resolution_block (``own``: data_re, data_im, weight) with the other
    half's: the average where ``selection``, ``own`` elsewhere (new arrays; the same values both halves get)."""
    xp = get_array_module(own[0])
    return [xp.where(selection, 0.5 * (a + b), a) for a, b in zip(own, other, strict=True)]


def join_low_resolution(bp1: BackProjector, bp2: BackProjector, r_join: float) -> None:
    """Average data and weight of both halves for padded voxels with |q|^2 <= ROUND(pf r_join)^2 and write
    the average back to both (RELION --low_resol_join_halves). Over low_resolution_block only, as the halves'
    owner ranks do under MPI: a loop over the whole padded grid cost every iteration a pass over 3 x 2 grids."""
    ix, sel = low_resolution_block(bp1.weight.shape, bp1.pad, r_join, bp1.xp)
    names = ("data_re", "data_im", "weight")
    blocks = [[getattr(bp, a)[ix] for a in names] for bp in (bp1, bp2)]
    for h, bp in enumerate((bp1, bp2)):
        for a, v in zip(names, join_block(blocks[h], blocks[1 - h], sel), strict=True):
            getattr(bp, a)[ix] = v


def update_sigma_offset(wsum: float, sum_weight: float, min_sigma2: float = 2.0, ndim: int = 2) -> float:
    """sigma_off (Å) = sqrt(max(wsum / (ndim S), min_sigma2)) for 2D images (ndim = 2)."""
    return float(np.sqrt(max(wsum / (ndim * max(sum_weight, 1e-300)), min_sigma2)))


def update_norm(old_norm: np.ndarray, norm_average: float, residual_power: np.ndarray) -> np.ndarray:
    """n_i <- (n_i / n_avg) sqrt(2 E_i): the real-space noise std of the residual, on the original scale."""
    return (np.asarray(old_norm) / norm_average) * np.sqrt(np.maximum(2.0 * np.asarray(residual_power), 0.0))


def update_scales(xa: np.ndarray, aa: np.ndarray, counts: np.ndarray, old: np.ndarray) -> np.ndarray:
    """RELION's group intensity scales (maximizationOtherParameters): s_g = XA/AA from the sums with the old scale
    divided out (1 for a group with no reference power), clamped to [median/5, 5 median] with RELION's median (the
    upper middle value, sorted[G // 2]), then divided by their particle-weighted mean. ``old`` is returned when no
    group has any particle."""
    xa, aa = np.asarray(xa, np.float64), np.asarray(aa, np.float64)
    s = np.where(aa > 0, xa / np.where(aa > 0, aa, 1.0), 1.0)
    med = float(np.sort(s)[s.size // 2])
    s = np.clip(s, med / 5.0, 5.0 * med)
    mean = float((s * counts).sum() / max(counts.sum(), 1))
    return s / mean if mean > 0 else np.asarray(old, np.float64)


def initial_data_vs_prior(tau2: np.ndarray, sigma2_groups: np.ndarray, pdf_class: np.ndarray, n_particles: int,
                          tau2_fudge: float, ref_dim: int, data_dim: int = 2) -> np.ndarray:
    """RELION's SSNR before the first M-step (MlModel::initialiseDataVersusPrior), per class and shell (K, N/2+1):
    evidence / prior = n pdf_class(k) tau2_fudge tau2_k(r) / <sigma2>(r), divided by 2r for a 3D reference of 2D
    data (the ratio of pixels in 3D and 2D shells). ``tau2`` (K, N/2+1) the references' tau2 (reference_tau2),
    ``sigma2_groups`` (G, N/2+1) the noise spectra, averaged over the groups that have one."""
    sig = np.asarray(sigma2_groups, np.float64)
    have = sig.sum(axis=1) > 0
    avg = sig[have].mean(axis=0) if have.any() else np.ones(sig.shape[1])
    t2 = np.asarray(tau2, np.float64)
    evidence = n_particles * np.asarray(pdf_class, np.float64)[:, None] / np.where(avg > 0, avg, np.inf)[None, :]
    if ref_dim == 3 and data_dim == 2:
        r = np.arange(t2.shape[1], dtype=np.float64)
        evidence = evidence / np.where(r > 0, 2.0 * r, 1.0)[None, :]
    return evidence * tau2_fudge * t2


def resolution_shell_from_ssnr(ssnr: np.ndarray, minres_map: int = 5, gold_standard: bool = True) -> int:
    """RELION's current resolution shell (updateCurrentResolution): (first shell >= 1 with SSNR < 1) - 1; in
    gold-standard runs a shell r2 > that + 3 that still has SSNR > 1 (scanning down from N/2 - 1) is used instead
    (fsc.resolution_shell's skip_dips); at least ``minres_map``. In a refinement's iterations the SSNR is
    tau2_fudge FSC / (1 - FSC) of the half maps, so this is about where their FSC drops below 0.5, not 0.143."""
    return max(resolution_shell(np.asarray(ssnr, np.float64), 1.0, skip_dips=gold_standard), minres_map)


def coarse_image_size(box: int, pixel_size: float, angular_step_deg: float, diameter_A: float,
                      current_size: int, kappa: float = 1.2) -> int:
    """RELION's coarse-pass image size 2 ceil(N p / d_c), d_c = (step/360) pi D / kappa, capped at the
    current size (kappa 1.2 for 3D references)."""
    dc = angular_step_deg / 360.0 * np.pi * diameter_A / kappa
    s = 2 * int(np.ceil(box * pixel_size / dc))
    return int(min(s, current_size))


def reference_tau2(ref) -> np.ndarray:
    """Classification tau2 (relion_algorithm.md 5.1): tau2(r) = <|data(q)|^2> / 2 over the padded voxels of the
    prepared reference (projector.FourierReference) in shell r = ROUND(|q|/pf), shells 0..N/2, counting only the
    voxels the reference holds, |q|^2 <= ROUND(pf r_max)^2, as RELION's computeFourierTransformMap does (the
    outermost shell is half outside: averaging its zeros too would halve its tau2). Slab by slab."""
    return references_tau2([ref])[0]


def references_tau2(refs: list) -> list[np.ndarray]:
    """reference_tau2 of each of ``refs``; references of one geometry (the classes of an iteration) in one pass
    over the grid, which makes each slab's shells once for all of them."""
    first = refs[0]
    if any(r.data.shape != first.data.shape or r.pad != first.pad or r.r_max != first.r_max or r.size != first.size
           for r in refs):
        return [reference_tau2(r) for r in refs]
    xp, K = get_array_module(first.data), len(refs)

    def power(index):
        d = [r.data[index] for r in refs]
        return xp.stack([x.real.astype(np.float64) ** 2 + x.imag.astype(np.float64) ** 2 for x in d])

    cnt, tot = _grid_shell_sums(first.padded_size, first.pad, first.size, first.r_max, first.ndim, xp, power,
                                lead=K, inclusive=True)
    out = to_host(xp.where(cnt > 0, tot / (2.0 * xp.maximum(cnt, 1)), 0.0)).astype(np.float64).reshape(K, -1)
    return list(out)


def ssnr_map(bp, tau2: np.ndarray, tau2_fudge: float) -> np.ndarray:
    """Classification SSNR_MAP ("data_vs_prior", relion_algorithm.md 4.3): the shell average of
    pf^ndim T tau2(r) weight over the padded voxels within pf r_max; 0 beyond r_max, 999 in empty shells."""
    # sum over shell r of pf^ndim T tau2(r) weight = pf^ndim T tau2(r) x (sum of the weights in shell r)
    cnt, wsum = _shell_sums(bp, lambda sl: bp.weight[sl])
    return _ssnr_from_sums(cnt, wsum, tau2, tau2_fudge, bp.pad**bp.ndim, bp.r_max, bp.xp)


def ssnr_maps(stack, tau2, tau2_fudge: float) -> list[np.ndarray]:
    """ssnr_map of every member of a BackProjectorStack (``tau2`` (K, shells)), in one pass over the grids."""
    K, w = len(stack.members), stack.arrays[2]
    cnt, wsum = _grid_shell_sums(stack.pad * stack.size, stack.pad, stack.size, stack.r_max, stack.ndim, stack.xp,
                                 lambda index: w[(slice(None),) + index], lead=K)
    return list(_ssnr_from_sums(cnt, wsum.reshape(K, -1), tau2, tau2_fudge, stack.pad**stack.ndim, stack.r_max,
                                stack.xp))


def _ssnr_from_sums(cnt, wsum, tau2, tau2_fudge: float, pad_ndim: int, r_max: float, xp) -> np.ndarray:
    """SSNR_MAP from the voxel counts (n,) and the weight sums (n,) or (K, n) per shell, with tau2 of the same
    shape (columns beyond n ignored): one array, one copy to the host."""
    n = cnt.shape[0]
    t2 = np.asarray(to_host(tau2), np.float64)[..., :n]
    val = (pad_ndim * tau2_fudge) * xp.asarray(t2) * wsum
    out = np.asarray(to_host(xp.where(cnt > 0, val / xp.maximum(cnt, 1), 999.0)), dtype=np.float64)
    out[..., np.arange(n) > r_max] = 0.0
    return out


def initial_noise_spectrum(images, mask_radius_px: float, zero_mask: bool, mask_edge_px: float = 5.0) -> np.ndarray:
    """(N/2+1,) RELION's initial sigma2 of one optics group from its particle images (n, N, N) (up to 1000 of
    them; zero-masked first with --zero_mask): (mean image power - power of the mean image) / 2."""
    N = images.shape[-1]
    x = soft_mask_outside(images, mask_radius_px, mask_edge_px, 2) if zero_mask else images
    F = rfft_centered(x, 2)
    # RELION averages |F|^2 over every element of the FFTW half transform in the shell, the x = 0 column's
    # Hermitian duplicates included (calculateSumOfPowerSpectraAndAverageImage, getSpectrum); leaving them out
    # raised the estimate by 7 % at shell 1 and 0.5-1.7 % at shells 4-30 on relion_project data
    each = to_host(radial_average((F.real**2 + F.imag**2).astype(np.float64), N, 2, unique_only=False).mean(axis=0))
    Fm = F.mean(axis=0)
    mean_pow = to_host(radial_average((Fm.real**2 + Fm.imag**2).astype(np.float64), N, 2, unique_only=False))
    return initial_sigma2(each, mean_pow)


def reconstruct_classes(stack, tau2: list, tau2_fudge: float, class_weight: np.ndarray, old_refs,
                        sym_matrices: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """The classification M-step of the class maps: Hermitian pairing of every class, point-group symmetrisation
    (``sym_matrices``, 3D), SSNR_MAP per class and one batched MAP reconstruction with each class's tau2.
    Returns the new maps (K, N, ...) on the stack's device, float32 as reconstructed, and the SSNR_MAP curves. An
    empty class (no weight) keeps ``old_refs[k]``, as RELION does; the maps are then float64, since the first
    iteration's references need not be float32 values."""
    stack.enforce_hermitian()
    if sym_matrices is not None and len(sym_matrices) > 1:
        for bp in stack.members:  # symmetrisation per class
            bp.symmetrise(sym_matrices)
    tau2 = np.stack([to_host(t) for t in tau2])
    ssnr_all = ssnr_maps(stack, tau2, tau2_fudge)  # one pass over the K grids
    maps = stack.reconstruct(tau2, tau2_fudge).astype(np.float32, copy=False)
    empty = np.flatnonzero(~(np.asarray(class_weight) > 0))  # a NaN weight keeps the old map too
    if empty.size:
        xp = get_array_module(maps)
        maps = maps.astype(np.float64)
        maps[xp.asarray(empty)] = xp.asarray(np.asarray(old_refs)[empty], dtype=np.float64)
    return maps, ssnr_all


def class_offset_priors(offset_sum_A: np.ndarray, class_weight: np.ndarray) -> np.ndarray:
    """(K, 2) prior means of the offsets per class (Å): the weighted mean offset of the class's particles,
    0 for empty classes (RELION's maximizationOtherParameters divides by the class's own weight)."""
    w = np.asarray(class_weight, float)[:, None]
    return np.where(w > 0, np.asarray(offset_sum_A) / np.where(w > 0, w, 1.0), 0.0)


def normalised_direction_priors(pdf_direction: np.ndarray) -> np.ndarray:
    """(K, n_dirs) orientation distribution of each class, normalised to 1, from its summed weights or from a
    model STAR's (RELION's, which sum to the class distribution); uniform for a class without weight."""
    tot = pdf_direction.sum(axis=1, keepdims=True)
    return np.where(tot > 0, pdf_direction / np.maximum(tot, 1e-300), 1.0 / pdf_direction.shape[1])

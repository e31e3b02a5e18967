"""Fourier shell correlation, resolution, FSC' join, phase randomisation, masked-FSC correction and
B-factor sharpening (relion_algorithm.md 4.7; relion_pick_extract_post.md 3.2).

Shells are ROUND(|k|) = 0..N/2; each stored half-complex element counts once; shells beyond N/2 (corners)
are ignored.
"""

from __future__ import annotations

import numpy as np

from .backend import get_array_module
from .fourier import (
    irfft_centered,
    lowpass_raised_cosine,
    radius_grid,
    rfft_centered,
    round_half_away,
    shell_grid,
    shell_sum,
)


def fsc_from_fts(F1, F2, ndim: int = 3, r_max: float | None = None):
    """FSC per shell 0..N/2 from two half-grid FTs of an N box; FSC(0) = 1 by convention of RELION's
    half-map comparison when both DC terms are non-zero (computed, not forced). ``r_max`` (Fourier pixels): only
    the elements with |k| <= r_max count, as in RELION's calculateDownSampledFourierShellCorrelation. Its shell
    ROUND(r_max) then holds only its inner half: the elements beyond r_max in it got data only by the insertion's
    interpolation from inside, too little to correlate (an auto-refine's FSC at the edge of its images was
    -0.02 in ours against RELION's 0.18 from RELION's own state, benchmarks/continue_refine_from_relion.py; the
    first shell below 0.143 sets the next image-size increment)."""
    xp = get_array_module(F1)
    N = F1.shape[-2]
    if r_max is None:
        shells = shell_grid(N, ndim, xp)
    else:
        r = radius_grid(N, ndim, xp)
        shells = xp.where(r <= r_max, round_half_away(r).astype(np.int32), N)  # N: beyond every counted shell
    n = N // 2 + 1
    num = shell_sum((F1 * xp.conj(F2)).real, shells, n)
    d1 = shell_sum((F1 * xp.conj(F1)).real, shells, n)
    d2 = shell_sum((F2 * xp.conj(F2)).real, shells, n)
    return num / xp.sqrt(xp.maximum(d1 * d2, 1e-300))


def fsc(map1, map2):
    """FSC between two real-space maps (or 2D images) of the same even box."""
    if map1.shape != map2.shape:
        raise ValueError(f"FSC needs maps of the same shape, got {map1.shape} and {map2.shape}")
    ndim = map1.ndim
    return fsc_from_fts(rfft_centered(map1.astype(np.float64), ndim),
                        rfft_centered(map2.astype(np.float64), ndim), ndim)


def resolution_shell(curve, threshold: float = 0.143, skip_dips: bool = False) -> int:
    """RELION's rule: walking up from shell 1, the last shell before the first value below ``threshold``
    (0 if shell 1 already fails; the last shell if it never drops). ``skip_dips``: as RELION's auto-refine
    (updateCurrentResolution, on its SSNR), a curve that rises above ``threshold`` again more than 3 shells beyond
    that one gives the highest such shell, scanning down from the second-to-last: a dip is not the resolution."""
    c = np.asarray(curve)
    shell = len(c) - 1
    for i in range(1, len(c)):
        if c[i] < threshold:
            shell = i - 1
            break
    if skip_dips:
        for r2 in range(len(c) - 2, shell + 3, -1):
            if c[r2] > threshold:
                return r2
    return shell


def shell_to_angstrom(shell: float, box: int, pixel_size: float) -> float:
    return 999.0 if shell <= 0 else box * pixel_size / shell


def resolution_A(curve, box: int, pixel_size: float, threshold: float = 0.143) -> float:
    """Resolution (Å) where the FSC first drops below ``threshold`` (RELION's last-shell-above rule)."""
    return shell_to_angstrom(resolution_shell(curve, threshold), box, pixel_size)


def fsc_to_full(curve):
    """FSC' = sqrt(2 FSC / (1 + FSC)): the expected FSC of the full map against the truth from the half-map
    FSC (0 where FSC <= 0)."""
    c = np.asarray(curve, dtype=np.float64)
    return np.where(c > 0, np.sqrt(2 * np.clip(c, 0, None) / (1 + c)), 0.0)


def randomize_phases_beyond(vol, shell: float, seed: int = 0):
    """Keep amplitudes and give every Fourier component with |k| >= ``shell`` an independent uniform phase
    (the half grid is filled consistently: the inverse real transform makes it Hermitian)."""
    xp = get_array_module(vol)
    ndim = vol.ndim
    N = vol.shape[-1]
    F = rfft_centered(vol.astype(np.float64), ndim)
    rng = np.random.default_rng(seed)
    phase = xp.asarray(rng.uniform(0, 2 * np.pi, F.shape))
    sel = radius_grid(N, ndim, xp) >= shell
    F = xp.where(sel, xp.abs(F) * xp.exp(1j * phase), F)
    return irfft_centered(F, N, ndim)


def corrected_fsc(fsc_masked, fsc_random_masked, randomize_shell: int):
    """FSC_true = (FSC_masked - FSC_rand)/(1 - FSC_rand) for shells >= randomize_shell + 2 (0 where FSC_rand >
    FSC_masked); FSC_masked below."""
    fm = np.asarray(fsc_masked, dtype=np.float64)
    fr = np.asarray(fsc_random_masked, dtype=np.float64)
    out = fm.copy()
    hi = np.arange(len(fm)) >= randomize_shell + 2
    corr = np.where(fr > fm, 0.0, (fm - fr) / np.maximum(1 - fr, 1e-12))
    out[hi] = corr[hi]
    return out


def guinier(vol, pixel_size: float):
    """Guinier plot of a map: (1/d^2 per shell in 1/Å^2, ln mean |F| per shell; -99 where zero)."""
    xp = get_array_module(vol)
    N = vol.shape[-1]
    F = rfft_centered(vol.astype(np.float64), 3)
    shells = shell_grid(N, 3, xp)
    n = N // 2 + 1
    amp = shell_sum(xp.abs(F), shells, n) / xp.maximum(shell_sum(xp.ones(F.shape), shells, n), 1)
    amp = np.asarray(amp.get() if hasattr(amp, "get") else amp)
    i = np.arange(n)
    x = (i / (N * pixel_size)) ** 2
    y = np.where(amp > 0, np.log(np.maximum(amp, 1e-300)), -99.0)
    return x, y


def fit_bfactor(x, y, pixel_size_box: tuple[int, float], lowres_A: float = 10.0, highres_A: float = 0.0):
    """Least-squares line through Guinier points with highres <= d <= lowres and non-zero amplitude.
    Returns (B = 4 slope, intercept, r^2)."""
    N, p = pixel_size_box
    i = np.arange(len(x))
    d = np.where(i > 0, N * p / np.maximum(i, 1), np.inf)
    sel = (d <= lowres_A) & (d >= highres_A) & (y > -99) & (i > 0)
    if sel.sum() < 3:
        raise ValueError(f"too few Guinier points between {highres_A} and {lowres_A} Å to fit a B-factor")
    slope, icept = np.polyfit(x[sel], y[sel], 1)
    r = np.corrcoef(x[sel], y[sel])[0, 1]
    return 4.0 * slope, icept, r * r


def fsc_weights(fsc_curve) -> np.ndarray:
    """The sharpening's FSC weighting: sqrt(2 FSC / (1 + FSC)) (:func:`fsc_to_full`) per shell up to the last
    shell before the FSC first drops below 1e-4, 0 beyond."""
    c = np.asarray(fsc_curve, dtype=np.float64)
    below = np.nonzero(c < 1e-4)[0]
    imax = (below[below > 0][0] - 1) if np.any(below > 0) else len(c) - 1
    w = fsc_to_full(c)
    w[imax + 1:] = 0.0
    return w


def apply_bfactor_and_fsc_weight(vol, pixel_size: float, bfactor: float, fsc_curve=None,
                                 lowpass_A: float | None = None, edge_shells: float = 2.0):
    """Sharpen: F * exp(-B s^2 / 4) for s <= Nyquist (0 beyond); optional FSC weighting sqrt(2FSC/(1+FSC))
    up to the last shell before FSC < 1e-4 (zero beyond); optional raised-cosine low-pass."""
    xp = get_array_module(vol)
    N = vol.shape[-1]
    F = rfft_centered(vol.astype(np.float64), 3)
    r = radius_grid(N, 3, xp)
    s2 = (r / (N * pixel_size)) ** 2
    filt = xp.where(r <= N / 2, xp.exp(-bfactor * s2 / 4.0), 0.0)
    if fsc_curve is not None:
        w = fsc_weights(fsc_curve)
        sh = shell_grid(N, 3, xp)
        wv = xp.asarray(w)[xp.clip(sh, 0, len(w) - 1)]
        filt = filt * xp.where(sh < len(w), wv, 0.0)
    if lowpass_A is not None and lowpass_A > 0:
        shell = np.floor(N * pixel_size / lowpass_A + 0.5)
        filt = filt * lowpass_raised_cosine(N, shell, edge_shells, 3, xp)
    return irfft_centered(F * filt, N, 3).astype(np.float32)

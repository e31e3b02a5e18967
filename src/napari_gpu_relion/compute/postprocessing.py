"""Post-processing of two half maps within a bounded amount of device memory (relion_postprocess; issue 21).

The same numbers as compute/fsc.py's whole-grid functions (fsc, randomize_phases_beyond, guinier,
apply_bfactor_and_fsc_weight), computed so that a 1024^3 box fits one 80 GB GPU: the half maps stay on the host
(float32, as read) and go to the device one at a time; every function over the Fourier half grid (shell sums,
phase randomisation, filters) works in slabs of its first axis instead of making grid-sized temporaries
(radius, shell index, filter grids: 4-8 bytes per voxel each); the Fourier transforms are float64 as before. At
most about five complex128 grids exist at once (an FT held, another being made, the FFT's input and work
area), about 45 GB at 1024^3 instead of the ~15 whole-grid arrays of the plain functions.

Per element the arithmetic is that of the plain functions (the same formulas, the same random phases in the
same order); only the shell sums add their terms in another order (slab by slab), so results agree to float64
rounding (tests/test_postprocess_lean.py).
"""

from __future__ import annotations

import numpy as np

from ..marks import memory_mark
from .backend import get_array_module, to_host
from .fourier import half_grid_slabs, irfft_centered, raised_cosine, rfft_centered, round_half_away
from .fsc import fsc_weights

#: Bytes of temporaries per half-grid voxel of one slab (complex128 products, float64 radii and filters).
SLAB_BYTES_PER_VOXEL = 96


def _slabs(N: int, xp):
    return half_grid_slabs(N, 3, xp, bytes_per_voxel=SLAB_BYTES_PER_VOXEL)


def _radius(ks, xp):
    """|k| of a slab, as fourier.radius_grid computes it."""
    return xp.sqrt(sum(k.astype(np.float64) ** 2 for k in ks))


def _shells(ks, xp):
    """ROUND(|k|) of a slab, as fourier.shell_grid computes it."""
    return round_half_away(_radius(ks, xp)).astype(np.int32)


def _shell_add(out, values, shells, n: int) -> None:
    """out[s] += sum of ``values`` over the voxels of shell s < n (fourier.shell_sum of one slab)."""
    xp = get_array_module(values)
    flat = shells.reshape(-1)
    ok = (flat >= 0) & (flat < n)
    out += xp.bincount(flat[ok], weights=xp.broadcast_to(values, shells.shape).reshape(-1)[ok], minlength=n)[:n]


def device_ft(host_map, xp, mask=None, plus=None, scale: float | None = None, consume: bool = False):
    """RELION's forward FT (fourier.rfft_centered) of a map in float64 on the device of ``xp``:
    ``(map [+ plus]) [* scale] [* mask]``, each operand brought over as it is (float32 host maps stay float32
    until they reach the device). Only the map, its shifted copy and the FT exist at once. ``consume``: a float64
    map on the device is used as the work array and overwritten (the caller gives it away)."""
    x = xp.asarray(host_map).astype(np.float64, copy=not consume)
    if plus is not None:
        x += xp.asarray(plus)
    if scale is not None:
        x *= scale
    if mask is not None:
        x *= xp.asarray(mask)
    return rfft_centered(x, 3)


def fsc_of_fts(F1, F2):
    """fsc.fsc_from_fts of two half-grid FTs, shell sums slab by slab (no grid-sized products)."""
    xp = get_array_module(F1)
    N = F1.shape[-2]
    n = N // 2 + 1
    num, d1, d2 = xp.zeros(n), xp.zeros(n), xp.zeros(n)
    for sl, ks in _slabs(N, xp):
        sh = _shells(ks, xp)
        a, b = F1[sl], F2[sl]
        _shell_add(num, (a * xp.conj(b)).real, sh, n)
        _shell_add(d1, (a * xp.conj(a)).real, sh, n)
        _shell_add(d2, (b * xp.conj(b)).real, sh, n)
    return to_host(num / xp.sqrt(xp.maximum(d1 * d2, 1e-300)))


def randomize_phases_in_place(F, shell: float, seed: int) -> None:
    """fsc.randomize_phases_beyond on an FT, in place: components with |k| >= ``shell`` get the phases that
    function draws (numpy's default_rng(seed), uniform in [0, 2 pi), in C order over the half grid, drawn slab
    by slab from the same generator: the same numbers)."""
    xp = get_array_module(F)
    N = F.shape[-2]
    rng = np.random.default_rng(seed)
    for sl, ks in _slabs(N, xp):
        block = F[sl]
        phase = xp.asarray(rng.uniform(0, 2 * np.pi, block.shape))
        sel = _radius(ks, xp) >= shell
        F[sl] = xp.where(sel, xp.abs(block) * xp.exp(1j * phase), block)


def real_map(F, N: int):
    """The real map of an FT (fourier.irfft_centered), float64 on F's device."""
    return irfft_centered(F, N, 3)


def guinier_of_ft(F, pixel_size: float):
    """fsc.guinier from the FT of the map: (1/d^2 per shell, ln of the mean |F| per shell; -99 where 0)."""
    xp = get_array_module(F)
    N = F.shape[-2]
    n = N // 2 + 1
    tot, cnt = xp.zeros(n), xp.zeros(n)
    for sl, ks in _slabs(N, xp):
        sh = _shells(ks, xp)
        _shell_add(tot, xp.abs(F[sl]), sh, n)
        _shell_add(cnt, xp.ones(sh.shape), sh, n)
    amp = to_host(tot / xp.maximum(cnt, 1))
    i = np.arange(n)
    x = (i / (N * pixel_size)) ** 2
    y = np.where(amp > 0, np.log(np.maximum(amp, 1e-300)), -99.0)
    return x, y


def filter_in_place(F, pixel_size: float, bfactor: float, fsc_curve=None, lowpass_A: float | None = None,
                    edge_shells: float = 2.0) -> None:
    """F *= the filter of fsc.apply_bfactor_and_fsc_weight (B-factor to Nyquist, FSC weighting, raised-cosine
    low-pass), computed slab by slab with that function's per-element arithmetic."""
    xp = get_array_module(F)
    N = F.shape[-2]
    w = None if fsc_curve is None else xp.asarray(fsc_weights(fsc_curve))
    shell = None
    if lowpass_A is not None and lowpass_A > 0:
        shell = np.floor(N * pixel_size / lowpass_A + 0.5)
    for sl, ks in _slabs(N, xp):
        r = _radius(ks, xp)
        s2 = (r / (N * pixel_size)) ** 2
        filt = xp.where(r <= N / 2, xp.exp(-bfactor * s2 / 4.0), 0.0)
        if w is not None:
            sh = round_half_away(r).astype(np.int32)
            wv = w[xp.clip(sh, 0, len(w) - 1)]
            filt = filt * xp.where(sh < len(w), wv, 0.0)
        if shell is not None:
            filt = filt * raised_cosine(r, shell, edge_shells)
        F[sl] *= filt


def sharpened_map(A, pixel_size: float, bfactor: float, fsc_curve=None, lowpass_A: float | None = None,
                  consume: bool = False):
    """fsc.apply_bfactor_and_fsc_weight from the FT ``A`` of the map: float32 map on A's device. With
    ``consume`` the filter is applied to A itself (no copy; A is then the filtered FT)."""
    N = A.shape[-2]
    F = A if consume else A.copy()
    filter_in_place(F, pixel_size, bfactor, fsc_curve, lowpass_A)
    out = irfft_centered(F, N, 3)
    del F
    return out.astype(np.float32)


def masked_fsc(v1, v2, mask, xp):
    """fsc.fsc(v1 * mask, v2 * mask) for host maps: one masked FT at a time on the device beside the other."""
    G1 = device_ft(v1, xp, mask=mask)
    G2 = device_ft(v2, xp, mask=mask)
    out = fsc_of_fts(G1, G2)
    del G1, G2
    memory_mark("postprocess: masked FSC")
    return out

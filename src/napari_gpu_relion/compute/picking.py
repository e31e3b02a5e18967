"""Autopicking math (relion_pick_extract_post.md section 1): RELION's Laplacian-of-Gaussian and template
(probability-ratio) figures of merit, and their peak searches.

Conventions. A micrograph batch is (B, N, N) after square embedding. Its spectrum is the plain (uncentred)
``rfft2`` divided by N^2 (RELION's forward normalisation), cropped to the working size W (RELION's "shrink"
grid, see :func:`working_size`); every FOM map is W x W and W-grid pixel p sits at micrograph pixel p * N / W.
Frequencies k are integer indices of the N grid (the crop keeps them), so filters and CTFs use k / (N apix).
Templates are centred (phase origin at the box centre): correlating with them puts the template centre on
each map pixel. Functions take NumPy or CuPy arrays and return the same kind; the greedy peak searches run on
the host (as in RELION), with loops over accepted picks only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix

from .backend import get_array_module, to_host
from .fourier import (
    _fft_module,
    irfft_centered,
    radius_grid,
    rfft_centered,
    round_half_away,
    signed_index,
    window_fourier,
)
from .projector import _corner_indices, pixel_list

# ----------------------------------------------------------------------------------------------------------
# Working grid


def _largest_prime(n: int) -> int:
    n = int(n)
    best, f = 1, 2
    while f * f <= n:
        while n % f == 0:
            best, n = f, n // f
        f += 1
    return max(best, n) if n > 1 else best


def _fft_ok(n: int, limit: int) -> bool:
    return max(_largest_prime(n), _largest_prime(n // 2 + 1)) <= limit


def good_fourier_size(n: int, n_max: int) -> int:
    """RELION's getGoodFourierDims: an even size near ``n`` (pixels) whose FFTs have prime factors <= 43;
    searched in steps of 2 both ways, the closer wins (ties: up; up only if <= ``n_max``)."""
    n = max(2, int(n) + int(n) % 2)
    if _fft_ok(n, 43):
        return n
    up = n
    while not _fft_ok(up, 42):
        up += 2
    down = n
    while down > 2 and not _fft_ok(down, 42):
        down -= 2
    if up > n_max or (n - down) < (up - n):
        return down
    return up


def working_size(n: int, pixel_size: float, lowpass_A: float, shrink: float) -> int:
    """Working grid W (even, <= n) of RELION's autopicker for an n x n (embedded) micrograph at
    ``pixel_size`` Å: ``shrink`` 0 -> from ``lowpass_A`` (Nyquist of W = lowpass); 0 < s <= 1 -> s n;
    s > 1 -> s pixels. ``lowpass_A`` < 0 means no low-pass."""
    downsize = n if lowpass_A <= 0 else int(2 * round_half_away(np.float64(n * pixel_size / lowpass_A)))
    downsize = min(max(downsize, 2), n)
    if shrink == 0:
        w = downsize
    elif shrink <= 1:
        w = int(round_half_away(np.float64(shrink * n)))
    else:
        w = int(round_half_away(np.float64(shrink)))
    w = min(max(2, w + w % 2), n)
    w = good_fourier_size(w, n)
    return int(min(w + w % 2, n))


def oversampled_size(w: int, n: int, factor: int) -> int:
    """A grid ``factor`` times finer than the working size ``w`` for FOM maps (not RELION): the even good Fourier
    size nearest factor x w, at most the embedded size ``n`` (pixels). The FOM maps' frequencies stay those of
    the w grid (the spectrum is zero-padded): only the sampling of the maps gets finer. A template correlation
    band-limited at --lowpass peaks within about one w-grid pixel (its Nyquist sampling), so a particle centred
    between w pixels loses FOM there, and a noise peak beside it can outrank and suppress it (issue 48)."""
    if factor <= 1 or w >= n:
        return int(w)
    m = min(int(factor) * int(w), n)
    m = good_fourier_size(m, n) if m < n else n
    return int(min(m + m % 2, n))


def downsize_mic(n: int, pixel_size: float, lowpass_A: float) -> int:
    """Size whose Nyquist is the low-pass (2 ROUND(n apix / lowpass)); n without low-pass."""
    if lowpass_A <= 0:
        return n
    return int(min(n, 2 * round_half_away(np.float64(n * pixel_size / lowpass_A))))


# ----------------------------------------------------------------------------------------------------------
# Micrograph preparation


def normalise_micrographs(m, zscore: float = 8.0, invert: bool = False):
    """(B, ny, nx) raw micrographs (any dtype) -> float32 with mean 0 and population std 1 (RELION: outliers
    with |m - mean| / std > ``zscore`` are set to the mean first, with the original statistics).
    ``invert`` negates the result (LoG: dark particles become positive blobs)."""
    xp = get_array_module(m)
    x = m.astype(np.float32)
    axes = (-2, -1)
    mu = x.mean(axis=axes, dtype=np.float64, keepdims=True)
    sd = xp.sqrt(((x - mu.astype(np.float32)) ** 2).mean(axis=axes, dtype=np.float64, keepdims=True))
    sd = xp.where(sd > 0, sd, 1.0)
    z = (x - mu.astype(np.float32)) / sd.astype(np.float32)
    if zscore > 0:
        z = xp.where(xp.abs(z) > zscore, np.float32(0.0), z)
    return -z if invert else z


def square_size(ny: int, nx: int) -> int:
    """Edge of the square embedding (even): max(ny, nx) rounded up to even."""
    n = max(ny, nx)
    return n + n % 2


def embed_square(x, n: int, seed: int = 0):
    """Place (B, ny, nx) centred (logical origin, offset n/2 - floor(size/2) per axis) in an (B, n, n) field
    filled with N(0, 1) noise (RELION's embedding of non-square micrographs); square input is returned as is."""
    xp = get_array_module(x)
    B, ny, nx = x.shape
    if ny == n and nx == n:
        return x
    rng = np.random.default_rng(seed)
    out = xp.asarray(rng.standard_normal((B, n, n), dtype=np.float32))
    oy, ox = n // 2 - ny // 2, n // 2 - nx // 2
    out[:, oy:oy + ny, ox:ox + nx] = x
    return out


def micrograph_spectrum(x):
    """Plain rfft2 of the last two axes divided by their size (RELION forward normalisation)."""
    xp = get_array_module(x)
    fft, kw = _fft_module(xp)
    return fft.rfft2(x, norm="forward", **kw)


def inverse_on_grid(F, w: int):
    """Unnormalised inverse rfft2 onto a w x w grid (the inverse of :func:`micrograph_spectrum`)."""
    xp = get_array_module(F)
    fft, kw = _fft_module(xp)
    return fft.irfft2(F, s=(w, w), norm="forward", **kw)


def crop_spectrum(F, w: int):
    """Crop a half-grid spectrum (..., n, n//2+1) to (..., w, w//2+1) keeping logical indices."""
    return window_fourier(F, w, 2)


@dataclass(frozen=True)
class Grid:
    """Geometry of one micrograph on the working grid: embedded size n, working size w, scale w/n and the
    W-grid rectangle [y0, y1) x [x0, x1) that holds the original ny x nx micrograph."""

    n: int
    w: int
    ny: int
    nx: int

    @property
    def scale(self) -> float:
        return self.w / self.n

    def _span(self, size: int) -> tuple[int, int]:
        m = int(size * self.scale)
        lo = self.w // 2 - m // 2
        return lo, lo + m

    @property
    def region(self) -> tuple[int, int, int, int]:
        y0, y1 = self._span(self.ny)
        x0, x1 = self._span(self.nx)
        return y0, y1, x0, x1

    def inside(self, skip: int, xp=np):
        """(w, w) bool: W-grid pixels inside the original micrograph shrunk by ``skip`` pixels."""
        y0, y1, x0, x1 = self.region
        iy = xp.arange(self.w)[:, None]
        ix = xp.arange(self.w)[None, :]
        return (iy >= y0 + skip) & (iy < y1 - skip) & (ix >= x0 + skip) & (ix < x1 - skip)

    def to_micrograph(self, py, px) -> tuple[np.ndarray, np.ndarray]:
        """W-grid pixel indices -> micrograph coordinates X, Y (pixels), RELION's
        X = (j + floor(int(nx scale) / 2)) / scale with j the logical W index."""
        s = self.scale
        jx = np.asarray(px, np.float64) - self.w // 2
        jy = np.asarray(py, np.float64) - self.w // 2
        return (jx + int(self.nx * s) // 2) / s, (jy + int(self.ny * s) // 2) / s


# ----------------------------------------------------------------------------------------------------------
# Laplacian of Gaussian


def log_diameters(d_min: float, d_max: float, max_search: int = 5) -> np.ndarray:
    """RELION's LoG diameters (Å): ROUND(d_min/i) for i = max_search..2, d_min, (d_min+d_max)/2, d_max,
    ROUND(d_max i) for i = 2..max_search (the out-of-range sizes act as competitors)."""
    lo = [float(round_half_away(np.float64(d_min / i))) for i in range(max_search, 1, -1)]
    hi = [float(round_half_away(np.float64(d_max * i))) for i in range(2, max_search + 1)]
    return np.array(lo + [d_min, (d_min + d_max) / 2.0, d_max] + hi, dtype=np.float64)


def log_filter(w: int, n: int, pixel_size: float, diameter_A: float, xp=np):
    """Scale-normalised negative LoG on the (w, w//2+1) half grid: (k^2/s^2) exp(-k^2 / (2 s^2)) with
    s = 0.5 n apix / d (k, s in Fourier pixels of the n grid; real-space sigma = d / (pi apix) pixels)."""
    s = 0.5 * n * pixel_size / diameter_A
    ky = signed_index(w, xp).astype(np.float64)[:, None]
    kx = xp.arange(w // 2 + 1, dtype=np.float64)[None, :]
    k2 = (ky * ky + kx * kx) / (s * s)
    return (k2 * xp.exp(-0.5 * k2)).astype(np.float32)


def log_fom(F_w, n: int, pixel_size: float, diameters_A):
    """Best LoG response over the diameters and the index of the diameter giving it (strictly greater
    replaces, starting from -999), for a batch of cropped spectra (B, w, w//2+1) -> (B, w, w) float32, int16."""
    xp = get_array_module(F_w)
    w = F_w.shape[-2]
    best = xp.full(F_w.shape[:-2] + (w, w), -999.0, dtype=np.float32)
    which = xp.zeros(best.shape, dtype=np.int16)
    for i, d in enumerate(np.asarray(diameters_A, dtype=np.float64)):
        r = inverse_on_grid(F_w * log_filter(w, n, pixel_size, float(d), xp), w).astype(np.float32)
        better = r > best
        best = xp.where(better, r, best)
        which = xp.where(better, np.int16(i), which)
    return best, which


def log_threshold(best, which, diameters_A, d_min: float, d_max: float, inside, adjust: float = 0.0,
                  upper: float = 99999.0, robust: bool = False):
    """RELION's LoG selection on (B, w, w) maps: zero outside ``inside`` (w, w), zero pixels whose best
    diameter is outside [d_min, d_max], then threshold at mean + adjust std of the "ok-size" pixels (border
    zeros included; population std). ``robust`` (not in RELION) uses the median and 1.4826 x MAD instead, which
    contamination does not inflate. Returns (fom map with values below the threshold zeroed, upper limit (B,))."""
    xp = get_array_module(best)
    d = xp.asarray(np.asarray(diameters_A, np.float32))[which.astype(np.int64)]
    fom = xp.where(inside[None], best, np.float32(0.0))
    ok = (d >= d_min - 1e-3) & (d <= d_max + 1e-3)
    fom = xp.where(ok, fom, np.float32(0.0))
    if robust:
        mu_l, sd_l = [], []
        for b in range(fom.shape[0]):  # one median per micrograph of the batch
            v = fom[b][ok[b]].astype(np.float64)
            med = xp.median(v) if v.size else xp.asarray(0.0)
            mu_l.append(med)
            sd_l.append(1.4826 * xp.median(xp.abs(v - med)) if v.size else xp.asarray(0.0))
        mu, sd = xp.stack(mu_l), xp.stack(sd_l)
    else:
        cnt = xp.maximum(ok.sum(axis=(-2, -1)), 1).astype(np.float64)
        mu = fom.sum(axis=(-2, -1), dtype=np.float64) / cnt
        dev = xp.where(ok, (fom - mu[:, None, None].astype(np.float32)) ** 2, 0.0)
        sd = xp.sqrt(dev.sum(axis=(-2, -1), dtype=np.float64) / cnt)
    thr = (mu + adjust * sd).astype(np.float32)
    up = (mu + upper * sd).astype(np.float32)
    fom = xp.where(fom < thr[:, None, None], np.float32(0.0), fom)
    return fom, up


def greedy_pick(values: np.ndarray, radius: np.ndarray | float, upper: float = np.inf
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RELION's LoG peak search on a host (h, w) map: repeatedly take the largest remaining value > 0 (first
    in raster order on ties), record it if it is < ``upper``, and remove every pixel at squared distance
    < radius^2 of it (``radius`` per pixel, in pixels, evaluated at the pick). Returns rows, cols, values in
    pick order. The loop runs once per accepted pick; the sort and the pixel tests are vectorised."""
    v = np.asarray(values)
    h, w = v.shape
    flat = v.ravel()
    rad = np.broadcast_to(np.asarray(radius), v.shape).ravel()
    cand = np.flatnonzero(flat > 0)
    order = cand[np.argsort(-flat[cand], kind="stable")]
    alive = np.ones(flat.size, dtype=bool)
    alive2 = alive.reshape(h, w)
    rows, cols, vals = [], [], []
    ptr, chunk = 0, 4096
    while ptr < order.size:
        seg = order[ptr:ptr + chunk]
        ok = alive[seg]
        if not ok.any():
            ptr += seg.size
            continue
        k = int(np.argmax(ok))
        idx = int(seg[k])
        ptr += k + 1
        y, x = divmod(idx, w)
        if flat[idx] < upper:
            rows.append(y)
            cols.append(x)
            vals.append(flat[idx])
        r = float(rad[idx])
        ri = int(np.ceil(r))
        ya, yb, xa, xb = max(0, y - ri), min(h, y + ri + 1), max(0, x - ri), min(w, x + ri + 1)
        yy = (np.arange(ya, yb) - y)[:, None]
        xx = (np.arange(xa, xb) - x)[None, :]
        alive2[ya:yb, xa:xb] &= (yy * yy + xx * xx) >= r * r
        alive[idx] = False
    return np.array(rows, np.int64), np.array(cols, np.int64), np.array(vals, np.float64)


def log_pick_radius(which: np.ndarray, diameters_A, d_min: float, pixel_size: float, scale: float,
                    neighbour_percent: float = 100.0) -> np.ndarray:
    """Exclusion radius (W-grid pixels) per pixel: ROUND(scale (d_best + d_min) neighbour/100 / 2 / apix)."""
    d = np.asarray(diameters_A, np.float64)[np.asarray(which, np.int64)]
    return round_half_away(scale * (d + d_min) * (neighbour_percent / 100.0) / 2.0 / pixel_size)


# ----------------------------------------------------------------------------------------------------------
# Templates


def particle_disc(size: int, radius_px: float, xp=np):
    """(size, size) bool: r^2 < R^2 around the box centre (logical origin size/2)."""
    c = xp.arange(size, dtype=np.float64) - size // 2
    return (c[:, None] ** 2 + c[None, :] ** 2) < radius_px**2


def auto_particle_diameter(refs: np.ndarray, pixel_size: float) -> float:
    """RELION's guess (Å): along each reference's central row, the span of pixels differing (> 1e-6) from
    the corner value; mean span x pixel size."""
    refs = np.asarray(refs, np.float64)
    row = refs[:, refs.shape[-2] // 2, :]
    diff = np.abs(row - refs[:, :1, 0]) > 1e-6
    widths = []
    for d in diff:  # one per reference (a handful): not a hot path
        idx = np.flatnonzero(d)
        widths.append(idx[-1] - idx[0] + 1 if idx.size else 0)
    return float(np.mean(widths)) * pixel_size


def dft_matrices(size: int, n: int, w: int, xp=np):
    """Exact DFT of a centred size x size box at the n-grid frequencies of the (w, w//2+1) half grid, as two
    matrices: FT = Ey @ b @ Ex.T / n^2 with Ey (w, size), Ex (w//2+1, size) complex128."""
    p = xp.arange(size, dtype=np.float64) - size // 2
    ky = signed_index(w, xp).astype(np.float64)
    kx = xp.arange(w // 2 + 1, dtype=np.float64)
    Ey = xp.exp(-2j * np.pi * ky[:, None] * p[None, :] / n)
    Ex = xp.exp(-2j * np.pi * kx[:, None] * p[None, :] / n)
    return Ey, Ex


def box_spectrum(b, n: int, w: int):
    """Spectrum (w, w//2+1) (1/n^2 normalised, n-grid frequencies) of a centred real box b (s, s), exactly,
    by two matrix products (no n x n FFT)."""
    xp = get_array_module(b)
    Ey, Ex = dft_matrices(b.shape[-1], n, w, xp)
    return ((Ey @ b.astype(np.complex128) @ Ex.T) / float(n * n)).astype(np.complex64)


@dataclass
class TemplateBank:
    """References ready for in-plane rotation: padded, gridding-corrected, centred FTs (unnormalised sums),
    (K, P, P//2+1) with P = pad x box; the references themselves (K, box, box) are kept for the ψ=0 terms."""

    data: object
    refs: object
    box: int
    pad: int

    @property
    def n_refs(self) -> int:
        return int(self.data.shape[0])


def prepare_templates(refs, pad: int = 2) -> TemplateBank:
    """(K, s, s) real templates (already masked/inverted) -> :class:`TemplateBank`. The gridding pre-correction
    divides by the bilinear kernel's transform sinc^2(x/P) sinc^2(y/P)."""
    xp = get_array_module(refs)
    K, s, _ = refs.shape
    P = pad * s
    c = (xp.arange(s, dtype=np.float64) - s // 2) / P
    g = xp.sinc(c) ** 2
    v = refs.astype(np.float64) / (g[:, None] * g[None, :])
    padded = xp.zeros((K, P, P), dtype=np.float64)
    lo = P // 2 - s // 2
    padded[:, lo:lo + s, lo:lo + s] = v
    fft, kw = _fft_module(xp)
    F = fft.rfft2(fft.ifftshift(padded, axes=(-2, -1)), axes=(-2, -1), **kw)  # unnormalised sums
    return TemplateBank(F.astype(np.complex64), refs, s, pad)


def rotation_matrices_2d(psi_deg, xp=np):
    """RELION's in-plane matrices A(0, 0, psi) (upper-left 2x2), (n, 2, 2)."""
    p = np.deg2rad(np.asarray(psi_deg, np.float64))
    c, s = np.cos(p), np.sin(p)
    return xp.asarray(np.stack([np.stack([c, s], -1), np.stack([-s, c], -1)], -2))


def template_pixels(w: int, r_max: float, xp=np):
    """Half-grid pixels of the w grid with |k| <= r_max (n-grid units): (ky, kx, flat index)."""
    return pixel_list(w, r_max, xp)


def rotated_templates(bank: TemplateBank, ref_idx, psi_deg, pixels, n: int, w: int):
    """Spectra (b, w, w//2+1) complex64 of references ``ref_idx`` (b,) rotated by ``psi_deg`` (b,) as seen on
    the n-grid frequencies of ``pixels`` (from :func:`template_pixels`, zero elsewhere), 1/n^2 normalised:
    bilinear interpolation of the padded FT at pad*A^T k*s/n (the 2D-classification rotation)."""
    xp = get_array_module(bank.data)
    ky, kx, flat = pixels
    P = bank.data.shape[-2]
    A = rotation_matrices_2d(psi_deg, xp).astype(np.float32)
    f = bank.box / n
    kxs = (kx * f).astype(np.float32)
    kys = (ky * f).astype(np.float32)
    q = bank.pad * (kxs[None, :, None] * A[:, None, 0, :] + kys[None, :, None] * A[:, None, 1, :])
    neg = q[..., 0] < 0
    q = xp.where(neg[..., None], -q, q)
    data = bank.data.reshape(bank.n_refs, -1)
    r = xp.asarray(ref_idx).astype(np.int64)[:, None]
    vals = None
    for idx, wgt, valid in _corner_indices(q, P):
        wv = wgt if valid is True else xp.where(valid, wgt, np.float32(0))
        v = data[r, idx] * wv
        vals = v if vals is None else vals + v
    vals = xp.where(neg, xp.conj(vals), vals) * np.float32(1.0 / (n * n))
    out = xp.zeros((q.shape[0], w * (w // 2 + 1)), dtype=np.complex64)
    out[:, flat] = vals
    return out.reshape(q.shape[0], w, w // 2 + 1)


def template_means(refs, disc, ctf_ps=None, lowpass_radius_ps: float | None = None):
    """RELION's per-reference averages at ψ=0 on the references' own grid: ā = Σ_disc A / (n_disc + 1),
    ā² = Σ_disc A² / (n_disc + 1), of the low-passed (|k| <= ``lowpass_radius_ps`` box pixels), CTF-multiplied
    (``ctf_ps`` on the (s, s//2+1) half grid) references. Returns (ā, ā²), each (K,)."""
    xp = get_array_module(refs)
    s = refs.shape[-1]
    F = rfft_centered(refs.astype(np.float64), 2)
    if lowpass_radius_ps is not None:
        F = xp.where(radius_grid(s, 2, xp) <= lowpass_radius_ps, F, 0)
    if ctf_ps is not None:
        F = F * ctf_ps
    a = irfft_centered(F, s, 2)
    nd = float(disc.sum()) + 1.0
    am = (a * disc).sum(axis=(-2, -1)) / nd
    a2 = (a * a * disc).sum(axis=(-2, -1)) / nd
    return am, a2


def local_background(X_w, X2_w, ring_w, n: int, n_ring: int):
    """Roseman local statistics under the ring around every pixel: mean μ and std σ (σ = 1 where σ² <= 1e-10),
    from spectra of x, x² (cropped, (w, w//2+1)) and of the centred ring mask."""
    xp = get_array_module(X_w)
    w = X_w.shape[-2]
    cr = xp.conj(ring_w)
    f = np.float32(n * n / n_ring)
    mu = inverse_on_grid(X_w * cr, w).astype(np.float32) * f
    m2 = inverse_on_grid(X2_w * cr, w).astype(np.float32) * f
    var = m2 - mu * mu
    sd = xp.where(var > 1e-10, xp.sqrt(xp.maximum(var, 1e-10)), np.float32(1.0))
    return mu, sd.astype(np.float32)


def template_correlation(X_w, T, n: int, n_disc: int):
    """C(r) = (1/n_disc) Σ_p A(p) x(r + p) for each template spectrum T (b, w, w//2+1): (b, w, w) float32."""
    w = X_w.shape[-2]
    xp = get_array_module(X_w)
    return inverse_on_grid(X_w[None] * xp.conj(T), w).astype(np.float32) * np.float32(n * n / n_disc)


def probability_ratio_fom(C, mu, sigma, a_mean, a2_mean):
    """RELION's FOM (P - 1)/(E - 1) with D = (-2C + 2 μ ā)/σ + ā², P = exp(-D/2) and the noiseless expected
    ratio E = exp(ā²/2) (RELION adds a random term to E; see pitfall 6). C (b, w, w); ā, ā² (b,)."""
    xp = get_array_module(C)
    am = xp.asarray(a_mean, dtype=np.float32)[:, None, None]
    a2 = xp.asarray(a2_mean, dtype=np.float32)[:, None, None]
    D = (-2.0 * C + 2.0 * mu[None] * am) / sigma[None] + a2
    e1 = xp.expm1(0.5 * a2)
    e1 = xp.where(xp.abs(e1) > 1e-30, e1, np.float32(1e-30))
    return (xp.expm1(xp.minimum(-0.5 * D, np.float32(80.0))) / e1).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------
# Matched filter (not RELION): whitened, CTF-weighted correlation in units of its noise standard deviation


def half_grid_weights(w: int, xp=np):
    """(w, w//2+1) multiplicity of each half-grid pixel in the full w x w spectrum: 1 on the kx = 0 and
    kx = w/2 columns, 2 elsewhere (so Σ_full |F|² = Σ_half weight |F|²)."""
    wt = xp.full((w, w // 2 + 1), 2.0, dtype=np.float32)
    wt[:, 0] = 1.0
    wt[:, -1] = 1.0
    return wt


def whitening_filter(F_w):
    """1/sqrt(P(|k|)) on the (w, w//2+1) half grid of a cropped micrograph spectrum, P the mean power of the
    spectrum in each shell ROUND(|k|) (n-grid units; at low SNR this is the noise spectrum, contamination
    included). DC is set to 0 (a constant carries no position). A matched filter needs noise of one power at
    every frequency: multiplying the micrograph by this filter whitens it."""
    xp = get_array_module(F_w)
    w = F_w.shape[-2]
    shell = round_half_away(radius_grid(w, 2, xp)).astype(np.int64).ravel()
    wt = half_grid_weights(w, xp).ravel().astype(np.float64)
    p = (xp.abs(F_w.reshape(-1)) ** 2).astype(np.float64)
    n_sh = int(shell.max()) + 1
    num = xp.bincount(shell, weights=wt * p, minlength=n_sh)
    den = xp.bincount(shell, weights=wt, minlength=n_sh)
    ps = num / xp.maximum(den, 1e-30)
    ps = xp.where(ps > 1e-30 * float(ps.max()), ps, float(ps.max()))
    f = (1.0 / xp.sqrt(ps))[shell].reshape(w, w // 2 + 1)
    f[0, 0] = 0.0
    return f.astype(np.float32)


def ring_on_grid(w: int, box_w: int, radius_w: float, xp=np):
    """Spectrum (w, w//2+1) (1/w² normalised) of the ring = a ``box_w`` square minus the disc of
    ``radius_w`` pixels, centred at the origin of a w x w grid, and its pixel count."""
    ring = ~particle_disc(box_w, radius_w, np)
    return box_spectrum(xp.asarray(ring, np.float64), w, w), int(ring.sum())


@dataclass
class WhitenedMicrograph:
    """A micrograph whitened and low-passed on the working grid: spectrum X (w, w//2+1), 1/w² normalised on
    the w grid; the whitening filter used (:func:`whitening_filter`, applied to the templates too); its global
    standard deviation; the local mean (mu) and standard deviation (sigma_rel) under the ring around every
    pixel, both in units of the global standard deviation ((w, w) each); ``n_band``, the number of frequencies
    of the full w x w spectrum the whitened micrograph keeps (its noise spreads sd² evenly over them)."""

    X: object
    filt: object
    sd: float
    mu: object
    sigma_rel: object
    n_band: float


def whiten_micrograph(F_w, ring_w, n_ring: int, lowpass_radius: float | None = None
                      ) -> WhitenedMicrograph:
    """Whiten a cropped micrograph spectrum (:func:`whitening_filter`), cut it at ``lowpass_radius`` (n-grid
    Fourier pixels, None = no cut) and measure its local statistics under the ring (``ring_w`` from
    :func:`ring_on_grid`)."""
    xp = get_array_module(F_w)
    w = F_w.shape[-2]
    filt = whitening_filter(F_w)
    Xw = F_w * filt
    kept = filt != 0
    if lowpass_radius is not None:
        kept &= radius_grid(w, 2, xp) <= lowpass_radius
        Xw = xp.where(kept, Xw, 0)
    n_band = float((half_grid_weights(w, xp) * kept).sum())
    x = inverse_on_grid(Xw, w).astype(np.float32)
    sd = float(xp.sqrt(xp.mean(x.astype(np.float64) ** 2)))
    sd = sd if sd > 0 else 1.0
    X2 = micrograph_spectrum(x * x)
    mu, sig = local_background(Xw.astype(np.complex64), X2, ring_w, w, n_ring)
    s = np.float32(1.0 / sd)
    return WhitenedMicrograph(Xw.astype(np.complex64), filt, sd, mu * s, sig * s, n_band)


def zscore_fom(Xw, T, filt, sd: float, n_band: float | None = None):
    """Matched-filter FOM for template spectra T (b, w, w//2+1) (n-grid frequencies, CTF applied) on a
    whitened micrograph Xw: the correlation of the whitened template with the whitened micrograph, divided by
    its standard deviation under noise, (sd / sqrt(n_band)) ||t||, so that on noise alone each map is N(0, 1) (a
    z-score). ``filt`` is the whitening filter (applied to the templates too); ``n_band`` the number of frequencies
    of the full w x w spectrum that Xw keeps (None: all, w²). A low-pass at the working grid's Nyquist keeps about
    pi/4 of them, on a grid twice as fine pi/16: dividing by w, the FOM of noise had standard deviation 1.13 and
    2.26 there (issue 48). Returns (b, w, w) float32."""
    xp = get_array_module(Xw)
    w = Xw.shape[-2]
    nb = float(w * w) if n_band is None else float(n_band)
    Tw = T * filt[None]
    norm2 = (half_grid_weights(w, xp)[None] * (Tw.real**2 + Tw.imag**2)).sum(axis=(-2, -1))
    norm = xp.sqrt(xp.maximum(norm2, 1e-30)).astype(np.float32)
    c = inverse_on_grid(Xw[None] * xp.conj(Tw), w).astype(np.float32)
    return c * (np.float32(np.sqrt(nb) / sd) / norm)[:, None, None]


def template_candidates(fom, sigma, mu, threshold: float, inside, max_stddev_noise: float = -1.0,
                        min_avg_noise: float = -999.0, scale: float = 1.0):
    """Candidate peaks of best-over-ψ FOM maps (K, w, w): FOM >= threshold inside ``inside``, local σ and μ
    limits, not smaller than any 4-neighbour (and, for scale >= 1, all 4 neighbours >= threshold).
    Returns host arrays (ref, row, col)."""
    xp = get_array_module(fom)
    ok = (fom >= threshold) & inside[None]
    if max_stddev_noise > 0:
        ok &= (sigma <= max_stddev_noise)[None]
    if min_avg_noise > -900:
        ok &= (mu >= min_avg_noise)[None]
    pad = xp.pad(fom, ((0, 0), (1, 1), (1, 1)), mode="constant", constant_values=-np.inf)
    nb = [pad[:, :-2, 1:-1], pad[:, 2:, 1:-1], pad[:, 1:-1, :-2], pad[:, 1:-1, 2:]]
    for v in nb:
        ok &= fom >= v
        if scale >= 1:
            ok &= v >= threshold
    k, y, x = xp.nonzero(ok)
    return to_host(k), to_host(y), to_host(x)


def greedy_nms_pairs(priority_order: np.ndarray, i: np.ndarray, j: np.ndarray, n: int) -> np.ndarray:
    """Greedy non-maximum suppression on a conflict graph, vectorised: visiting nodes from the highest
    priority down, keep a node unless a kept node conflicts with it. ``priority_order`` lists nodes from
    highest priority; (i, j) are undirected conflicts. Returns the kept mask (n,). Rounds: a node is kept once
    every higher-priority neighbour is removed, removed once one is kept (exactly the sequential result)."""
    rank = np.empty(n, np.int64)
    rank[priority_order] = np.arange(n)
    hi = np.where(rank[i] < rank[j], i, j)
    lo = np.where(rank[i] < rank[j], j, i)
    state = np.zeros(n, np.int8)  # 0 undecided, 1 kept, 2 removed
    while (state == 0).any():
        blocked = np.zeros(n, bool)
        blocked[lo[state[hi] != 2]] = True
        newly = (state == 0) & ~blocked
        state[newly] = 1
        killed = lo[state[hi] == 1]
        state[killed[state[killed] == 0]] = 2
    return state == 1


def prune_peaks(xy: np.ndarray, fom: np.ndarray, link_radius: float, min_distance: float) -> np.ndarray:
    """RELION's cluster pruning (host): single-linkage clusters with squared distance < link_radius^2; in each
    cluster keep the highest FOM (first on ties) and drop members at squared distance < min_distance^2 of a
    kept peak, greedily. An infinite ``link_radius`` makes one cluster: plain greedy non-maximum suppression.
    Returns the kept mask."""
    from scipy.sparse.csgraph import connected_components  # noqa: PLC0415
    from scipy.spatial import cKDTree  # noqa: PLC0415

    n = len(xy)
    if n == 0:
        return np.zeros(0, bool)
    tree = cKDTree(xy)
    if np.isfinite(link_radius):
        link = tree.query_pairs(np.nextafter(link_radius, 0), output_type="ndarray") if link_radius > 0 else \
            np.zeros((0, 2), np.int64)
        g = coo_matrix((np.ones(len(link)), (link[:, 0], link[:, 1])), shape=(n, n))
        _, label = connected_components(g, directed=False)
    else:
        label = np.zeros(n, np.int64)
    pairs = tree.query_pairs(np.nextafter(min_distance, 0), output_type="ndarray") if min_distance > 0 else \
        np.zeros((0, 2), np.int64)
    same = label[pairs[:, 0]] == label[pairs[:, 1]] if len(pairs) else np.zeros(0, bool)
    pairs = pairs[same]
    order = np.lexsort((np.arange(n), -fom))
    return greedy_nms_pairs(order, pairs[:, 0], pairs[:, 1], n)


@dataclass
class TemplateMaps:
    """Per-reference best-over-ψ FOM maps (K, w, w), the ψ index giving each, and the local mean/std maps."""

    fom: object
    psi_index: object
    mu: object
    sigma: object


def template_fom_maps(X_w, X2_w, bank: TemplateBank, psi_deg, pixels, ring_w, n_ring: int, n_disc: int,
                      a_mean, a2_mean, n: int, ctf_w=None, batch: int = 64, cache: dict | None = None
                      ) -> TemplateMaps:
    """RELION's template FOM for one micrograph: for every reference, the best FOM over the in-plane angles
    ``psi_deg`` (strictly greater replaces) and its ψ index. Work goes in batches of ``batch`` (reference, ψ)
    pairs, all ψ of a reference in one batch when they fit; ``cache`` (a dict, optional) keeps the rotated
    template spectra between micrographs of the same grid (they do not depend on the micrograph)."""
    xp = get_array_module(X_w)
    w = X_w.shape[-2]
    K = bank.n_refs
    psi = np.asarray(psi_deg, np.float64)
    mu, sd = local_background(X_w, X2_w, ring_w, n, n_ring)
    best = xp.full((K, w, w), -np.inf, dtype=np.float32)
    which = xp.zeros((K, w, w), dtype=np.int16)
    am = np.asarray(to_host(a_mean), np.float64)
    a2 = np.asarray(to_host(a2_mean), np.float64)
    for kk, pp, T in _template_batches(bank, psi, pixels, n, w, batch, cache, ctf_w):
        C = template_correlation(X_w, T, n, n_disc)
        _keep_best(best, which, probability_ratio_fom(C, mu, sd, am[kk], a2[kk]), kk, pp)
        del C
    return TemplateMaps(best, which, mu, sd)


def _template_batches(bank, psi: np.ndarray, pixels, n: int, w: int, batch: int, cache: dict | None, ctf_w):
    """(reference indices, ψ indices, rotated templates (b, w, w) times ``ctf_w``) for every (reference, ψ)
    pair, ``batch`` pairs at a time, a reference's ψ contiguous; the rotated templates are taken from / kept in
    ``cache`` (they do not depend on the micrograph)."""
    K, n_psi = bank.n_refs, psi.size
    pairs_k = np.repeat(np.arange(K), n_psi)
    pairs_p = np.tile(np.arange(n_psi), K)
    b = max(1, int(batch))
    for i0 in range(0, K * n_psi, b):
        kk, pp = pairs_k[i0:i0 + b], pairs_p[i0:i0 + b]
        key = (i0, b, w, n)
        T = None if cache is None else cache.get(key)
        if T is None:
            T = rotated_templates(bank, kk, psi[pp], pixels, n, w)
            if cache is not None:
                cache[key] = T
        yield kk, pp, (T if ctf_w is None else T * ctf_w[None])


def _keep_best(best, which, fom, kk: np.ndarray, pp: np.ndarray) -> None:
    """Running best per reference over its ψ, in place: ``fom`` (b, w, w) of the (reference ``kk``, ψ index
    ``pp``) pairs of one batch (a reference's ψ contiguous); strictly greater replaces, the first ψ wins ties."""
    xp = get_array_module(fom)
    for k in np.unique(kk):  # the few references of this batch
        sel = np.flatnonzero(kk == k)
        f = fom[sel[0]:sel[-1] + 1]
        j = xp.argmax(f, axis=0)
        v = xp.take_along_axis(f, j[None], axis=0)[0]
        better = v > best[k]
        best[k] = xp.where(better, v, best[k])
        which[k] = xp.where(better, (j + int(pp[sel[0]])).astype(np.int16), which[k])


def template_zscore_maps(mic: WhitenedMicrograph, bank: TemplateBank, psi_deg, pixels, n: int,
                         ctf_w=None, local_sigma: bool = True, batch: int = 64, cache: dict | None = None
                         ) -> TemplateMaps:
    """Matched-filter FOM maps (:func:`zscore_fom`) of one whitened micrograph: per reference the best z over
    the in-plane angles and its ψ index; with ``local_sigma`` each z is divided by the local standard deviation
    under the ring (relative to the global one; RELION's local normalisation, which damps edges of
    contamination). Batching and ``cache`` as in :func:`template_fom_maps`. The returned sigma is that relative
    local standard deviation."""
    xp = get_array_module(mic.X)
    w = mic.X.shape[-2]
    K = bank.n_refs
    psi = np.asarray(psi_deg, np.float64)
    best = xp.full((K, w, w), -np.inf, dtype=np.float32)
    which = xp.zeros((K, w, w), dtype=np.int16)
    inv_sig = (np.float32(1.0) / mic.sigma_rel) if local_sigma else None
    for kk, pp, T in _template_batches(bank, psi, pixels, n, w, batch, cache, ctf_w):
        z = zscore_fom(mic.X, T, mic.filt, mic.sd, mic.n_band)
        if inv_sig is not None:
            z *= inv_sig[None]
        _keep_best(best, which, z, kk, pp)
        del z
    return TemplateMaps(best, which, mic.mu, mic.sigma_rel)


def template_picks(maps: TemplateMaps, inside, threshold: float, link_radius: float, min_distance: float,
                   max_stddev_noise: float = -1.0, min_avg_noise: float = -999.0, scale: float = 1.0
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """RELION's template peak search (pixels of the maps' grid): candidates per reference, cluster pruning per
    reference then over the union, then a last greedy pass over all clusters: of two picks closer than
    ``min_distance`` the stronger stays (RELION's GUI: "from each cluster, only one particle will be picked").
    ``scale``: RELION's working scale W/n, which picks the candidate rule (:func:`template_candidates`). Returns
    host arrays (rows, cols, fom, reference index, ψ index), by decreasing FOM.

    RELION's last filter instead drops both members of every pair at distance <= min_distance: a particle went
    with any weaker peak next to it, in another cluster (link_radius < distance < min_distance) or exactly
    min_distance away in its own (the pruning keeps those: common on the grid's integer offsets, e.g. (12, 16) for
    20 pixels). With --threshold -999 that removed 40 of the 55 never-picked particles of
    benchmarks/picking_recall.py (3 SNRs, 2 references, 89 particles each; issue 48), every one with a partner
    exactly min_distance away, and whether a particle was picked depended on peaks far below the threshold. Here a
    peak goes only for a stronger one, so (up to RELION's clusters) the picks at threshold t are those at -999 with
    FOM >= t."""
    xp = get_array_module(maps.fom)
    k, y, x = template_candidates(maps.fom, maps.sigma, maps.mu, threshold, inside, max_stddev_noise,
                                  min_avg_noise, scale)
    if k.size == 0:
        e = np.zeros(0, np.int64)
        return e, e, np.zeros(0), e, e
    ki, yi, xi = (xp.asarray(a) for a in (k, y, x))
    fom = np.asarray(to_host(maps.fom[ki, yi, xi]), np.float64)
    psi_i = np.asarray(to_host(maps.psi_index[ki, yi, xi]), np.int64)
    xy = np.stack([x, y], 1).astype(np.float64)
    keep = np.zeros(k.size, bool)
    for r in np.unique(k):  # per reference (a handful to a few hundred): not per pixel
        sel = np.flatnonzero(k == r)
        keep[sel] = prune_peaks(xy[sel], fom[sel], link_radius, min_distance)
    idx = np.flatnonzero(keep)
    idx = idx[prune_peaks(xy[idx], fom[idx], link_radius, min_distance)]
    idx = idx[prune_peaks(xy[idx], fom[idx], np.inf, min_distance)]
    idx = idx[np.lexsort((idx, -fom[idx]))]
    return y[idx].astype(np.int64), x[idx].astype(np.int64), fom[idx], k[idx].astype(np.int64), psi_i[idx]

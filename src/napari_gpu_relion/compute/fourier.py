"""RELION's Fourier conventions, in one place.

- Forward FFT divided by the number of real-space elements; inverse unnormalised (``norm="forward"``).
- The real-space origin is the box centre (index N/2); transforms are of ``ifftshift(x)`` (RELION's
  CenterFFTbySign), which needs even boxes.
- Half-complex layout: last axis kx = 0..N/2; other axes in FFT order with index i <-> i if i <= N/2 else
  i - N, so the Nyquist row is +N/2 (RELION's loop convention, not NumPy's fftfreq).
- Shell index = ROUND(|k|), round half away from zero.

Functions take NumPy or CuPy arrays and return the same kind. Image batches are (..., N, N), volumes
(..., N, N, N); ``ndim`` says how many trailing axes are spatial.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .backend import get_array_module
from .memory_model import SLAB_BYTES


def _fft_module(xp):
    if xp is np:
        import scipy.fft as sfft  # noqa: PLC0415

        return sfft, {"workers": -1}
    return xp.fft, {}


@contextmanager
def uncached_fft_plans(xp):
    """On CuPy, no cuFFT plan is kept in CuPy's plan cache inside this context: each plan and its work area are
    freed after its transform. For the few transforms of whole large grids (post-processing a 1024^3 box), where
    every cached plan would hold a work area about the size of the grid. Nothing on NumPy."""
    if xp is np:
        yield
        return
    cache = xp.fft.config.get_plan_cache()
    size = cache.get_size()
    cache.set_size(0)  # disables (and empties) the cache
    try:
        yield
    finally:
        cache.set_size(size)


def check_even(n: int, what: str = "box size") -> None:
    if n % 2:
        raise ValueError(f"{what} must be even for RELION's centred FFT convention, got {n}")


def rfft_centered(x, ndim: int = 2):
    """RELION forward transform of the last ``ndim`` axes: FT of the centred map, divided by the element count.

    Returns complex64 for float32 input (complex128 for float64)."""
    xp = get_array_module(x)
    for n in x.shape[-ndim:]:
        check_even(n)
    fft, kw = _fft_module(xp)
    axes = tuple(range(-ndim, 0))
    return fft.rfftn(fft.ifftshift(x, axes=axes), axes=axes, norm="forward", **kw)


def irfft_centered(F, size: int, ndim: int = 2):
    """Inverse of :func:`rfft_centered` for a cubic/square box of edge ``size`` (unnormalised inverse)."""
    xp = get_array_module(F)
    fft, kw = _fft_module(xp)
    axes = tuple(range(-ndim, 0))
    x = fft.irfftn(F, s=(size,) * ndim, axes=axes, norm="forward", **kw)
    return fft.fftshift(x, axes=axes)


def signed_index(n: int, xp=np):
    """Signed Fourier index of each row of an n-point FFT axis, with +n/2 for the Nyquist row."""
    i = xp.arange(n)
    return xp.where(i <= n // 2, i, i - n)


def half_grid_indices(size: int, ndim: int = 2, xp=np):
    """Integer frequency components of the (size,)*(ndim-1) + (size//2+1,) half grid, ordered (kz,) ky, kx,
    each broadcastable to the grid shape."""
    s = signed_index(size, xp)
    kx = xp.arange(size // 2 + 1)
    if ndim == 2:
        return s[:, None], kx[None, :]
    if ndim == 3:
        return s[:, None, None], s[None, :, None], kx[None, None, :]
    raise ValueError("ndim must be 2 or 3")



def half_grid_slabs(size: int, ndim: int = 3, xp=np, bytes_per_voxel: int = 64):
    """The half grid of edge ``size`` in slabs of rows of its first axis: (slice of those rows, their frequency
    components as half_grid_indices gives them), each slab about SLAB_BYTES of temporaries at
    ``bytes_per_voxel``. For functions over a whole padded grid that must not make grid-sized temporaries."""
    ks = half_grid_indices(size, ndim, xp)
    row = size ** (ndim - 2) * (size // 2 + 1)
    step = int(max(1, min(size, SLAB_BYTES // (row * bytes_per_voxel))))
    for a in range(0, size, step):
        b = min(size, a + step)
        yield slice(a, b), (ks[0][a:b],) + tuple(ks[1:])


def half_grid_box_slabs(size: int, radius: float, ndim: int = 3, xp=np, bytes_per_voxel: int = 64):
    """As half_grid_slabs, over only the voxels whose every frequency component is at most ``radius`` in size
    (the box around the sphere of that radius): (index, frequency components) with ``grid[index]`` a copy of
    those voxels. For read-only sums over a sphere much smaller than the grid (the padded grids of auto-refine's
    early iterations: 15x fewer voxels at box 256 and image size 100)."""
    R = int(np.floor(radius))
    if 2 * R + 1 >= size:
        yield from half_grid_slabs(size, ndim, xp, bytes_per_voxel)
        return
    rows = np.concatenate([np.arange(R + 1), np.arange(size - R, size)])  # signed components -R..R
    s = signed_index(size, np)
    kx = xp.arange(R + 1)
    if ndim == 2:
        inner = (slice(0, R + 1),)
        comps = (kx[None, :],)
    else:
        ky_rows = xp.asarray(rows)
        inner = (ky_rows[:, None], xp.arange(R + 1)[None, :])
        comps = (xp.asarray(s[rows])[None, :, None], kx[None, None, :])
    row = (rows.size if ndim == 3 else 1) * (R + 1)
    step = int(max(1, min(rows.size, SLAB_BYTES // (row * bytes_per_voxel))))
    for part in (rows[: R + 1], rows[R + 1:]):  # two runs of consecutive rows: 0..R and size-R..size-1
        for a in range(0, part.size, step):
            r = part[a:a + step]
            first = slice(int(r[0]), int(r[-1]) + 1)
            kz = xp.asarray(s[first]).reshape((-1,) + (1,) * (ndim - 1))
            yield (first,) + inner, (kz,) + comps


def round_half_away(x):
    """ROUND as RELION does: half away from zero (numpy's round is half-to-even)."""
    xp = get_array_module(x)
    return xp.sign(x) * xp.floor(xp.abs(x) + 0.5)


def radius_grid(size: int, ndim: int = 2, xp=np, dtype=np.float64):
    """|k| on the half grid (Fourier pixels)."""
    ks = half_grid_indices(size, ndim, xp)
    r2 = sum(k.astype(dtype) ** 2 for k in ks)
    return xp.sqrt(r2)


def shell_grid(size: int, ndim: int = 2, xp=np):
    """Shell index ROUND(|k|) on the half grid (int32)."""
    return round_half_away(radius_grid(size, ndim, xp)).astype(np.int32)


def hermitian_unique_mask(size: int, ndim: int = 2, xp=np):
    """True for half-grid elements that are not Hermitian duplicates: drops (kx=0, ky<0) (and, in 3D, the
    kx=0, ky=0, kz<0 line). Matches RELION's exclusion of the redundant half of the kx=0 column/plane."""
    if ndim == 2:
        ky, kx = half_grid_indices(size, 2, xp)
        return ~((kx == 0) & (ky < 0))
    kz, ky, kx = half_grid_indices(size, 3, xp)
    return ~((kx == 0) & ((ky < 0) | ((ky == 0) & (kz < 0))))


def shell_sum(values, shells, nshells: int):
    """Sum of ``values`` (..., grid) per shell 0..nshells-1 over the grid axes (shells outside are dropped);
    ``values`` None counts the grid points per shell.

    ``values`` may carry leading batch axes; ``shells`` has the grid's shape. On the GPU: block-local float64
    histograms (gpu_kernels.binned_sum), not CuPy's bincount, whose float64 atomic adds into ~100 bins serialise
    (116 ms of an H200's 3D-classification iteration); on the CPU NumPy's bincount."""
    from . import gpu_kernels  # noqa: PLC0415 - imports no CuPy

    xp = get_array_module(shells if values is None else values)
    lead = () if values is None else values.shape[: values.ndim - shells.ndim]
    if shells.size == 0:
        return xp.zeros(lead + (nshells,))
    if (xp is not np and nshells <= gpu_kernels.BINNED_SUM_MAX_BINS
            and gpu_kernels.binned_sum_applies(shells, values)):
        w = None if values is None else values.reshape((-1, shells.size))
        return gpu_kernels.binned_sum(shells, w, nshells).reshape(lead + (nshells,))
    if values is None:
        values = xp.ones(shells.shape, dtype=np.float64)
    flat_s = shells.reshape(-1)
    ok = (flat_s >= 0) & (flat_s < nshells)
    v = values.reshape(lead + (-1,))[..., ok]
    idx = flat_s[ok]
    if v.ndim == 1:
        return xp.bincount(idx, weights=v, minlength=nshells)[:nshells]
    # batch dims: one scatter over a flattened (batch, shell) index
    nb = int(np.prod(v.shape[:-1]))
    v2 = v.reshape(nb, -1)
    full = (xp.arange(nb)[:, None] * nshells + idx[None, :]).reshape(-1)
    return xp.bincount(full, weights=v2.reshape(-1), minlength=nb * nshells).reshape(v.shape[:-1] + (nshells,))


def shell_count(shells, nshells: int):
    """The number of grid points per shell 0..nshells-1 (float64)."""
    return shell_sum(None, shells, nshells)


def radial_average(values, size: int, ndim: int = 2, unique_only: bool = True):
    """Mean of ``values`` on the half grid per shell 0..size/2 (Hermitian duplicates excluded by default)."""
    xp = get_array_module(values)
    shells = shell_grid(size, ndim, xp)
    if unique_only:
        shells = xp.where(hermitian_unique_mask(size, ndim, xp), shells, -1)
    n = size // 2 + 1
    s = shell_sum(values, shells, n)
    c = shell_count(shells, n)
    return s / xp.maximum(c, 1)


def window_fourier(F, new_size: int, ndim: int = 2):
    """RELION's windowFourierTransform: crop or zero-pad a half-grid FT of an (N,)*ndim box to ``new_size``,
    keeping logical indices. Cropping keeps rows {0..W/2} U {-W/2+1..-1} (the +W/2 row comes from the input);
    padding copies every element with |k|^2 <= (N/2)^2. With forward-normalised FFTs this preserves
    real-space grey values (mean-preserving resampling)."""
    xp = get_array_module(F)
    N = F.shape[-2]
    W = int(new_size)
    check_even(W, "new box size")
    if W == N:
        return F.copy()
    lead = F.shape[: F.ndim - ndim]
    out = xp.zeros(lead + (W,) * (ndim - 1) + (W // 2 + 1,), dtype=F.dtype)
    if W < N:
        rows = signed_index(W, xp) % N  # logical -> input row
        if ndim == 2:
            out[...] = F[..., rows[:, None], xp.arange(W // 2 + 1)[None, :]]
        else:
            out[...] = F[..., rows[:, None, None], rows[None, :, None], xp.arange(W // 2 + 1)[None, None, :]]
        return out
    # padding: copy the input's logical indices within radius N/2
    rows_in = signed_index(N, xp)
    dst = rows_in % W
    keep = radius_grid(N, ndim, xp) ** 2 <= (N / 2) ** 2
    src = xp.where(keep, F, 0)
    if ndim == 2:
        out[..., dst[:, None], xp.arange(N // 2 + 1)[None, :]] = src
    else:
        out[..., dst[:, None, None], dst[None, :, None], xp.arange(N // 2 + 1)[None, None, :]] = src
    return out


def fourier_resize(x, new_size: int, ndim: int = 2):
    """Resample real-space boxes to ``new_size`` by Fourier cropping/padding (RELION's rescale)."""
    return irfft_centered(window_fourier(rfft_centered(x, ndim), new_size, ndim), new_size, ndim)


def phase_shift_2d(F, shifts, size: int):
    """Translate the content of 2D half-grid FTs by ``shifts`` (n, 2) = (x, y) pixels:
    X_t(k) = X(k) exp(-2 pi i k.t / N) (RELION's sign: content moves by +t). F is (n, s, s//2+1), the
    FT of a box of ``size`` N (s may be a window of it)."""
    xp = get_array_module(F)
    s = F.shape[-2]
    ky, kx = half_grid_indices(s, 2, xp)
    t = xp.asarray(shifts, dtype=np.float64)
    phase = (-2.0 * np.pi / size) * (kx[None] * t[:, 0, None, None] + ky[None] * t[:, 1, None, None])
    return F * xp.exp(1j * phase).astype(F.dtype)


def raised_cosine(r, cutoff_shell: float, width_shells: float = 2.0):
    """The raised-cosine low-pass at radii ``r`` (Fourier pixels): 1 below cutoff - width/2, 0 above
    cutoff + width/2, the 0.5 point at ``cutoff_shell`` (RELION's WIDTH_FMASK_EDGE filter)."""
    xp = get_array_module(r)
    lo = cutoff_shell - width_shells / 2.0
    hi = cutoff_shell + width_shells / 2.0
    f = 0.5 + 0.5 * xp.cos(np.pi * (r - lo) / max(width_shells, 1e-9))
    return xp.where(r < lo, 1.0, xp.where(r > hi, 0.0, f))


def lowpass_raised_cosine(size: int, cutoff_shell: float, width_shells: float = 2.0, ndim: int = 3, xp=np):
    """:func:`raised_cosine` on the half grid (ini_high, low-pass and mask edges)."""
    return raised_cosine(radius_grid(size, ndim, xp), cutoff_shell, width_shells)


def lowpass_map(vol, pixel_size: float, resolution_A: float, width_shells: float = 2.0, ndim: int = 3):
    """Low-pass a map (or image batch with ndim=2) at ``resolution_A`` with a raised-cosine edge."""
    xp = get_array_module(vol)
    N = vol.shape[-1]
    F = rfft_centered(vol, ndim)
    filt = lowpass_raised_cosine(N, N * pixel_size / resolution_A, width_shells, ndim, xp)
    return irfft_centered(F * filt.astype(F.real.dtype), N, ndim).astype(vol.dtype)


def real_radius_grid(size: int, ndim: int = 3, xp=np):
    """Distance (pixels) of each voxel from the box centre (index N/2)."""
    c = xp.arange(size) - size // 2
    if ndim == 2:
        return xp.sqrt(c[:, None] ** 2 + c[None, :] ** 2)
    return xp.sqrt(c[:, None, None] ** 2 + c[None, :, None] ** 2 + c[None, None, :] ** 2)

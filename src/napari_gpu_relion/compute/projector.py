"""Padded Fourier references and batched central-slice extraction (relion_algorithm.md 5.1, 5.2).

The padded reference is stored as the half-complex FT of the (pf N)^ndim zero-padded map in FFT layout
(z, y wrap around; x = 0..pf N/2), scaled so that a slice equals the FT of the *projection* in the images'
1/N^2 normalisation. A slice at orientation A samples V(pf A^T k) for image frequencies k = (kx, ky);
points with a negative x component are read from their Hermitian mate (negated, conjugated).
Everything is vectorised over (orientations x pixels); work is chunked to bound memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import gpu_kernels, memory_model
from .backend import get_array_module
from .fourier import _fft_module, half_grid_indices, real_radius_grid, rfft_centered
from .host_threads import for_each


def sinc2_gridding(size: int, pad: int, ndim: int = 3, xp=np):
    """sinc^2(|x| / (pf N)) on the real-space box (the trilinear kernel's transform), for gridding
    pre-/post-correction."""
    r = real_radius_grid(size, ndim, xp) / (pad * size)
    s = xp.sinc(r)  # numpy/cupy sinc(u) = sin(pi u)/(pi u)
    return s * s


@dataclass
class FourierReference:
    """A map ready for slicing: padded half-grid FT and its geometry (sizes in pixels)."""

    data: object  # complex array (P, P, P//2+1) for 3D or (P, P//2+1) for 2D, P = pad * size; (K, ...) if stacked
    size: int  # original box N
    pad: int  # padding factor pf
    r_max: float  # largest |k| (Fourier pixels of the N box) kept
    stacked: bool = False  # data holds K references along a leading axis (stack_references)

    @property
    def ndim(self) -> int:
        return self.data.ndim - int(self.stacked)

    @property
    def padded_size(self) -> int:
        return self.data.shape[-2]

    @property
    def n_stacked(self) -> int:
        return self.data.shape[0] if self.stacked else 1


def stack_references(refs: list[FourierReference]) -> FourierReference:
    """K references of one geometry as one stacked reference, so that one ``project_pixels(..., index=)`` call
    projects rows of any class (the E-step's class-major rows without a loop over classes). Each ref's
    ``data`` becomes a view into the stack, so the K grids are held once."""
    first = refs[0]
    if any(r.data.shape != first.data.shape or r.pad != first.pad or r.size != first.size for r in refs):
        raise ValueError("stacked references need one box, padding and grid")
    xp = get_array_module(first.data)
    stack = xp.stack([r.data for r in refs])
    for k, r in enumerate(refs):
        r.data = stack[k]
    return FourierReference(stack, first.size, first.pad, max(r.r_max for r in refs), stacked=True)


def prepare_references(vols, pad: int = 2, r_max: float | None = None, max_bytes: int = memory_model.SLAB_BYTES,
                       to_device=None) -> list[FourierReference]:
    """prepare_reference of each map of ``vols`` ((K, N, N) images or (K, N, N, N) maps, or a list of them), each
    moved to the device by ``to_device`` (none: as they are) only when its turn comes. 2D images are prepared in
    batches of about ``max_bytes`` of transients (48 bytes per padded pixel, measured: the float64 padded images,
    their complex128 transforms and the mask's result): one upload and a few batched FFTs instead of K of each
    (class2d's 200 references at box 360 took 0.53 s of an iteration on an H200 one at a time, thirty-fourth
    session); each reference's data is a view into its batch. 3D maps one by one (each already works in slabs)."""
    move = (lambda a: a) if to_device is None else to_device
    if len(vols) == 0:
        return []
    if vols[0].ndim != 2:
        return [prepare_reference(move(v), pad, r_max, max_bytes=max_bytes) for v in vols]
    N = vols[0].shape[-1]
    if any(tuple(v.shape) != (N, N) for v in vols):
        raise ValueError(f"2D references must be square images of one size, got {[tuple(v.shape) for v in vols]}")
    P = pad * N
    rmax = N / 2 if r_max is None else float(r_max)
    step = int(max(1, max_bytes // (P * P * 48)))
    lo = P // 2 - N // 2  # where the image sits in the padded box
    out: list[FourierReference] = []
    keep = grid = None
    for a in range(0, len(vols), step):
        part = vols[a:a + step]
        v = move(part if not isinstance(part, list) else get_array_module(part[0]).stack(part))
        xp = get_array_module(v)
        if keep is None:
            ky, kx = half_grid_indices(P, 2, xp)
            keep = ky.astype(np.float64) ** 2 + kx.astype(np.float64) ** 2 <= (pad * rmax) ** 2
            grid = sinc2_gridding(N, pad, 2, xp)
        padded = xp.zeros((v.shape[0], P, P), dtype=np.float64)
        padded[:, lo:lo + N, lo:lo + N] = xp.asarray(v, dtype=np.float64) / grid
        F = (xp.where(keep, rfft_centered(padded, 2), 0) * pad**2).astype(np.complex64)
        out += [FourierReference(F[k], N, pad, rmax) for k in range(F.shape[0])]
    return out


def prepare_reference(vol, pad: int = 2, r_max: float | None = None, gridding: bool = True,
                      max_bytes: int = memory_model.SLAB_BYTES) -> FourierReference:
    """Real-space map (N,)*ndim (3D map or 2D image) -> padded Fourier reference.

    Steps (RELION computeFourierTransformMap): divide by sinc^2 (gridding pre-correction), zero-pad centred
    to pf N, forward FFT / (pf N)^ndim with centred phases, keep |q| <= pf r_max, multiply by pf^3 N (3D:
    slices then equal projection FTs in image normalisation) or pf^2 (2D references).

    3D maps are transformed one axis at a time in slabs of about ``max_bytes`` (x, keeping only the columns
    within pf r_max, then y, then z), so the padded box is never formed: the transient is a few bytes per
    padded voxel instead of ~60 (memory_plan.PREPARE_BYTES_PER_VOXEL), what a 1024 box needs."""
    xp = get_array_module(vol)
    ndim = vol.ndim
    N = vol.shape[-1]
    if any(n != N for n in vol.shape):
        raise ValueError(f"reference must be a square/cubic box, got shape {vol.shape}")
    P = pad * N
    rmax = N / 2 if r_max is None else float(r_max)
    scale = pad**3 * N if ndim == 3 else pad**2
    if ndim == 2:  # small: the whole padded image
        v = vol.astype(np.float64)
        if gridding:
            v = v / sinc2_gridding(N, pad, ndim, xp)
        padded = xp.zeros((P, P), dtype=np.float64)
        lo = P // 2 - N // 2
        padded[lo:lo + N, lo:lo + N] = v
        F = rfft_centered(padded, 2)
        ky, kx = half_grid_indices(P, 2, xp)
        F = xp.where(ky.astype(np.float64) ** 2 + kx.astype(np.float64) ** 2 <= (pad * rmax) ** 2, F, 0)
        return FourierReference((F * scale).astype(np.complex64), N, pad, rmax)
    fft, kw = _fft_module(xp)
    H = P // 2 + 1
    Hk = int(min(H, np.floor(pad * rmax) + 1))  # x columns that can be within pf r_max
    at = (xp.arange(N) - N // 2) % P  # where the centred box's rows sit on a padded axis, in the FFT's order
    rows = int(max(1, min(N, max_bytes // (N * P * 24))))
    c = (xp.arange(N) - N // 2).astype(np.float64)
    S1 = xp.empty((N, N, Hk), dtype=np.complex128)  # x transformed
    for a in range(0, N, rows):
        b = min(N, a + rows)
        line = xp.zeros((b - a, N, P))
        line[..., at] = vol[a:b]
        if gridding:  # sinc2_gridding of these rows
            s = xp.sinc(xp.sqrt(c[a:b, None, None] ** 2 + c[None, :, None] ** 2 + c[None, None, :] ** 2) / P)
            line[..., at] /= s * s
        S1[a:b] = fft.rfft(line, axis=2, norm="forward", **kw)[..., :Hk]
    S2 = xp.empty((N, P, Hk), dtype=np.complex128)  # y transformed
    for a in range(0, N, rows):
        b = min(N, a + rows)
        line = xp.zeros((b - a, P, Hk), dtype=np.complex128)
        line[:, at] = S1[a:b]
        S2[a:b] = fft.fft(line, axis=1, norm="forward", **kw)
    del S1
    out = xp.zeros((P, P, H), dtype=np.complex64)
    kz, ky, kx = (k.astype(np.float64) for k in half_grid_indices(P, 3, xp))
    cols = int(max(1, min(P, max_bytes // (P * Hk * 48))))
    for a in range(0, P, cols):  # z transformed, per slab of y rows; the sphere |q| <= pf r_max kept
        b = min(P, a + cols)
        line = xp.zeros((P, b - a, Hk), dtype=np.complex128)
        line[at] = S2[:, a:b]
        F = fft.fft(line, axis=0, norm="forward", **kw)
        keep = kz**2 + ky[:, a:b] ** 2 + kx[..., :Hk] ** 2 <= (pad * rmax) ** 2
        out[:, a:b, :Hk] = xp.where(keep, F * scale, 0)
    return FourierReference(out, N, pad, rmax)


def _corner_indices(q, P: int):
    """Trilinear (or bilinear) corners of points q (..., d) with q_x >= 0 on a half grid of edge P.

    Returns a list of (flat_index, weight, valid) per corner. Axis order of q: (x, y[, z]); the array is
    indexed [z, y, x]. The per-axis indices and weights are made once (2 per axis) and combined per corner."""
    xp = get_array_module(q)
    d = q.shape[-1]
    nx = P // 2 + 1
    itype = np.int32 if nx * P ** (d - 1) < 2**31 else np.int64
    f0 = xp.floor(q)
    frac = (q - f0).astype(np.float32)
    i0 = f0.astype(itype)
    axes = []  # per axis: ((index * stride, weight) for b = 0, 1)
    stride = 1
    valid = None
    for a in range(d):
        ia = i0[..., a]
        fa = frac[..., a]
        if a == 0:
            valid = ia + 1 < nx  # the upper x corner beyond the half grid carries no weight
            lo, hi = ia, xp.minimum(ia + 1, nx - 1)
            stride_next = nx
        else:
            lo, hi = ia % P, (ia + 1) % P
            stride_next = stride * P
        axes.append(((lo * stride, 1.0 - fa), (hi * stride, fa)))
        stride = stride_next
    corners = []
    for bits in range(1 << d):
        idx, w = axes[0][bits & 1]
        for a in range(1, d):
            ia, wa = axes[a][(bits >> a) & 1]
            idx = idx + ia
            w = w * wa
        corners.append((idx, w, valid if bits & 1 else True))
    return corners


def rotated_frequencies(A, kx, ky, pad: int):
    """q = pad * A^T (kx, ky, 0) for each orientation: (R, Npix, d) with d = A's size (2 or 3)."""
    xp = get_array_module(A)
    kx = xp.asarray(kx, dtype=A.dtype)
    ky = xp.asarray(ky, dtype=A.dtype)
    return pad * (kx[None, :, None] * A[:, None, 0, :] + ky[None, :, None] * A[:, None, 1, :])


def squared_radius(q):
    """|q|^2 over the last axis (2 or 3 coordinates) summed in a fixed order, ((q0^2 + q1^2) + q2^2), as the fused
    kernels sum it: a reduction (``(q * q).sum(-1)``) adds in an order that depends on the library (CuPy's own
    reductions, CUB's, NumPy's), and a point on the r_max sphere then falls inside on one and outside on another:
    a whole value apart (the GPU tests of the fused kernels failed so once CuPy's reductions ran without CUB)."""
    r2 = q[..., 0] * q[..., 0]
    for c in range(1, q.shape[-1]):
        r2 = r2 + q[..., c] * q[..., c]
    return r2


def within_radius(q, r2_max: float):
    """Whether |q|^2 (squared_radius's order) <= ``r2_max``, compared in the coordinates' type (float32 q: float32,
    as the fused kernels compare); no temporary outlives the call."""
    r2 = squared_radius(q)
    return r2 <= r2.dtype.type(r2_max)


def stack_offsets(index, grid_size: int, total_size: int, xp):
    """Flat offsets index * grid_size of the grids of a stack, shaped (R, 1) to broadcast over pixels."""
    itype = np.int32 if total_size < 2**31 else np.int64
    return (xp.asarray(index).astype(itype) * itype(grid_size))[:, None]


def interpolate(grid, q, r_max_padded: float, index=None):
    """Trilinear/bilinear interpolation of a half-grid array (complex or real) at points q (..., d) in padded
    Fourier pixels; negative-x points are read from their Hermitian mate (conjugated for complex grids);
    points beyond ``r_max_padded`` give 0. With ``index`` (R,), ``grid`` is a stack (K, *half grid) and
    the points q[r] (R, Npix, d) are read from grid[index[r]]."""
    xp = get_array_module(grid)
    P = grid.shape[-2]
    neg = q[..., 0] < 0
    q = xp.where(neg[..., None], -q, q)
    inside = within_radius(q, r_max_padded**2)
    flat = grid.reshape(-1)
    base = None if index is None else stack_offsets(index, grid[0].size, grid.size, xp)
    out = None
    for idx, w, valid in _corner_indices(q, P):
        if base is not None:
            idx = idx + base
        wv = w if valid is True else xp.where(valid, w, np.float32(0))
        v = xp.take(flat, idx) * wv.astype(flat.real.dtype, copy=False)
        out = v if out is None else out + v
    if xp.iscomplexobj(grid):
        out = xp.where(neg, xp.conj(out), out)
    return xp.where(inside, out, 0)


def pixel_list(size: int, r_max: float, xp=np, unique: bool = False):
    """Half-grid pixels of an s-box with |k| <= r_max: (ky, kx, flat index into (s, s//2+1)).
    ``unique`` drops the Hermitian-redundant kx=0, ky<0 half column."""
    ky, kx = half_grid_indices(size, 2, xp)
    KY, KX = xp.broadcast_arrays(ky, kx)
    keep = KX**2 + KY**2 <= r_max**2
    if unique:
        keep &= ~((KX == 0) & (KY < 0))
    flat = xp.nonzero(keep.reshape(-1))[0]
    return KY.reshape(-1)[flat], KX.reshape(-1)[flat], flat


def project(ref: FourierReference, A, size: int | None = None, r_max: float | None = None,
            chunk_points: int = 1 << 24):
    """Central slices (3D reference) or in-plane rotations (2D reference) for R orientations.

    A: (R, 3, 3) Euler matrices (RELION convention) for a 3D reference, (R, 2, 2) or (R, 3, 3) for 2D
    (the upper-left 2x2 block is used). Returns (R, s, s//2+1) complex64 half-grid FTs in image
    normalisation, s = ``size`` (default N), zero beyond ``r_max`` (default the reference's r_max)."""
    xp = get_array_module(ref.data)
    s = ref.size if size is None else int(size)
    rm = min(ref.r_max, s / 2) if r_max is None else min(float(r_max), ref.r_max)
    A = xp.asarray(A, dtype=np.float64)
    if ref.ndim == 2:
        A = A[:, :2, :2]
    ky, kx, flat = pixel_list(s, rm, xp)
    vals = project_pixels(ref, A, kx, ky, chunk_points=chunk_points)
    out = xp.zeros((A.shape[0], s * (s // 2 + 1)), dtype=np.complex64)
    out[:, flat] = vals
    return out.reshape(A.shape[0], s, s // 2 + 1)


def project_pixels(ref: FourierReference, A, kx, ky, chunk_points: int | None = None, index=None):
    """Reference values at image pixels (kx, ky) for each orientation: (R, Npix) complex64 (the GEMM-ready
    layout of the E-step). Coordinates in float32: their rounding (< 2e-5 px at box 256) is far below the
    trilinear interpolation error. For a stacked reference, ``index`` (R,) names the reference of each row.
    Interpolated ``chunk_points`` points at a time (default memory_model.PROJECT_CHUNK_POINTS)."""
    chunk_points = memory_model.PROJECT_CHUNK_POINTS if chunk_points is None else chunk_points
    xp = get_array_module(ref.data)
    A = xp.asarray(A, dtype=np.float32)
    if ref.ndim == 2:
        A = A[:, :2, :2]
    R = A.shape[0]
    npix = int(np.size(kx))
    rmp = ref.pad * ref.r_max
    if ref.stacked and index is None:
        raise ValueError("a stacked reference needs the reference index of each orientation")
    index = None if index is None else xp.asarray(index)
    if gpu_kernels.projection_applies(ref.data):  # one fused kernel, no temporaries
        return gpu_kernels.project_slices(ref.data, A, kx, ky, ref.pad, rmp, index)
    out = xp.empty((R, npix), dtype=np.complex64)
    step = memory_model.orientations_per_chunk(xp, chunk_points, npix)  # cache-sized on the CPU

    def chunk(r0: int) -> None:
        q = rotated_frequencies(A[r0:r0 + step], kx, ky, ref.pad)
        out[r0:r0 + step] = interpolate(ref.data, q, rmp, None if index is None else index[r0:r0 + step])

    for_each(chunk, range(0, R, step), threads=xp is np)  # NumPy: chunks in threads
    return out

"""Batched back-projection into a padded Fourier grid and MAP reconstruction (relion_algorithm.md 4.1-4.4).

Accumulators (data: complex, weight: real) live on the same padded half grid as the projector's reference
(FFT layout, P = pf N). Insertion is a trilinear splat of many weighted slices at once (scatter-add:
``numpy.add.at`` (float64 grids) or ``bincount`` (float32) on the CPU; on the GPU one fused kernel of float64
atomic adds, gpu_kernels.insert_slices).
"""

from __future__ import annotations

import numpy as np

from ..errors import is_out_of_memory
from . import gpu_kernels
from .backend import get_array_module, to_host
from .fourier import _fft_module, half_grid_indices, round_half_away, shell_count, shell_sum, signed_index
from .host_threads import map_ordered
from .masks import soft_edge_weight
from .memory_model import INSERT_CHUNK_POINTS, SLAB_BYTES, orientations_per_chunk
from .projector import _corner_indices, interpolate, pixel_list, rotated_frequencies, stack_offsets, within_radius

#: NumPy insertion: chunks whose contributions are made at once in threads, at most.
INSERT_AHEAD = 2


def _scatter_add(target_flat, idx, vals):
    xp = get_array_module(target_flat)
    if xp is np:
        if target_flat.dtype == np.float64:  # NumPy >= 2's add.at (one dtype: its fast path) is as fast as bincount
            # for a chunk as large as the grid and makes no grid-sized array per chunk
            np.add.at(target_flat, idx, vals.astype(np.float64, copy=False))
        else:  # float32 grids: each chunk summed in float64 first, rounded once (accumulator_precision.py)
            target_flat += np.bincount(idx, weights=vals, minlength=target_flat.size)
    else:
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(target_flat, idx, vals.astype(target_flat.dtype))


def grid_shape(size: int, pad: int, ndim: int) -> tuple[int, ...]:
    """Shape of the padded half grid (P,)*(ndim-1) + (P//2+1,), P = pad * size."""
    P = pad * size
    return (P,) * (ndim - 1) + (P // 2 + 1,)


def support_index(shape: tuple[int, ...], reach: int, xp=np) -> tuple | None:
    """Open-mesh indices (``xp.ix_``) of the block of a padded half grid (FFT layout, ``shape``) within ``reach``
    grid pixels of the origin along every axis: [0, reach] and [P - reach, P) on the full axes, [0, reach] on the
    half axis; None when that block is the whole grid. Insertion up to r_max touches only the block with
    reach >= pad r_max + 1 (trilinear corners), so the sums over MPI ranks need only it."""
    *full, half = shape
    r = int(reach)
    if 2 * r + 1 >= min(full) and r + 1 >= half:
        return None
    axes = [xp.arange(P) if 2 * r + 1 >= P else xp.concatenate([xp.arange(r + 1), xp.arange(P - r, P)])
            for P in full]
    return xp.ix_(*axes, xp.arange(min(r + 1, half)))


def insertion_reach(pad: int, r_max: float) -> int:
    """Grid pixels from the origin that inserting frequencies |k| <= r_max (pixels of N) can touch."""
    return int(np.ceil(pad * r_max)) + 1


def _enforce_hermitian(re, im, w, ndim: int) -> None:
    """In place on grids (..., *half grid): data(k) + conj(data(-k)) and summed weights on the kx=0 plane (2D:
    line), DC left alone; leading axes are independent grids (a class stack)."""
    xp = get_array_module(re)
    P = re.shape[-2]
    m = (-xp.arange(P)) % P
    if ndim == 3:
        sl = (Ellipsis, slice(None), slice(None), 0)
        mate = [a[sl][..., m, :][..., :, m] for a in (re, im, w)]
        dc = (Ellipsis, 0, 0)
    else:
        sl = (Ellipsis, slice(None), 0)
        mate = [a[sl][..., m] for a in (re, im, w)]
        dc = (Ellipsis, 0)
    re0, im0, w0 = re[sl], im[sl], w[sl]
    new = [re0 + mate[0], im0 - mate[1], w0 + mate[2]]
    for n, old in zip(new, (re0, im0, w0), strict=True):
        n[dc] = old[dc]
    re[sl], im[sl], w[sl] = new


def slab_outside_sphere(P: int, ndim: int, a: int, b: int, lim2: float) -> bool:
    """reconstruct_grids' slab a:b of a padded half grid of size P (rows of ky in 3D, columns of kx in 2D) lies
    wholly outside the sphere q^2 < lim2 (its smallest k^2 reaches lim2): it adds nothing to the floor's sums and
    its regularised map is 0, so it is skipped (early iterations: most of the padded grid)."""
    k = signed_index(P, np)[a:b] if ndim == 3 else np.arange(a, b)
    return float(np.min(k.astype(np.float64) ** 2)) >= lim2


def reconstruct_grids(data_re, data_im, weight, size: int, pad: int, ndim: int, r_max: float, tau2=None,
                      tau2_fudge: float = 1.0, minres_map: int = 5, soft_edge: bool = True,
                      max_bytes: int = SLAB_BYTES, out_dtype=np.float32):
    """BackProjector.reconstruct for B grids at once: data (B, *half grid) as real and imaginary parts, weight
    (B, *half grid), tau2 (B, shells) or None -> (B, N, ...) maps, float32 (``out_dtype``: float64 keeps the
    arithmetic's precision, for measuring it).

    Worked in slabs of the half grid (rows of its second-to-last axis, about ``max_bytes`` of temporaries each)
    and, in 3D, inverted one axis at a time keeping only the N central real-space rows of each axis (the padded
    box is never formed), so the transient is ~12 bytes per grid voxel at pad 2 instead of ~115 for whole-grid
    arrays (memory_plan.RECONSTRUCT_BYTES_PER_VOXEL): what lets box 512 reconstruct with pad 2."""
    xp = get_array_module(weight)
    N, pf = size, pad
    B = weight.shape[0]
    P = pf * N
    H = P // 2 + 1
    lim2 = float(round_half_away(np.float64(pf * r_max))) ** 2
    nsh = int(r_max) + 2
    t2 = None if tau2 is None else xp.asarray(tau2, dtype=np.float64).reshape(B, -1)
    rows = P if ndim == 3 else H  # slabs: rows of axis -2 (3D) or columns of axis -1 (2D)
    per_row = B * (P * H if ndim == 3 else P) * 96  # bytes of the float64/complex128 temporaries of one row
    step = int(max(1, min(rows, max_bytes // per_row)))

    def geometry(a: int, b: int):
        """'inside' (the reconstructed sphere) and the shells ROUND(|q|/pf) and FLOOR(|q|/pf) of slab a:b."""
        ks = list(half_grid_indices(P, ndim, xp))
        ks[1] = ks[1][:, a:b]  # 3D: y rows (axis 1 of the grid); 2D: x columns (its last axis)
        q2 = sum(k.astype(np.float64) ** 2 for k in ks)
        inside = q2 < lim2
        r = xp.sqrt(q2) / pf
        return inside, round_half_away(r).astype(np.int64), xp.where(inside, xp.floor(r).astype(np.int64), nsh)

    def regularised_weight(a: int, b: int, inside, shells):
        """W of slab a:b with the MAP prior 1/(pf^ndim T tau2) added, and the slab's index in (B, *grid)."""
        sl = (slice(None), slice(None), slice(a, b))
        W = weight[sl].astype(np.float64)
        if t2 is not None:
            L = t2.shape[1]
            t = t2[:, xp.clip(shells, 0, L - 1)]
            prior_ok = (inside & (shells >= minres_map) & (shells < L))[None]
            add = xp.where(prior_ok & (t > 0), 1.0 / xp.maximum(pf**ndim * tau2_fudge * t, 1e-300), 0.0)
            add = xp.where(prior_ok & (t <= 0) & (W > 0), 1.0 / xp.maximum(0.001 * W, 1e-300), add)
            W = W + add
        return W, sl

    # pass 1: the floor, shell mean of W / 1000 over shells FLOOR(|q|/pf) inside the sphere (the count of the
    # dropped bin nsh, whose sum is 0, is the only number the skipped slabs would change)
    sums = xp.zeros((B, nsh + 1))
    cnts = xp.zeros(nsh + 1)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        if slab_outside_sphere(P, ndim, a, b, lim2):
            continue
        inside, shells, rf = geometry(a, b)
        W, _ = regularised_weight(a, b, inside, shells)
        sums += shell_sum(xp.where(inside[None], W, 0), rf, nsh + 1)  # (B, nsh + 1)
        cnts += shell_count(rf, nsh + 1)
    wbar = sums / xp.maximum(cnts, 1)[None] / 1000.0

    def vhat(a: int, b: int):
        """The regularised Fourier map of slab a:b: data / max(W, floor) inside the sphere, 0 elsewhere."""
        if slab_outside_sphere(P, ndim, a, b, lim2):
            return xp.zeros((B, P) + ((b - a, H) if ndim == 3 else (b - a,)), dtype=np.complex128)
        inside, shells, rf = geometry(a, b)
        W, sl = regularised_weight(a, b, inside, shells)
        denom = xp.maximum(W, wbar[:, xp.minimum(rf, nsh)])
        ok = inside[None] & (denom > 0)
        return xp.where(ok, (data_re[sl] + 1j * data_im[sl]) / xp.where(denom > 0, denom, 1.0), 0)

    crop = (xp.arange(N) - N // 2) % P  # the N central rows of a centred padded axis, in the FFT's order
    fft, kw = _fft_module(xp)
    if ndim == 2:  # small grids: one inverse transform of the whole padded image, then the central N x N
        V = xp.concatenate([vhat(a, min(rows, a + step)) for a in range(0, rows, step)], axis=-1)
        x = fft.irfftn(V, s=(P, P), axes=(-2, -1), norm="forward", **kw)
        vol = x[:, crop][:, :, crop]
    else:  # z then y (complex, per slab of y rows, then per slab of the kept z rows), then x (real)
        A = xp.empty((B, N, P, H), dtype=np.complex128)
        for a in range(0, rows, step):
            b = min(rows, a + step)
            if slab_outside_sphere(P, ndim, a, b, lim2):  # the transform of zeros
                A[:, :, a:b] = 0
                continue
            A[:, :, a:b] = fft.ifft(vhat(a, b), axis=1, norm="forward", **kw)[:, crop]
        zstep = int(max(1, min(N, max_bytes // (B * P * H * 32))))
        C = xp.empty((B, N, N, H), dtype=np.complex128)
        for a in range(0, N, zstep):
            C[:, a:a + zstep] = fft.ifft(A[:, a:a + zstep], axis=2, norm="forward", **kw)[:, :, crop]
        del A
        vol = xp.empty((B, N, N, N), dtype=np.float64)
        for a in range(0, N, zstep):
            vol[:, a:a + zstep] = fft.irfft(C[:, a:a + zstep], n=P, axis=3, norm="forward", **kw)[..., crop]
        del C
    vol *= 1.0 / (pf**3 * N) if ndim == 3 else 1.0 / pf**2
    return _soft_edge_and_gridding(vol, N, pf, ndim, soft_edge, max_bytes).astype(out_dtype, copy=False)


def _sums_last_axis_first(x, keep: int):
    """Sums of ``x`` over every axis after its first ``keep`` ones, the last axis first, then the rest. CuPy's own
    reductions (without CUB, the package's default) give each output one thread block, so a few outputs of
    millions of elements ran on a few of the GPU's multiprocessors: the soft edge's means of a class3d M-step's six
    box-256 maps took about 0.12 s per iteration that way (thirty-ninth session's kernel trace on an H200)."""
    lead = x.shape[:keep]
    return x.reshape(lead + (-1, x.shape[-1])).sum(axis=-1).sum(axis=-1)


def _soft_edge_and_gridding(vol, N: int, pf: int, ndim: int, soft_edge: bool, max_bytes: int):
    """In place on (B, N, ...) float64 maps, in slabs of their first spatial axis: RELION's soft edge at N/2
    (3 px wide, the outside filled with the edge-weighted mean) and the division by the sinc^2 gridding
    kernel (projector.sinc2_gridding) -- the same as masks.soft_mask_outside and that division on the whole box,
    without box-sized temporaries (a 1024^3 float64 box is 8 GiB)."""
    xp = get_array_module(vol)
    B = vol.shape[0]
    c0 = (xp.arange(N) - N // 2).astype(np.float64)
    step = int(max(1, min(N, max_bytes // (B * N ** (ndim - 1) * 8 * 6))))

    def radius(a: int, b: int):
        if ndim == 2:
            return xp.sqrt(c0[a:b, None] ** 2 + c0[None, :] ** 2)
        return xp.sqrt(c0[a:b, None, None] ** 2 + c0[None, :, None] ** 2 + c0[None, None, :] ** 2)

    spans = [(a, min(N, a + step)) for a in range(0, N, step)]
    if soft_edge:
        num, wsum = xp.zeros(B), 0.0
        for a, b in spans:
            c = soft_edge_weight(radius(a, b), N / 2, 3.0, xp)
            num += _sums_last_axis_first(vol[:, a:b] * c[None], 1)
            wsum += float(_sums_last_axis_first(c, 0))
        bg = (num / max(wsum, 1e-12)).reshape((B,) + (1,) * ndim)
    for a, b in spans:
        r = radius(a, b)
        if soft_edge:
            c = soft_edge_weight(r, N / 2, 3.0, xp)[None]
            vol[:, a:b] = (1 - c) * vol[:, a:b] + c * bg
        sinc = xp.sinc(r / (pf * N))
        vol[:, a:b] /= (sinc * sinc)[None]
    return vol


def _chunk_contributions(A, kx, ky, v, w, pad: int, P: int, rmp2: float, base=None, check=None):
    """Flat grid indices and the real, imaginary and weight contributions of one chunk of slices; ``base``
    (R, 1) adds each slice's flat offset in a stack of grids. ``check()``: a cancel point per corner."""
    xp = get_array_module(v)
    q = rotated_frequencies(A, kx, ky, pad)
    neg = q[..., 0] < 0
    q = xp.where(neg[..., None], -q, q)
    v = xp.where(neg, xp.conj(v), v)
    inside = within_radius(q, rmp2) & (w != 0)
    q, v, w = q[inside], v[inside], w[inside]
    b = None if base is None else xp.broadcast_to(base, inside.shape)[inside]
    idx_all, vr, vi, ww = [], [], [], []
    for idx, cw, valid in _corner_indices(q, P):
        if check is not None:
            check()
        cw = cw if valid is True else xp.where(valid, cw, np.float32(0))
        idx_all.append(idx if b is None else idx + b)
        vr.append(cw * v.real)
        vi.append(cw * v.imag)
        ww.append(cw * w)
    return xp.concatenate(idx_all), xp.concatenate(vr), xp.concatenate(vi), xp.concatenate(ww)


def _insert_chunks(targets: tuple, pad: int, r_max: float, A, kx, ky, values, weights, chunk_points: int,
                   index=None, check=None) -> None:
    """Splat slices into ``targets`` (data_re, data_im, weight) in chunks of about ``chunk_points`` points;
    out of memory halves the chunk. With ``index`` (R,), the targets are stacks (K, *grid) and slice r goes
    into grid index[r]. ``check()`` (a cancel point that raises to stop) is called before every chunk."""
    xp = get_array_module(targets[0])
    values = xp.asarray(values)
    weights = xp.asarray(weights, dtype=np.float64)
    R, npix = values.shape
    P = targets[0].shape[-2]
    grid_size = targets[0][0].size if index is not None else targets[0].size
    flats = [t.reshape(-1) for t in targets]
    step = orientations_per_chunk(xp, chunk_points, npix, flats[0].size)  # cache-sized on the CPU
    rmp2 = float(round_half_away(np.float64(pad * r_max))) ** 2
    if gpu_kernels.insertion_applies(targets, values):
        for r0 in range(0, R, step):  # one fused kernel per chunk: no temporaries, so no out-of-memory retry
            if check is not None:
                check()
            gpu_kernels.insert_slices(targets, A[r0:r0 + step], kx, ky, values[r0:r0 + step],
                                      weights[r0:r0 + step], pad, rmp2, None if index is None else index[r0:r0 + step])
        return

    def contributions(r0_step: tuple[int, int]) -> tuple:
        r0, n = r0_step
        if check is not None:
            check()
        base = None if index is None else stack_offsets(index[r0:r0 + n], grid_size, targets[0].size, xp)
        return _chunk_contributions(A[r0:r0 + n], kx, ky, values[r0:r0 + n], weights[r0:r0 + n], pad, P, rmp2,
                                    base, check)

    r0 = 0
    while r0 < R:  # the contributions of the next chunks are made (NumPy: in threads) while one is added
        todo = [(a, step) for a in range(r0, R, step)]
        # NumPy: two chunks' contributions made at once at most (a chunk is up to INSERT_CHUNK_POINTS points at
        # ~160 bytes each; the adds, in this thread, take one at a time)
        chunks = map_ordered(contributions, todo, ahead=INSERT_AHEAD) if xp is np else map(contributions, todo)
        try:
            while r0 < R:
                try:  # everything that allocates comes before the first add: a chunk is added whole or not at all
                    idx, vr, vi, ww = next(chunks)
                except Exception as exc:  # noqa: BLE001 - out of memory: smaller chunks from r0; else: raise
                    if not is_out_of_memory(exc) or step == 1:
                        raise
                    step = max(1, step // 2)
                    break
                for flat, contrib in zip(flats, (vr, vi, ww), strict=True):
                    if check is not None:  # a cancelled job's accumulators are dropped: stopping between adds is safe
                        check()
                    _scatter_add(flat, idx, contrib)
                r0 += step
        finally:
            getattr(chunks, "close", lambda: None)()  # chunks started and not added: waited for, dropped


class BackProjector:
    """Padded Fourier accumulators for one reconstruction (one class, one half).

    size: box N (pixels); pad: padding factor; r_max: largest |k| inserted (Fourier pixels of N);
    ndim: 3 for a 3D map from 2D images, 2 for a 2D class average."""

    def __init__(self, size: int, pad: int = 2, r_max: float | None = None, ndim: int = 3, xp=np,
                 dtype=np.float64, arrays: tuple | None = None):
        self.size, self.pad, self.ndim, self.xp = int(size), int(pad), ndim, xp
        self.r_max = size / 2 if r_max is None else float(r_max)
        if arrays is None:  # else views (data_re, data_im, weight) into a BackProjectorStack
            arrays = tuple(xp.zeros(grid_shape(self.size, self.pad, ndim), dtype=dtype) for _ in range(3))
        self.data_re, self.data_im, self.weight = arrays
        # (the stack's full arrays, this member's index) when a BackProjectorStack made this one; no reference to
        # the stack object itself, so no reference cycle keeps device memory alive until a garbage collection
        self.stack: tuple[tuple, int] | None = None

    @property
    def padded_size(self) -> int:
        return self.pad * self.size

    @property
    def data(self):
        return self.data_re + 1j * self.data_im

    def insert_pixels(self, A, kx, ky, values, weights, chunk_points: int = INSERT_CHUNK_POINTS, check=None):
        """Insert, for R orientations, the values (R, Npix) complex and weights (R, Npix) real given at image
        pixels (kx, ky) (Fourier pixels of the N box). A: (R, 3, 3) (or 2x2 for 2D). ``check()``: a cancel point
        before every chunk."""
        xp = self.xp
        A = xp.asarray(A, dtype=np.float64)
        if self.ndim == 2:
            A = A[:, :2, :2]
        _insert_chunks((self.data_re, self.data_im, self.weight), self.pad, self.r_max, A, kx, ky, values, weights,
                       chunk_points, check=check)

    def insert_images(self, A, F, W, r_max: float | None = None, check=None):
        """Insert half-grid slices F (R, s, s//2+1) complex with weights W (same shape, real or broadcastable).

        Only pixels with |k| <= r_max (default this projector's r_max) are used; the redundant kx=0, ky<0
        half column is skipped (it would count twice). ``check()``: a cancel point before every chunk."""
        xp = self.xp
        s = F.shape[-2]
        rm = self.r_max if r_max is None else min(self.r_max, float(r_max))
        rm = min(rm, s / 2)
        ky, kx, flat = pixel_list(s, rm, xp, unique=True)
        R = F.shape[0]
        Fv = F.reshape(R, -1)[:, flat]
        Wv = xp.broadcast_to(xp.asarray(W), F.shape).reshape(R, -1)[:, flat]
        self.insert_pixels(A, kx, ky, Fv, Wv, check=check)

    def add(self, other: BackProjector) -> None:
        self.data_re += other.data_re
        self.data_im += other.data_im
        self.weight += other.weight

    def release(self) -> None:
        """Drop the grids (their memory is freed once nothing else refers to them); the object is unusable
        after this."""
        self.data_re = self.data_im = self.weight = None
        self.stack = None

    # ---- before reconstruction -------------------------------------------------------------------------
    def enforce_hermitian(self) -> None:
        """Sum the Hermitian pairs on the kx=0 plane (line in 2D): D = data(k) + conj(data(-k)), weights summed
        (RELION 4.2 step 1; sums, not averages). The DC element is left alone."""
        _enforce_hermitian(self.data_re, self.data_im, self.weight, self.ndim)

    def _grid_points(self):
        """Padded-grid coordinates (x, y[, z]) of all half-grid voxels within pf r_max, and their flat index."""
        xp = self.xp
        P = self.padded_size
        ks = half_grid_indices(P, self.ndim, xp)
        grids = xp.broadcast_arrays(*ks)
        r2 = sum(g.astype(np.float64) ** 2 for g in grids)
        flat = xp.nonzero((r2 <= (self.pad * self.r_max) ** 2).reshape(-1))[0]
        coords = [g.reshape(-1)[flat].astype(np.float64) for g in grids[::-1]]  # x, y[, z]
        return xp.stack(coords, axis=-1), flat

    def symmetrise(self, matrices) -> None:
        """Point-group symmetrisation: data'(k) = sum over operators R of data(R k), same for weights,
        trilinear interpolation with Hermitian mates (RELION 4.2 step 3; a sum, not an average).
        ``matrices``: (n, 3, 3) with the identity among them."""
        xp = self.xp
        mats = np.asarray(matrices, dtype=np.float64)
        ops = [M for M in mats if not np.allclose(M, np.eye(M.shape[0]))]
        if not ops:
            return
        q, flat = self._grid_points()
        data = self.data
        rmp = self.pad * self.r_max
        acc_d = data.reshape(-1)[flat].copy()
        acc_w = self.weight.reshape(-1)[flat].copy()
        for M in ops:
            Mx = xp.asarray(M[: self.ndim, : self.ndim])
            qr = q @ Mx.T  # R k for each point
            acc_d += interpolate(data, qr, rmp)
            acc_w += interpolate(self.weight, qr, rmp)
        self.data_re.reshape(-1)[flat] = acc_d.real
        self.data_im.reshape(-1)[flat] = acc_d.imag
        self.weight.reshape(-1)[flat] = acc_w

    # ---- reconstruction -----------------------------------------------------------------------------
    def reconstruct(self, tau2=None, tau2_fudge: float = 1.0, minres_map: int = 5,
                    soft_edge: bool = True, out_dtype=np.float32):
        """Real-space map (N,)*ndim float32 from the accumulators (RELION BackProjector::reconstruct, default
        skip_gridding path). ``tau2`` (shells 0..N/2) adds the MAP prior 1/(pf^ndim T tau2) for shells
        >= ``minres_map``; ``tau2=None`` gives the unregularised reconstruction. A floor of the shell-mean
        weight / 1000 avoids division by tiny weights. Then inverse FFT, crop, /(pf^3 N) (3D) or /pf^2 (2D),
        soft edge at N/2 (3 px) and the sinc^2 gridding correction."""
        t2 = None if tau2 is None else self.xp.asarray(tau2, dtype=np.float64)[None]
        return reconstruct_grids(self.data_re[None], self.data_im[None], self.weight[None], self.size, self.pad,
                                 self.ndim, self.r_max, t2, tau2_fudge, minres_map, soft_edge,
                                 out_dtype=out_dtype)[0]


class BackProjectorStack:
    """K accumulators of one geometry in one array (K, *grid) each for data and weight, so that one scatter-add
    inserts the slices of all classes (2D classification: K = 100-200 small grids). ``members[k]`` is an
    ordinary BackProjector over grid k (reconstruct, symmetrise, ... per class)."""

    def __init__(self, n: int, size: int, pad: int = 2, r_max: float | None = None, ndim: int = 3, xp=np,
                 dtype=np.float64):
        shape = (int(n),) + grid_shape(int(size), int(pad), ndim)
        self.arrays = tuple(xp.zeros(shape, dtype=dtype) for _ in range(3))
        self.size, self.pad, self.ndim, self.xp = int(size), int(pad), ndim, xp
        self.r_max = size / 2 if r_max is None else float(r_max)
        self.members = []
        for k in range(int(n)):
            bp = BackProjector(size, pad, r_max, ndim, xp, dtype, arrays=tuple(a[k] for a in self.arrays))
            bp.stack = (self.arrays, k)
            self.members.append(bp)

    def block(self, lo: int, hi: int) -> BackProjectorStack:
        """The members lo..hi-1 as a stack of their own (views of these arrays, nothing copied): the classes one
        MPI rank reconstructs."""
        out = object.__new__(BackProjectorStack)
        out.arrays = tuple(a[lo:hi] for a in self.arrays)
        out.size, out.pad, out.ndim, out.xp, out.r_max = self.size, self.pad, self.ndim, self.xp, self.r_max
        out.members = self.members[lo:hi]
        return out

    def enforce_hermitian(self) -> None:
        """BackProjector.enforce_hermitian for every member at once."""
        _enforce_hermitian(*self.arrays, self.ndim)

    def reconstruct(self, tau2, tau2_fudge: float = 1.0, max_bytes: int = SLAB_BYTES):
        """(K, N, ...) float32 maps of every member (BackProjector.reconstruct), ``tau2`` (K, shells) or None;
        members in chunks whose padded real-space grids fit ``max_bytes``."""
        xp = self.xp
        K = self.arrays[0].shape[0]
        step = max(1, int(max_bytes // (8 * (self.pad * self.size) ** self.ndim)))
        out = []
        for k0 in range(0, K, step):  # ceil(K / step) batched reconstructions
            re, im, w = (a[k0:k0 + step] for a in self.arrays)
            t2 = None if tau2 is None else xp.asarray(tau2, dtype=np.float64)[k0:k0 + step]
            out.append(reconstruct_grids(re, im, w, self.size, self.pad, self.ndim, self.r_max, t2,
                                         tau2_fudge))
        return xp.concatenate(out)

    def insert_pixels(self, index, A, kx, ky, values, weights, chunk_points: int = INSERT_CHUNK_POINTS) -> None:
        """As BackProjector.insert_pixels; slice r goes into member index[r]."""
        xp = self.xp
        A = xp.asarray(A, dtype=np.float64)
        if self.ndim == 2:
            A = A[:, :2, :2]
        _insert_chunks(self.arrays, self.pad, self.r_max, A, kx, ky, values, weights, chunk_points,
                       index=xp.asarray(index))


def _one_stack(backprojectors: list) -> bool:
    """Whether the back-projectors are the members of one BackProjectorStack, in order."""
    first = backprojectors[0]
    return first.stack is not None and first.stack[0][0].shape[0] == len(backprojectors) and all(
        bp.stack is not None and bp.stack[0] is first.stack[0] and bp.stack[1] == k
        for k, bp in enumerate(backprojectors))


def insertion_orientations(backprojectors: list, npix: int) -> int:
    """Orientations of ``npix`` pixels that insert_by_class inserts per chunk (_insert_chunks's step: the array it
    adds each chunk into is a stack's or one grid's), so that a caller can hand its slices over in the same pieces."""
    first = backprojectors[0]
    target = first.stack[0][0].size if _one_stack(backprojectors) else first.data_re.size
    return orientations_per_chunk(first.xp, INSERT_CHUNK_POINTS, npix, int(target))


def insert_by_class(backprojectors: list, index, A, kx, ky, values, weights, check=None) -> None:
    """Insert slice r into ``backprojectors[index[r]]``: one call when they are the members of one
    BackProjectorStack in order, else one call per class. ``check()``: a cancel point before every chunk."""
    xp = get_array_module(values)
    first = backprojectors[0]
    if _one_stack(backprojectors):
        A = xp.asarray(A, dtype=np.float64)
        A = A[:, :2, :2] if first.ndim == 2 else A
        _insert_chunks(first.stack[0], first.pad, first.r_max, A, kx, ky, values, weights, INSERT_CHUNK_POINTS,
                       index=xp.asarray(index), check=check)
        return
    index_h = to_host(index)
    for c, bp in enumerate(backprojectors):
        keep = np.flatnonzero(index_h == c)
        if keep.size:
            kd = xp.asarray(keep)
            bp.insert_pixels(A[kd], kx, ky, values[kd], weights[kd], check=check)

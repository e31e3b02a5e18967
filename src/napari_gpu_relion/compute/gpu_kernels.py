"""Fused CUDA kernels for the two trilinear steps that dominate local searches and the final iteration:
slice extraction (projector.interpolate) and slice insertion (backprojector's scatter-add); and two sums that
CuPy does with atomic adds into few addresses (``bincount`` with weights, ``scatter_add``), where every thread
of the GPU waits on the same ~100 shells or on the rows that all particles share: binned_sum (shell sums) and
segment_rows_sum (per-row sums of the fine pass's gathered chunks); and the last step of the scores, pnorm - 2 cross,
in place over the GEMM's output (finish_scores: one pass over the largest array of an E-step instead of two); and
any_over_middle, the coarse pass's significant rows (CuPy's reduction over a middle axis of few elements ran at
a tenth of the memory bandwidth).

Each kernel does per point what the array code does as a chain of CuPy operations (rotated frequency,
Hermitian mate, r_max test, 8 corner indices and weights, gather or atomic add) in one pass, without the
chain's (points x 8) temporaries. The arithmetic is the array code's, operation for operation, in the same
precision and order (intrinsics keep the compiler from fusing a multiply and an add), so projection gives the
array code's numbers and insertion differs only in the order of the atomic float64 additions, which the array
code's scatter-add does not fix either. ``tests/test_gpu.py`` checks both against the array code.

Importing this module never imports CuPy; the kernels compile on first use (CuPy caches them on disk).
"""

from __future__ import annotations

import functools

import numpy as np

from .backend import get_array_module, launch_grid_stride, raw_module

#: Off only to measure the array code on a GPU (benchmarks) or to compare with it (tests).
ENABLED = True

_SOURCE = r"""
__device__ __forceinline__ long long wrap(long long i, int P) {
    // Python's i % P for P > 0 and |i| < 2^31, in 32 bits (a 64-bit remainder is a long software routine on a
    // GPU); every caller's i lies within about P of 0 (a point inside the r_max sphere of a grid of edge P)
    const int m = (int)i % P;
    return m < 0 ? m + P : m;
}

__device__ __forceinline__ float2 project_point(
        const float2* __restrict__ grid, const float* a, const float x, const float y, const long long base,
        const int P, const int d, const float pad, const float rmp2) {
    // the reference at q = pad A^T (x, y, 0) (rows of A from a), trilinear, 0 beyond rmp2, the negative-x half
    // read from its Hermitian mate
    const long long nx = P / 2 + 1;
    float q[3] = {0.f, 0.f, 0.f};
    for (int c = 0; c < d; ++c)
        q[c] = __fmul_rn(pad, __fadd_rn(__fmul_rn(x, a[c]), __fmul_rn(y, a[d + c])));
    const bool neg = q[0] < 0.f;
    if (neg) for (int c = 0; c < d; ++c) q[c] = -q[c];
    float r2 = __fmul_rn(q[0], q[0]);
    for (int c = 1; c < d; ++c) r2 = __fadd_rn(r2, __fmul_rn(q[c], q[c]));
    float2 acc = make_float2(0.f, 0.f);
    if (r2 <= rmp2) {
        long long lo[3], hi[3];
        float w0[3], w1[3];
        long long stride = 1;
        bool x_valid = true;
        for (int c = 0; c < d; ++c) {
            const float f0 = floorf(q[c]);
            const float fr = q[c] - f0;
            const long long i0 = (long long)f0;
            if (c == 0) {
                x_valid = i0 + 1 < nx;
                lo[c] = i0;
                hi[c] = i0 + 1 < nx - 1 ? i0 + 1 : nx - 1;
            } else {
                lo[c] = wrap(i0, P) * stride;
                hi[c] = wrap(i0 + 1, P) * stride;
            }
            w0[c] = 1.f - fr;
            w1[c] = fr;
            stride = c == 0 ? nx : stride * P;
        }
        for (int bits = 0; bits < (1 << d); ++bits) {
            long long idx = (bits & 1) ? hi[0] : lo[0];
            float w = (bits & 1) ? w1[0] : w0[0];
            for (int c = 1; c < d; ++c) {
                const bool up = (bits >> c) & 1;
                idx += up ? hi[c] : lo[c];
                w = __fmul_rn(w, up ? w1[c] : w0[c]);
            }
            if ((bits & 1) && !x_valid) w = 0.f;
            const float2 v = grid[base + idx];
            if (bits == 0) {
                acc = make_float2(__fmul_rn(v.x, w), __fmul_rn(v.y, w));
            } else {
                acc.x = __fadd_rn(acc.x, __fmul_rn(v.x, w));
                acc.y = __fadd_rn(acc.y, __fmul_rn(v.y, w));
            }
        }
        if (neg) acc.y = -acc.y;
    }
    return acc;
}

extern "C" __global__ void project_gather(
        const float2* __restrict__ grid, const float* __restrict__ A, const float* __restrict__ kx,
        const float* __restrict__ ky, const long long* __restrict__ index, const long long grid_size,
        const int P, const int d, const float pad, const float rmp2, const long long R, const long long npix,
        float2* __restrict__ out) {
    const long long total = R * npix;
    for (long long n = blockIdx.x * (long long)blockDim.x + threadIdx.x; n < total;
         n += (long long)gridDim.x * blockDim.x) {
        const long long r = n / npix;
        const long long p = n - r * npix;
        out[n] = project_point(grid, A + r * d * d, kx[p], ky[p], index ? index[r] * grid_size : 0, P, d, pad,
                               rmp2);
    }
}

extern "C" __global__ void project_stacked(
        const float2* __restrict__ grid, const float* __restrict__ A, const float* __restrict__ kx,
        const float* __restrict__ ky, const long long* __restrict__ index, const long long* __restrict__ source,
        const bool* __restrict__ zero, const long long grid_size, const int P, const int d, const float pad,
        const float rmp2, const long long R, const long long npix, const long long width,
        float* __restrict__ stacked, float* __restrict__ power) {
    // output row r is orientation source[r] (its matrix, and its reference index[source[r]] of a stack), written
    // as [Re | Im] at row r of stacked (R, width) and |P|^2 at row r of power (R, npix); pixels where zero[p]
    // give 0 (the coarse pass's corners beyond its radius)
    const long long total = R * npix;
    for (long long n = blockIdx.x * (long long)blockDim.x + threadIdx.x; n < total;
         n += (long long)gridDim.x * blockDim.x) {
        const long long r = n / npix;
        const long long p = n - r * npix;
        const long long m = source[r];
        float2 v = make_float2(0.f, 0.f);
        if (!(zero && zero[p]))
            v = project_point(grid, A + m * d * d, kx[p], ky[p], index ? index[m] * grid_size : 0, P, d, pad, rmp2);
        stacked[r * width + p] = v.x;
        stacked[r * width + npix + p] = v.y;
        power[n] = __fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y));
    }
}

extern "C" __global__ void insert_splat(
        double* __restrict__ data_re, double* __restrict__ data_im, double* __restrict__ weight,
        const double* __restrict__ A, const double* __restrict__ kx, const double* __restrict__ ky,
        const float2* __restrict__ values, const double* __restrict__ weights, const long long* __restrict__ index,
        const long long grid_size, const int P, const int d, const double pad, const double rmp2,
        const long long R, const long long npix) {
    const long long nx = P / 2 + 1;
    const long long total = R * npix;
    for (long long n = blockIdx.x * (long long)blockDim.x + threadIdx.x; n < total;
         n += (long long)gridDim.x * blockDim.x) {
        const double wt = weights[n];
        if (wt == 0.0) continue;
        const long long r = n / npix;
        const long long p = n - r * npix;
        const double* a = A + r * d * d;
        const double x = kx[p], y = ky[p];
        double q[3] = {0.0, 0.0, 0.0};
        for (int c = 0; c < d; ++c)
            q[c] = __dmul_rn(pad, __dadd_rn(__dmul_rn(x, a[c]), __dmul_rn(y, a[d + c])));
        float2 v = values[n];
        if (q[0] < 0.0) {
            for (int c = 0; c < d; ++c) q[c] = -q[c];
            v.y = -v.y;
        }
        double r2 = __dmul_rn(q[0], q[0]);
        for (int c = 1; c < d; ++c) r2 = __dadd_rn(r2, __dmul_rn(q[c], q[c]));
        if (!(r2 <= rmp2)) continue;
        long long lo[3], hi[3];
        float w0[3], w1[3];
        long long stride = 1;
        bool x_valid = true;
        for (int c = 0; c < d; ++c) {
            const double f0 = floor(q[c]);
            const float fr = (float)(q[c] - f0);
            const long long i0 = (long long)f0;
            if (c == 0) {
                x_valid = i0 + 1 < nx;
                lo[c] = i0;
                hi[c] = i0 + 1 < nx - 1 ? i0 + 1 : nx - 1;
            } else {
                lo[c] = wrap(i0, P) * stride;
                hi[c] = wrap(i0 + 1, P) * stride;
            }
            w0[c] = 1.f - fr;
            w1[c] = fr;
            stride = c == 0 ? nx : stride * P;
        }
        const long long base = index ? index[r] * grid_size : 0;
        for (int bits = 0; bits < (1 << d); ++bits) {
            if ((bits & 1) && !x_valid) continue;
            long long idx = (bits & 1) ? hi[0] : lo[0];
            float w = (bits & 1) ? w1[0] : w0[0];
            for (int c = 1; c < d; ++c) {
                const bool up = (bits >> c) & 1;
                idx += up ? hi[c] : lo[c];
                w = __fmul_rn(w, up ? w1[c] : w0[c]);
            }
            if (w == 0.f) continue;
            atomicAdd(data_re + base + idx, (double)__fmul_rn(w, v.x));
            atomicAdd(data_im + base + idx, (double)__fmul_rn(w, v.y));
            atomicAdd(weight + base + idx, __dmul_rn((double)w, wt));
        }
    }
}

extern "C" __global__ void binned_sum(
        const long long* __restrict__ index, const double* __restrict__ w, const long long m,
        const long long n_rows, const int nbins, const int has_w, double* __restrict__ out) {
    // out[row, k] += sum of w[row, j] (1 without w) over j < m with index[j] == k: one histogram of nbins
    // float64 in shared memory per block, added to the output once per bin
    extern __shared__ double hist[];
    for (long long row = blockIdx.y; row < n_rows; row += gridDim.y) {
        for (int k = threadIdx.x; k < nbins; k += blockDim.x) hist[k] = 0.0;
        __syncthreads();
        const double* wr = w + row * m;
        for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < m;
             j += (long long)gridDim.x * blockDim.x) {
            const long long k = index[j];
            if (k >= 0 && k < nbins) atomicAdd(hist + k, has_w ? wr[j] : 1.0);
        }
        __syncthreads();
        for (int k = threadIdx.x; k < nbins; k += blockDim.x) {
            const double v = hist[k];
            if (v != 0.0) atomicAdd(out + row * nbins + k, v);
        }
        __syncthreads();
    }
}

extern "C" __global__ void segment_rows_sum(
        const float* __restrict__ vals, const long long* __restrict__ order, const long long* __restrict__ start,
        const long long n, const long long C, float* __restrict__ out) {
    // out[t, c] = sum over e = start[t] .. start[t+1]-1 of vals[order[e], c], in that order: no atomics. The
    // block's threads share one row t (blockIdx.y) and read SEG entries' rows at once (independent loads in
    // flight: a row has tens to hundreds of entries, one dependent load after another would wait on latency)
    const int SEG = 8;
    for (long long t = blockIdx.y; t < n; t += gridDim.y) {
        const long long e0 = start[t], e1 = start[t + 1];
        for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < C;
             c += (long long)gridDim.x * blockDim.x) {
            float acc = 0.f;
            long long e = e0;
            for (; e + SEG <= e1; e += SEG) {
                float v[SEG];
#pragma unroll
                for (int k = 0; k < SEG; ++k) v[k] = __ldg(vals + __ldg(order + e + k) * C + c);
#pragma unroll
                for (int k = 0; k < SEG; ++k) acc = __fadd_rn(acc, v[k]);
            }
            for (; e < e1; ++e) acc = __fadd_rn(acc, __ldg(vals + __ldg(order + e) * C + c));
            out[t * C + c] = acc;
        }
    }
}
"""

#: segment_rows_sum for rows of at least this many values (one thread per output element: with a few values per
#: row, a few threads would add all entries one after another; CuPy's scatter_add is faster there).
SEGMENT_ROWS_MIN_COLUMNS = 64

#: binned_sum keeps one float64 histogram per block in shared memory (16 KiB at this many bins); more bins
#: take CuPy's bincount.
BINNED_SUM_MAX_BINS = 2048


@functools.cache
def _finish_kernel():
    import cupy as cp  # noqa: PLC0415

    # c = pnorm - 2 c in float32: 2 c is exact, so one rounding, as the array code's two operations have
    return cp.ElementwiseKernel("float32 pnorm", "float32 c", "c = pnorm - 2.0f * c", "ngr_finish_scores")


def finish_scores_applies(cross, pnorm) -> bool:
    """finish_scores takes these: enabled, CuPy arrays, float32, the scores C-contiguous."""
    return (_on_gpu(cross, pnorm) and cross.dtype == np.float32 and pnorm.dtype == np.float32
            and cross.flags.c_contiguous)


def finish_scores(cross, pnorm):
    """cross (I, T, R) float32 C-contiguous becomes pnorm - 2 cross in place (pnorm (I, 1, R) float32, broadcast):
    the diff2 of expectation._finish_scores, the same float32 values, in one pass; returns cross."""
    if not finish_scores_applies(cross, pnorm):
        raise ValueError("finish_scores takes C-contiguous float32 CuPy scores and float32 norms")
    _finish_kernel()(pnorm, cross)
    return cross


@functools.cache
def _any_kernel():
    import cupy as cp  # noqa: PLC0415

    return cp.ElementwiseKernel(
        "raw bool a, int64 T, int64 n", "bool out",
        "const long long p = i / n, c = i - p * n; bool v = false; "
        "for (long long t = 0; t < T; ++t) v |= a[(p * T + t) * n + c]; out = v;",
        "ngr_any_over_middle")


def any_over_middle_applies(a) -> bool:
    """any_over_middle takes this: enabled, a C-contiguous 3-D bool CuPy array."""
    return _on_gpu(a) and a.dtype == np.bool_ and a.ndim == 3 and a.flags.c_contiguous


def any_over_middle(a):
    """a.any(axis=1) of a C-contiguous bool CuPy array (I, T, n) -> (I, n): one thread per output, reading the T
    values of its column (consecutive threads read consecutive bytes)."""
    import cupy as cp  # noqa: PLC0415

    if not any_over_middle_applies(a):
        raise ValueError("any_over_middle takes a C-contiguous 3-D bool CuPy array")
    I, T, n = (int(s) for s in a.shape)
    out = cp.empty((I, n), dtype=bool)
    if out.size:
        _any_kernel()(a, np.int64(T), np.int64(n), out)
    return out


def _launch(name: str, n: int, args) -> None:
    launch_grid_stride(_SOURCE, name, n, args)


def _on_gpu(*arrays) -> bool:
    return ENABLED and all(get_array_module(a) is not np for a in arrays)


def projection_applies(grid) -> bool:
    """project_slices takes this reference grid: enabled, a CuPy array, complex64 (else the array code)."""
    return _on_gpu(grid) and grid.dtype == np.complex64


def insertion_applies(targets: tuple, values) -> bool:
    """insert_slices takes these accumulators and values: enabled, CuPy arrays, C-contiguous float64 grids and
    complex64 values (what every job inserts; other dtypes keep the array code's precision)."""
    return _on_gpu(*targets, values) and values.dtype == np.complex64 and all(
        t.dtype == np.float64 and t.flags.c_contiguous for t in targets)


def project_slices(grid, A, kx, ky, pad: int, r_max_padded: float, index=None):
    """(R, Npix) complex64 reference values for R orientations at image pixels (kx, ky) (Fourier pixels of
    the image box): the grid (complex64 half grid of edge P, or a stack (K, *half grid) read at ``index`` (R,))
    interpolated at q = pad A^T (kx, ky, 0), zero beyond ``r_max_padded`` (padded pixels), the negative-x half
    read from its Hermitian mate. A: (R, d, d) float32 with d = 3 (3D) or 2 (2D)."""
    import cupy as cp  # noqa: PLC0415

    A = cp.ascontiguousarray(A, dtype=np.float32)
    R, d = int(A.shape[0]), int(A.shape[-1])
    kx = cp.ascontiguousarray(kx, dtype=np.float32).reshape(-1)
    ky = cp.ascontiguousarray(ky, dtype=np.float32).reshape(-1)
    npix = int(kx.size)
    P = int(grid.shape[-2])
    grid_size = int(np.prod(grid.shape[-d:]))
    if not projection_applies(grid):
        raise ValueError(f"the fused projection reads complex64 CuPy grids, not {grid.dtype}")
    flat = cp.ascontiguousarray(grid)
    idx = None if index is None else cp.ascontiguousarray(index, dtype=np.int64)
    out = cp.empty((R, npix), dtype=np.complex64)
    rmp2 = np.float32(r_max_padded**2)  # the array code compares float32 |q|^2 with it in float32
    _launch("project_gather", R * npix,
            (flat, A, kx, ky, idx if idx is not None else np.uint64(0), np.int64(grid_size), np.int32(P),
             np.int32(d), np.float32(pad), rmp2, np.int64(R), np.int64(npix), out))
    return out


def project_stacked(grid, A, kx, ky, pad: int, r_max_padded: float, source, width: int, index=None, zero=None):
    """Projections in the score GEMMs' form, one output row per entry of ``source`` (R,): row r is orientation
    source[r] of A (M, d, d) (of reference index[source[r]] of a stacked grid), at pixels (kx, ky) (npix); returns
    (stacked (R, width) float32 = [Re | Im | zeros], power (R, npix) float32 = |P|^2), zero at the pixels where
    ``zero`` (npix,) bool is set. The numbers of project_slices followed by expectation.as_slices and a take of
    the rows ``source``, without the complex slices, their stacked copy and the gathered copy (the coarse pass of
    a local search, where each particle has its own orientations)."""
    import cupy as cp  # noqa: PLC0415

    if not projection_applies(grid):
        raise ValueError(f"the fused projection reads complex64 CuPy grids, not {grid.dtype}")
    A = cp.ascontiguousarray(A, dtype=np.float32)
    d = int(A.shape[-1])
    kx = cp.ascontiguousarray(kx, dtype=np.float32).reshape(-1)
    ky = cp.ascontiguousarray(ky, dtype=np.float32).reshape(-1)
    npix = int(kx.size)
    if width < 2 * npix:
        raise ValueError(f"width {width} is less than 2 x {npix} pixels")
    src = cp.ascontiguousarray(source, dtype=np.int64).reshape(-1)
    R = int(src.size)
    stacked = cp.empty((R, int(width)), dtype=np.float32)
    if width > 2 * npix:
        stacked[:, 2 * npix:] = 0.0
    power = cp.empty((R, npix), dtype=np.float32)
    idx = np.uint64(0) if index is None else cp.ascontiguousarray(index, dtype=np.int64)
    zr = np.uint64(0) if zero is None else cp.ascontiguousarray(zero, dtype=bool).reshape(-1)
    P = int(grid.shape[-2])
    grid_size = int(np.prod(grid.shape[-d:]))
    _launch("project_stacked", R * npix,
            (cp.ascontiguousarray(grid), A, kx, ky, idx, src, zr, np.int64(grid_size), np.int32(P), np.int32(d),
             np.float32(pad), np.float32(r_max_padded**2), np.int64(R), np.int64(npix), np.int64(width), stacked,
             power))
    return stacked, power


@functools.cache
def _stacked_shifted_kernel():
    import cupy as cp  # noqa: PLC0415

    # expectation.stacked_shifted's operations in its order: re = gr rr - gi ri, im = gr ri + gi rr, each
    # product rounded before the sum
    return cp.ElementwiseKernel(
        "raw complex64 g, raw complex64 ramps, int64 T, int64 K, int64 W", "float32 out",
        "const long long col = i % W, it = i / W, t = it % T, p = it / T; "
        "if (col >= 2 * K) { out = 0.f; } else { "
        "const long long k = col < K ? col : col - K; "
        "const complex<float> a = g[p * K + k], r = ramps[t * K + k]; "
        "out = col < K ? __fsub_rn(__fmul_rn(a.real(), r.real()), __fmul_rn(a.imag(), r.imag())) "
        ": __fadd_rn(__fmul_rn(a.real(), r.imag()), __fmul_rn(a.imag(), r.real())); }",
        "ngr_stacked_shifted")


def shifted_applies(g, ramps) -> bool:
    """stacked_shifted takes these: enabled, complex64 CuPy arrays."""
    return _on_gpu(g, ramps) and g.dtype == np.complex64 and ramps.dtype == np.complex64


def stacked_shifted(g, ramps, width: int):
    """[Re, Im] of g_i e_t: (I, T, width) float32 from g (I, K) and ramps (T, K) complex64, zeros after 2K:
    expectation.stacked_shifted's numbers in one pass, without its temporary."""
    import cupy as cp  # noqa: PLC0415

    if not shifted_applies(g, ramps):
        raise ValueError("stacked_shifted takes complex64 CuPy arrays")
    g, ramps = cp.ascontiguousarray(g), cp.ascontiguousarray(ramps)
    I, K = (int(v) for v in g.shape)
    T = int(ramps.shape[0])
    if ramps.ndim != 2 or ramps.shape[1] != K:
        raise ValueError(f"ramps of shape {ramps.shape} for {K} pixels")
    out = cp.empty((I, T, max(int(width), 2 * K)), dtype=np.float32)
    if out.size:
        _stacked_shifted_kernel()(g, ramps, np.int64(T), np.int64(K), np.int64(out.shape[2]), out)
    return out


@functools.cache
def _sum_conj_shifted_kernel():
    import cupy as cp  # noqa: PLC0415

    # four float32 sums over t, as the array code's four contractions, then re = s1 + s2, im = s3 - s4
    return cp.ElementwiseKernel(
        "raw float32 U, raw complex64 ramps, int64 T, int64 K, int64 W", "complex64 out",
        "const long long p = i / K, k = i - p * K; float s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f; "
        "for (long long t = 0; t < T; ++t) { "
        "const float ur = U[(p * T + t) * W + k], ui = U[(p * T + t) * W + K + k]; "
        "const complex<float> r = ramps[t * K + k]; "
        "s1 += ur * r.real(); s2 += ui * r.imag(); s3 += ur * r.imag(); s4 += ui * r.real(); } "
        "out = complex<float>(s1 + s2, s3 - s4);",
        "ngr_sum_conj_shifted")


def sum_conj_shifted(U, ramps):
    """sum_t (U_re - i U_im)_t e_t: (I, K) complex64 from U (I, T, W) float32 = [Re, Im, ...] and ramps (T, K)
    complex64, one thread per output reading its T values of U once (expectation.sum_conj_shifted's four
    contractions, in float32, each summed over t in order)."""
    import cupy as cp  # noqa: PLC0415

    if not (_on_gpu(U, ramps) and U.dtype == np.float32 and ramps.dtype == np.complex64):
        raise ValueError("sum_conj_shifted takes float32 U and complex64 ramps on the GPU")
    U, ramps = cp.ascontiguousarray(U), cp.ascontiguousarray(ramps)
    I, T, W = (int(v) for v in U.shape)
    K = int(ramps.shape[1])
    if ramps.shape[0] != T or W < 2 * K:
        raise ValueError(f"U of shape {U.shape} against ramps of shape {ramps.shape}")
    out = cp.empty((I, K), dtype=np.complex64)
    if out.size:
        _sum_conj_shifted_kernel()(U, ramps, np.int64(T), np.int64(K), np.int64(W), out)
    return out


def insert_slices(targets: tuple, A, kx, ky, values, weights, pad: int, rmp2: float, index=None) -> None:
    """Add R weighted slices into float64 grids ``targets`` = (data_re, data_im, weight) (one half grid each,
    or stacks (K, *half grid) with slice r going into grid ``index[r]``): the trilinear splat of
    backprojector._chunk_contributions, with atomic float64 adds. A: (R, d, d) float64; values (R, Npix)
    complex64; weights (R, Npix) float64; ``rmp2`` the squared insertion radius in padded pixels."""
    import cupy as cp  # noqa: PLC0415

    re, im, wt = targets
    d = int(A.shape[-1])
    A = cp.ascontiguousarray(A, dtype=np.float64)
    R = int(A.shape[0])
    kx = cp.ascontiguousarray(kx, dtype=np.float64).reshape(-1)
    ky = cp.ascontiguousarray(ky, dtype=np.float64).reshape(-1)
    npix = int(kx.size)
    if not insertion_applies(targets, values):
        raise ValueError("the fused insertion adds complex64 values into C-contiguous float64 CuPy grids")
    values = cp.ascontiguousarray(values)
    weights = cp.ascontiguousarray(weights, dtype=np.float64)
    if values.shape != (R, npix) or weights.shape != (R, npix):
        raise ValueError(f"values {values.shape} and weights {weights.shape} must be ({R}, {npix})")
    P = int(re.shape[-2])
    grid_size = int(np.prod(re.shape[-d:]))
    idx = None if index is None else cp.ascontiguousarray(index, dtype=np.int64)
    _launch("insert_splat", R * npix,
            (re, im, wt, A, kx, ky, values, weights, idx if idx is not None else np.uint64(0),
             np.int64(grid_size), np.int32(P), np.int32(d), np.float64(pad), np.float64(rmp2), np.int64(R),
             np.int64(npix)))


def binned_sum_applies(index, weights) -> bool:
    """binned_sum takes these: enabled and CuPy arrays (weights None counts)."""
    return _on_gpu(index) and (weights is None or _on_gpu(weights))


def binned_sum(index, weights, nbins: int):
    """(rows, nbins) float64: per row of ``weights`` (rows, m) (or (m,), one row; None counts), the sum of its
    values whose ``index`` (m,) is k, for k < nbins (other indices are dropped). Block-local shared-memory
    histograms, then one atomic add per bin and block: the order of the float64 additions is not fixed."""
    import cupy as cp  # noqa: PLC0415

    if not binned_sum_applies(index, weights) or nbins > BINNED_SUM_MAX_BINS:
        raise ValueError(f"binned_sum takes CuPy arrays and at most {BINNED_SUM_MAX_BINS} bins, not {nbins}")
    idx = cp.ascontiguousarray(index, dtype=np.int64).reshape(-1)
    m = int(idx.size)
    w = None if weights is None else cp.ascontiguousarray(weights, dtype=np.float64).reshape(-1, m)
    rows = 1 if w is None else int(w.shape[0])
    out = cp.zeros((rows, nbins), dtype=np.float64)
    if m == 0 or rows == 0 or nbins == 0:
        return out
    block = 256
    bx = int(max(1, min(-(-m // (block * 16)), -(-2048 // rows))))
    grid = (bx, int(min(rows, 65535)))
    raw_module(_SOURCE).get_function("binned_sum")(
        grid, (block,), (idx, w if w is not None else np.uint64(0), np.int64(m), np.int64(rows), np.int32(nbins),
                         np.int32(w is not None), out), shared_mem=8 * nbins)
    return out


def segment_rows_sum(rows, values, n: int, sorted_entries=None):
    """(n, C) float32: out[r] = the sum of the rows of ``values`` (E, C) whose ``rows`` (E,) entry is r (entries
    outside 0..n-1 are dropped), each in the order of the entries: a stable sort of the entries by row, then one
    thread per output element. For wide rows (SEGMENT_ROWS_MIN_COLUMNS values or more) with many entries each
    (every particle of a chunk adds into the same fine orientations), where atomic adds into shared addresses
    serialise; narrow rows with many entries are slow here (one thread adds a whole row's entries).
    ``sorted_entries`` = (order (E,), start (n + 1,)): that sort made already (expectation.segments_of), so that
    sums of several arrays over the same rows sort once."""
    import cupy as cp  # noqa: PLC0415

    if not _on_gpu(rows, values):
        raise ValueError("segment_rows_sum takes CuPy arrays")
    rows = cp.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if values.shape[0] != rows.size:
        raise ValueError(f"segment_rows_sum: {values.shape[0]} rows of values for {rows.size} row indices")
    vals = cp.ascontiguousarray(values, dtype=np.float32).reshape(rows.size, int(np.prod(values.shape[1:])))
    C = int(vals.shape[1])
    out = cp.empty((n, C), dtype=np.float32)
    if n == 0 or C == 0:
        return out
    if sorted_entries is None:
        order = cp.argsort(rows, kind="stable")
        start = cp.searchsorted(rows[order], cp.arange(n + 1, dtype=np.int64), side="left")
    else:
        order, start = (cp.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in sorted_entries)
        if order.size != rows.size or start.size != n + 1:
            raise ValueError(f"segment_rows_sum: a sort of {order.size} entries into {start.size - 1} rows given "
                             f"for {rows.size} entries into {n} rows")
    block = 256
    grid = (int(min(-(-C // block), 1 << 16)), int(min(n, 65535)))
    raw_module(_SOURCE).get_function("segment_rows_sum")(
        grid, (block,), (vals, order, start, np.int64(n), np.int64(C), out))
    return out

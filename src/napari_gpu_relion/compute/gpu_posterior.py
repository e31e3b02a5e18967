"""Fused CUDA kernels for the log-domain posterior weights of an E-step pass (expectation.posterior_weights).

The log weight of sample (i, r, c) of the scores diff2 (I, R, C) is lw = log_prior(i, r, c) - diff2 (float64).
The log prior is a :class:`~.sample_prior.SampleLogPrior`: a small table indexed by (particle, row group, column
group) plus an optional per-column term, so it is read from cache, never written out as an (I, R, C) float64
array. Two passes read the float32 scores:

1. ``lw_maxsum``: per row segment, the largest lw, its first index (argmax's tie rule) and the float64 sum of
   exp(lw - largest), rescaled whenever the largest grows (one pass instead of a max pass and a sum pass);
2. ``lw_normalise_select``: p = float32(exp(lw - top) / S), and the samples with p >= eps that RELION's
   significance threshold can reach (expectation.significance_threshold), counted per row and packed, unordered,
   into an (I, cap) array (a warp-aggregated atomic per 32 samples).

Then ``significant_weights`` makes the mask p >= w_sig (and p > 0) and zeroes the rest of p in place, in one
elementwise pass. lw, exp(lw - top) and the division are the array code's operations in the same precision, so
the best sample, top and p are its values; S is the same sum added in another order (float64 rounding); the
packed candidates are sorted before they are summed, so the threshold is the array code's. Rows are split into
segments so that a batch of few particles still fills the GPU. ``tests/test_gpu.py`` checks all of it against the
array code.

Importing this module never imports CuPy; the kernels compile on first use (CuPy caches them on disk).
"""

from __future__ import annotations

import functools

import numpy as np

from .backend import get_array_module, raw_module
from .sample_prior import SampleLogPrior

#: Off only to compare with the array code (tests, benchmarks).
ENABLED = True

_BLOCK = 256
_SEGMENT = 1 << 16  # samples per block and row: >= ~130 blocks for a batch of 64 rows of 10^6 samples

_SOURCE = r"""
#define BLOCK 256

// The log weight of sample j = r * C + c of particle i: table[i, rowmap[r], colmap[c]] (+ column[i * cs + c])
// - d2[i, j], in the array code's order of operations.
struct Lw {
    const float* d2; const double* table; const int* rowmap; const int* colmap; const double* column;
    long long cs; int A; int B; int has_column;
    __device__ __forceinline__ double at(long long i, long long M, long long j, int r, int c) const {
        double lp = table[((long long)i * A + rowmap[r]) * B + colmap[c]];
        if (has_column) lp = lp + column[i * cs + c];
        return lp - (double)d2[i * M + j];
    }
};

__device__ __forceinline__ void step(int& r, int& c, const int C, const int dr, const int dc) {
    c += dc; r += dr;
    if (c >= C) { c -= C; r += 1; }
}

extern "C" __global__ void lw_maxsum(const float* __restrict__ d2, const double* __restrict__ table,
                                     const int* __restrict__ rowmap, const int* __restrict__ colmap,
                                     const double* __restrict__ column, const long long cs, const int A,
                                     const int B, const int has_column, const int R, const int C,
                                     const long long seg, double* __restrict__ out_max,
                                     long long* __restrict__ out_idx, double* __restrict__ out_sum) {
    const Lw lw{d2, table, rowmap, colmap, column, cs, A, B, has_column};
    const long long i = blockIdx.y, M = (long long)R * C;
    const long long s0 = blockIdx.x * seg, s1 = min(M, s0 + seg);
    const int dr = BLOCK / C, dc = BLOCK % C;
    long long j = s0 + threadIdx.x;
    int r = (int)(j / C), c = (int)(j % C);
    double best = -1.0 / 0.0, sum = 0.0;
    long long idx = 0x7fffffffffffffffLL;
    for (; j < s1; j += BLOCK) {
        const double v = lw.at(i, M, j, r, c);
        if (v > best) { sum = sum * exp(best - v) + 1.0; best = v; idx = j; }
        else if (v == best) { if (j < idx) idx = j; if (v != -1.0 / 0.0) sum += 1.0; }
        else sum += exp(v - best);
        step(r, c, C, dr, dc);
    }
    __shared__ double sb[BLOCK];
    __shared__ double ss[BLOCK];
    __shared__ long long si[BLOCK];
    sb[threadIdx.x] = best; ss[threadIdx.x] = sum; si[threadIdx.x] = idx;
    __syncthreads();
    for (int h = BLOCK / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) {
            const double b1 = sb[threadIdx.x], b2 = sb[threadIdx.x + h];
            const long long i1 = si[threadIdx.x], i2 = si[threadIdx.x + h];
            const double top = b1 > b2 ? b1 : b2;
            if (top != -1.0 / 0.0)
                ss[threadIdx.x] = ss[threadIdx.x] * exp(b1 - top) + ss[threadIdx.x + h] * exp(b2 - top);
            if (b2 > b1 || (b2 == b1 && i2 < i1)) { sb[threadIdx.x] = b2; si[threadIdx.x] = i2; }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const long long o = i * gridDim.x + blockIdx.x;
        out_max[o] = sb[0]; out_idx[o] = si[0]; out_sum[o] = ss[0];
    }
}

extern "C" __global__ void lw_normalise_select(const float* __restrict__ d2, const double* __restrict__ table,
                                               const int* __restrict__ rowmap, const int* __restrict__ colmap,
                                               const double* __restrict__ column, const long long cs,
                                               const int A, const int B, const int has_column, const int R,
                                               const int C, const long long seg, const double* __restrict__ top,
                                               const double* __restrict__ S, float* __restrict__ p,
                                               const float eps, const int cap, int* __restrict__ counts,
                                               float* __restrict__ packed) {
    const Lw lw{d2, table, rowmap, colmap, column, cs, A, B, has_column};
    const long long i = blockIdx.y, M = (long long)R * C;
    const long long s0 = blockIdx.x * seg, s1 = min(M, s0 + seg);
    const int dr = BLOCK / C, dc = BLOCK % C;
    const double t = top[i], s = S[i];
    const int lane = threadIdx.x & 31;
    long long j = s0 + threadIdx.x;
    int r = (int)(j / C), c = (int)(j % C);
    for (long long base = s0; base < s1; base += BLOCK, j += BLOCK) {
        const bool in = j < s1;
        float pv = 0.0f;
        if (in) {
            pv = (float)(exp(lw.at(i, M, j, r, c) - t) / s);
            p[i * M + j] = pv;
        }
        const bool cand = in && pv >= eps;
        const unsigned mask = __ballot_sync(0xffffffffu, cand);
        if (mask != 0u) {  // the same for the whole warp
            const int leader = __ffs(mask) - 1;
            int first = 0;
            if (lane == leader) first = atomicAdd(&counts[i], __popc(mask));
            first = __shfl_sync(0xffffffffu, first, leader);
            if (cand) {
                const int slot = first + __popc(mask & ((1u << lane) - 1u));
                if (slot < cap) packed[i * (long long)cap + slot] = pv;
            }
        }
        if (in) step(r, c, C, dr, dc);
    }
}
"""


def applies(diff2, log_prior) -> bool:
    """fused_weights takes these: enabled, float32 CuPy scores (I, R, C) with 0 < I <= 65,535 (the kernels' grid
    has one y block per particle) and R x C < 2^31, and a SampleLogPrior of CuPy float64 arrays whose table has a
    row per particle and covers R x C, and whose column term is (1 or I, C) (the kernels read them unchecked)."""
    if not (ENABLED and isinstance(log_prior, SampleLogPrior) and get_array_module(diff2) is not np):
        return False
    if diff2.ndim != 3 or log_prior.table.ndim != 3:
        return False
    I, R, C = diff2.shape
    t, col = log_prior.table, log_prior.column
    covers = (t.shape[0] == I and t.shape[1] * log_prior.row_group >= R and t.shape[2] * log_prior.col_group >= C
              and (col is None or (col.ndim == 2 and col.shape[0] in (1, I) and col.shape[1] == C)))
    return (covers and get_array_module(t) is not np and diff2.dtype == np.float32 and t.dtype == np.float64
            and 0 < I <= 65535 and R * C < 2**31 and (col is None or col.dtype == np.float64))


def fused_weights(diff2, log_prior, eps: float, cap: int):
    """(p, best, top, S, counts, packed) of lw = log_prior - diff2 per particle over its R x C samples (diff2
    (I, R, C) float32, log_prior a SampleLogPrior of float64 CuPy arrays): p = exp(lw - top) / S (I, R C)
    float32, best the first index of the largest lw (I,) int64, top = lw[best] and S = sum exp(lw - top) (I,)
    float64; counts (I,) int32 the samples with p >= eps (float32; none for eps = inf) and packed (I, cap)
    float32 the first ``cap`` of their p values found, in no particular order (rows with counts > cap have only
    some)."""
    import cupy as cp  # noqa: PLC0415

    if not applies(diff2, log_prior):
        raise ValueError("the fused posterior weights read float32 CuPy scores and a float64 CuPy SampleLogPrior")
    I, R, C = (int(n) for n in diff2.shape)
    M = R * C
    d2 = cp.ascontiguousarray(diff2)
    table = cp.ascontiguousarray(log_prior.table)
    A, B = int(table.shape[1]), int(table.shape[2])
    rowmap = (cp.arange(R, dtype=np.int32) // np.int32(log_prior.row_group)).astype(np.int32)
    colmap = (cp.arange(C, dtype=np.int32) // np.int32(log_prior.col_group)).astype(np.int32)
    if log_prior.column is None:
        column, cs, has_column = table, 0, 0  # never read
    else:
        column = cp.ascontiguousarray(log_prior.column)
        cs, has_column = (C if column.shape[0] > 1 else 0), 1
    nseg = max(1, -(-M // _SEGMENT))
    k = raw_module(_SOURCE)
    args = (d2, table, rowmap, colmap, column, np.int64(cs), np.int32(A), np.int32(B), np.int32(has_column),
            np.int32(R), np.int32(C), np.int64(_SEGMENT))
    part_max = cp.empty((I, nseg), dtype=np.float64)
    part_idx = cp.empty((I, nseg), dtype=np.int64)
    part_sum = cp.empty((I, nseg), dtype=np.float64)
    k.get_function("lw_maxsum")((nseg, I), (_BLOCK,), (*args, part_max, part_idx, part_sum))
    seg = cp.argmax(part_max, axis=1)  # the first segment holding the row's largest value: argmax's tie rule
    rows = cp.arange(I)
    top = part_max[rows, seg]
    best = part_idx[rows, seg]
    S = (part_sum * cp.exp(part_max - top[:, None])).sum(axis=1)
    p = cp.empty((I, M), dtype=np.float32)
    counts = cp.zeros(I, dtype=np.int32)
    cap = max(1, int(cap))
    packed = cp.empty((I, cap), dtype=np.float32)
    k.get_function("lw_normalise_select")((nseg, I), (_BLOCK,),
                                          (*args, top, S, p, np.float32(eps), np.int32(cap), counts, packed))
    return p, best, top, S, counts, packed


@functools.cache
def _mask_kernels():
    import cupy as cp  # noqa: PLC0415

    mask = cp.ElementwiseKernel("float32 p, float32 ws", "bool sig", "sig = (p >= ws) && (p > 0.0f)",
                                "ngr_significant")
    zero = cp.ElementwiseKernel("float32 ws", "float32 p, bool sig",
                                "sig = (p >= ws) && (p > 0.0f); if (!sig) p = 0.0f;", "ngr_significant_weights")
    return mask, zero


def significant_weights(p, wsig, weights: bool):
    """(sig, w): sig = (p >= w_sig of the row) & (p > 0) (I, M) bool in one pass; with ``weights`` w is p with
    the other samples set to 0, in place (p is w afterwards), else None."""
    import cupy as cp  # noqa: PLC0415

    mask, zero = _mask_kernels()
    ws = wsig.astype(np.float32, copy=False)[:, None]
    if not weights:
        return mask(p, ws), None
    sig = cp.empty(p.shape, dtype=bool)
    zero(ws, p, sig)
    return sig, p


@functools.cache
def _row_key_kernels():
    import cupy as cp  # noqa: PLC0415

    # (row, value) -> one uint64 whose ascending order is the rows in order, each row's values descending: the
    # row in the high 32 bits, the complement of the value's bits in the low 32 (the bits of a float >= 0 order
    # as the floats do). Values <= 0 (the packing's -1, -0.0) become +0.0.
    encode = cp.ElementwiseKernel(
        "float32 v, int64 m", "uint64 key",
        "float x = v > 0.0f ? v : 0.0f; "
        "key = ((unsigned long long)(i / m) << 32) | (unsigned long long)(0xFFFFFFFFu - __float_as_uint(x));",
        "ngr_row_desc_key")
    decode = cp.ElementwiseKernel(
        "uint64 key", "float32 v", "v = __uint_as_float(0xFFFFFFFFu - (unsigned int)(key & 0xFFFFFFFFull));",
        "ngr_row_desc_value")
    return encode, decode


def sort_rows_descending(vals):
    """Each row of ``vals`` (I, m) float32 sorted descending, values <= 0 as 0 (what the significance threshold
    sums): one radix sort of (row, value) keys over the whole array instead of CuPy's sort along an axis (a
    comparison sort over (segment, value) pairs)."""
    import cupy as cp  # noqa: PLC0415

    encode, decode = _row_key_kernels()
    I, m = vals.shape
    if I == 0 or m == 0:
        return cp.zeros((I, m), dtype=np.float32)
    keys = encode(cp.ascontiguousarray(vals, dtype=np.float32), np.int64(m))
    keys = cp.sort(keys.reshape(-1))
    return decode(keys).reshape(I, m)

"""Fused CUDA kernels for the log-domain posterior weights of an E-step pass (expectation.posterior_weights).

The array code makes the log weights lw = log_prior - diff2 (float64) of every sample, then reads and writes
the whole (I, M) float64 array five more times (argmax, exp(lw - top), sum, divide, cast to float32): at HEALPix
order 3 that is ~10^8 samples per batch and, on an H200, 0.5 s of a 2.0 s auto-refine iteration (issue 15).
Here three passes read diff2 (float32) and log_prior (float64) and compute lw on the fly:

1. ``lw_max``: per row segment, the largest lw and its first index (argmax's tie rule);
2. ``lw_expsum``: per row segment, the float64 sum of exp(lw - top);
3. ``lw_normalise``: p = float32(exp(lw - top) / S).

lw, exp(lw - top) and the division are the array code's operations in the same precision, so p, the best
sample and top are its values; S is the same sum added in another order (float64 rounding). Rows are split
into segments so that a batch of few particles still fills the GPU. ``tests/test_gpu.py`` checks the result
against the array code.

Importing this module never imports CuPy; the kernels compile on first use (CuPy caches them on disk).
"""

from __future__ import annotations

import numpy as np

from .backend import get_array_module, launch_grid_stride, raw_module

#: Off only to compare with the array code (tests, benchmarks).
ENABLED = True

_BLOCK = 256
_SEGMENT = 1 << 16  # samples per block and row: >= ~130 blocks for a batch of 64 rows of 10^6 samples

_SOURCE = r"""
#define BLOCK 256

__device__ __forceinline__ double lw_at(const double* lp, const float* d2, long long k) {
    return lp[k] - (double)d2[k];
}

extern "C" __global__ void lw_max(const double* __restrict__ lp, const float* __restrict__ d2,
                                  const long long M, const long long seg, double* __restrict__ out_max,
                                  long long* __restrict__ out_idx) {
    const long long row = blockIdx.y, s0 = blockIdx.x * seg;
    const long long s1 = min(M, s0 + seg);
    const long long base = row * M;
    double best = -1.0 / 0.0;
    long long idx = 0x7fffffffffffffffLL;
    for (long long j = s0 + threadIdx.x; j < s1; j += BLOCK) {
        const double v = lw_at(lp, d2, base + j);
        if (v > best || (v == best && j < idx)) { best = v; idx = j; }
    }
    __shared__ double sb[BLOCK];
    __shared__ long long si[BLOCK];
    sb[threadIdx.x] = best; si[threadIdx.x] = idx;
    __syncthreads();
    for (int h = BLOCK / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) {
            const double v = sb[threadIdx.x + h];
            const long long i = si[threadIdx.x + h];
            if (v > sb[threadIdx.x] || (v == sb[threadIdx.x] && i < si[threadIdx.x])) {
                sb[threadIdx.x] = v; si[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out_max[row * gridDim.x + blockIdx.x] = sb[0];
        out_idx[row * gridDim.x + blockIdx.x] = si[0];
    }
}

extern "C" __global__ void lw_expsum(const double* __restrict__ lp, const float* __restrict__ d2,
                                     const long long M, const long long seg, const double* __restrict__ top,
                                     double* __restrict__ out_sum) {
    const long long row = blockIdx.y, s0 = blockIdx.x * seg;
    const long long s1 = min(M, s0 + seg);
    const long long base = row * M;
    const double t = top[row];
    double acc = 0.0;
    for (long long j = s0 + threadIdx.x; j < s1; j += BLOCK)
        acc += exp(lw_at(lp, d2, base + j) - t);
    __shared__ double sa[BLOCK];
    sa[threadIdx.x] = acc;
    __syncthreads();
    for (int h = BLOCK / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) sa[threadIdx.x] += sa[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) out_sum[row * gridDim.x + blockIdx.x] = sa[0];
}

extern "C" __global__ void lw_normalise(const double* __restrict__ lp, const float* __restrict__ d2,
                                        const long long M, const long long n, const double* __restrict__ top,
                                        const double* __restrict__ S, float* __restrict__ p) {
    for (long long k = blockIdx.x * (long long)BLOCK + threadIdx.x; k < n; k += (long long)gridDim.x * BLOCK) {
        const long long row = k / M;
        p[k] = (float)(exp(lw_at(lp, d2, k) - top[row]) / S[row]);
    }
}
"""

def applies(diff2, log_prior) -> bool:
    """fused_weights takes these: enabled, CuPy arrays, float32 scores, a float64 log prior of their shape or
    broadcastable to it, and at most 65,535 rows (the kernels' grid has one y block per row)."""
    return (ENABLED and get_array_module(diff2) is not np and get_array_module(log_prior) is not np
            and diff2.dtype == np.float32 and log_prior.dtype == np.float64 and 0 < diff2.shape[0] <= 65535)


def fused_weights(diff2, log_prior):
    """(p, best, top, S) of the rows of lw = log_prior - diff2 over their M samples (diff2 (I, ...) float32,
    log_prior broadcastable to it, float64): p = exp(lw - top) / S (I, M) float32, best the first index of the
    largest lw (I,) int64, top = lw[best] and S = sum exp(lw - top) (I,) float64."""
    import cupy as cp  # noqa: PLC0415

    if not applies(diff2, log_prior):
        raise ValueError("the fused posterior weights read float32 CuPy scores and a float64 CuPy log prior")
    I = int(diff2.shape[0])
    M = int(np.prod(diff2.shape[1:]))
    d2 = cp.ascontiguousarray(diff2).reshape(I, M)
    lp = cp.ascontiguousarray(cp.broadcast_to(log_prior, diff2.shape)).reshape(I, M)
    nseg = max(1, -(-M // _SEGMENT))
    k = raw_module(_SOURCE)
    part_max = cp.empty((I, nseg), dtype=np.float64)
    part_idx = cp.empty((I, nseg), dtype=np.int64)
    args = (lp, d2, np.int64(M), np.int64(_SEGMENT))
    k.get_function("lw_max")((nseg, I), (_BLOCK,), (*args, part_max, part_idx))
    seg = cp.argmax(part_max, axis=1)  # the first segment holding the row's largest value: argmax's tie rule
    rows = cp.arange(I)
    top = part_max[rows, seg]
    best = part_idx[rows, seg]
    part_sum = cp.empty((I, nseg), dtype=np.float64)
    k.get_function("lw_expsum")((nseg, I), (_BLOCK,), (*args, top, part_sum))
    S = part_sum.sum(axis=1)
    p = cp.empty((I, M), dtype=np.float32)
    n = I * M
    launch_grid_stride(_SOURCE, "lw_normalise", n, (lp, d2, np.int64(M), np.int64(n), top, S, p), _BLOCK)
    return p, best, top, S

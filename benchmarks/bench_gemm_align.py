"""The coarse pass's score GEMM, (M x 2K) @ (2K x N) in float32 and TF32, with the contraction length 2K as the
pixels give it and padded with zeros to a multiple of expectation.GEMM_ALIGN: cuBLAS's fast kernels read
16-byte-aligned rows. Reports TFLOP/s of the useful products (2 M N 2K) and, as the limit, an 8192^3 SGEMM and
TF32 GEMM measured in the same run.

    python benchmarks/bench_gemm_align.py --out results/gemm_align_h100.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _tflops(cp, a, b, flops: float, tf32: bool, repeat: int = 5) -> float:
    from napari_gpu_relion.compute.backend import matmul_tf32

    with matmul_tf32(cp, tf32):
        a @ b.T
        best = np.inf
        for _ in range(repeat):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            a @ b.T
            cp.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
    return flops / best / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--npix", default="211,799,1563", help="coarse pixel counts (box 128: coarse sizes 22, 44, 62)")
    ap.add_argument("--M", type=int, default=64 * 29 * 4, help="rows: particles x translations of a batch")
    ap.add_argument("--N", type=int, default=36864, help="orientations (HEALPix order 3)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import cupy as cp

    from napari_gpu_relion.compute.expectation import gemm_width

    rng = cp.random.default_rng(0)
    big = rng.standard_normal((8192, 8192), dtype=np.float32)
    limit = {"float32": _tflops(cp, big, big, 2.0 * 8192**3, False), "tf32": _tflops(cp, big, big, 2.0 * 8192**3, True)}
    del big
    rows = []
    for npix in (int(n) for n in a.npix.split(",")):
        for width in sorted({2 * npix, gemm_width(npix)}):
            x = rng.standard_normal((a.M, width), dtype=np.float32)
            y = rng.standard_normal((a.N, width), dtype=np.float32)
            flops = 2.0 * a.M * a.N * 2 * npix
            row = {"npix": npix, "width": width, **{k: _tflops(cp, x, y, flops, k == "tf32") for k in limit}}
            rows.append(row)
            print(row, flush=True)
            del x, y
    props = cp.cuda.runtime.getDeviceProperties(0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"gpu": props["name"].decode(), "M": a.M, "N": a.N, "limit_8192_tflops": limit,
                                 "cases": rows}, indent=1))


if __name__ == "__main__":
    main()

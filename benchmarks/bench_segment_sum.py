"""Per-row sums of the fine pass's gathered chunks on the GPU (issue 15): CuPy's scatter_add (atomic adds)
against gpu_kernels.segment_rows_sum (entries sorted by row, summed per row), at a chunk's shapes: ``ni``
particles, each with ``cols`` parent columns drawn from a pool of ``pool`` coarse rows, ``children`` fine rows
per parent, ``C`` float32 values per row (2 x the fine pixels for the slices). Bytes read per call over the
wall give the fraction of the memory bandwidth. Writes JSON naming the GPU.

Run (GPU machine): python benchmarks/bench_segment_sum.py --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import time

import cupy as cp
import cupyx
import numpy as np

from napari_gpu_relion.compute import gpu_kernels


def timed(fn, reps: int = 5) -> float:
    fn()
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t) / reps


def case(ni: int, cols: int, pool: int, children: int, C: int, rng) -> dict:
    parents = np.stack([rng.choice(pool, cols, replace=False) for _ in range(ni)])  # (ni, cols)
    fine = (parents[:, :, None] * children + np.arange(children)).reshape(-1)
    touched, flat = np.unique(fine, return_inverse=True)
    rows = cp.asarray(flat.reshape(-1))
    vals = cp.asarray(rng.normal(size=(rows.size, C)).astype(np.float32))
    n = int(touched.size)

    def atomics():
        out = cp.zeros((n, C), dtype=np.float32)
        cupyx.scatter_add(out, rows, vals)
        return out

    def sorted_rows():
        return gpu_kernels.segment_rows_sum(rows, vals, n)

    a, b = atomics(), sorted_rows()
    err = float(cp.abs(a - b).max() / cp.abs(a).max())
    ta, tb = timed(atomics), timed(sorted_rows)
    gb = vals.nbytes / 1e9
    return {"ni": ni, "cols": cols, "pool": pool, "children": children, "C": C, "entries": int(rows.size),
            "rows_out": n, "GB_read": gb, "scatter_add_ms": ta * 1e3, "segment_rows_sum_ms": tb * 1e3,
            "GB_per_s_scatter_add": gb / ta, "GB_per_s_segment_rows_sum": gb / tb, "max_rel_diff": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for ni, cols, pool, children, C in [(294, 854, 18432, 8, 700), (294, 854, 18432, 8, 350),
                                        (294, 854, 3000, 8, 700), (100, 300, 1000, 8, 2000),
                                        (450, 500, 9000, 8, 1200)]:
        r = case(ni, cols, pool, children, C, rng)
        print(json.dumps(r), flush=True)
        rows.append(r)
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cases": rows}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

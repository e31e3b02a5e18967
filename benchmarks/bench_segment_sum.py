"""Per-row sums of the fine pass's gathered chunks on the GPU (issue 15): CuPy's scatter_add (atomic adds)
against gpu_kernels.segment_rows_sum (entries sorted by row, summed per row), at a chunk's shapes: ``ni``
particles, each with ``cols`` parent columns drawn from a pool of ``pool`` coarse rows, ``children`` fine rows
per parent, ``C`` float32 values per row (2 x the fine pixels for the slices). Bytes read per call over the
wall give the fraction of the memory bandwidth. Then chunks with padding (particles with fewer parents than the
chunk's largest count): the padding summed into parent 0's rows against left out. Writes JSON naming the GPU.

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


def case_padded(ni: int, cols: int, pool: int, children: int, C: int, short: float, rng) -> dict:
    """A gathered chunk whose particles have from (1 - short) x cols to cols parent columns, padded to cols:
    the padding keyed to parent 0's fine rows (the layout before the twenty-fourth session: one long group that
    one thread per value adds up entry after entry) against keyed -1 (in no group). Each: the entries' sort
    (segments_of) and the sum (grouped_sum), the same values."""
    from napari_gpu_relion.compute.expectation import grouped_sum, segments_of  # noqa: PLC0415

    counts = rng.integers(int(cols * (1 - short)), cols + 1, ni)
    parents = np.stack([rng.choice(pool, cols, replace=False) for _ in range(ni)])
    pad = np.arange(cols)[None, :] >= counts[:, None]
    fine = parents[:, :, None] * children + np.arange(children)
    vals = cp.asarray(rng.normal(size=(fine.size, C)).astype(np.float32))
    vals.reshape(ni, cols, children, C)[cp.asarray(pad)] = 0  # the padding's slices are 0 (weight 0)
    out = {"ni": ni, "cols": cols, "pool": pool, "children": children, "C": C, "short": short,
           "padded_entries": int(pad.sum()) * children, "entries": int(fine.size)}
    sums = {}
    for name, keys in (("to_parent_0", np.where(pad[:, :, None], np.arange(children), fine)),
                       ("left_out", np.where(pad[:, :, None], -1, fine))):
        k = cp.asarray(keys.reshape(-1))
        g = segments_of(k)
        sums[name] = (g.distinct.get(), grouped_sum(g, vals).get())
        out[f"{name}_sort_ms"] = timed(lambda k=k: segments_of(k)) * 1e3
        out[f"{name}_sum_ms"] = timed(lambda g=g: grouped_sum(g, vals)) * 1e3
    (d0, s0), (d1, s1) = sums["to_parent_0"], sums["left_out"]
    same = np.isin(d0, d1)
    out["same_sums"] = bool(np.array_equal(s0[same], s1) and not np.abs(s0[~same]).any())
    return out


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
    padded = []
    for ni, cols, pool, children, C, short in [(667, 585, 36864, 8, 500, 0.3), (667, 585, 36864, 8, 250, 0.3),
                                                (294, 854, 18432, 8, 700, 0.1)]:
        r = case_padded(ni, cols, pool, children, C, short, rng)
        print(json.dumps(r), flush=True)
        padded.append(r)
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cases": rows, "padded": padded}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

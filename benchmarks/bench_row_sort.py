"""The significance threshold's sort of each row (expectation._sorted_descending): CuPy's sort along the last
axis of (I, m) against one radix sort of (row, value) uint64 keys (gpu_posterior.sort_rows_descending), at
the shapes of a box-128 auto-refine's iteration 1 (a batch of 512 rows of packed candidates of up to a quarter
of 24,192 coarse samples; full rows of 24,192; a fine chunk's rows of 84 x 2,048 samples). Reports the best of
5 times and the rate in sorted values per second; checks the two give the same array.

    python benchmarks/bench_row_sort.py --out results/row_sort_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _best(cp, fn, repeat: int = 5) -> float:
    fn()
    best = np.inf
    for _ in range(repeat):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    import cupy as cp

    from napari_gpu_relion.compute.gpu_posterior import sort_rows_descending

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for shape in ((512, 6048), (512, 24192), (64, 172032)):
        v = cp.asarray(rng.random(shape, dtype=np.float32))
        old = _best(cp, lambda v=v: -cp.sort(-cp.maximum(v, np.float32(0.0)), axis=1))
        new = _best(cp, lambda v=v: sort_rows_descending(v))
        same = bool(cp.array_equal(-cp.sort(-v, axis=1), sort_rows_descending(v)))
        n = shape[0] * shape[1]
        rows.append({"shape": shape, "cupy_sort_axis_s": old, "key_radix_sort_s": new, "speedup": old / new,
                     "values_per_s_key_sort": n / new, "same": same})
        print(json.dumps(rows[-1]), flush=True)
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy": cp.__version__, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

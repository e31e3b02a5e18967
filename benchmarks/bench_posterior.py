"""Time the E-step's posterior weights and significance (expectation.posterior_weights) on the GPU, three ways on
the same scores: the fused kernels with the factored log prior (what the E-step passes now), the fused kernels
with the log prior given as a full float64 array (what the E-step passed before: the array is made first, and
that time is counted), and the CuPy array code. Reports milliseconds, the bytes the factored path must move at
least (scores read twice, p written and read, the mask written; the weights written too with --weights) and that
as a fraction of the device-to-device copy bandwidth measured in the same run.

    python benchmarks/bench_posterior.py --cases 64:29:36864:sharp,16:116:8192:flat --out results/x.json

A case is I:R:C:kind: I particles, R rows (translations), C columns (orientations), kind sharp (posteriors
concentrated on few samples, as from iteration 2 on) or flat (iteration 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _time(fn, repeat: int, sync) -> list[float]:
    out = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _case(case: str, weights: bool, repeat: int, sync, copy_bw: float, rng) -> dict:
    """Time one I:R:C:kind case three ways, and the factored path's three steps alone."""
    import cupy as cp

    from napari_gpu_relion.compute import expectation, gpu_posterior
    from napari_gpu_relion.compute.expectation import SampleLogPrior

    I, R, C, kind = case.split(":")
    I, R, C = int(I), int(R), int(C)
    width = 30.0 if kind == "sharp" else 0.05
    d2 = cp.asarray((1.0e5 + width * rng.standard_normal((I, R, C), dtype=np.float32)).astype(np.float32))
    lp = SampleLogPrior(cp.asarray(rng.normal(0.0, 0.5, (I, R, 1))), col_group=C,
                        column=cp.asarray(rng.normal(0.0, 0.5, (1, C))))

    def factored():
        return expectation.posterior_weights(d2, lp, 0.999, weights=weights)

    def full_array():
        return expectation.posterior_weights(d2, lp.full((I, R, C)), 0.999, weights=weights)

    def array_code():
        gpu_posterior.ENABLED = False
        try:
            return expectation.posterior_weights(d2, lp, 0.999, weights=weights)
        finally:
            gpu_posterior.ENABLED = True

    eps = expectation.candidate_floor(0.999, R * C)
    p, _, _, _, counts, packed = gpu_posterior.fused_weights(d2, lp, eps, R * C // 4)
    _, wsig = expectation.significance_threshold(p, 0.999, candidates=(counts, packed))
    steps = (("factored: fused_weights", lambda: gpu_posterior.fused_weights(d2, lp, eps, R * C // 4)),
             ("factored: threshold", lambda: expectation.significance_threshold(p, 0.999, candidates=(counts, packed))),
             ("factored: mask", lambda: gpu_posterior.significant_weights(p, wsig, False)))
    nsig = factored().nr_significant
    same = all(bool((fn().nr_significant == nsig).all()) for fn in (full_array, array_code))
    times = {name: min(_time(fn, repeat, sync)) for name, fn in
             (("factored", factored), ("full_array", full_array), ("array_code", array_code), *steps)}
    n = I * R * C
    least = n * (4 + 4 + 4 + 4 + 1 + (4 if weights else 0))
    return dict(case=case, samples=n, mean_significant=float(nsig.mean()), same_significance=same,
                seconds=times, least_bytes=least, fraction_of_copy_bandwidth=least / times["factored"] / copy_bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="64:29:36864:sharp,32:29:36864:flat,8:116:65536:flat")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--weights", action="store_true", help="also make the zeroed weights (the fine pass)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import cupy as cp

    sync = cp.cuda.Device().synchronize
    pair = [cp.empty(1 << 28, dtype=np.float32) for _ in range(2)]  # 1 GiB each
    copy_bw = 2 * pair[0].nbytes / min(_time(lambda: cp.copyto(pair[1], pair[0]), 5, sync))
    pair.clear()
    rng = np.random.default_rng(0)
    rows = []
    for case in a.cases.split(","):
        rows.append(_case(case, a.weights, a.repeat, sync, copy_bw, rng))
        print(rows[-1], flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    props = cp.cuda.runtime.getDeviceProperties(0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(dict(gpu=props["name"].decode(), copy_bandwidth_GBps=copy_bw / 1e9,
                                     weights=a.weights, cases=rows), indent=1))


if __name__ == "__main__":
    main()

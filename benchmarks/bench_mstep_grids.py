"""The M-step's passes over the padded accumulator grids, by resolution (issue 47/48's per-iteration fixed costs):
auto-refine's half-map FSC (``pooled_average`` of both halves and their FSC), its low-resolution join
(``join_low_resolution``) and the classification M-step's soft edge and gridding correction of K maps
(``_soft_edge_and_gridding``, whose means CuPy's reductions without CUB made on a few thread blocks).

For each r_max (pixels of the box) the accumulators hold random values only where insertion up to r_max can put
them (insertion_reach's box, as after an E-step); ``pooled_average`` then goes over that box, and the same call
with r_max set to the box's Nyquist goes over the whole padded grid, as before the thirty-ninth session (the same
values: the rest is zero; the script checks it). The join is timed against a slab-by-slab whole-grid join written
here (what join_low_resolution was). Writes JSON naming the GPU or the CPU.

Run: python benchmarks/bench_mstep_grids.py [--box 256] [--pad 2] [--r_max 14,30,64] [--K 6] [--cpu]
     [--out benchmarks/results/mstep_grids_<hardware>.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from napari_gpu_relion.compute.backprojector import BackProjector, _soft_edge_and_gridding, insertion_reach
from napari_gpu_relion.compute.fourier import half_grid_slabs
from napari_gpu_relion.compute.maximization import fsc_from_backprojectors, join_low_resolution, round_half_away
from napari_gpu_relion.runtime.device import select_backend


def _sync(xp) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def timed(fn, xp, reps: int) -> float:
    fn()
    _sync(xp)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(xp)
    return (time.perf_counter() - t) / reps


def filled(box: int, pad: int, r_max: float, xp, seed: int) -> BackProjector:
    """A back-projector whose grids hold random values in insertion_reach's box of r_max, zero elsewhere."""
    bp = BackProjector(box, pad, r_max, ndim=3, xp=xp)
    P = bp.padded_size
    R = min(insertion_reach(pad, r_max), P // 2)
    rows = np.r_[0:R + 1, P - R:P] if 2 * R + 1 < P else np.arange(P)
    rng = np.random.default_rng(seed)
    for g in (bp.data_re, bp.data_im, bp.weight):
        block = rng.random((rows.size, rows.size, min(R + 1, g.shape[-1])))
        g[xp.ix_(xp.asarray(rows), xp.asarray(rows), xp.arange(block.shape[-1]))] = xp.asarray(block)
    return bp


def whole_grid_join(bp1: BackProjector, bp2: BackProjector, r_join: float) -> None:
    """join_low_resolution as it was: slab by slab over both whole padded grids."""
    xp = bp1.xp
    lim = float(round_half_away(np.float64(bp1.pad * r_join))) ** 2
    for sl, ks in half_grid_slabs(bp1.padded_size, 3, xp):
        sel = xp.broadcast_to(sum(k.astype(np.float64) ** 2 for k in ks) <= lim, bp1.weight[sl].shape)
        for a in ("data_re", "data_im", "weight"):
            x1, x2 = getattr(bp1, a)[sl], getattr(bp2, a)[sl]
            avg = 0.5 * (x1 + x2)
            x1[sel] = avg[sel]
            x2[sel] = avg[sel]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--box", type=int, default=256)
    ap.add_argument("--pad", type=int, default=2)
    ap.add_argument("--r_max", default="14,30,64")
    ap.add_argument("--K", type=int, default=6)
    ap.add_argument("--r_join", type=float, default=7.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu, gpu=None if a.cpu else 0)
    xp = be.xp
    rows = []
    for r_max in [float(x) for x in a.r_max.split(",")]:
        bps = [filled(a.box, a.pad, r_max, xp, s) for s in (1, 2)]
        fsc = fsc_from_backprojectors(*bps)
        box_s = timed(lambda: fsc_from_backprojectors(*bps), xp, a.reps)  # noqa: B023
        for bp in bps:
            bp.r_max = a.box / 2  # the same grids, pooled over the whole padded grid
        same = bool(np.allclose(fsc_from_backprojectors(*bps)[: int(r_max) + 1], fsc[: int(r_max) + 1],
                                rtol=1e-12, atol=1e-12))
        whole_s = timed(lambda: fsc_from_backprojectors(*bps), xp, a.reps)  # noqa: B023
        for bp in bps:
            bp.r_max = r_max
        join_block_s = timed(lambda: join_low_resolution(*bps, a.r_join), xp, a.reps)  # noqa: B023
        join_whole_s = timed(lambda: whole_grid_join(*bps, a.r_join), xp, a.reps)  # noqa: B023
        rows.append({"r_max": r_max, "half_map_fsc_box_s": round(box_s, 4), "half_map_fsc_whole_grid_s":
                     round(whole_s, 4), "same_fsc": same, "join_block_s": round(join_block_s, 4),
                     "join_whole_grid_s": round(join_whole_s, 4)})
        print(json.dumps(rows[-1]), flush=True)
    vol = xp.asarray(np.random.default_rng(3).random((a.K,) + (a.box,) * 3))
    soft_s = timed(lambda: _soft_edge_and_gridding(vol.copy(), a.box, a.pad, 3, True, 1 << 28), xp, a.reps)
    out = {"hardware": be.name, "cpu": platform.processor() or platform.machine(), "args": vars(a),
           "rows": rows, "soft_edge_and_gridding_K_maps_s": round(soft_s, 4)}
    print(json.dumps({"soft_edge_and_gridding_K_maps_s": out["soft_edge_and_gridding_K_maps_s"]}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""How long the M-step's class maps take to reach every rank (issue 47): K maps of box^3 float32, each rank owning a
consecutive block of classes (runtime.distributed.owner_blocks), gathered to the host of every rank by

- ``allgather``: gather_items as the jobs call it (each rank's block sent once: NCCL's allgather between GPUs of
  their own, MPI_Allgatherv on the host path);
- ``sum``: the former way, one sum over the ranks of a zero-filled array of every class (the path the jobs still
  take where ranks share a GPU).

Run under MPI, one rank per GPU, e.g. on 2 H200s:

    mpiexec -n 2 python benchmarks/bench_map_gather.py --K 6 --box 256 --reps 5 --out R.json
    NAPARI_GPU_RELION_NCCL=0 mpiexec -n 2 python benchmarks/bench_map_gather.py ...   (the host path: issue 47's
        stand-in for ranks on different nodes)

Rank 0 writes the JSON (the GPU named, the path, each rep's seconds and the medians) and checks that both ways give
the same maps, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute.backend import to_host
from napari_gpu_relion.runtime import distributed


def _sum_gather(comm, xp, shape, dtype, mine: dict, pinned: bool) -> np.ndarray:
    """The former gather: a zero-filled array of every item, each rank's own filled in, summed over the ranks."""
    full = xp.zeros(shape, dtype=dtype)
    for i, a in mine.items():
        full[i] = a
    comm.sum_arrays([full])
    return np.asarray(to_host(full, pinned=pinned))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=int, default=6)
    ap.add_argument("--box", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pinned", type=int, default=1, help="1: maps come back in page-locked memory (as the jobs)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import cupy as cp

    comm = distributed.world()
    cp.cuda.Device(comm.local_rank % cp.cuda.runtime.getDeviceCount()).use()
    comm.prepare_device_sum()
    owners = distributed.owner_blocks([k * comm.size // a.K for k in range(a.K)])
    lo, hi = next(((lo, hi) for root, lo, hi in owners if root == comm.rank), (0, 0))
    rng = np.random.default_rng(comm.rank)
    mine = {k: cp.asarray(rng.standard_normal((a.box,) * 3, dtype=np.float32)) for k in range(lo, hi)}
    shape = (a.K,) + (a.box,) * 3
    times: dict[str, list[float]] = {"allgather": [], "sum": []}
    results = {}
    for rep in range(a.reps + 1):  # the first rep of each warms its path (NCCL's kernels, the pinned pool)
        for way in ("allgather", "sum"):
            comm.barrier()
            t = time.perf_counter()
            if way == "allgather":
                got = distributed.gather_items(comm, cp, shape, np.float32, mine, pinned=bool(a.pinned))
            else:
                got = _sum_gather(comm, cp, shape, np.float32, mine, bool(a.pinned))
            comm.barrier()
            if rep:
                times[way].append(time.perf_counter() - t)
            results[way] = got
    same = bool(np.array_equal(results["allgather"], results["sum"]))
    sent = comm.allgather(comm.bytes_sent)
    if comm.is_root:
        out = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "ranks": comm.size, "K": a.K,
               "box": a.box, "map_set_MB": round(np.prod(shape) * 4 / 1e6, 1), "reduction_path": comm.reduction_path,
               "pinned": bool(a.pinned), "same_maps": same, "seconds": times,
               "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
               "bytes_sent_per_rank_MB": [round(b / 1e6, 1) for b in sent]}
        print(json.dumps(out))
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1))
    if not same:
        raise SystemExit("the two ways gave different maps")


if __name__ == "__main__":
    main()

"""The CPU path's threads (RELION's --j): an auto-refine with local searches on the CPU at --j 1 and at --j N.

The demo's auto-refine on 2 cores spent most of its time in local searches (20-50 s per iteration against 3 s
for the global ones): NumPy's trilinear projection of each particle's own orientations, one core at a time. The
projections and insertions now run their cache-sized chunks in threads (compute/host_threads), and a local
search's coarse rows go straight into the score layout (expectation.project_as_slices). This script makes a
small data set with our simulator (box 64, 400 particles by default), refines it from HEALPix order 3 with local
searches from the start, once per thread count, and reports each run's E-step time per iteration and whether
the angles, offsets and map are the same to the bit. Writes JSON naming the CPU.

Run: python benchmarks/cpu_threads.py [--j 1,2] [--n 400] [--box 64] [--iters 2]
     [--out benchmarks/results/cpu_threads_<cores>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import starfile

from napari_gpu_relion.events import Message
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import refine3d
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime.device import usable_cores

TIMING = re.compile(r"iteration (\d+) timing: E-step ([\d.]+) s")


def refine(data: Path, out: Path, j: int, iters: int) -> dict:
    """One auto-refine on the CPU with --j j: wall time, E-step seconds per iteration, the output folder."""
    t = time.perf_counter()
    estep = {}
    for e in refine3d.run(refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=out / "run",
                                          healpix_order=3, auto_local_healpix_order=3, auto_iter_max=iters,
                                          ctf=True, cpu=True, j=j)):
        m = TIMING.search(e.text) if isinstance(e, Message) else None
        if m:
            estep[int(m.group(1))] = float(m.group(2))
    return {"j": j, "wall_s": round(time.perf_counter() - t, 2), "estep_per_iteration_s": estep}


def same_to_the_bit(a: Path, b: Path) -> bool:
    pa, pb = (starfile.read(d / "run_data.star")["particles"] for d in (a, b))
    cols = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst")
    return all(np.array_equal(pa[c].to_numpy(), pb[c].to_numpy()) for c in cols) and np.array_equal(
        read_mrc(a / "run_class001.mrc").data, read_mrc(b / "run_class001.mrc").data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--j", default="1,2", help="thread counts, comma-separated (the first is the reference)")
    ap.add_argument("--n", type=int, default=400, help="particles")
    ap.add_argument("--box", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2, help="--auto_iter_max")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    counts = [int(x) for x in a.j.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_sample_data(work / "data", box=a.box, angpix=3.0, n_particles=a.n, snr=0.1, n_micrographs=0)
        runs = []
        for j in counts:
            runs.append(refine(data, work / f"j{j}", j, a.iters))
            runs[-1]["same_as_first"] = same_to_the_bit(work / f"j{counts[0]}", work / f"j{j}")
            print(json.dumps(runs[-1]))
    cores = usable_cores()
    result = {"benchmark": "cpu_threads", "cpu": platform.processor() or platform.machine(), "usable_cores": cores,
              "os_cpu_count": os.cpu_count(), "args": vars(a) | {"out": str(a.out)}, "runs": runs,
              "speedup": [{"j": r["j"], "over_first": round(runs[0]["wall_s"] / r["wall_s"], 2)} for r in runs]}
    out = a.out or Path(f"benchmarks/results/cpu_threads_cpu{cores}.json")
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["speedup"]), "->", out)


if __name__ == "__main__":
    main()

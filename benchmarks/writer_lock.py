"""Benchmark: how much a job's thread is slowed while its files are written in the background (issue 47: MPI rank 0,
which writes, took 1.3-2.3x the time per particle of the other rank on 2 H200s).

A loop of small NumPy operations stands in for a job's thread launching GPU kernels from Python (each step needs
Python's lock for a few microseconds). It runs alone, then while a WriteQueue writes ``--n`` rows of a data STAR
``--writes`` times on its worker thread, then while the same writes go through the helper process
(``helper_process=True``: the STAR files in the helper, whose long loops are formatted by its worker processes,
io/star.FORMAT_WORKERS_ENV; the MRC files on a thread). With ``--maps K`` each write is one class3d iteration's
files: K maps of ``--box`` and the data STAR. Reported: the loop's speed beside the writes as a fraction of its
speed alone, and the seconds the writes took.

Run: python benchmarks/writer_lock.py [--n 100000] [--writes 3] [--maps 6 --box 256]
         [--out benchmarks/results/writer_lock_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from napari_gpu_relion.io.mrc import write_mrc
from napari_gpu_relion.io.star import read_particles, write_particles
from napari_gpu_relion.io.write_queue import WriteQueue

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data" / "particles.star"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def steps_per_second(seconds: float, until=None) -> float:
    """Steps of the stand-in loop per second, for ``seconds`` or until ``until()`` is true."""
    a = np.ones(1000, np.float32)
    n, t0 = 0, time.perf_counter()
    while True:
        b = a * 2.0 + 1.0
        b.sum()
        n += 1
        dt = time.perf_counter() - t0
        if (until is not None and until()) or (until is None and dt >= seconds):
            return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--writes", type=int, default=3)
    ap.add_argument("--maps", type=int, default=0, help="maps written with each data STAR (a class3d iteration)")
    ap.add_argument("--box", type=int, default=256)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    table = read_particles(SAMPLE)
    p = table.particles
    big = pd.concat([p] * -(-a.n // len(p)), ignore_index=True).iloc[:a.n].copy()
    rng = np.random.default_rng(0)
    for c in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst"):
        big[c] = rng.uniform(-180, 180, len(big))
    alone = steps_per_second(2.0)
    maps = [rng.standard_normal((a.box,) * 3).astype(np.float32) for _ in range(a.maps)]
    res = {"cpu": cpu_model(), "cores": os.cpu_count(), "rows": a.n, "maps": a.maps, "box": a.box,
           "writes": a.writes, "date": time.strftime("%Y-%m-%d"), "alone_steps_per_s": round(alone)}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("thread", "helper"):
            q = WriteQueue(mode, helper_process=mode == "helper")
            if mode == "helper":  # the helper started (and its imports done) before the measurement
                q.put(write_particles, Path(tmp) / "warm.star", table)
                q.drain()
            t0 = time.perf_counter()
            for k in range(a.writes):
                for m, vol in enumerate(maps):
                    q.put(write_mrc, Path(tmp) / f"{mode}{k}_class{m + 1:03d}.mrc", vol, 1.05)
                q.put(write_particles, Path(tmp) / f"{mode}{k}.star", big, table.optics)
            speed = steps_per_second(0.0, until=lambda q=q: q.pending() == 0)
            q.drain()
            res[mode] = {"loop_speed_fraction": round(speed / alone, 3),
                         "writes_s": round(time.perf_counter() - t0, 2), "note": q.helper_note,
                         "slowest": q.slowest_since(0)}
            q.close()
            print(mode, res[mode], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()

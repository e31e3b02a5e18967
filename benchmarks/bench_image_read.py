"""How fast a job's particle images are read, and how much a background reader slows the job's thread.

Writes a stack of n box x box float32 images and its particles STAR (once, into --dir), then reads every image in
blocks of jobs/read_ahead.BLOCK_ROWS rows, the way the read-ahead thread does (ParticleSet._read: the value check
included), in the order a job asks for them: ``stack`` (class2d/class3d: the STAR's order) or ``halves`` (refine3d:
one random half, then the other). Each read path (``direct``: io/mrc.LazyStack's positioned scatter reads;
``map``: the memory map, the path before them) is timed alone, then beside a thread that stands in for a job's
thread (Python work with a short call that releases Python's lock every ~50 statements, like CuPy's launches):
the job thread's work lost while the reader runs is what the reader costs the job.

With ``--threads 1,2,4`` also the job's background reader (jobs/read_ahead.ImageReadAhead) with that many threads.
With ``--gpu`` (CuPy) also the job's whole path on a GPU: the images asked for in batches of ``--batch`` rows from
a ParticleSet whose store is on the GPU while the reader's threads read ahead (what a job's iteration 1 counts as
reading), and one block's upload from pageable and from pinned host memory: whether the job's thread, which
uploads each block, bounds the reading (a 100,000-particle box-256 iteration 1 read at ~3.4-4 GB/s on an H200 host
with one thread and with four, thirty-seventh session).

Run: python benchmarks/bench_image_read.py --threads 1,2,4 --out benchmarks/results/image_read_<machine>.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import threading
import time
from pathlib import Path

import mrcfile
import numpy as np
import pandas as pd
import starfile

from napari_gpu_relion.io import mrc
from napari_gpu_relion.jobs.particles import load_particle_set
from napari_gpu_relion.jobs.read_ahead import BLOCK_ROWS, ImageReadAhead
from napari_gpu_relion.runtime.device import host_available_bytes
from napari_gpu_relion.runtime.memory import read_ahead_bytes

_BUF = bytes(4096)


def make_data(folder: Path, n: int, box: int) -> Path:
    star = folder / f"particles_{n}_{box}.star"
    if star.exists():
        return star
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with mrcfile.new(folder / f"stack_{n}_{box}.mrcs", overwrite=True) as m:
        m.set_data(rng.standard_normal((n, box, box), dtype=np.float32))
        m.voxel_size = 2.0
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnImagePixelSize": [2.0], "rlnImageSize": [box],
                           "rlnImageDimensionality": [2]})
    parts = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@stack_{n}_{box}.mrcs" for i in range(n)],
                          "rlnOpticsGroup": 1, "rlnRandomSubset": rng.permutation(np.arange(n) % 2) + 1})
    starfile.write({"optics": optics, "particles": parts}, star, overwrite=True)
    return star


def job_thread(stop: threading.Event, out: list) -> None:
    """Python work with a lock-releasing call every 50 statements; out gets the loops done."""
    n, d = 0, {}
    while not stop.is_set():
        for i in range(1000):
            d[i] = i * 2
            if i % 50 == 49:
                hashlib.sha256(_BUF).digest()
        n += 1
    out.append(n)


def job_order(ps, order_kind: str) -> np.ndarray:
    """The rows in the order a job asks for them: ``stack`` (class2d/class3d) or ``halves`` (refine3d)."""
    if order_kind == "stack":
        return np.arange(len(ps))
    return np.concatenate([np.flatnonzero(ps.subset == h) for h in (1, 2)])


def beside_job(read_all, alone: float) -> tuple[float, float]:
    """(seconds of ``read_all`` beside a job thread, the job thread's work lost meanwhile in seconds): the job
    thread's loop rate alone (for ``alone`` seconds at least 0.2) against its rate while ``read_all`` runs."""
    rates = {}
    for beside in (False, True):
        stop, loops = threading.Event(), []
        th = threading.Thread(target=job_thread, args=(stop, loops))
        th.start()
        t = time.perf_counter()
        if beside:
            read_all()
        else:
            time.sleep(max(alone, 0.2))
        dt = time.perf_counter() - t
        stop.set()
        th.join()
        rates[beside] = (loops[0] / dt, dt)
    return rates[True][1], rates[True][1] * (1.0 - rates[True][0] / rates[False][0])


def measure(star: Path, order_kind: str, path_kind: str) -> dict:
    saved = mrc.DIRECT_READ_MIN_IMAGES_PER_WINDOW
    if path_kind == "map":
        mrc.DIRECT_READ_MIN_IMAGES_PER_WINDOW = 1 << 40  # never direct
    try:
        ps = load_particle_set(star, ctf=False)
        order = job_order(ps, order_kind)
        blocks = [order[i:i + BLOCK_ROWS] for i in range(0, len(order), BLOCK_ROWS)]

        def read_all() -> float:
            ps.checked[:] = False  # every image checked, as in a job's first iteration
            t = time.perf_counter()
            for b in blocks:
                ps._read(b)
            return time.perf_counter() - t

        read_all()  # the page cache holds the stack (a job's data read before)
        alone = min(read_all() for _ in range(3))
        beside, lost = beside_job(read_all, alone)
        gb = len(order) * ps.box * ps.box * 4 / 1e9
        return {"order": order_kind, "path": path_kind, "read_alone_s": round(alone, 4),
                "gb_per_s": round(gb / alone, 2), "read_beside_job_s": round(beside, 4),
                "job_thread_lost_s": round(lost, 4)}
    finally:
        mrc.DIRECT_READ_MIN_IMAGES_PER_WINDOW = saved


def measure_threads(star: Path, order_kind: str, threads: int) -> dict:
    """Every image read by the job's background reader (jobs/read_ahead.ImageReadAhead) with ``threads`` threads,
    blocks taken in order as a job takes them (best of three, the page cache warm)."""
    ps = load_particle_set(star, ctf=False)
    order = job_order(ps, order_kind)
    ahead = read_ahead_bytes(host_available_bytes()) // (BLOCK_ROWS * ps.box * ps.box * 4)

    def read_all() -> float:
        ps.checked[:] = False
        t = time.perf_counter()
        reader = ImageReadAhead(ps._read, order, len(ps), BLOCK_ROWS, ahead, threads=threads)
        while reader.next(wait=True) is not None:
            pass
        return time.perf_counter() - t

    read_all()
    alone = min(read_all() for _ in range(3))
    beside, lost = beside_job(read_all, alone)
    gb = len(order) * ps.box * ps.box * 4 / 1e9
    return {"order": order_kind, "path": "read_ahead", "threads": threads, "read_alone_s": round(alone, 4),
            "gb_per_s": round(gb / alone, 2), "read_beside_job_s": round(beside, 4),
            "job_thread_lost_s": round(lost, 4)}


def measure_gpu_store(star: Path, order_kind: str, threads: int, batch: int) -> dict:
    """Every image asked for in batches of ``batch`` rows, in the job's order, from a ParticleSet that keeps its
    images on the GPU and reads ahead in ``threads`` threads (a job's first iteration); best of three."""
    import cupy  # noqa: PLC0415

    first = load_particle_set(star, ctf=False)
    order = job_order(first, order_kind)
    gb = len(first) * first.box * first.box * 4 / 1e9

    def read_all() -> float:
        ps = load_particle_set(star, ctf=False)  # a fresh store each time
        ps.keep_images_on(cupy)
        t = time.perf_counter()
        ps.read_ahead(order, threads, read_ahead_bytes(host_available_bytes()))
        for i in range(0, len(order), batch):
            ps.images(order[i:i + batch])
        cupy.cuda.Device().synchronize()
        dt = time.perf_counter() - t
        ps.stop_reading()
        del ps
        cupy.get_default_memory_pool().free_all_blocks()
        return dt

    best = min(read_all() for _ in range(3))
    return {"order": order_kind, "path": "gpu_store", "threads": threads, "batch": batch,
            "read_alone_s": round(best, 4), "gb_per_s": round(gb / best, 2)}


def measure_upload(box: int) -> dict:
    """One block (BLOCK_ROWS images) to the GPU from pageable and from pinned host memory (GB/s, best of 20)."""
    import cupy  # noqa: PLC0415

    block = np.random.default_rng(0).standard_normal((BLOCK_ROWS, box, box), dtype=np.float32)
    pinned = cupy.cuda.alloc_pinned_memory(block.nbytes)
    staged = np.frombuffer(pinned, np.float32, block.size).reshape(block.shape)
    staged[...] = block
    dev = cupy.empty(block.shape, np.float32)
    out = {}
    for name, src in (("pageable", block), ("pinned", staged)):
        times = []
        for _ in range(20):
            t = time.perf_counter()
            dev.set(src)
            cupy.cuda.Device().synchronize()
            times.append(time.perf_counter() - t)
        out[f"{name}_gb_per_s"] = round(block.nbytes / min(times) / 1e9, 2)
    return {"path": "upload_one_block", "block_bytes": block.nbytes, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--box", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/bench_image_read")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", default="", help="e.g. 1,2,4: the background reader with that many threads")
    ap.add_argument("--gpu", action="store_true", help="also the job's path into a store on the GPU, and uploads")
    ap.add_argument("--batch", type=int, default=1749, help="rows per request on the GPU path (a box-256 batch)")
    a = ap.parse_args()
    star = make_data(Path(a.dir), a.n, a.box)
    rows = [measure(star, o, p) for o in ("stack", "halves") for p in ("direct", "map")]
    rows += [measure_threads(star, o, int(k)) for o in ("stack", "halves") for k in a.threads.split(",") if k]
    if a.gpu:
        rows.append(measure_upload(a.box))
        rows += [measure_gpu_store(star, "stack", int(k), a.batch) for k in (a.threads or "1").split(",") if k]
    for r in rows:
        print(r)
    hardware = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if a.gpu:
        import cupy  # noqa: PLC0415

        hardware += ", GPU: " + cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res = {"hardware": hardware,
           "n": a.n, "box": a.box, "block_rows": BLOCK_ROWS, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Whether a background thread's GPU start-up work leaves the GIL to the job's thread (issue 46's cold first run:
the job's thread waits in its first cuFFT plan and its first kernels while the preload threads compile). For each kind
of work, run in a second thread on fresh caches (CuPy's CUPY_CACHE_DIR and the driver's CUDA_CACHE_PATH, set by the
caller), the main thread counts a pure-Python loop meanwhile: its rate against the rate with the second thread idle
says how much of the work held the GIL (1.0: none of it; near 0: all of it).

    CUPY_CACHE_DIR=$(mktemp -d) CUDA_CACHE_PATH=$(mktemp -d) python benchmarks/gil_during_compile.py --out R.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from first_run import gpu_name  # the benchmarks folder is on the path when a script runs


def spin(until) -> float:
    """Loop iterations per second of this thread until ``until()``."""
    n, t = 0, time.perf_counter()
    while not until():
        n += 1
    return n / max(time.perf_counter() - t, 1e-9)


def measure(name: str, work) -> dict:
    t0 = time.perf_counter()
    base = spin(lambda: time.perf_counter() - t0 > 0.3)
    out: dict = {}

    def run() -> None:
        t = time.perf_counter()
        work()
        out["seconds"] = time.perf_counter() - t

    th = threading.Thread(target=run)
    th.start()
    rate = spin(lambda: not th.is_alive())
    th.join()
    return {"work": name, "seconds": round(out["seconds"], 3), "main_thread_rate": round(rate / base, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import cupy as cp  # noqa: PLC0415

    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415
    from napari_gpu_relion.compute.backend import raw_module  # noqa: PLC0415
    from napari_gpu_relion.runtime import cupy_kernels  # noqa: PLC0415

    cp.cuda.runtime.memGetInfo()
    entries = cupy_kernels.shipped_entries("class3d")
    rows = [
        measure("20 shipped CuPy modules compiled (NVRTC)",
                lambda: [cupy_kernels.compile_module(e["source"], e["options"]) for e in entries[:20]]),
        measure("our gpu_kernels raw module compiled (NVRTC)", lambda: raw_module(gpu_kernels._SOURCE).compile()),  # noqa: SLF001
        measure("first cuFFT plans, 3D 128^3 and 2D 300 x 128^2, r2c and c2r",
                lambda: [cp.fft.irfftn(cp.fft.rfftn(cp.ones((128,) * 3, cp.float32))),
                         cp.fft.irfft2(cp.fft.rfft2(cp.ones((300, 128, 128), cp.float32))),
                         cp.cuda.Device().synchronize()]),
        measure("first sorts (thrust) and a product (cuBLAS)",
                lambda: [cp.sort(cp.arange(10_000, dtype=cp.float32)[::-1]),
                         cp.argsort(cp.arange(10_000, dtype=cp.int64)[::-1], kind="stable"),
                         cp.ones((512, 512), cp.float32) @ cp.ones((512, 512), cp.float32),
                         cp.cuda.Device().synchronize()]),
    ]
    for r in rows:
        print(json.dumps(r), flush=True)
    Path(a.out).write_text(json.dumps({"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

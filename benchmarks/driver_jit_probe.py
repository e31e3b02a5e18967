"""Which first uses of a class3d's start-up make the NVIDIA driver compile PTX (issue 46's cold first run: a fresh
driver cache alone cost the box-128 class3d 0.3-0.6 s, its initial model 0.73-0.76 s against 0.35-0.38 s warm).
Each step runs once, synchronised, in the order a class3d first meets it; its seconds and the growth of the driver's
JIT cache (CUDA_CACHE_PATH, set by the caller) are written. Run it on a fresh driver cache with CuPy's cache filled
(CuPy's own modules are cubins: only the driver's compile of a library's PTX is left), then again on the same
caches (all loaded from the caches):

    C=$(mktemp -d) J=$(mktemp -d)
    CUPY_CACHE_DIR=$C CUDA_CACHE_PATH=$(mktemp -d) python benchmarks/driver_jit_probe.py --label fill --out a.json
    CUPY_CACHE_DIR=$C CUDA_CACHE_PATH=$J python benchmarks/driver_jit_probe.py --label driver_fresh --out b.json
    CUPY_CACHE_DIR=$C CUDA_CACHE_PATH=$J python benchmarks/driver_jit_probe.py --label warm --out c.json

The probe's map is float32 (a job's reference is float64: its low-pass uses cuFFT's double-precision transforms).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from first_run import gpu_name  # the benchmarks folder is on the path when a script runs


def cache_kb() -> int:
    root = Path(os.environ.get("CUDA_CACHE_PATH", Path.home() / ".nv" / "ComputeCache"))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) // 1024 if root.exists() else 0


def first(cp, what: str) -> None:
    """What runs before the job's first transforms (--first)."""
    if what.startswith("fft2d"):
        n = int(what[5:])
        cp.fft.irfft2(cp.fft.rfft2(cp.asarray(np.ones((4, n, n), np.float32))))
    elif what.startswith("fft"):
        n = int(what[3:])
        cp.fft.irfftn(cp.fft.rfftn(cp.asarray(np.ones((n, n, n), np.float32))))
    else:
        from napari_gpu_relion.runtime import kernels  # noqa: PLC0415

        if what == "all":
            kernels.build(0)
        else:
            op = next(o for o in kernels.REGISTRY if o.name == what)
            for flag in op.specialisations:
                kernels.run_op(op, cp, flag)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--box", type=int, default=128)
    ap.add_argument("--first", default="",
                    help="right after the context, what may take the first cuFFT plans' cost: 'fftN' a 3D r2c and "
                         "c2r transform of N^3 float32, 'fft2dN' a batch of four N^2, 'projection' the registry's "
                         "projection op (its example's prepared references), 'all' the whole registry")
    a = ap.parse_args()
    t_import = time.perf_counter()
    import cupy as cp  # noqa: PLC0415

    from napari_gpu_relion.compute import projector  # noqa: PLC0415
    from napari_gpu_relion.compute.fourier import lowpass_map  # noqa: PLC0415
    from napari_gpu_relion.compute.maximization import initial_noise_spectrum  # noqa: PLC0415

    N = a.box
    rng = np.random.default_rng(0)
    vol_h = rng.normal(size=(N, N, N)).astype(np.float32)
    imgs_h = rng.normal(size=(1000, N, N)).astype(np.float32)
    rows = [{"step": "imports", "seconds": round(time.perf_counter() - t_import, 3), "driver_cache_kB": cache_kb()}]
    state: dict = {}
    steps = [
        ("CUDA context", lambda: cp.cuda.runtime.memGetInfo()),
        *([(f"first: {a.first}", lambda: first(cp, a.first))] if a.first else []),
        ("map and images to the GPU", lambda: state.update(vol=cp.asarray(vol_h), imgs=cp.asarray(imgs_h))),
        ("cuFFT 3D r2c + c2r (the initial low-pass)", lambda: lowpass_map(state["vol"], 2.0, 60.0)),
        ("cuFFT 2D r2c batch (initial noise spectra)", lambda: initial_noise_spectrum(state["imgs"], N * 0.4, False)),
        ("reference prepared (padded 3D FFT)", lambda: projector.prepare_reference(state["vol"], pad=2)),
        ("thrust sort float32", lambda: cp.sort(cp.arange(400_000, dtype=np.float32)[::-1])),
        ("thrust argsort stable int64", lambda: cp.argsort(cp.arange(400_000)[::-1], kind="stable")),
        ("cuBLAS sgemm", lambda: cp.matmul(cp.ones((4096, 1600), np.float32), cp.ones((1600, 4096), np.float32))),
        ("cuBLAS batched sgemm", lambda: cp.matmul(cp.ones((700, 100, 940), np.float32),
                                                   cp.ones((700, 940, 600), np.float32))),
        ("cuFFT 2D c2r batch", lambda: cp.fft.irfft2(cp.ones((2048, N, N // 2 + 1), np.complex64))),
    ]
    for name, fn in steps:
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        rows.append({"step": name, "seconds": round(time.perf_counter() - t, 3), "driver_cache_kB": cache_kb()})
        print(f"{a.label:14s} {name:45s} {rows[-1]['seconds']:7.3f} s  driver cache {rows[-1]['driver_cache_kB']} kB",
              flush=True)
    versions = {"cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "driver": cp.cuda.runtime.driverGetVersion(),
                "cufft": cp.cuda.cufft.getVersion(), "cupy": cp.__version__}
    Path(a.out).write_text(json.dumps({"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"), "label": a.label,
                                       "box": N, "versions": versions, "steps": rows}, indent=1))


if __name__ == "__main__":
    main()

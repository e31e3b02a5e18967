"""When a compile-ahead worker process becomes useful (issue 46: a new machine's workers write their first modules
about 3 s after the job's process starts, forty-first session): N spawned processes at once each record, from the
parent's start, when it began, imported CuPy, read the GPU's architecture, made its CUDA context (``--context
first``) and compiled two of the shipped modules into an empty cache (NVRTC; the module's load makes the context
when it was not made first). Fresh CUPY_CACHE_DIR per case; the JSON names the GPU:

    python benchmarks/worker_start.py --workers 1,4,12 --context first,compile --out R.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from first_run import gpu_name  # the benchmarks folder is on the path when a script runs


def _worker(t0: float, entries: list[dict], context_first: bool) -> dict:
    marks = {"begun": time.time() - t0}
    import cupy as cp  # noqa: PLC0415

    from napari_gpu_relion.runtime import cupy_kernels  # noqa: PLC0415

    marks["cupy imported"] = time.time() - t0
    cp.cuda.Device(0).compute_capability  # noqa: B018 - the architecture, as CuPy's compile asks it
    marks["architecture read"] = time.time() - t0
    if context_first:
        cp.cuda.runtime.memGetInfo()
        marks["context made"] = time.time() - t0
    for k, e in enumerate(entries):
        cupy_kernels.compile_module(e["source"], e["options"])
        marks[f"module {k + 1} compiled"] = time.time() - t0
    return marks


def main() -> None:
    from napari_gpu_relion.runtime import cupy_kernels  # noqa: PLC0415

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,4,12")
    ap.add_argument("--context", default="first,compile", help="first: make the context before compiling")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    entries = cupy_kernels.shipped_entries("class3d")
    rows = []
    for n in (int(w) for w in a.workers.split(",")):
        for how in a.context.split(","):
            with tempfile.TemporaryDirectory(prefix="ngr_ws_") as tmp:
                os.environ["CUPY_CACHE_DIR"] = tmp  # the spawned workers inherit it
                t0 = time.time()
                with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as ex:
                    got = list(ex.map(_worker, [t0] * n, [entries[2 * i:2 * i + 2] for i in range(n)],
                                      [how == "first"] * n))
            keys = list(got[0])
            row = {"workers": n, "context": how,
                   "median_s": {k: round(statistics.median(g[k] for g in got), 3) for k in keys},
                   "last_s": {k: round(max(g[k] for g in got), 3) for k in keys}}
            print(json.dumps(row), flush=True)
            rows.append(row)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps({"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"),
                                               "cases": rows}, indent=1))


if __name__ == "__main__":
    main()

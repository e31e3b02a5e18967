"""How fast the shipped CuPy modules of a job kind compile into an empty disk cache with N worker processes
(runtime/cupy_kernels.compile_ahead; issue 46's first job on a new machine).

Each case runs in a fresh Python process with a fresh CUPY_CACHE_DIR (and CUDA_CACHE_PATH), so nothing is loaded or
cached before it; the JSON names the GPU:

    python benchmarks/compile_ahead_pools.py --job class3d --workers 8,12,14 --out R.json

The forty-first session measured two other pools with this script before removing them from the package: threads
of one process (NVRTC compiles one program at a time in a process: 18-20 s for 6-14 threads against 6.2 s in 12
processes) and processes forked from a server that imported CuPy once (7.15 s against 7.16 s spawned)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from first_run import gpu_name  # the benchmarks folder is on the path when a script runs

CASE = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from napari_gpu_relion.runtime import cupy_kernels
entries = cupy_kernels.shipped_entries(sys.argv[1])
got = cupy_kernels.compile_ahead(entries, 0, Path(sys.argv[2]), sys.argv[1], workers=int(sys.argv[3]))
got["process_s"] = time.perf_counter() - t0
got["cache_files"] = cupy_kernels.cache_files(Path(sys.argv[2]))
print(json.dumps(got))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="class3d")
    ap.add_argument("--workers", default="8,12,14", help="worker processes, one case each")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for workers in a.workers.split(","):
        with tempfile.TemporaryDirectory(prefix="ngr_pools_") as tmp:
            env = dict(os.environ, CUPY_CACHE_DIR=f"{tmp}/cupy", CUDA_CACHE_PATH=f"{tmp}/jit")
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", CASE, a.job, f"{tmp}/cupy", workers], env=env,
                               capture_output=True, text=True)
            row = {"workers": int(workers), "wall_s": round(time.perf_counter() - t, 2),
                   "returncode": r.returncode}
            if r.returncode == 0:
                row.update(json.loads(r.stdout.strip().splitlines()[-1]))
            else:
                row["tail"] = r.stderr[-1500:]
        print(json.dumps(row), flush=True)
        rows.append(row)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"), "job": a.job,
                                           "cases": rows}, indent=1))


if __name__ == "__main__":
    main()

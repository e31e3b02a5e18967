"""What NVRTC's automatic precompiled headers (CuPy's CUPY_NVRTC_USE_PCH=1, NVRTC 12.8+) save on the shipped class3d
modules (issue 46's cold first run): each case on a fresh CUPY_CACHE_DIR in a fresh process.

- ``serial``: the first N modules of the class3d list compiled one after another in one process (seconds per module:
  the first, which makes the header's PCH, and the median of the others);
- ``pool``: the whole class3d list by ``cupy_kernels.compile_ahead`` in its worker processes (the seconds of the
  pool, as a new machine's first job starts it).

CuPy adds ``--pch`` to NVRTC's options after it has made the module's cache key, so a module compiled with it is
found by a process without it (checked here: the second process of each ``pool`` case with PCH reads every module
without compiling, PCH off).

    python benchmarks/nvrtc_pch.py --serial 40 --rounds 2 --out R.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from first_run import gpu_name  # the benchmarks folder is on the path when a script runs

_SERIAL = """
import json, sys, time
from napari_gpu_relion.runtime import cupy_kernels
import cupy
cupy.cuda.runtime.memGetInfo()
entries = cupy_kernels.shipped_entries("class3d")[:int(sys.argv[1])]
times = []
for e in entries:
    t = time.perf_counter()
    cupy_kernels.compile_module(e["source"], e["options"])
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

_POOL = """
import json, sys, time
from pathlib import Path
from napari_gpu_relion.runtime import cupy_kernels, kernel_preload
entries = cupy_kernels.shipped_entries("class3d")
t = time.perf_counter()
r = cupy_kernels.compile_ahead(entries, 0, kernel_preload.kernel_cache_dir(), None)
r["wall_s"] = time.perf_counter() - t
r["files"] = cupy_kernels.cache_files(kernel_preload.kernel_cache_dir())
print(json.dumps(r))
"""

_READ = """
import json, time
from napari_gpu_relion.runtime import cupy_kernels, kernel_preload
import cupy
cupy.cuda.runtime.memGetInfo()
before = cupy_kernels.cache_files(kernel_preload.kernel_cache_dir())
t = time.perf_counter()
for e in cupy_kernels.shipped_entries("class3d"):
    cupy_kernels.compile_module(e["source"], e["options"])
print(json.dumps({"seconds": time.perf_counter() - t,
                  "new_files": cupy_kernels.cache_files(kernel_preload.kernel_cache_dir()) - before}))
"""


def _run(script: str, args: list[str], cache: str, pch: bool) -> dict | list:
    env = dict(os.environ, CUPY_CACHE_DIR=cache, CUPY_NVRTC_USE_PCH="1" if pch else "0")
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serial", type=int, default=40, help="modules compiled one after another per case")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for r in range(a.rounds):
        for pch in (False, True) if r % 2 == 0 else (True, False):
            with tempfile.TemporaryDirectory(prefix="ngr_pch_") as tmp:
                t = _run(_SERIAL, [str(a.serial)], tmp, pch)
                rows.append({"case": "serial", "pch": pch, "round": r, "modules": len(t), "first_s": t[0],
                             "median_rest_s": statistics.median(t[1:]), "total_s": sum(t)})
                print(json.dumps(rows[-1]), flush=True)
            with tempfile.TemporaryDirectory(prefix="ngr_pch_") as tmp:
                p = _run(_POOL, [], tmp, pch)
                row = {"case": "pool", "pch": pch, "round": r, **p}
                if pch:  # read back by a process without PCH: same keys, nothing compiled again
                    row["read_back_without_pch"] = _run(_READ, [], tmp, False)
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"),
                                       "cupy": __import__("cupy").__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

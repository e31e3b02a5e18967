"""Which CuPy modules the preload's libraries warm-up (runtime/kernel_preload._warm_libraries) compiles on a fresh
CuPy cache, and whether the shipped list of a class3d holds them (then the compile workers make them too, and the
warm-up's own compiles only hold the job process's GIL: issue 46's cold first run). The caller sets a fresh
CUPY_CACHE_DIR; PYTHONPATH picks the code measured.

    CUPY_CACHE_DIR=$(mktemp -d) python benchmarks/libraries_compiles.py --out R.json
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from pathlib import Path

from first_run import gpu_name  # the benchmarks folder is on the path when a script runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import cupy as cp  # noqa: PLC0415

    from napari_gpu_relion.runtime import cupy_kernels, kernel_preload  # noqa: PLC0415

    cp.cuda.runtime.memGetInfo()
    cache = kernel_preload.kernel_cache_dir()
    since = time.time()
    seconds = kernel_preload._warm_libraries(0, threading.Event())  # noqa: SLF001
    names = cupy_kernels.new_module_names(cache, since - 1)
    shipped = set()
    for e in cupy_kernels.shipped_entries("class3d"):
        shipped |= set(re.findall(r"__global__\s+void\s+(\w+)", e["source"]))
    rows = [{"module": n, "in_shipped_class3d": all(k in shipped for k in n.split("+"))} for n in names]
    out = {"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"), "code": kernel_preload.__file__,
           "seconds": round(seconds, 3), "modules": len(names),
           "not_in_shipped": sum(not r["in_shipped_class3d"] for r in rows), "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"{seconds:.2f} s, {len(names)} modules compiled, {out['not_in_shipped']} not in the shipped class3d list")


if __name__ == "__main__":
    main()

"""The CuPy kernel modules a job compiled, written down as a list the package can ship (issue 46), with CuPy's public
interface only.

Run the job with an empty kernel cache, the preload off and CuPy's documented ``CUPY_CACHE_SAVE_CUDA_SOURCE=1``
(CuPy then writes each compiled module's CUDA source beside it), then this script: for each saved source it finds
the module's own compile options among a few candidates (those of the shipped list, then CuPy's default), by
compiling the source as a ``cupy.RawModule`` with those options into the same cache: the right options name the
same cache file, so nothing new is written. A module whose options are not found is reported and left out.
The modules are listed in the order the job compiled them (the files' times), which is the order the background
compile of a job follows. benchmarks/ship_kernels.py merges the lists of several job kinds.

  CUPY_CACHE_DIR=/root/c_rec CUPY_CACHE_SAVE_CUDA_SOURCE=1 NAPARI_GPU_RELION_KERNEL_PRELOAD=0 \
      python -m napari_gpu_relion.cli class3d ...
  python benchmarks/record_kernels.py --cache /root/c_rec --out $OUT/class3d.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def candidates(source: str) -> list[list[str]]:
    """Own-option sets to try, most likely first (CUB reductions are compiled in two passes with macros)."""
    from napari_gpu_relion.runtime import cupy_kernels  # noqa: PLC0415

    data = cupy_kernels._data() or {"modules": []}  # noqa: SLF001 - our own shipped list
    seen: list[list[str]] = []
    for e in data["modules"]:
        o = cupy_kernels.own_options(e["options"])
        if o not in seen:
            seen.append(o)
    if ["--std=c++17"] not in seen:
        seen.append(["--std=c++17"])
    first = [o for o in seen if ("-DFIRST_PASS=1" in o) == ("FIRST_PASS" in source)
             and ("-DSECOND_PASS=1" in o) == ("SECOND_PASS" in source)]
    return first + [o for o in seen if o not in first]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, type=Path, help="the kernel cache the job compiled into")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    os.environ["CUPY_CACHE_DIR"] = str(a.cache)
    os.environ.pop("CUPY_CACHE_SAVE_CUDA_SOURCE", None)
    from napari_gpu_relion.runtime import cupy_kernels  # noqa: PLC0415

    saved = sorted((p for p in a.cache.glob("*.cubin.cu") if p.with_suffix("").exists()),
                   key=lambda p: p.with_suffix("").stat().st_mtime)
    modules, missing = [], []
    for src_file in saved:
        source = src_file.read_text()
        found = None
        for opts in candidates(source):
            before = {p.name for p in a.cache.glob("*.cubin")}
            try:
                cupy_kernels.compile_module(source, opts)
            except Exception:  # noqa: BLE001 - options this source does not compile with
                continue
            new = {p.name for p in a.cache.glob("*.cubin")} - before
            for name in new:  # a miss: not the job's module
                (a.cache / name).unlink(missing_ok=True)
            if not new:
                found = opts
                break
        if found is None:
            missing.append(src_file.name)
        else:
            site = str(Path(sys.modules["cupy"].__file__).resolve().parents[1])
            modules.append({"source": source, "options": found, "site": site})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"modules": modules, "missing": missing}))
    print(f"{len(modules)} of {len(saved)} modules matched with their options; {len(missing)} not -> {a.out}")


if __name__ == "__main__":
    main()

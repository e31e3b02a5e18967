"""Which CUDA kernels a job compiles, where in our code, and in which iteration (issue 15: a machine's first job
paid ~100 s of CuPy compilation; `napari-gpu-relion warmup` compiles ahead, and this says what it missed).

CuPy compiles a kernel the first time it is used and its source is not in the on-disk cache; the compilation
itself is cupy.cuda.compiler._compile_using_nvrtc_no_warning in CuPy 14 (compile_using_nvrtc before; or
compile_using_nvcc), called only on a cache miss. This wraps both, times
them and records the kernel's name (from its source) and the frames of napari_gpu_relion that asked for it.

Run: python benchmarks/kernel_compiles.py [--out x.json] -- refine3d --i particles.star --ref ref.mrc ...
     (any job of the command line, `warmup` included)
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import fields
from pathlib import Path

from napari_gpu_relion import cli
from napari_gpu_relion.events import IterationFinished, Message

RECORDS: list[dict] = []
STATE = {"iteration": 1}


def _kernel_name(source: str) -> str:
    m = re.search(r"__global__\s+void\s+(\w+)", source or "")
    return m.group(1) if m else "?"


def _our_frames() -> list[str]:
    frames = [f for f in traceback.extract_stack()[:-3] if "napari_gpu_relion" in f.filename]
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:]]


def install() -> bool:
    """Wrap CuPy's compilers; False when CuPy (or its compiler module) is not there."""
    try:
        from cupy.cuda import compiler
    except Exception:
        return False
    names = ["_compile_using_nvrtc_no_warning", "compile_using_nvcc"]
    if not hasattr(compiler, names[0]):  # CuPy < 14
        names[0] = "compile_using_nvrtc"
    for name in names:
        fn = getattr(compiler, name, None)
        if fn is None:
            continue

        def wrapped(source, *a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(source, *a, **k)
            finally:
                RECORDS.append({"iteration": STATE["iteration"], "compiler": _name, "kernel": _kernel_name(source),
                                "seconds": time.perf_counter() - t, "where": _our_frames()})

        setattr(compiler, name, wrapped)
    return True


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv[:split])
    hooked = install()
    args = cli.build_parser().parse_args(argv[split + 1:])
    module = importlib.import_module(args._module)
    params = module.Params(**{f.name: getattr(args, f.name) for f in fields(module.Params)})
    t0, per_it = time.time(), []
    for ev in module.run(params):
        if isinstance(ev, Message):
            print(" ", ev.text, flush=True)
        if isinstance(ev, IterationFinished):
            mine = [r for r in RECORDS if r["iteration"] == STATE["iteration"]]
            per_it.append({"iteration": ev.iteration, "compiled": len(mine),
                           "compile_s": sum(r["seconds"] for r in mine)})
            print(f"iteration {ev.iteration}: {len(mine)} kernels compiled, {per_it[-1]['compile_s']:.1f} s",
                  flush=True)
            STATE["iteration"] += 1
    where = Counter(r["where"][-1] if r["where"] else "(outside our code)" for r in RECORDS)
    print(f"{len(RECORDS)} kernels compiled in {sum(r['seconds'] for r in RECORDS):.1f} s of "
          f"{time.time() - t0:.1f} s; by the innermost frame of ours:")
    for k, v in where.most_common():
        print(f"  {v:4d}  {k}")
    res = {"argv": argv, "hooked": hooked, "total_s": time.time() - t0, "per_iteration": per_it,
           "compiles": RECORDS}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

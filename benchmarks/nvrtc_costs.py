"""What NVRTC spends on the CuPy modules the package ships (issue 46: a machine's first job without `warmup`).

Compiles every shipped module of one job kind (runtime/cupy_kernels.json.gz: its source and own options, with
CuPy's include folders) to PTX for one architecture, one module at a time in this process, and reports the
seconds per module, grouped by kind: CuPy's CUB block reductions (``cupy_cub_*``, made when CuPy's reduction
accelerators include CUB, its default), its scans, and the rest (elementwise kernels, take, scatters, our raw
modules). NVRTC needs no GPU: it runs on a CPU-only machine with CuPy and the NVRTC wheel
(``pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12``). PTX only: on a GPU CuPy also makes the machine code (cubin),
so these seconds are a lower bound of a cold job's compile work; their split between kinds is the point.

Run: python benchmarks/nvrtc_costs.py --job class3d --out benchmarks/results/nvrtc_costs_class3d_cpu.json
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import gzip
import json
import os
import platform
import re
import time
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "src" / "napari_gpu_relion" / "runtime" / "cupy_kernels.json.gz"


def _load_nvrtc() -> None:
    """Load the NVRTC wheel's library where the system has none (a CPU-only machine)."""
    try:
        import nvidia.cuda_nvrtc as wheel  # noqa: PLC0415
    except ImportError:
        return
    for f in glob.glob(os.path.join(wheel.__path__[0], "lib", "*.so*")):
        try:
            ctypes.CDLL(f, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass


def _local_include(option: str, site: str) -> str:
    """A recorded include option (-I<site-packages>/...) on this machine: the recording machine's CUDA headers
    (nvidia/cu13/include) stand for the local CUDA runtime wheel's where those are absent."""
    path = option[2:].replace("<site-packages>", site)
    if not os.path.isdir(path) and "/nvidia/" in path:
        local = os.path.join(site, "nvidia", "cuda_runtime", "include")
        path = local if os.path.isdir(local) else path
    return f"-I{path}"


def kind(source: str) -> str:
    if "cupy_cub_" in source:
        return "cub_block_reduction"
    if "scan" in source:
        return "scan"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default="class3d")
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _load_nvrtc()
    import cupy  # noqa: PLC0415
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

    data = json.loads(gzip.decompress(SHIPPED.read_bytes()))
    site = os.path.dirname(os.path.dirname(cupy.__file__))
    rows = []
    for m in (m for m in data["modules"] if a.job in m["jobs"]):
        opts = [o for o in m["options"] if not o.startswith("-I") and not o.startswith("-arch")]
        includes = [_local_include(o, site) for o in m["options"] if o.startswith("-I")]
        t = time.perf_counter()
        prog = nvrtc.createProgram(m["source"], "module.cu", [], [])
        try:
            nvrtc.compileProgram(prog, opts + includes + [f"-arch={a.arch}"])
            error = None
        except Exception:  # noqa: BLE001 - counted and reported with NVRTC's log
            error = nvrtc.getProgramLog(prog)[:400]
        name = (re.findall(r"__global__\s+void\s+(\w+)", m["source"]) or ["?"])[0]
        rows.append({"kind": kind(m["source"]), "name": name, "seconds": time.perf_counter() - t, "ok": error is None,
                     "error": error})
    by_kind = {}
    for r in rows:
        k = by_kind.setdefault(r["kind"], {"modules": 0, "seconds": 0.0})
        k["modules"] += 1
        k["seconds"] += r["seconds"]
    out = {"job": a.job, "arch": a.arch, "cupy": cupy.__version__, "shipped_cupy": data.get("cupy"),
           "nvrtc": list(nvrtc.getVersion()), "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "by_kind": by_kind,
           "modules": len(rows), "failed": [{k: r[k] for k in ("name", "error")} for r in rows if not r["ok"]],
           "total_s": sum(r["seconds"] for r in rows)}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

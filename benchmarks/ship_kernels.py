"""Merge the CuPy kernel modules that benchmarks/record_kernels.py found after the EM jobs' runs (one JSON per job
kind, recorded on a GPU machine at box 128, 256 and 360) into the list the package ships
(runtime/cupy_kernels.json.gz), so that `napari-gpu-relion warmup` compiles every CuPy kernel module of those runs in
parallel processes, and a job on a machine whose cache lacks them compiles its own kind's in the background.

The recording machine's path to its Python packages (in CuPy's include options) becomes "<site-packages>"; the
CuPy version is kept, and a CuPy of another version ignores the list (its kernels' sources differ). Entries whose
compile call a plain RawModule cannot repeat (name expressions, another backend) are left out.

Run: python benchmarks/ship_kernels.py --cupy 14.2.0 DIR/class3d.json DIR/refine3d.json DIR/class2d.json
     python benchmarks/ship_kernels.py --cupy 14.2.0 --add DIR/ctf_refine.json   (another kind, to the list)
     python benchmarks/ship_kernels.py --cupy 14.2.0 --add --without_cub DIR/*.json   (recorded with
         CUPY_ACCELERATORS empty: the modules new to the list are marked, and compiled ahead only without CUB)
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

from napari_gpu_relion.runtime import cupy_kernels

PLAIN = {"arch": None, "backend": "nvrtc", "enable_cooperative_groups": False, "name_expressions": None,
         "log_stream": None, "jitify": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cupy", required=True, help="the CuPy version of the recording machine")
    ap.add_argument("manifests", nargs="+", type=Path)
    ap.add_argument("--add", action="store_true",
                    help="add the manifests' modules to the shipped list (of the same CuPy version) instead of "
                         "replacing it: another job kind recorded on its own")
    ap.add_argument("--without_cub", action="store_true",
                    help="the manifests were recorded with CuPy's reductions without CUB: modules new to the list "
                         "are marked so that only a CuPy set not to use CUB compiles them ahead")
    a = ap.parse_args()
    if a.without_cub and not a.add:
        raise SystemExit("--without_cub marks the modules new to the shipped list: it needs --add (a list recorded "
                         "with CUB first)")
    modules: dict[str, dict] = {}
    skipped = 0
    if a.add:
        old = json.loads(gzip.decompress(cupy_kernels.SHIPPED.read_bytes()))
        if old["cupy"] != a.cupy:
            raise SystemExit(f"the shipped list is for CuPy {old['cupy']}, the manifests for {a.cupy}")
        for e in old["modules"]:
            modules[cupy_kernels.entry_key(e["source"], e["options"])] = e
    for path in a.manifests:
        job = path.stem
        for e in json.loads(path.read_text())["modules"]:
            if any(e.get("kw", {}).get(k, v) != v for k, v in PLAIN.items()):
                skipped += 1
                continue
            site = next((m.group(1) for o in e["options"] if (m := re.match(r"-I(.*)/cupy/_core/include", o))), None)
            options = [o.replace(site, cupy_kernels.SITE) if site else o for o in e["options"]]
            entry = {"source": e["source"], "options": options}
            key = cupy_kernels.entry_key(e["source"], options)
            if a.without_cub and key not in modules:
                entry[cupy_kernels.WITHOUT_CUB] = True
            elif not a.without_cub and key in modules:  # a CuPy with CUB uses it too
                modules[key].pop(cupy_kernels.WITHOUT_CUB, None)
            jobs = modules.setdefault(key, {**entry, "jobs": []})["jobs"]
            if job not in jobs:
                jobs.append(job)
    data = {"cupy": a.cupy, "modules": list(modules.values())}
    cupy_kernels.SHIPPED.write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    print(f"{len(modules)} modules ({skipped} left out) -> {cupy_kernels.SHIPPED} "
          f"({cupy_kernels.SHIPPED.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

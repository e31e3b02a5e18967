"""Which CUDA kernels the E-step's significance threshold compiles on long candidate rows after warm_scans (the
GPU test test_the_warmed_scans_leave_nothing_for_the_significance_threshold_to_compile found one on an H200 in
the thirty-third session: 37 cache files before, 38 after). Runs the test's steps in a fresh kernel cache with
CUPY_CACHE_SAVE_CUDA_SOURCE=1 and prints the kernel names of the sources saved during the long-row call.

Run (GPU): python benchmarks/threshold_compiles.py [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_STEPS = """
import json, sys, time
from pathlib import Path
import cupy as cp
import numpy as np
from napari_gpu_relion.compute import expectation
from napari_gpu_relion.runtime import kernel_preload as kp
cache = Path(sys.argv[1])
rng = np.random.default_rng(0)
def weights(n):
    logits = rng.normal(0.0, 8.0, (64, n)).astype(np.float32)
    p = cp.asarray(np.exp(logits - logits.max(axis=1, keepdims=True)))
    p /= p.sum(axis=1, keepdims=True)
    return p
small, big = weights(2_000), weights(252_000)
expectation.significance_threshold(small, 0.999)
kp.warm_scans(cp)
cp.cuda.Device().synchronize()
before = set(cache.rglob("*"))
expectation.significance_threshold(big, 0.999)
cp.cuda.Device().synchronize()
print(json.dumps(sorted(str(f) for f in set(cache.rglob("*")) - before)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache, CUPY_CACHE_SAVE_CUDA_SOURCE="1",
                   NAPARI_GPU_RELION_KERNEL_PRELOAD="0")
        r = subprocess.run([sys.executable, "-c", _STEPS, cache], env=env, capture_output=True, text=True,
                           timeout=300)
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        new = json.loads(r.stdout.strip().splitlines()[-1])
        kernels = {}
        for f in new:
            p = Path(f)
            if p.suffix == ".cu" and p.is_file():
                src = p.read_text(errors="replace")
                kernels[p.name] = {"kernels": re.findall(r"__global__\s+void\s+(\w+)", src),
                                   "head": src[:1500]}
    res = {"new_cache_files": [Path(f).name for f in new], "sources": kernels}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""napari-gpu-relion: RELION-style cryo-EM processing on the GPU, in napari and on the command line.

Importing this package is light: no napari, no Qt, no CuPy. Those load only when a widget, the viewer
or the GPU backend is used.

CuPy's reductions without CUB by default (CuPy's public CUPY_ACCELERATORS, read when CuPy is imported, so set
here before any CuPy import of this package; a value the user set is kept, ``CUPY_ACCELERATORS=cub`` brings CUB
back). CUB's block reductions are 25 modules that take 65 % of NVRTC's time in a machine's first class3d; without
them that first job took 15.86 s instead of 22.44 s and a warm one 6.58 s instead of 6.60 s (box 128, one H200 of
an nvidia-h200-x2 host, benchmarks/first_run.sh nocub, thirty-seventh session).

NVRTC's automatic precompiled headers for CuPy's kernels by default (CuPy's CUPY_NVRTC_USE_PCH, read when CuPy's
compiler is imported; used from NVRTC 12.8 on; a value the user set is kept). CuPy adds NVRTC's ``--pch`` after it
has made a module's cache key, so the modules are the same files with it or without. Each process parses CuPy's
headers once instead of once per module: 0.06-0.07 s per class3d module instead of 0.12-0.16 s, the shipped class3d
list compiled ahead in 5.6-5.8 s instead of 7.1-7.2 s, and a new machine's first class3d at box 128 8.84 s instead of
9.57 s, 1.52x its second run instead of 1.70x (the means of nine pairs on three H200 machines, NVRTC 13.0,
benchmarks/nvrtc_pch.py and first_run.sh pairs, forty-ninth session).
"""

import os as _os
import sys as _sys

if "cupy" not in _sys.modules:
    _os.environ.setdefault("CUPY_ACCELERATORS", "")
    _os.environ.setdefault("CUPY_NVRTC_USE_PCH", "1")

__version__ = "0.1.0"

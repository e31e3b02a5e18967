"""napari-gpu-relion: RELION-style cryo-EM processing on the GPU, in napari and on the command line.

Importing this package is light: no napari, no Qt, no CuPy. Those load only when a widget, the viewer
or the GPU backend is used.

CuPy's reductions without CUB by default (CuPy's public CUPY_ACCELERATORS, read when CuPy is imported, so set
here before any CuPy import of this package; a value the user set is kept, ``CUPY_ACCELERATORS=cub`` brings CUB
back). CUB's block reductions are 25 modules that take 65 % of NVRTC's time in a machine's first class3d; without
them that first job took 15.86 s instead of 22.44 s and a warm one 6.58 s instead of 6.60 s (box 128, one H200 of
an nvidia-h200-x2 host, benchmarks/first_run.sh nocub, thirty-seventh session).
"""

import os as _os
import sys as _sys

if "cupy" not in _sys.modules:
    _os.environ.setdefault("CUPY_ACCELERATORS", "")

__version__ = "0.1.0"

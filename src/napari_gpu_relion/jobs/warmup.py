"""Compile this machine's GPU kernels once, ahead of the first real job.

CuPy compiles each CUDA kernel the first time a process uses it and keeps the result in its kernel cache
(``CUPY_CACHE_DIR``, by default ~/.cupy/kernel_cache), where every later process finds it. On a machine whose
cache is empty, a user's first job pays for all of them: about 100 s of a box-128 auto-refine on an H100 (155 s
against 48 s with a warm cache, benchmarks/README.md). RELION ships compiled kernels, so without this its first
run and ours are not alike. The warm-up runs the EM jobs on a tiny simulated set (box 32, 200 particles) with the
options of a typical run (CTF, solvent flattening, masks with zeros and with noise, norm and scale corrections in
the refinement and in the classification (whose group-scale sums run per class),
padding 2, global and local searches, the final iteration), so that the kernels the real jobs use are compiled
here; before them it builds every specialisation of the registry's fused ops (runtime/kernels.py). CuPy
specialises some kernels by size as well as by type (its reductions pick other kernels for long rows
than for short ones; dimensions of length 1 drop out of the indexing code), so the runs are repeated on a
medium set (box 96, 1,000 particles) whose arrays have the sizes of real jobs. benchmarks/kernel_compiles.py
lists what a real job still compiles after the warm-up (benchmarks/README.md, "Kernel compilation").
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..events import Finished, Message, Started
from ..runtime import cupy_kernels, kernels
from ..runtime.device import backend_for
from ..runtime.kernel_preload import kernel_cache_dir, warm_scans
from . import class2d, class3d, refine3d
from .common import param
from .simulate import make_sample_data

JOB_NAME = "warmup"


@dataclass(frozen=True)
class Params:
    o: Path | None = param(None, "--o", "Folder for the tiny data set and the runs (default: a temporary folder, "
                           "removed afterwards)")
    gpu: str | None = param(None, "--gpu", "GPU index")
    boxes: str = param("32,96", "--boxes", "Box sizes (pixels) of the simulated sets the jobs run on, comma-separated: "
                       "box 32 has 200 particles, larger boxes 1,000 (so that size-specialised kernels are compiled "
                       "for the sizes of real jobs)")

    def __post_init__(self):
        try:
            boxes = [int(b) for b in str(self.boxes).split(",")]
        except ValueError:
            raise InputError(f"--boxes: comma-separated even box sizes in pixels, got {self.boxes!r}") from None
        if not boxes or any(b < 32 or b % 2 for b in boxes):
            raise InputError(f"--boxes: even box sizes of at least 32 pixels, got {self.boxes!r}")


def warmup_sets(boxes: str) -> list[dict]:
    """make_sample_data arguments of each set: the same physical particle (192 Å box, 140 Å phantom) sampled at
    each box size."""
    out = []
    for b in (int(x) for x in boxes.split(",")):
        out.append({"box": b, "angpix": 192.0 / b, "n_particles": 200 if b <= 32 else 1000, "snr": 0.1,
                    "diameter": 140.0, "ini_high": 60.0, "n_micrographs": 0})
    return out


def cached_kernels() -> int:
    """How many compiled modules CuPy's disk cache holds."""
    return cupy_kernels.cache_files(kernel_cache_dir())


def _runs(data: Path, out: Path, gpu: str, full: bool) -> list[tuple[str, object, object]]:
    """(name, job module, Params) of the runs that compile the kernels. ``full``: the auto-refine goes RELION's
    whole default schedule (HEALPix 2, local searches from order 4, to convergence and the final iteration), so
    that the branches a real run takes only late (finer orders, local searches, the full-size final pass) meet
    arrays of real sizes; the tiny set takes a short cut through the same stages."""
    common = {"i": data / "particles.star", "ctf": True, "particle_diameter": 160.0, "gpu": gpu}
    ref = {"ref": data / "reference.mrc", "ini_high": 60.0, "flatten_solvent": True}
    schedule = {"healpix_order": 2, "auto_local_healpix_order": 4} if full else \
        {"healpix_order": 1, "auto_local_healpix_order": 2, "auto_iter_max": 3}
    return [
        ("3D auto-refine, global then local searches and the final iteration", refine3d, refine3d.Params(
            o=out / "refine_global" / "run", zero_mask=True, norm=True, scale=True, pad=2, **schedule, **ref,
            **common)),
        ("3D auto-refine, local searches from the start, masks filled with noise", refine3d, refine3d.Params(
            o=out / "refine_local" / "run", healpix_order=2, auto_local_healpix_order=2, auto_iter_max=1, pad=2,
            **ref, **common)),
        ("3D classification, K=2, norm and scale corrections", class3d, class3d.Params(
            o=out / "class3d" / "run", K=2, iter=2, healpix_order=2 if full else 1, zero_mask=True, pad=2, norm=True,
            scale=True, **ref, **common)),
        ("2D classification, K=2", class2d, class2d.Params(
            o=out / "class2d" / "run", K=2, iter=2, zero_mask=True, **common)),
    ]


def run(p: Params) -> Iterator:
    be = backend_for(p)
    yield Started(JOB_NAME, Path(p.o) if p.o else Path(tempfile.gettempdir()), be.name,
                  "compiling the GPU kernels of the EM jobs on small simulated sets")
    if not be.is_gpu:
        yield Finished({}, "no GPU: nothing to compile (the CPU runs NumPy)")
        return
    t0, before = time.time(), cached_kernels()
    try:
        reg = kernels.build(be.device)
        with be.xp.cuda.Device(be.device):  # CuPy's scans of long rows (size-dependent variants)
            warm_scans(be.xp)
        yield Message(f"  the registry's fused ops: {reg['ops']} specialisations built in {reg['seconds']:.1f} s, "
                      f"{cached_kernels() - before} kernels compiled so far")
    except Exception as exc:  # noqa: BLE001 - the runs below still compile what the jobs use
        yield Message(f"the registry's fused ops did not all build ({type(exc).__name__}: {exc}); the jobs below "
                      "compile theirs", "warning")
    shipped = cupy_kernels.shipped_entries(None)
    if shipped:
        got = cupy_kernels.compile_ahead(shipped, be.device, kernel_cache_dir())
        yield Message(f"  CuPy's kernel modules of the EM jobs at box 128-360 (the package's list): "
                      f"{got['modules']} of {got['of']} compiled in {cupy_kernels.default_workers()} processes in "
                      f"{got['seconds']:.1f} s")
    else:
        yield Message("  no shipped list of CuPy kernel modules for this CuPy version: the jobs below compile theirs")
    with tempfile.TemporaryDirectory(prefix="ngr_warmup_") as tmp:
        out = Path(p.o) if p.o else Path(tmp)
        gpu = "0" if p.gpu is None else str(p.gpu)
        for spec in warmup_sets(p.boxes):
            tag = f"box{spec['box']}"
            data = make_sample_data(out / f"data_{tag}", **spec)
            for name, module, params in _runs(data, out / tag, gpu, full=spec["box"] > 32):
                t = time.time()
                for ev in module.run(params):
                    if isinstance(ev, Message) and ev.level == "warning":
                        yield ev
                after = cached_kernels()
                yield Message(f"  box {spec['box']}, {spec['n_particles']} particles, {name}: {time.time() - t:.1f} s, "
                              f"{after - before} kernels compiled so far")
    added = cached_kernels() - before
    yield Finished({"kernel_cache": kernel_cache_dir()},
                   f"{added} kernels compiled into {kernel_cache_dir()} in {time.time() - t0:.0f} s; later jobs on "
                   f"this machine find them there")

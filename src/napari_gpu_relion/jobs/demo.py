"""The demo: the whole pipeline that exists, on the sample data, printing what it achieved.

Now: reconstruct the two random halves of the sample particles from their true angles (CTF-corrected), make
a mask from the joined map, post-process the half maps, and compare with the ground-truth map.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute.fsc import fsc, fsc_to_full, resolution_A, resolution_shell
from ..io.mrc import read_mrc, write_mrc
from . import mask_create, postprocess, reconstruct
from .common import param
from .events import Finished, Message, Started
from .simulate import make_sample_data, sample_data_dir

JOB_NAME = "demo"


@dataclass(frozen=True)
class Params:
    o: Path = param(flag="--o", help="Output folder for the demo's job folders")
    data: Path | None = param(None, "--data", "Sample data folder (default: the packaged sample data)")
    regenerate: bool = param(False, "--regenerate", "Simulate a fresh sample data set into <o>/sample_data")
    cpu: bool = param(False, "--cpu", "Run on the CPU even if a GPU is present")
    gpu: int | None = param(None, "--gpu", "GPU index to use")


def _forward(gen, sink: list):
    """Re-yield a sub-job's events except its Started/Finished, remembering its Finished."""
    for ev in gen:
        if isinstance(ev, Finished):
            sink.append(ev)
            yield Message(f"  -> {ev.summary}")
        elif not isinstance(ev, Started):
            yield ev


def run(p: Params) -> Iterator:
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(p.data) if p.data else (make_sample_data(out / "sample_data") if p.regenerate else sample_data_dir())
    yield Started(JOB_NAME, out, "see each step", f"demo on {data}")
    done: list[Finished] = []
    halves = []
    for k in (1, 2):
        yield Message(f"Reconstruct half {k} from the true angles (--ctf --subset {k})")
        o = out / "Reconstruct" / f"run_half{k}_class001_unfil.mrc"
        yield from _forward(reconstruct.run(reconstruct.Params(
            i=data / "particles.star", o=o, ctf=True, subset=k, cpu=p.cpu, gpu=p.gpu)), done)
        halves.append(o)
    h1 = read_mrc(halves[0])
    apix = float(h1.pixel_size)
    joined = 0.5 * (np.asarray(h1.data, np.float64) + np.asarray(read_mrc(halves[1]).data, np.float64))
    jpath = write_mrc(out / "Reconstruct" / "joined.mrc", joined.astype(np.float32), apix)
    yield Message("Mask from the joined map (lowpass 15 Å, threshold at 3% of max, extend 2 px, edge 4 px)")
    mpath = out / "MaskCreate" / "mask.mrc"
    yield from _forward(mask_create.run(mask_create.Params(
        i=jpath, o=mpath, ini_threshold=0.03 * float(joined.max()), extend_inimask=2, width_soft_edge=4,
        lowpass=15.0)), done)
    yield Message("Post-process the half maps (auto B-factor)")
    yield from _forward(postprocess.run(postprocess.Params(
        i=halves[0], i2=halves[1], o=out / "PostProcess", mask=mpath, auto_bfac=True, autob_lowres=15.0)), done)
    truth = np.asarray(read_mrc(data / "truth.mrc").data, np.float64)
    N = truth.shape[0]
    f_half = fsc(np.asarray(h1.data, np.float64), np.asarray(read_mrc(halves[1]).data, np.float64))
    f_truth = fsc(joined, truth)
    r_half = resolution_A(f_half, N, apix, 0.143)
    r_truth = resolution_A(f_truth, N, apix, 0.5)
    r_pred = resolution_A(fsc_to_full(f_half), N, apix, 0.5)
    summary = (f"half-map FSC 0.143: {r_half:.1f} Å; joined map vs truth FSC 0.5: {r_truth:.1f} Å "
               f"(predicted from the half maps by FSC' = sqrt(2FSC/(1+FSC)): {r_pred:.1f} Å, shells "
               f"{resolution_shell(f_truth, 0.5)} vs {resolution_shell(fsc_to_full(f_half), 0.5)})")
    yield Finished({"postprocess": out / "PostProcess" / "postprocess.mrc", "half1": halves[0],
                    "half2": halves[1]}, summary)

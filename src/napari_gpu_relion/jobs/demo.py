"""The demo: the whole pipeline that exists, on the sample data, printing what it achieved.

Now: pick the sample micrographs (LoG) and extract the picks, scoring the picks against the true positions;
reconstruct the two random halves of the sample particles from their true angles (CTF-corrected), make
a mask from the joined map, post-process the half maps, and compare with the ground-truth map; classify the
particles in 2D and select the classes holding at least 5 % of them; then refine the selected particles with
3D auto-refine from the sample reference low-passed to 60 Å and report the gold-standard
resolution and the median angular error against the true angles.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute.fsc import fsc, fsc_to_full, resolution_A, resolution_shell
from ..compute.geometry import angular_distance_deg, euler_to_matrix
from ..compute.ground_truth import pick_matches
from ..io.jobdir import RunFiles
from ..io.micrographs import read_coordinate_list
from ..io.mrc import read_mrc, write_mrc
from ..io.star import read_coordinates, read_particles
from . import autopick, class2d, extract, mask_create, postprocess, reconstruct, refine3d, select
from .common import param
from .events import Finished, Message, Started
from .simulate import make_sample_data, sample_data_dir

JOB_NAME = "demo"


@dataclass(frozen=True)
class Params:
    o: Path = param(flag="--o", help="Output folder for the demo's job folders")
    data: Path | None = param(None, "--data", "Sample data folder (default: the packaged sample data)")
    regenerate: bool = param(False, "--regenerate", "Simulate a fresh sample data set into <o>/sample_data")
    particle_diameter: float = param(150.0, "--particle_diameter", "Particle diameter of the data (Å): picking "
                                     "searches 0.8-1.2 x this")
    cpu: bool = param(False, "--cpu", "Run on the CPU even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index; MPI: RELION's 0:1:2:3, ranks take them in turn")


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
    summary = yield from _pick_and_extract(p, data, out, done)
    halves = []
    for k in (1, 2):
        yield Message(f"Reconstruct half {k} from the true angles (--ctf --subset {k})")
        o = RunFiles(out / "Reconstruct" / "run").unfiltered_half_map(k)
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
    summary += (f"; half-map FSC 0.143: {r_half:.1f} Å; joined map vs truth FSC 0.5: {r_truth:.1f} Å "
               f"(predicted from the half maps by FSC' = sqrt(2FSC/(1+FSC)): {r_pred:.1f} Å, shells "
               f"{resolution_shell(f_truth, 0.5)} vs {resolution_shell(fsc_to_full(f_half), 0.5)})")
    yield Message(summary)
    class2d_run = RunFiles(out / "Class2D" / "run")
    yield Message("2D classification (K=4, 10 iterations, --ctf --flatten_solvent --zero_mask --center_classes), "
                  "then select the classes holding >= 5 % of the particles")
    yield from _forward(class2d.run(class2d.Params(
        i=data / "particles.star", o=class2d_run.root, K=4, iter=10, ctf=True,
        particle_diameter=p.particle_diameter + 10, flatten_solvent=True, zero_mask=True, center_classes=True,
        cpu=p.cpu, gpu=p.gpu)), done)
    selected = out / "Select" / "particles.star"
    yield from _forward(select.run(select.Params(i=class2d_run.data(10), o=selected,
                                                 min_class_distribution=0.05)), done)
    summary += f"; 2D classes -> {done[-1].summary}"
    yield Message("3D auto-refine of the selected particles from the reference low-passed to 60 Å (--ctf "
                  "--flatten_solvent, HEALPix order 1 to start, local searches from order 3)")
    refined = RunFiles(out / "Refine3D" / "run")
    yield from _forward(refine3d.run(refine3d.Params(
        i=selected, ref=data / "reference.mrc", o=refined.root, ini_high=60.0, ctf=True, flatten_solvent=True,
        healpix_order=1, auto_local_healpix_order=3, cpu=p.cpu, gpu=p.gpu)), done)
    r1 = read_mrc(refined.unfiltered_half_map(1))
    r_ref = resolution_A(fsc(np.asarray(r1.data, np.float64),
                             np.asarray(read_mrc(refined.unfiltered_half_map(2)).data, np.float64)),
                         N, apix, 0.143)
    err = _angular_errors(refined.data(), data / "particles.star")
    summary += (f"; refined from 60 Å: half-map FSC 0.143 {r_ref:.1f} Å (true angles {r_half:.1f} Å), median "
                f"angular error {np.median(err):.2f}° ({(err < 10).mean() * 100:.0f}% under 10°)")
    yield Finished({"postprocess": out / "PostProcess" / "postprocess.mrc", "half1": halves[0],
                    "half2": halves[1], "refined": refined.class_map(1)}, summary)


def _pick_and_extract(p: Params, data: Path, out: Path, done: list) -> Iterator:
    """LoG picking of the sample micrographs, scored against their true coordinates, then extraction of the
    picks (box 64, background normalisation, contrast inverted). Returns the summary text."""
    d = p.particle_diameter
    yield Message(f"Auto-pick the micrographs (--LoG {0.8 * d:.0f}-{1.2 * d:.0f} Å, robust threshold +3 sd)")
    pdir = out / "AutoPick"
    yield from _forward(autopick.run(autopick.Params(
        i=data / "micrographs.star", odir=pdir, LoG=True, LoG_diam_min=0.8 * d, LoG_diam_max=1.2 * d,
        LoG_adjust_threshold=3.0, LoG_robust_stats=True, cpu=p.cpu, gpu=p.gpu)), done)
    tot = np.zeros(4, int)
    apix = None
    for mic, coords in read_coordinate_list(pdir / "autopick.star").items():
        apix = apix or float(read_mrc(data / mic, mmap=True).pixel_size)
        picks = read_coordinates(coords)
        truth = read_coordinates(data / "coords" / f"{Path(mic).stem}_truth.star")
        tot += pick_matches(truth[["rlnCoordinateX", "rlnCoordinateY"]].to_numpy(),
                            picks[["rlnCoordinateX", "rlnCoordinateY"]].to_numpy(), d / 4 / apix)
    box = int(2 * round(0.75 * d / apix))  # about 1.5 diameters, even
    text = (f"picking: recall {tot[0] / max(tot[1], 1):.2f}, precision {tot[2] / max(tot[3], 1):.2f} "
            f"({tot[3]} picks, {tot[1]} particles, within {d / 4:.1f} Å)")
    if tot[3]:
        yield Message(f"Extract the picks (--extract_size {box} --norm --invert_contrast)")
        yield from _forward(extract.run(extract.Params(
            i=data / "micrographs.star", coord_list=pdir / "autopick.star", o=out / "Extract", extract_size=box,
            norm=True, invert_contrast=True, cpu=p.cpu, gpu=p.gpu)), done)
        text += f"; extracted {done[-1].summary}"
    yield Message(text)
    return text


def _angular_errors(refined_star: Path, truth_star: Path) -> np.ndarray:
    """Angle (degrees) between refined and true orientations of the refined particles, matched to the truth
    by their image number in the (one) stack."""
    cols = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
    a, b = read_particles(refined_star).particles, read_particles(truth_star).particles
    number = b["rlnImageName"].astype(str).str.split("@").str[0].astype(int)
    b = b.set_index(number.to_numpy()).loc[a["rlnImageName"].astype(str).str.split("@").str[0].astype(int)]
    ma = euler_to_matrix(*(a[c].to_numpy() for c in cols))
    mb = euler_to_matrix(*(b[c].to_numpy() for c in cols))
    return angular_distance_deg(ma, mb)

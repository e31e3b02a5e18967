"""The demo: the whole pipeline that exists, on the sample data, printing what it achieved.

Now: pick the sample micrographs (LoG) and extract the picks, scoring the picks against the true positions;
reconstruct the two random halves of the sample particles from their true angles (CTF-corrected), make
a mask from the joined map, post-process the half maps, and compare with the ground-truth map; classify the
particles in 2D and select the classes holding at least 5 % of them; make a 3D initial model of the selected
particles from the particles alone (no reference: RELION's "3D initial model", relion_refine --grad
--denovo_3dref); then refine the selected particles with 3D auto-refine from that model low-passed to 60 Å and
report the gold-standard resolution and the median angular error against the true angles.

The initial model's hand and orientation are arbitrary (a map made from projections alone can be the mirror
image, turned any way). The demo has the truth, so it compares the model with the truth at 30 Å after the best
rotation and shift in both hands, and flips the model (compute.initial_model.invert_hand) when its mirror image
fits better: with real data the hand is checked on the refined map from a known feature (the right-handed twist
of alpha-helices at high resolution) and the map flipped if needed. The refined poses are compared with the true
ones after the best common rotation (the model's frame is the model's own), in both hands: the hand in which they
agree confirms or refutes the choice made at 30 Å. ``<o>/demo_summary.json`` holds the numbers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute.fsc import fsc, fsc_to_full, resolution_A, resolution_shell
from ..compute.geometry import euler_to_matrix, rotation_angle_deg
from ..compute.ground_truth import frame_aligned_angular_errors, pick_matches
from ..compute.initial_model import aligned_map_correlation, invert_hand
from ..events import Finished, Message, Started
from ..io.jobdir import RunFiles
from ..io.micrographs import read_coordinate_list
from ..io.mrc import read_mrc, write_mrc
from ..io.star import read_coordinates, read_particles
from . import autopick, class2d, extract, initial_model, mask_create, postprocess, reconstruct, refine3d, select
from .common import param
from .simulate import make_sample_data, sample_data_dir

JOB_NAME = "demo"
#: The 3D initial model's options in the demo (RELION's names): a short run for 2 CPU cores (RELION's job runs 200
#: iterations), mini-batches of 100 growing to 400 particles, 35 Å -> 15 Å, --pad 1 (RELION's GUI job). Chosen on
#: the sample particles (400, box 64, 3 Å/px, SNR 0.1): benchmarks/README.md, "The demo's initial model".
INITIAL_MODEL = {"iter": 100, "grad_ini_subset": 100, "grad_fin_subset": 400, "grad_ini_resol": 35.0,
                 "grad_fin_resol": 15.0, "pad": 1, "random_seed": 0}
#: Resolution (Å) at which the initial model is compared with the truth and its hand chosen (issue 22's measure).
HAND_CHECK_A = 30.0


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
    model, im = yield from _initial_model(p, selected, out, truth, apix, done)
    summary += "; " + im["text"]
    yield Message("3D auto-refine of the selected particles from the initial model low-passed to 60 Å (--ctf "
                  "--flatten_solvent, HEALPix order 1 to start, local searches from order 3)")
    refined = RunFiles(out / "Refine3D" / "run")
    t0 = time.time()
    yield from _forward(refine3d.run(refine3d.Params(
        i=selected, ref=model, o=refined.root, ini_high=60.0, ctf=True, flatten_solvent=True,
        healpix_order=1, auto_local_healpix_order=3, cpu=p.cpu, gpu=p.gpu)), done)
    t_refine = time.time() - t0
    r1 = read_mrc(refined.unfiltered_half_map(1))
    r_ref = resolution_A(fsc(np.asarray(r1.data, np.float64),
                             np.asarray(read_mrc(refined.unfiltered_half_map(2)).data, np.float64)),
                         N, apix, 0.143)
    poses = _pose_check(refined.data(), data / "particles.star")
    if poses["refined_map_mirrored"]:
        yield Message(poses["text"] + f": the hand chosen on the initial model at {HAND_CHECK_A:g} Å was wrong",
                      "warning")
    else:
        yield Message(poses["text"] + f", as chosen on the initial model at {HAND_CHECK_A:g} Å")
    summary += (f"; refined from the initial model (60 Å): half-map FSC 0.143 {r_ref:.1f} Å (true angles "
                f"{r_half:.1f} Å), median angular error {poses['median_error_deg']:.2f}° after the best common "
                f"rotation ({poses['under_10deg'] * 100:.0f}% under 10°; {poses['hand_text']})")
    numbers = {"summary": summary, "true_angles_half_map_resolution_A": r_half,
               "initial_model": {k: v for k, v in im.items() if k != "text"},
               "refine3d": {"reference": str(model), "half_map_resolution_A": r_ref, "seconds": t_refine,
                            **{k: v for k, v in poses.items() if k not in ("text", "hand_text")}}}
    (out / "demo_summary.json").write_text(json.dumps(numbers, indent=1, default=str))
    yield Finished({"postprocess": out / "PostProcess" / "postprocess.mrc", "half1": halves[0],
                    "half2": halves[1], "initial_model": model, "refined": refined.class_map(1),
                    "summary": out / "demo_summary.json"}, summary)


def _initial_model(p: Params, selected: Path, out: Path, truth: np.ndarray, apix: float,
                   done: list) -> Iterator:
    """The 3D initial model of the selected particles from the particles alone (``INITIAL_MODEL``), compared with
    the truth at ``HAND_CHECK_A`` Å after the best rotation and shift in either hand, and flipped when its mirror
    image fits the truth better (only the demo can know: it has the truth). Returns (the map to refine from, a dict
    of numbers and the summary text)."""
    o = INITIAL_MODEL
    yield Message(f"3D initial model of the selected particles from the particles alone (no reference; --iter "
                  f"{o['iter']}, mini-batches {o['grad_ini_subset']} -> {o['grad_fin_subset']}, "
                  f"{o['grad_ini_resol']:g} -> {o['grad_fin_resol']:g} Å, --pad {o['pad']}, --ctf --flatten_solvent "
                  "--zero_mask)")
    run = RunFiles(out / "InitialModel" / "run")
    t0 = time.time()
    yield from _forward(initial_model.run(initial_model.Params(
        i=selected, o=run.root, K=1, ctf=True, particle_diameter=p.particle_diameter + 10, flatten_solvent=True,
        zero_mask=True, cpu=p.cpu, gpu=p.gpu, **o)), done)
    seconds = time.time() - t0
    made = run.class_map(1)
    vol = np.asarray(read_mrc(made).data, np.float64)
    yield Message(f"Compare the initial model with the truth at {HAND_CHECK_A:g} Å after the best rotation and "
                  "shift, in both hands (only the demo can: it has the truth)")
    t0 = time.time()
    by_hand = aligned_map_correlation(vol, truth, apix, HAND_CHECK_A)["by_hand"]
    compare_seconds = time.time() - t0
    cc, cc_mirror = by_hand[False]["cc"], by_hand[True]["cc"]
    flipped = cc_mirror > cc
    model = made
    if flipped:
        model = write_mrc(made.with_name(made.stem + "_inverted_hand.mrc"), invert_hand(vol).astype(np.float32),
                          apix)
    hand = ("its mirror image fits the truth better, so the demo flipped it (x -> -x about the box centre, "
            f"relion_image_handler --invert_hand): {model}" if flipped else "the hand it was made in fits the truth "
            "better, so the demo keeps it")
    yield Message(f"initial model vs truth at {HAND_CHECK_A:g} Å: cc {cc:.3f} as made, {cc_mirror:.3f} mirrored; "
                  f"{hand}. The demo used the truth to choose the hand; with real data the hand is checked on the "
                  "refined map from a known feature (e.g. the right-handed twist of alpha-helices at high "
                  f"resolution) and the map flipped if needed ({compare_seconds:.0f} s)")
    best = max(cc, cc_mirror)
    text = (f"initial model from the particles alone ({o['iter']} iterations, {seconds:.0f} s): cc with the truth "
            f"at {HAND_CHECK_A:g} Å {best:.3f} in the chosen hand ({min(cc, cc_mirror):.3f} in the other), "
            + ("flipped" if flipped else "kept as made") + " (hand chosen with the truth)")
    return model, {"text": text, "seconds": seconds, "compare_seconds": compare_seconds, "options": dict(o),
                   "cc_as_made": cc, "cc_mirrored": cc_mirror, "cc_chosen_hand": best, "resolution_A": HAND_CHECK_A,
                   "flipped": flipped, "map": str(model)}


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


def _pose_matrices(refined_star: Path, truth_star: Path) -> tuple[np.ndarray, np.ndarray]:
    """Refined and true rotation matrices (n, 3, 3) of the refined particles, matched to the truth by their image
    number in the (one) stack."""
    cols = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
    a, b = read_particles(refined_star).particles, read_particles(truth_star).particles
    number = b["rlnImageName"].astype(str).str.split("@").str[0].astype(int)
    b = b.set_index(number.to_numpy()).loc[a["rlnImageName"].astype(str).str.split("@").str[0].astype(int)]
    return (euler_to_matrix(*(a[c].to_numpy() for c in cols)), euler_to_matrix(*(b[c].to_numpy() for c in cols)))


def _pose_check(refined_star: Path, truth_star: Path) -> dict:
    """The refined poses against the true ones after the best common rotation (a map made from the particles alone
    lies in a frame of its own), in both hands: the hand with the smaller median error is the refined map's (a
    refinement keeps the hand of its reference). The errors reported are those of that hand."""
    A, B = _pose_matrices(refined_star, truth_star)
    fits = {m: frame_aligned_angular_errors(A, B, mirrored=m) for m in (False, True)}
    med = {m: float(np.median(fits[m][0])) for m in fits}
    mirrored = med[True] < med[False]
    err, G = fits[mirrored]
    hand_text = "the refined map is the truth's mirror image" if mirrored else "the refined map has the truth's hand"
    text = (f"refined poses vs the true ones after the best common rotation ({rotation_angle_deg(G):.0f}° from the "
            f"truth's frame): median error {med[False]:.2f}° in the truth's hand, {med[True]:.2f}° in its mirror "
            f"image's: {hand_text}")
    return {"text": text, "hand_text": hand_text, "refined_map_mirrored": mirrored, "median_error_deg": med[mirrored],
            "median_error_other_hand_deg": med[not mirrored], "under_10deg": float((err < 10).mean()),
            "frame_rotation_deg": float(rotation_angle_deg(G))}

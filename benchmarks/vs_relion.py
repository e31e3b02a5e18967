"""Side by side with RELION 5 on the same GPU, same data, same options (issue 15).

Two steps, both on the GPU machine with RELION built from ../shared/relion_gpu (``. /root/rb/env.sh``):

1. ``make-data``: a map of your choice (default: the real 70S ribosome, 65^3 at ~5 Å/px) resampled to the box,
   optionally a second state (a sphere of density removed), random orientations, offsets and CTFs, and particles
   made by RELION's own ``relion_project --ctf --add_noise --white_noise SD`` with SD set from the projections'
   variance for the requested SNR (signal variance over the box / noise variance). Writes particles.star (both
   states), truth.star (angles, offsets, state per image name) and ref.mrc (state 1; both programs low-pass it
   to --ini_high themselves).
2. ``run``: one job (class3d, refine3d or class2d) by RELION (its usual one-GPU layout, or ``--relion_ranks N``)
   and by us (one process, or ``--ours_ranks N`` under mpiexec), with identical options, one after the other;
   per-iteration times from the run_itNNN files' times,
   resolution of the final half maps (our FSC of both programs' unfiltered half maps, unmasked: one method for
   both), median angular error against the truth, class purity and the fraction of particles that changed class
   per iteration. Writes JSON naming the GPU.

Run (GPU machine):
  python benchmarks/vs_relion.py make-data --out /root/d128 --box 128 --n 10000 --states 2
  python benchmarks/vs_relion.py run --job class3d --data /root/d128 --K 4 --iter 5 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import starfile
from scipy import ndimage

from napari_gpu_relion.compute.fsc import fsc, resolution_A
from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.compute.ground_truth import frame_aligned_angular_errors
from napari_gpu_relion.compute.simulate import fit_box
from napari_gpu_relion.compute.symmetry_alignment import rotate_map
from napari_gpu_relion.io.mrc import read_mrc, write_mrc

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
DEFAULT_MAP = Path(__file__).resolve().parents[1] / ".relion_kit" / "ribosome70S_65px.mrc"


def relion(cmd: str, log: Path) -> float:
    """Run a RELION command line through the build's env.sh (``rl`` sets its library path); returns the wall."""
    rb = os.environ.get("RB", "/root/rb")
    t = time.time()
    with open(log, "w") as fh:
        r = subprocess.run(["bash", "-c", f". {rb}/env.sh && {cmd}"], stdout=fh, stderr=subprocess.STDOUT)
    wall = time.time() - t
    if r.returncode:
        sys.exit(f"RELION failed (rc {r.returncode}): {cmd}\n" + log.read_text()[-3000:])
    return wall


# --------------------------------------------------------------------------------------------------------------
# make-data
# --------------------------------------------------------------------------------------------------------------

def resampled_map(path: Path, box: int, map_angpix: float = 0.0, angpix: float = 0.0) -> np.ndarray:
    """The map resampled (cubic spline), mean 0 outside. Without ``map_angpix``: from its box to ``box`` voxels over
    the same extent. With it: from ``map_angpix`` to ``angpix`` Å/px, then centre-cropped or zero-padded to ``box``
    (a real map such as EMD-11007 at 0.834 Å/px put into a box 256 at 1.05 Å/px)."""
    v = np.asarray(read_mrc(path).data, dtype=np.float64)
    if map_angpix > 0:
        out = ndimage.zoom(v, map_angpix / angpix, order=3)
        out = fit_box((out - np.median(out)).astype(np.float32), box)
        return out.astype(np.float32)
    out = ndimage.zoom(v, box / v.shape[0], order=3)
    out = out[:box, :box, :box]
    return (out - np.median(out)).astype(np.float32)


def remove_sphere(vol: np.ndarray, radius_px: float, seed: int) -> np.ndarray:
    """State 2: the map with a soft sphere of density removed, centred on a dense voxel at about a third of the
    particle radius from the centre (chosen reproducibly)."""
    n = vol.shape[0]
    z, y, x = np.mgrid[:n, :n, :n] - n // 2
    r = np.sqrt(x * x + y * y + z * z)
    rng = np.random.default_rng(seed)
    shell = np.argwhere((np.abs(r - n / 6) < 2) & (vol > np.percentile(vol, 95)))
    c = shell[rng.integers(len(shell))] - n // 2
    d = np.sqrt((x - c[2]) ** 2 + (y - c[1]) ** 2 + (z - c[0]) ** 2)
    keep = np.clip((d - radius_px) / 2.0, 0, 1)  # 0 inside, 2-voxel linear edge
    return (vol * keep).astype(np.float32)


def angles_table(n: int, box: int, angpix: float, rng, state: int, first: int,
                 defocus_A: tuple[float, float] = (10000.0, 25000.0), preferred: float = 0.0
                 ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Optics and particles blocks for relion_project: uniform orientations (a fraction ``preferred`` of them with
    tilt below 20°: a preferred view), offsets ~ N(0, 2 px) in Å, defocus ``defocus_A`` (default 1-2.5 µm) with
    astigmatism up to 300 Å."""
    u = rng.random((n, 3))
    top = rng.random(n) < preferred
    u[top, 1] *= (1 - np.cos(np.radians(20.0))) / 2  # cos(tilt) in [cos 20°, 1]
    rot, tilt, psi = 360 * u[:, 0] - 180, np.degrees(np.arccos(1 - 2 * u[:, 1])), 360 * u[:, 2] - 180
    du = rng.uniform(*defocus_A, n)
    parts = pd.DataFrame({
        "rlnAngleRot": rot, "rlnAngleTilt": tilt, "rlnAnglePsi": psi,
        "rlnOriginXAngst": rng.normal(0, 2.0, n) * angpix, "rlnOriginYAngst": rng.normal(0, 2.0, n) * angpix,
        "rlnDefocusU": du, "rlnDefocusV": du - rng.uniform(0, 300, n), "rlnDefocusAngle": rng.uniform(0, 180, n),
        "rlnPhaseShift": 0.0, "rlnCtfBfactor": 0.0, "rlnOpticsGroup": 1,
        "rlnRandomSubset": (np.arange(first, first + n) % 2) + 1, "rlnGpuRelionTrueState": state})
    optics = pd.DataFrame({"rlnOpticsGroupName": ["opticsGroup1"], "rlnOpticsGroup": [1],
                           "rlnImagePixelSize": [angpix], "rlnImageSize": [box], "rlnImageDimensionality": [2],
                           "rlnVoltage": [300.0], "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1]})
    return optics, parts


def make_data(a) -> None:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    extent_A = 65 * 5.0  # the ribosome map's extent (its header has no pixel size: ~5 Å/px)
    angpix = extent_A / a.box if a.angpix <= 0 else a.angpix
    if a.map_angpix > 0 and a.angpix <= 0:
        sys.exit("--map_angpix needs --angpix (the particles' pixel size)")
    v1 = resampled_map(Path(a.map), a.box, a.map_angpix, angpix)
    maps = [v1] + ([remove_sphere(v1, a.sphere_radius_A / angpix, a.seed)] if a.states == 2 else [])
    rng = np.random.default_rng(a.seed)
    n_per = [a.n // a.states + (1 if s < a.n % a.states else 0) for s in range(a.states)]
    write_mrc(out / "ref.mrc", v1, angpix)
    frames, first = [], 0
    for s, (vol, n) in enumerate(zip(maps, n_per, strict=True), start=1):
        write_mrc(out / f"state{s}.mrc", vol, angpix)
        optics, parts = angles_table(n, a.box, angpix, rng, s, first, (a.defocus_min_A, a.defocus_max_A),
                                     a.preferred)
        starfile.write({"optics": optics, "particles": parts}, out / f"angles{s}.star", overwrite=True)
        if s == 1:  # the noise SD from the noise-free projections of the first 300
            starfile.write({"optics": optics, "particles": parts.iloc[:300]}, out / "probe.star", overwrite=True)
            relion(f"cd {out} && rl $RELION_BIN/relion_project --i state1.mrc --o probe --ang probe.star --ctf "
                   f"--angpix {angpix}", out / "probe.log")
            sd = float(np.sqrt(np.asarray(read_mrc(out / "probe.mrcs").data, np.float64).var() / a.snr))
        relion(f"cd {out} && rl $RELION_BIN/relion_project --i state{s}.mrc --o proj{s} --ang angles{s}.star --ctf "
               f"--angpix {angpix} --add_noise --white_noise {sd}", out / f"proj{s}.log")
        df = starfile.read(out / f"proj{s}.star")
        frames.append(df["particles"] if isinstance(df, dict) else df)
        first += n
    opt = starfile.read(out / "proj1.star")
    optics = opt["optics"] if isinstance(opt, dict) else optics
    parts = pd.concat(frames, ignore_index=True)
    truth = parts[["rlnImageName", *ANG, "rlnOriginXAngst", "rlnOriginYAngst", "rlnGpuRelionTrueState"]] \
        if "rlnGpuRelionTrueState" in parts else None
    if truth is None:  # relion_project does not keep unknown columns: rebuild the truth from the angle tables
        ang = pd.concat([starfile.read(out / f"angles{s}.star")["particles"] for s in range(1, a.states + 1)],
                        ignore_index=True)
        truth = ang[[*ANG, "rlnOriginXAngst", "rlnOriginYAngst", "rlnGpuRelionTrueState"]].copy()
        truth.insert(0, "rlnImageName", parts["rlnImageName"].to_numpy())
    starfile.write({"particles": truth}, out / "truth.star", overwrite=True)
    keep = [c for c in parts.columns if c not in ("rlnGpuRelionTrueState",)]
    parts = parts[keep].copy()
    if a.zero_offsets:  # the images keep their true shifts; both programs start from offsets 0 (truth.star has them)
        parts[["rlnOriginXAngst", "rlnOriginYAngst"]] = 0.0
    starfile.write({"optics": optics, "particles": parts}, out / "particles.star", overwrite=True)
    info = {"box": a.box, "angpix": angpix, "n": int(a.n), "states": a.states, "snr": a.snr, "noise_sd": sd,
            "sphere_radius_A": a.sphere_radius_A if a.states == 2 else None, "zero_offsets": a.zero_offsets,
            "map": str(a.map), "map_angpix": a.map_angpix, "seed": a.seed,
            "defocus_A": [a.defocus_min_A, a.defocus_max_A], "preferred": a.preferred}
    (out / "data.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


# --------------------------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------------------------

def iteration_times(root: Path, t_start: float, startup_marker: Path | None = None
                    ) -> tuple[list[float], float | None]:
    """Per-iteration seconds from the modification times of run_itNNN_model.star (run_itNNN_half2_model.star
    in auto-refine) and the start-up time. The end of the start-up: RELION's it000 files (written at the end of
    its initialise(): references, initial noise spectra), else ``startup_marker`` (ours: note.txt, written when
    the initial references, the initial noise spectra and the memory plan are made, just before iteration 1),
    else none (iteration 1 then counts from t_start). The final iteration of auto-refine (run_model.star) counts
    as one more."""
    stamps = {}
    for f in root.parent.glob(root.name + "_it*_model.star"):
        m = re.search(r"_it(\d+)_(half2_)?model", f.name)
        if m and "half1" not in f.name:
            stamps[int(m.group(1))] = f.stat().st_mtime
    final = Path(f"{root}_model.star")
    if final.exists() and stamps:
        stamps[max(stamps) + 1] = final.stat().st_mtime
    if 0 not in stamps and startup_marker is not None and startup_marker.exists():
        stamps[0] = startup_marker.stat().st_mtime
    its = sorted(stamps)
    start = stamps.get(0)
    prev = start if start is not None else t_start
    times = []
    for it in its:
        if it == 0:
            continue
        times.append(stamps[it] - prev)
        prev = stamps[it]
    return times, (None if start is None else start - t_start)


def data_star(root: Path, final: bool) -> Path:
    if final and Path(f"{root}_data.star").exists():
        return Path(f"{root}_data.star")
    its = sorted(root.parent.glob(root.name + "_it*_data.star"))
    return its[-1]


def iteration_data_stars(root: Path) -> list[tuple[int | None, Path]]:
    """(iteration, path) of each iteration's data STAR of rootname ``root`` from iteration 1 on, then (None, the
    final data STAR) when it was written."""
    out = []
    for f in sorted(root.parent.glob(root.name + "_it*_data.star")):
        it = int(re.search(r"_it(\d+)_", f.name).group(1))
        if it > 0:
            out.append((it, f))
    if Path(f"{root}_data.star").exists():
        out.append((None, Path(f"{root}_data.star")))
    return out


def particles_of(path: Path) -> pd.DataFrame:
    d = starfile.read(path)
    return d["particles"] if isinstance(d, dict) else d


def _star_general(path: Path) -> dict:
    """The first (general) block of a STAR file as a dict, {} when the file is missing."""
    if not path.exists():
        return {}
    d = starfile.read(path, always_dict=True)
    first = next(iter(d.values()))
    return first if isinstance(first, dict) else first.iloc[0].to_dict()


#: What the schedule trace keeps of each iteration's optimiser STAR (RELION's labels; ours write them too, and
#: our EMState as rlnGpuRelion_<field>).
TRACE_OPTIMISER = {"no_resol_gain": "rlnNumberOfIterWithoutResolutionGain",
                   "no_large_changes": "rlnNumberOfIterWithoutChangingAssignments",
                   "acc_rot": "rlnOverallAccuracyRotations", "acc_trans_A": "rlnOverallAccuracyTranslationsAngst",
                   "changes_angles": "rlnChangesOptimalOrientations", "changes_offsets": "rlnChangesOptimalOffsets",
                   "changes_classes": "rlnChangesOptimalClasses",
                   "smallest_angles": "rlnSmallestChangesOrientations",
                   "smallest_offsets": "rlnSmallestChangesOffsets", "smallest_classes": "rlnSmallestChangesClasses",
                   "high_fsc_at_limit": "rlnHasHighFscAtResolLimit", "incr_size": "rlnIncrementImageSize"}
TRACE_OURS = {"acc_rot": "rlnGpuRelion_acc_rot", "acc_trans_A": "rlnGpuRelion_acc_trans_A",
              "offset_range": "rlnGpuRelion_offset_range", "offset_step": "rlnGpuRelion_offset_step",  # pixels
              "changes_angles": "rlnGpuRelion_last_angle_change",
              "changes_offsets": "rlnGpuRelion_last_offset_change_A",
              "smallest_angles": "rlnGpuRelion_smallest_angle_change",
              "smallest_offsets": "rlnGpuRelion_smallest_offset_change",
              "smallest_classes": "rlnGpuRelion_smallest_class_change", "order": "rlnGpuRelion_order",
              "local": "rlnGpuRelion_local", "high_fsc_at_limit": "rlnGpuRelion_has_high_fsc_at_limit",
              "incr_size": "rlnGpuRelion_incr_size"}


def schedule_trace(root: Path) -> list[dict]:
    """Per iteration: HEALPix order, offsets, image size, resolution and the change monitor's counters and values,
    from the run_itNNN files either program writes (why one program takes more iterations than the other)."""
    trace = []
    for opt_path in sorted(root.parent.glob(root.name + "_it*_optimiser.star")):
        it = int(re.search(r"_it(\d+)_", opt_path.name).group(1))
        if it == 0:
            continue
        stem = f"{root}_it{it:03d}"
        opt, smp = _star_general(opt_path), _star_general(Path(stem + "_sampling.star"))
        model = _star_general(Path(stem + "_half1_model.star")) or _star_general(Path(stem + "_model.star"))
        row = {"iteration": it, "order": smp.get("rlnHealpixOrder"), "offset_range": smp.get("rlnOffsetRange"),
               "offset_step": smp.get("rlnOffsetStep"), "image_size": model.get("rlnCurrentImageSize"),
               "resolution_A": model.get("rlnCurrentResolution"), "ave_pmax": model.get("rlnAveragePmax")}
        for k, label in TRACE_OPTIMISER.items():
            row[k] = opt.get(label)
        for k, label in TRACE_OURS.items():
            if label in opt and row.get(k) is None:
                row[k] = opt[label]
        trace.append({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()})
    return trace


def pose_differences(a: pd.DataFrame, b: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per particle of two tables in the same row order: the angle between their orientations (degrees) and the
    distance between their offsets (Å)."""
    ang = angular_distance_deg(*(euler_to_matrix(*(q[c].to_numpy() for c in ANG)) for q in (a, b)))
    off = np.hypot(a["rlnOriginXAngst"].to_numpy() - b["rlnOriginXAngst"].to_numpy(),
                   a["rlnOriginYAngst"].to_numpy() - b["rlnOriginYAngst"].to_numpy())
    return ang, off


def pose_arrays(truth: pd.DataFrame, refined: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(refined matrices A, true matrices B, offset differences refined - true (n, 2) Å) of two tables in the same
    row order: what ``frame_fit`` takes."""
    A, B = (euler_to_matrix(*(q[c].to_numpy() for c in ANG)) for q in (refined, truth))
    d = np.stack([refined[c].to_numpy(float) - truth[c].to_numpy(float)
                  for c in ("rlnOriginXAngst", "rlnOriginYAngst")], axis=1)
    return A, B, d


def frame_fit(A: np.ndarray, B: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The common turn G and 3D shift t (Å) of a refinement's frame against the truth, from refined poses ``A`` and
    true ones ``B`` ((n, 3, 3) RELION matrices) and the offset differences ``d`` (n, 2) (refined - true, Å).

    A map turned by G (V'(y) = V(G y)) gives every pose A = B G (``frame_aligned_angular_errors``' robust fit); one
    whose content moved by t gives every offset d = (B t)_xy (the particle's centre sits at the box centre minus its
    offset: ``compute.simulate``), fitted by least squares on the particles the turn fit kept. Returns (G, t, the
    angular errors after G (degrees), the offset errors after t (Å))."""
    ang, G = frame_aligned_angular_errors(A, B)
    keep = ang <= max(3.0 * float(np.median(ang)), 5.0)
    M = B[:, :2, :]  # each particle's two image-plane rows of its true pose
    t = np.linalg.lstsq(M[keep].reshape(-1, 3), d[keep].reshape(-1), rcond=None)[0]
    off = np.linalg.norm(d - M @ t, axis=1)
    return G, t, ang, off


def turn_angle_deg(G: np.ndarray) -> float:
    """The angle (degrees) of the rotation G."""
    return float(np.degrees(np.arccos(np.clip((np.trace(G) - 1) / 2, -1.0, 1.0))))


def truth_in_frame(vol: np.ndarray, G: np.ndarray, t_px: np.ndarray) -> np.ndarray:
    """The true map as a refinement with frame (G, t) (``frame_fit``; t in pixels) holds it: V turned by G (the map
    at refined poses A = B G projects as V at B; ``rotate_map`` by G^T, cubic splines), then its content moved by
    G^T t (a Fourier shift; (x, y, z) vector, arrays (z, y, x))."""
    w = rotate_map(vol, np.asarray(G).T, order=3)
    s = (np.asarray(G).T @ np.asarray(t_px, np.float64))[::-1]
    return np.real(np.fft.ifftn(ndimage.fourier_shift(np.fft.fftn(w), s)))


def frame_aligned_pose_errors(truth: pd.DataFrame, refined: pd.DataFrame) -> dict:
    """Pose errors of a C1 refinement after the common turn and shift of its frame, fitted in each half set.

    A refinement's map and poses are fixed only up to a turn G and a 3D shift t of the whole: each half set
    (rlnRandomSubset) has its own reference, and its frame can drift from the truth's by a fraction of a degree
    without any particle being worse aligned to it. The raw errors then count the drift once per particle. Here
    ``frame_fit`` per half (all particles as one set without the column). Returns the aligned per-particle errors
    (degrees, Å) and each half's turn (the matrix G, and its angle in degrees) and shift (Å)."""
    A, B, d = pose_arrays(truth, refined)
    halves = (refined["rlnRandomSubset"].to_numpy(int) if "rlnRandomSubset" in refined
              else np.ones(len(refined), int))
    ang = np.empty(len(refined))
    off = np.empty(len(refined))
    turns, shifts = {}, {}
    for h in np.unique(halves):
        sel = halves == h
        turns[int(h)], t, ang[sel], off[sel] = frame_fit(A[sel], B[sel], d[sel])
        shifts[int(h)] = float(np.linalg.norm(t))
    return {"angular_deg": ang, "offset_A": off, "turn": turns,
            "turn_deg": {h: turn_angle_deg(G) for h, G in turns.items()}, "shift_A": shifts}


def evaluate(root: Path, truth: pd.DataFrame, job: str, angpix: float) -> dict:
    """Resolution, angular error, class purity and class changes of a finished run with rootname ``root``."""
    res: dict = {}
    final = particles_of(data_star(root, final=True)).set_index("rlnImageName").loc[truth.index]
    if job in ("refine3d", "class3d", "refine3d_local"):
        err, d = pose_differences(truth, final)
        res["median_angular_error_deg"] = float(np.median(err))
        res["median_offset_error_A"] = float(np.median(d))
    if job == "refine3d":
        h1, h2 = Path(f"{root}_half1_class001_unfil.mrc"), Path(f"{root}_half2_class001_unfil.mrc")
        m1, m2 = (np.asarray(read_mrc(h).data, np.float64) for h in (h1, h2))
        res["resolution_unmasked_fsc_A"] = float(resolution_A(fsc(m1, m2), m1.shape[0], angpix, 0.143))
    if "rlnClassNumber" in final and job in ("class3d", "class2d"):
        states = truth["rlnGpuRelionTrueState"].to_numpy()
        curves = {"purity": [], "changed": [], "class_sizes": []}
        prev = None
        for f in sorted(root.parent.glob(root.name + "_it*_data.star")):
            if re.search(r"_it000_", f.name):
                continue
            c = particles_of(f).set_index("rlnImageName").loc[truth.index, "rlnClassNumber"].to_numpy()
            tab = pd.crosstab(c, states)
            curves["purity"].append(float(tab.max(axis=1).sum() / len(c)))
            curves["class_sizes"].append({int(k): int(v) for k, v in pd.Series(c).value_counts().items()})
            curves["changed"].append(None if prev is None else float((c != prev).mean()))
            prev = c
        res.update(curves)
        if job == "class3d":
            tab = pd.crosstab(prev, states)
            res["best_class_purity_per_state"] = [float((tab[s] / tab.sum(axis=1)).max()) for s in tab.columns]
    return res


def common_options(a, job: str) -> str:
    o = (f"--i particles.star --particle_diameter {a.diameter} --ctf --flatten_solvent --zero_mask "
         f"--offset_range {a.offset_range} --offset_step {a.offset_step} --pad 2 --random_seed {a.seed}")
    if job != "class2d":
        o += f" --ref ref.mrc --ini_high {a.ini_high} --sym C1 --healpix_order {a.healpix_order}"
    if job == "class3d":
        o += f" --K {a.K} --iter {a.iter} --tau2_fudge {a.tau2_fudge}"
    if job == "class2d":
        o += f" --K {a.K} --iter {a.iter} --tau2_fudge {a.tau2_fudge} --psi_step {a.psi_step}"
    if job == "refine3d":
        o += f" --auto_local_healpix_order {a.auto_local_healpix_order} --low_resol_join_halves 40"
    if not (job == "class3d" and a.relion_no_norm):  # RELION's GUI passes both to every relion_refine job
        o += " --norm --scale"
    return o


def relion_command(a, job: str, root: str) -> str:
    opts = common_options(a, job) + f" --o {root} --oversampling 1 --dont_combine_weights_via_disc --preread_images"
    opts += f" --pool {a.relion_pool} --j {a.relion_j}" + ("" if a.cpu else f" --gpu {getattr(a, 'relion_gpu', '0')}")
    if a.relion_extra:
        opts += " " + a.relion_extra
    if job == "class2d":
        opts += " --center_classes"
    # On a machine with fewer cores than ranks (the 2-core VM: RELION's leader rank is idle while 2 followers work),
    # Open MPI refuses to start without oversubscription.
    over = "--map-by :OVERSUBSCRIBE " if a.cpu else ""
    mpirun = "rl mpirun --allow-run-as-root " + over + "-x LD_LIBRARY_PATH -n {} $RELION_BIN/relion_refine_mpi "
    if job == "refine3d":  # one leader and two followers (one per half) at least
        return mpirun.format(max(3, a.relion_ranks)) + opts + " --auto_refine --split_random_halves"
    if a.relion_ranks > 1:
        return mpirun.format(a.relion_ranks) + opts
    return f"rl $RELION_BIN/relion_refine {opts}"


def our_command(a, job: str, root: str) -> list[str]:
    opts = common_options(a, job) + f" --o {root}"
    if job == "class2d":
        opts += " --center_classes"
    extra = (a.ours_extra.split() if a.ours_extra else []) + (["--cpu"] if a.cpu else [])
    # --ours_ranks N: our MPI layout, N ranks sharing the machine's GPUs in turn (RELION's side keeps its own layout)
    mpiexec = shlex.split(a.mpiexec) if a.mpiexec else [shutil.which("mpiexec") or "mpiexec"]  # may carry flags
    mpi = [*mpiexec, "-n", str(a.ours_ranks)] if a.ours_ranks > 1 else []
    return [*mpi, sys.executable, "-m", "napari_gpu_relion.cli", job, *opts.split(), *extra]


def run_pair(a) -> None:
    data = Path(a.data).resolve()
    info = json.loads((data / "data.json").read_text())
    truth = particles_of(data / "truth.star").set_index("rlnImageName")
    gpu = "CPU" if a.cpu or not shutil.which("nvidia-smi") else subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip() \
        or "no GPU"
    result = {"gpu": gpu, "host": platform.node(), "job": a.job, "data": info, "args": vars(a),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    sides = [s for s in ("relion", "ours") if s in a.sides.split(",")]
    for side in sides:
        tag = f"{side}_{a.job}_{a.tag}" if a.tag else f"{side}_{a.job}"
        folder = data / tag
        folder.mkdir(exist_ok=True)
        root = f"{tag}/run"
        t0 = time.time()
        if side == "relion":
            wall = relion(f"cd {data} && {relion_command(a, a.job, root)}", folder / "log.txt")
            cmd = relion_command(a, a.job, root)
        else:
            cmd = " ".join(our_command(a, a.job, root))
            with open(folder / "log.txt", "w") as fh:
                r = subprocess.run(our_command(a, a.job, root), cwd=data, stdout=fh, stderr=subprocess.STDOUT)
            wall = time.time() - t0
            if r.returncode:
                sys.exit(f"ours failed (rc {r.returncode})\n" + (folder / "log.txt").read_text()[-3000:])
        its, startup = iteration_times(data / root, t0, folder / "note.txt" if side == "ours" else None)
        side_res = {"command": cmd, "wall_s": wall, "iterations": len(its), "iteration_s": its,
                    "startup_s": startup}
        side_res.update(evaluate(data / root, truth, a.job, info["angpix"]))
        side_res["schedule"] = schedule_trace(data / root)
        result[side] = side_res
        print(json.dumps({side: {k: v for k, v in side_res.items() if k not in ("class_sizes",)}}), flush=True)
        if a.out:  # after each side: a run stopped later (a time limit) keeps what it measured
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
    if "relion" in result and "ours" in result:
        result["ratio_wall"] = result["relion"]["wall_s"] / result["ours"]["wall_s"]
        n = min(len(result["relion"]["iteration_s"]), len(result["ours"]["iteration_s"]))
        result["ratio_per_iteration"] = [r / o for r, o in zip(result["relion"]["iteration_s"][:n],
                                                                result["ours"]["iteration_s"][:n], strict=True)]
        print(f"RELION {result['relion']['wall_s']:.1f} s, ours {result['ours']['wall_s']:.1f} s: "
              f"{result['ratio_wall']:.2f}x; per iteration " +
              " ".join(f"{x:.2f}" for x in result["ratio_per_iteration"]))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-data")
    m.add_argument("--map", default=str(DEFAULT_MAP))
    m.add_argument("--out", required=True)
    m.add_argument("--box", type=int, default=128)
    m.add_argument("--angpix", type=float, default=0.0, help="0 = the map's extent (325 Å) over the box")
    m.add_argument("--map_angpix", type=float, default=0.0,
                   help="the map's own pixel size (Å): resample it to --angpix and centre it in --box (0 = stretch "
                        "the map's extent over the box, as for the 70S map)")
    m.add_argument("--defocus_min_A", type=float, default=10000.0)
    m.add_argument("--defocus_max_A", type=float, default=25000.0)
    m.add_argument("--preferred", type=float, default=0.0,
                   help="fraction of particles with tilt below 20° (a preferred view); the rest uniform")
    m.add_argument("--n", type=int, default=10000)
    m.add_argument("--states", type=int, default=1, choices=(1, 2))
    m.add_argument("--snr", type=float, default=0.05)
    m.add_argument("--sphere_radius_A", type=float, default=30.0,
                   help="state 2 lacks a sphere of this radius (20 Å: 0.8 %% of the mass, 30 Å: 2.8 %%, 40 Å: 6.8 %%)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--zero_offsets", action="store_true",
                   help="particles.star starts every particle at offset 0 (the images keep their true shifts)")
    r = sub.add_parser("run")
    r.add_argument("--job", required=True, choices=("class3d", "refine3d", "class2d"))
    r.add_argument("--data", required=True)
    r.add_argument("--sides", default="relion,ours")
    r.add_argument("--tag", default="")
    r.add_argument("--K", type=int, default=4)
    r.add_argument("--iter", type=int, default=5)
    r.add_argument("--tau2_fudge", type=float, default=4.0)
    r.add_argument("--psi_step", type=float, default=12.0)
    r.add_argument("--diameter", type=float, default=280.0)
    r.add_argument("--ini_high", type=float, default=60.0)
    r.add_argument("--healpix_order", type=int, default=2)
    r.add_argument("--auto_local_healpix_order", type=int, default=4)
    r.add_argument("--offset_range", type=float, default=5.0)
    r.add_argument("--offset_step", type=float, default=2.0)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--relion_ranks", type=int, default=1)
    r.add_argument("--ours_ranks", type=int, default=1,
                   help="our job under mpiexec with this many ranks (on one GPU they share it)")
    r.add_argument("--mpiexec", default="",
                   help="the mpiexec for --ours_ranks, with any flags of its own (default: the one on PATH)")
    r.add_argument("--relion_j", type=int, default=4)
    r.add_argument("--relion_pool", type=int, default=30)
    r.add_argument("--relion_extra", default="",
                   help="extra options for RELION (e.g. '--free_gpu_memory 90000' for runs sharing one GPU: each "
                        "RELION process otherwise takes all the free GPU memory)")
    r.add_argument("--ours_extra", default="", help="extra options for our job (e.g. '--batch 256')")
    r.add_argument("--relion_no_norm", action="store_true",
                   help="class3d: both programs without --norm --scale (as runs before our class3d took them)")
    r.add_argument("--cpu", action="store_true", help="both programs on the CPU (RELION without --gpu, ours --cpu)")
    r.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    make_data(a) if a.cmd == "make-data" else run_pair(a)


if __name__ == "__main__":
    main()

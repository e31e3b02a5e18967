"""Issue 51: after ``ctf_refine``, does the NEXT auto-refine reach the resolution of the error-free set within one
Fourier shell? RELION's tutorial flow (Refine3D -> PostProcess -> CtfRefine -> Refine3D) on simulated particles
with known CTF errors, on one GPU (or ``--cpu`` for a small trial).

Data: ``ctf_refine_bench.py make`` (tests/test_ctf_refine.py's simulation at any size): EMD-11007 Fourier-cropped
to --box (96: 1.668 Å/px, Nyquist 3.3 Å), particles projected with padding 3 at the TRUE per-particle defocus
(0.8-2.0 µm, astigmatism up to 300 Å), beam tilt (0.5, -0.2) mrad and trefoil (odd Zernike 2 = 15, 5 = -10),
white noise at --snr (signal variance over the box / noise variance). Its particles.star holds the true poses,
per-particle defocus errors of sigma 300 Å and no tilt or odd terms: the erroneous set. This script writes
beside it ``particles_true_ctf.star``: the same particles with the TRUE defocus U/V/angle and the true beam tilt
and odd Zernike terms in the optics table: the error-free set.

Three auto-refines, the same options for all (vs_relion.common_options's refine3d: ``--ctf --flatten_solvent
--zero_mask --particle_diameter D --offset_range 5 --offset_step 2 --pad 2 --norm --scale --ini_high 30
--low_resol_join_halves 40 --auto_local_healpix_order 4``), the same reference (the true map, which refine3d
low-passes to --ini_high 30 Å) and the same random halves (rlnRandomSubset of make):

  a. the error-free set (particles_true_ctf.star);
  b. the erroneous set as given (particles.star);
  c. the erroneous set after a real workflow on (b): (b)'s unfiltered half maps post-processed with the common
     mask (our ``postprocess``), then ``ctf_refine --i (b)'s run_data.star --f that postprocess.star
     --fit_defocus --fit_mode fpfff --fit_beamtilt --odd_aberr_max_n 3 --fit_aberr`` (ctf_refine_bench.FLAGS),
     then refine3d again on ctf_refine's particles_ctf_refine.star.

Where each starts (``--start``), and why the comparison is fair:
  perturbed (default): (a) and (b) start from the SAME poses, the true ones each turned by a random rotation of
     --perturb_deg rms (random axis) and shifted by --perturb_px rms per axis, and search locally from iteration 1
     (--healpix_order 4 = --auto_local_healpix_order: RELION's tutorial runs the Refine3D after CtfRefine /
     Polishing with local searches from 1.8°). So the only difference between (a) and (b) is the CTF; the start is
     not the truth (the local-search prior is not centred on it, the refinement has to find the poses); and a
     global search's run-to-run differences (a refinement caught in a wrong orientation for a while) cannot
     swamp a one-shell comparison. (c) starts where a real workflow starts: from (b)'s refined poses, which
     ctf_refine's STAR carries, with the same options.
  scratch: all three from a global search (--healpix_order 2), the angles and offsets of their STARs set to 0
     (also (c)'s: the same start for all three; (c) then differs from (b) only in its CTF values).

Every final result is judged the same way (realistic.judge_maps): our ``postprocess`` of the unfiltered half maps
with ONE mask made once from the true map (``mask_create``, as realistic.py), the gold-standard masked resolution
(rlnFinalResolution, FSC 0.143 of the phase-randomisation corrected curve), the FSC of the (masked) sum of the
halves against the (masked) true map at 0.5, and the Fourier shell of each (shell = box x pixel / resolution), so
"(c) within one shell of (a)" is a difference of shell indices; per iteration the reported resolution and the
median angular / offset errors against the true poses (realistic.per_iteration); for (c) the per-particle defocus
rms error, beam tilt and odd terms against the truth (ctf_refine_bench.judge). ``--true_poses a,b``: those sets
also reconstructed from the TRUE poses with their CTF values (our ``reconstruct``), judged the same way (default:
a only): the data's resolution without pose errors. Not an upper bound of the refinements: reconstruct uses the
whole images, the refinement masks them (--zero_mask --particle_diameter), one likely reason why on the CPU trial
(300 particles, box 64) the three refinements ended 2 shells above it.

The GPU defaults (--n 5000 --box 96 --snr 0.05 --bfactor 100): the error-free set's resolution must be limited by
the data, not by Nyquist (3.3 Å at box 96), and lie where a 300 Å defocus error matters: its phase error
pi lambda dz k^2 (lambda 0.0197 Å at 300 kV) is 0.74 rad rms at 5 Å and 1.16 rad at 4 Å, so the CTF's agreement
with the images falls to exp(-phase^2 / 2) = 0.76 and 0.51 of its value there (the beam tilt's phase,
2 pi Cs lambda^2 k^2 (k . t), is 0.5 rad at 4 Å). make's images have no envelope, and EMD-11007 keeps its power
to Nyquist: from the TRUE poses (our reconstruct, 2-core CPU) N x SNR = 50 already gave 3.48 Å (shell 46 of 48)
and 100 Nyquist. With B = 100 Å^2 (applied to the map, so the images carry it and the STARs do not know it),
5,000 particles at SNR 0.05 (box variance, as make defines it) gave from the true poses 3.91 Å (shell 41) with
the true CTF and 4.21 Å (shell 38) with the given, erroneous one (map vs truth at 0.5: shells 42 and 38); the
refinements may end a few shells either side of those (pose errors; the image mask), still short of Nyquist.
SNR 0.05 rather than 8,000 at 0.03: the same N x SNR, each particle easier to align, and a shorter run.

Run (GPU machine, from the repository root, after ``. benchmarks/gpu_env.sh``):
  python benchmarks/ctf_refine_next.py --work /root/next --out benchmarks/results/ctf_refine_next_h200.json
A small trial on the CPU:
  python benchmarks/ctf_refine_next.py --work /tmp/next --n 300 --box 64 --snr 0.3 --true_poses a,b --cpu \
      --out /tmp/next.json  (about 20 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ctf_refine_bench as crb  # noqa: E402
import realistic as rl  # noqa: E402
import vs_relion as vr  # noqa: E402

from napari_gpu_relion.compute.fsc import resolution_shell  # noqa: E402
from napari_gpu_relion.io.mrc import read_mrc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETS = {"a": "error_free", "b": "uncorrected", "c": "ctf_refined"}
POSE = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst")


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode:
            return "unknown (no git)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted edits)" if dirty else "")
    except FileNotFoundError:
        return "unknown (no git)"


class Log:
    """The commands run, with their wall times, in the result JSON."""

    def __init__(self, res: dict):
        self.res = res
        res["commands"] = []

    def ngr(self, what: str, args: list[str], log: Path, cwd: Path) -> float:
        wall = rl.ngr(args, log, cwd)
        self.res["commands"].append({"what": what, "command": "napari-gpu-relion " + " ".join(args),
                                     "cwd": str(cwd), "wall_s": round(wall, 2)})
        print(f"  {what}: {wall:.1f} s", flush=True)
        return wall


def blurred_map(b: float, out: Path) -> Path:
    """EMD-11007 (0.834 Å/px) times the envelope exp(-B k^2 / 4): every image then carries it (a projection's
    transform is the central slice), as real images carry their B-factor; the STARs keep rlnCtfBfactor 0, so the
    refinements do not know it. B = 0: the map itself."""
    if b == 0:
        return crb.MAP
    from napari_gpu_relion.io.mrc import write_mrc

    v = np.asarray(read_mrc(crb.MAP).data, np.float64)
    n = v.shape[0]
    k = np.fft.fftfreq(n, 0.834)
    k2 = k[:, None, None] ** 2 + k[None, :, None] ** 2 + np.fft.rfftfreq(n, 0.834)[None, None, :] ** 2
    v = np.fft.irfftn(np.fft.rfftn(v) * np.exp(-b * k2 / 4), v.shape, axes=(0, 1, 2))
    write_mrc(out, v.astype(np.float32), 0.834)
    return out


def make_data(a, work: Path, res: dict) -> dict:
    """ctf_refine_bench.py make into --work, from the map with --bfactor's envelope (reused when made with the
    same --n, --box, --snr, --seed and --bfactor)."""
    key = {k: getattr(a, k) for k in ("n", "box", "snr", "seed", "bfactor")}
    mark = work / "made_with.json"
    if mark.exists() and json.loads(mark.read_text()) == key and (work / "particles.mrcs").exists():
        info = json.loads((work / "data.json").read_text())
        info.update(reused=True, bfactor=a.bfactor)
        return info
    mark.unlink(missing_ok=True)
    t = time.time()
    src = blurred_map(a.bfactor, work / f"emd_11007_B{a.bfactor:g}.mrc")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ctf_refine_bench.py"), "make", "--out", str(work),
           "--map", str(src), "--n", str(a.n), "--box", str(a.box), "--snr", str(a.snr), "--seed", str(a.seed)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit("make failed:\n" + r.stdout[-2000:] + r.stderr[-2000:])
    res["commands"].append({"what": "make (with the B-factor applied to the map first)",
                            "command": " ".join(cmd[1:]), "wall_s": round(time.time() - t, 2)})
    mark.write_text(json.dumps(key))
    info = json.loads((work / "data.json").read_text())
    info.update(reused=False, bfactor=a.bfactor)
    return info


def write_sets(a, work: Path) -> None:
    """particles_true_ctf.star (the error-free set) beside particles.star, and the start STARs of (a) and (b)."""
    from scipy.spatial.transform import Rotation

    from napari_gpu_relion.compute.ctf import format_zernike
    from napari_gpu_relion.compute.geometry import euler_to_matrix, matrix_to_euler
    from napari_gpu_relion.io.star import read_particles, write_particles

    t = read_particles(work / "particles.star")
    truth = np.load(work / "truth.npz")
    merged = [c for c in t.optics.columns if c != "rlnOpticsGroup" and c in t.particles]
    given = t.particles.drop(columns=merged)
    true_ctf = given.copy()
    true_ctf["rlnDefocusU"], true_ctf["rlnDefocusV"] = truth["defocus_u"], truth["defocus_v"]
    true_ctf["rlnDefocusAngle"] = truth["defocus_angle"]
    optics = t.optics.copy()
    exact = optics.copy()
    exact["rlnBeamTiltX"], exact["rlnBeamTiltY"] = crb.TILT
    exact["rlnOddZernike"] = format_zernike(crb.ODD)
    write_particles(work / "particles_true_ctf.star", true_ctf, exact)

    # one start for (a) and (b)
    n = len(given)
    rng = np.random.default_rng(a.seed + 1000)
    if a.start == "perturbed":
        A = euler_to_matrix(*(given[c].to_numpy(float) for c in POSE[:3]))
        turn = Rotation.from_rotvec(rng.normal(0, np.radians(a.perturb_deg) / np.sqrt(3), (n, 3))).as_matrix()
        rot, tilt, psi = matrix_to_euler(turn @ A)
        angpix = float(optics["rlnImagePixelSize"].iloc[0])
        shift = rng.normal(0, a.perturb_px * angpix, (n, 2))
        start = {"rlnAngleRot": rot, "rlnAngleTilt": tilt, "rlnAnglePsi": psi,
                 "rlnOriginXAngst": given["rlnOriginXAngst"].to_numpy(float) + shift[:, 0],
                 "rlnOriginYAngst": given["rlnOriginYAngst"].to_numpy(float) + shift[:, 1]}
    else:
        start = {c: np.zeros(n) for c in POSE}
    for name, table, opt in (("a", true_ctf, exact), ("b", given, optics)):
        s = table.copy()
        for c, v in start.items():
            s[c] = v
        write_particles(work / f"start_{name}.star", s, opt)


def zero_poses(star: Path, out: Path) -> None:
    from napari_gpu_relion.io.star import read_particles, write_particles

    t = read_particles(star)
    merged = [c for c in t.optics.columns if c != "rlnOpticsGroup" and c in t.particles]
    p = t.particles.drop(columns=merged)
    for c in POSE:
        p[c] = 0.0
    write_particles(out, p, t.optics)


def refine_args(a, star: Path, root: Path, ref: Path) -> list[str]:
    """vs_relion.common_options(refine3d) with our star, reference and start."""
    order = 4 if a.start == "perturbed" else 2
    return ["refine3d", "--i", str(star), "--o", str(root), "--ref", str(ref), "--particle_diameter",
            str(a.diameter), "--ctf", "--flatten_solvent", "--zero_mask", "--offset_range", "5", "--offset_step", "2",
            "--pad", "2", "--random_seed", "1", "--ini_high", str(a.ini_high), "--sym", "C1", "--healpix_order",
            str(order), "--auto_local_healpix_order", "4", "--low_resol_join_halves", "40", "--norm", "--scale",
            "--dont_check_norm", *a.refine_extra.split(), *(["--cpu"] if a.cpu else [])]


def refine(a, log: Log, key: str, star: Path, work: Path, truth_poses) -> tuple[dict, tuple[Path, Path]]:
    folder = work / f"Refine3D_{key}_{SETS[key]}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    root = folder / "run"
    t0 = time.time()
    wall = log.ngr(f"refine3d ({key})", refine_args(a, star, root, work / "truth.mrc"), folder / "log.txt", work)
    its = rl.per_iteration(root, truth_poses, t0, folder / "note.txt")
    logged = {int(i): float(r) for i, r in
              re.findall(r"iteration (\d+): resolution ([0-9.]+) Å", (folder / "log.txt").read_text())}
    for row in its:  # the iteration's own gold-standard FSC 0.143, as its log says (the final one: the last)
        it = row["iteration"] if row["iteration"] != "final" else max(logged, default=None)
        row["logged_resolution_A"] = logged.get(it)
    res = {"wall_s": wall, "iterations": its, "n_iterations": len(its),
           "halves": [str(root) + "_half1_class001_unfil.mrc", str(root) + "_half2_class001_unfil.mrc"],
           "data_star": str(root) + "_data.star"}
    return res, (Path(res["halves"][0]), Path(res["halves"][1]))


def judge(log: Log, key: str, halves: tuple[Path, Path], work: Path, info: dict) -> dict:
    folder = work / f"PostProcess_{key}"
    if folder.exists():
        shutil.rmtree(folder)
    t = time.time()
    m = rl.judge_maps(*halves, work / "truth.mrc", work / "mask.mrc", folder, info["angpix"])
    log.res["commands"].append({"what": f"postprocess ({key})", "command": f"napari-gpu-relion postprocess --i "
                                f"{halves[0]} --i2 {halves[1]} --mask {work / 'mask.mrc'} --o {folder} --auto_bfac "
                                "--autob_lowres 10", "wall_s": round(time.time() - t, 2)})
    box, apix = info["box"], info["angpix"]
    m["gold_standard_shell"] = int(round(box * apix / m["gold_standard_masked_A"]))
    m["map_vs_truth_fsc05_shell"] = int(resolution_shell(m["fsc_map_vs_truth"], 0.5))
    m["map_vs_truth_fsc0143_shell"] = int(resolution_shell(m["fsc_map_vs_truth"], 0.143))
    m["nyquist_shell"] = box // 2
    m["postprocess_star"] = str(folder / "postprocess.star")
    return m


def true_pose_reference(a, log: Log, key: str, star: Path, work: Path, info: dict) -> dict:
    """Each half of ``star`` reconstructed from the TRUE poses with its CTF values (the best any refinement of
    these images with these CTF values can do), judged as the refinements are."""
    folder = work / f"TruePoses_{key}"
    folder.mkdir(exist_ok=True)
    for s in (1, 2):
        log.ngr(f"reconstruct, true poses ({key}, half {s})",
                ["reconstruct", "--i", str(star), "--o", str(folder / f"half{s}.mrc"), "--ctf", "--subset", str(s),
                 "--dont_check_norm", *(["--cpu"] if a.cpu else [])], folder / f"reconstruct{s}.log", work)
    return judge(log, f"true_poses_{key}", (folder / "half1.mrc", folder / "half2.mrc"), work, info)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="folder for the data and every job (made if missing)")
    ap.add_argument("--out", default=None, help="result JSON")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--box", type=int, default=96)
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bfactor", type=float, default=100.0,
                    help="B-factor (Å^2) of the images' envelope, applied to the map before make")
    ap.add_argument("--start", choices=("perturbed", "scratch"), default="perturbed")
    ap.add_argument("--perturb_deg", type=float, default=2.0, help="rms rotation of the start poses (degrees)")
    ap.add_argument("--perturb_px", type=float, default=0.7, help="rms shift per axis of the start offsets (px)")
    ap.add_argument("--diameter", type=float, default=150.0, help="--particle_diameter (Å)")
    ap.add_argument("--ini_high", type=float, default=30.0)
    ap.add_argument("--mask_threshold", type=float, default=0.0,
                    help="mask_create --ini_threshold on the true map (0 = 2 %% of its maximum)")
    ap.add_argument("--true_poses", default="a",
                    help="sets (a, b; comma-separated; '' = none) reconstructed from the true poses too")
    ap.add_argument("--refine_extra", default="", help="more refine3d options, e.g. '--batch 512'")
    ap.add_argument("--cpu", action="store_true", help="every job on the CPU (a small trial)")
    ap.add_argument("--commit", default="", help="the commit to name in the JSON (default: git's, where there is git)")
    a = ap.parse_args(argv)

    t_start = time.time()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    res = {"issue": 51, "what": "next auto-refine after ctf_refine vs the error-free set",
           "gpu": "CPU" if a.cpu else rl.gpu_name(), "host": platform.node(), "cpu_count": os.cpu_count(),
           "commit": a.commit or commit(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a)}
    log = Log(res)

    def save():
        res["total_s"] = round(time.time() - t_start, 1)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=1))

    print("data", flush=True)
    info = make_data(a, work, res)
    res["data"] = info
    write_sets(a, work)
    shutil.copyfile(work / "half1.mrc", work / "truth.mrc")  # make writes the true map as both half maps
    t = np.asarray(read_mrc(work / "truth.mrc").data, np.float64)
    thr = a.mask_threshold if a.mask_threshold > 0 else float(0.02 * t.max())
    log.ngr("mask_create", ["mask_create", "--i", "truth.mrc", "--o", "mask.mrc", "--lowpass", "15", "--ini_threshold",
                            str(thr), "--extend_inimask", "3", "--width_soft_edge", "6"], work / "mask.log", work)
    res["mask_fraction"] = float(np.asarray(read_mrc(work / "mask.mrc").data, np.float64).mean())
    truth_poses = rl.by_number(vr.particles_of(work / "particles.star"))  # make's STAR holds the true poses
    save()

    ref = res["true_poses"] = {}
    for key in [k for k in a.true_poses.split(",") if k]:
        print(f"true poses, {key}: {SETS[key]}", flush=True)
        star = work / ("particles_true_ctf.star" if key == "a" else "particles.star")
        ref[key] = true_pose_reference(a, log, key, star, work, info)
        save()

    sets = res["sets"] = {}
    for key, star in (("a", work / "start_a.star"), ("b", work / "start_b.star")):
        print(f"{key}: {SETS[key]}", flush=True)
        sets[key], halves = refine(a, log, key, star, work, truth_poses)
        sets[key]["maps"] = judge(log, key, halves, work, info)
        save()

    print("c: ctf_refine on (b), then refine3d", flush=True)
    ctf_dir = work / "CtfRefine_c"
    if ctf_dir.exists():
        shutil.rmtree(ctf_dir)
    wall = log.ngr("ctf_refine (c)", ["ctf_refine", "--i", sets["b"]["data_star"], "--f",
                                      sets["b"]["maps"]["postprocess_star"], *crb.FLAGS, "--o", f"{ctf_dir}/",
                                      *(["--cpu"] if a.cpu else [])], work / "ctf_refine_c.log", work)
    refined = ctf_dir / "particles_ctf_refine.star"
    ctf = {"wall_s": wall, "star": str(refined), **crb.judge(work, refined)}
    if a.start == "scratch":
        zero_poses(refined, work / "start_c.star")
        refined = work / "start_c.star"
    sets["c"], halves = refine(a, log, "c", refined, work, truth_poses)
    sets["c"]["ctf_refine"] = ctf
    sets["c"]["maps"] = judge(log, "c", halves, work, info)

    g = {k: sets[k]["maps"]["gold_standard_shell"] for k in sets}
    f = {k: sets[k]["maps"]["map_vs_truth_fsc05_shell"] for k in sets}
    res["verdict"] = {
        "gold_standard_shells": g, "map_vs_truth_fsc05_shells": f,
        "c_minus_a_gold_shells": g["c"] - g["a"], "b_minus_a_gold_shells": g["b"] - g["a"],
        "c_minus_a_truth_shells": f["c"] - f["a"], "b_minus_a_truth_shells": f["b"] - f["a"],
        "c_within_one_shell_of_a_gold": bool(g["c"] >= g["a"] - 1),
        "c_within_one_shell_of_a_truth": bool(f["c"] >= f["a"] - 1)}
    save()

    print(f"{res['gpu']}, {info['n']} particles, box {info['box']} at {info['angpix']:.3f} Å/px, SNR {info['snr']}, "
          f"start {a.start}; total {res['total_s']:.0f} s")
    for k, s in sets.items():
        m = s["maps"]
        last = s["iterations"][-1] if s["iterations"] else {}
        line = (f"{k} {SETS[k]:12s}: gold-standard {m['gold_standard_masked_A']:.2f} Å (shell "
                f"{m['gold_standard_shell']}/{m['nyquist_shell']}), vs truth at 0.5 {m['map_vs_truth_fsc05_A']:.2f} Å "
                f"(shell {m['map_vs_truth_fsc05_shell']}), median angular error "
                f"{last.get('median_angular_error_deg', float('nan')):.2f}°, {s['n_iterations']} iterations, "
                f"{s['wall_s']:.1f} s")
        if k == "c":
            c = s["ctf_refine"]
            line += (f"; ctf_refine {c['wall_s']:.1f} s: defocus rms error {c['defocus_rms_error_A']:.1f} Å (from "
                     f"{c['defocus_rms_error_before_A']:.1f}), beam tilt ({c['beam_tilt_mrad'][0]:.3f}, "
                     f"{c['beam_tilt_mrad'][1]:.3f}) mrad")
        print(line)
    for k, m in ref.items():
        print(f"{k} {SETS[k]:12s} from the TRUE poses (no refinement): gold-standard {m['gold_standard_masked_A']:.2f} "
              f"Å (shell {m['gold_standard_shell']}), vs truth at 0.5 {m['map_vs_truth_fsc05_A']:.2f} Å (shell "
              f"{m['map_vs_truth_fsc05_shell']})")
    v = res["verdict"]
    print(f"c - a: {v['c_minus_a_gold_shells']:+d} shells gold-standard, {v['c_minus_a_truth_shells']:+d} vs truth; "
          f"b - a: {v['b_minus_a_gold_shells']:+d}, {v['b_minus_a_truth_shells']:+d}")


if __name__ == "__main__":
    main()

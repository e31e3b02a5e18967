"""High-resolution auto-refine on a real EMDB map, ours and RELION's, judged against the truth (issue 48).

The data: ``vs_relion.py make-data`` from EMD-11007 (0.834 Å/px, density to about 3 Å), resampled to --angpix and
centred in --box, particles made by RELION's ``relion_project --ctf --add_noise``. This script then, on one GPU:

1. reconstructs each random half from the TRUE poses (our reconstruct, CTF-corrected): the resolution the data
   allow, the ground truth every refinement is judged against;
2. runs the auto-refine of each side named in --sides (``vs_relion.py run`` machinery: same options, RELION in its
   one-GPU MPI layout) from the map low-passed to --ini_high; a side may be stopped after --limit_s seconds and is
   then judged at its last finished iteration (the JSON says so);
3. per iteration: the resolution each program reports, the median angular and offset errors against the true
   poses (raw, and after each half set's common turn and shift of its frame: ``vs_relion.frame_aligned_pose_errors``;
   a C1 refinement's frame may drift by a fraction of a degree, which the raw errors count once per particle), the
   iteration's wall time;
4. at the end: the same post-processing (our ``postprocess``, one soft mask made from the true map by
   ``mask_create``) of every side's half maps and of the true-pose halves: gold-standard masked FSC at 0.143,
   the map-vs-truth FSC at 0.5, and the FSC curves for plotting (``plot``).

Run (GPU machine, RELION built, see gpu_env.sh):
  python benchmarks/vs_relion.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
      --angpix 1.05 --box 256 --n 10000 --snr 0.1 --defocus_min_A 8000 --out /root/hr
  python benchmarks/realistic.py science --data /root/hr --sides ours,relion --limit_s 900 --out results/x.json
  python benchmarks/realistic.py plot results/x.json docs/images/x.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import starfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion as vr  # noqa: E402

from napari_gpu_relion.compute.fsc import fsc, resolution_A  # noqa: E402
from napari_gpu_relion.io.mrc import read_mrc  # noqa: E402


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip() or "no GPU"
    except FileNotFoundError:
        return "CPU"


def ngr(args: list[str], log: Path, cwd: Path) -> float:
    t = time.time()
    with open(log, "w") as fh:
        r = subprocess.run([sys.executable, "-m", "napari_gpu_relion.cli", *args], cwd=cwd, stdout=fh,
                           stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"failed: {' '.join(args)}\n" + log.read_text()[-2000:])
    return time.time() - t


def image_key(names) -> list[str]:
    """"number@stack file name" of each rlnImageName: our STAR may write absolute stack paths, RELION relative ones,
    and data made in chunks (standard_class3d.py make-data) has several stacks numbered from 1."""
    parts = [str(s).partition("@") for s in names]
    return [f"{int(n)}@{os.path.basename(stack)}" for n, _, stack in parts]


def by_number(df):
    """Particles indexed by image_key (the image number and the name of its stack)."""
    df = df.copy()
    df.index = image_key(df["rlnImageName"])
    return df


def per_iteration(root: Path, truth, t0: float, marker: Path | None) -> list[dict]:
    """Resolution, errors against the truth and wall time of every finished iteration of rootname ``root``."""
    times, _ = vr.iteration_times(root, t0, marker)
    rows = []
    k = 0
    for it, f in vr.iteration_data_stars(root):
        d = by_number(vr.particles_of(f)).loc[truth.index]
        ang, off = vr.pose_differences(truth, d)
        fa = vr.frame_aligned_pose_errors(truth, d)
        model = Path(f"{root}_it{it:03d}_half1_model.star") if it is not None else Path(f"{root}_model.star")
        gen = vr._star_general(model)
        rows.append({"iteration": it if it is not None else "final",
                     "resolution_A": float(gen.get("rlnCurrentResolution", np.nan)),
                     "median_angular_error_deg": float(np.median(ang)),
                     "median_offset_error_A": float(np.median(off)),
                     "median_angular_error_frame_aligned_deg": float(np.median(fa["angular_deg"])),
                     "median_offset_error_frame_aligned_A": float(np.median(fa["offset_A"])),
                     "frame_turn_deg": fa["turn_deg"], "frame_shift_A": fa["shift_A"],
                     "wall_s": times[k] if k < len(times) else None})
        k += 1
    return rows


def frame_of(root: Path, truth) -> tuple[np.ndarray, np.ndarray] | None:
    """The turn G and shift t (Å) of the refinement's frame (``vs_relion.frame_fit``, every particle together: the
    summed half maps are judged), from its last data STAR (the final one when written)."""
    stars = vr.iteration_data_stars(root)
    if not stars:
        return None
    G, t, _, _ = vr.frame_fit(*vr.pose_arrays(truth, by_number(vr.particles_of(stars[-1][1])).loc[truth.index]))
    return G, t


def halves_of(root: Path, data: Path) -> tuple[Path, Path] | None:
    """The run's final unfiltered half maps; for a run stopped before its final iteration, half maps reconstructed
    (our ``reconstruct``, per rlnRandomSubset, no solvent flattening) from the poses of the last iteration's data
    STAR. (The iteration half maps are solvent-flattened by the mask, as RELION's: their unmasked FSC never falls
    below 0.143, and the post-processing then reports Nyquist.)"""
    fin = (Path(f"{root}_half1_class001_unfil.mrc"), Path(f"{root}_half2_class001_unfil.mrc"))
    if all(p.exists() for p in fin):
        return fin
    its = sorted(root.parent.glob(root.name + "_it*_data.star"))
    if not its:
        return None
    return reconstruct_halves(its[-1], data, root.parent / "halves_of_last_iteration")


def absolute_images(parts, data: Path):
    """The particles with rlnImageName pointing into ``data`` from anywhere."""
    parts = parts.copy()
    parts["rlnImageName"] = [str(data / s) if "@" not in s else s.split("@")[0] + "@" + str(data / s.split("@")[1])
                             for s in parts["rlnImageName"]]
    return parts


def reconstruct_halves(star: Path, data: Path, folder: Path) -> tuple[Path, Path]:
    """Each half (rlnRandomSubset) of ``star``'s particles reconstructed with CTF into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    opt = starfile.read(data / "particles.star", always_dict=True)["optics"]
    starfile.write({"optics": opt, "particles": absolute_images(vr.particles_of(star), data)},
                   folder / "particles.star", overwrite=True)
    for s in (1, 2):
        ngr(["reconstruct", "--i", "particles.star", "--o", f"half{s}.mrc", "--ctf", "--subset", str(s)],
            folder / f"reconstruct{s}.log", folder)
    return folder / "half1.mrc", folder / "half2.mrc"


def judge_maps(h1: Path, h2: Path, truth_map: Path, mask: Path, folder: Path, angpix: float,
               frame: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Our post-processing of a pair of half maps with the common mask, and the map-vs-truth FSC; with ``frame``
    (the refinement's turn G and shift t (Å) fitted on its poses: ``frame_of``) also against the truth as the
    refinement's frame holds it (``vs_relion.truth_in_frame``)."""
    folder.mkdir(parents=True, exist_ok=True)
    ngr(["postprocess", "--i", str(h1), "--i2", str(h2), "--mask", str(mask), "--o", str(folder),
         "--auto_bfac", "--autob_lowres", "10"], folder / "postprocess.log", folder)
    pp = starfile.read(folder / "postprocess.star", always_dict=True)  # --o is the job folder
    gen = pp["general"] if isinstance(pp["general"], dict) else pp["general"].iloc[0].to_dict()
    curves = pp["fsc"]
    a, b = (np.asarray(read_mrc(p).data, np.float64) for p in (h1, h2))
    t = np.asarray(read_mrc(truth_map).data, np.float64)
    msk = np.asarray(read_mrc(mask).data, np.float64)
    n = t.shape[0]
    f_truth = fsc((a + b) * msk, t * msk)
    extra = {}
    if frame is not None:
        f_al = fsc((a + b) * msk, vr.truth_in_frame(t, frame[0], frame[1] / angpix) * msk)
        extra = {"frame_turn_deg": vr.turn_angle_deg(frame[0]), "frame_shift_A": float(np.linalg.norm(frame[1])),
                 "fsc_map_vs_truth_frame_aligned": [float(x) for x in f_al]}
    return {**extra, "gold_standard_masked_A": float(gen["rlnFinalResolution"]),
            "bfactor": float(gen.get("rlnBfactorUsedForSharpening", np.nan)),
            "map_vs_truth_fsc05_A": float(resolution_A(f_truth, n, angpix, 0.5)),
            "map_vs_truth_fsc0143_A": float(resolution_A(f_truth, n, angpix, 0.143)),
            "unmasked_halves_A": float(resolution_A(fsc(a, b), n, angpix, 0.143)),
            "fsc_corrected": curves["rlnFourierShellCorrelationCorrected"].astype(float).tolist(),
            "fsc_map_vs_truth": [float(x) for x in f_truth],
            "resolution_of_shell_A": curves["rlnAngstromResolution"].astype(float).tolist()}


def run_side(side: str, a, data: Path, info: dict, truth) -> dict:
    limits = [float(x) for x in str(a.limit_s).split(",")]
    limit = limits[min(a.sides.split(",").index(side), len(limits) - 1)]
    """One side's auto-refine (killed after --limit_s when given), judged per iteration."""
    ns = argparse.Namespace(**{**DEFAULTS, **{k: getattr(a, k) for k in DEFAULTS if hasattr(a, k)}})
    tag = f"{side}_refine3d_{a.tag}" if a.tag else f"{side}_refine3d"
    folder = data / tag
    folder.mkdir(exist_ok=True)
    root = f"{tag}/run"
    if side == "relion":
        cmd = ["bash", "-c", f". /root/rb/env.sh && cd {data} && {vr.relion_command(ns, 'refine3d', root)}"]
    else:
        cmd = vr.our_command(ns, "refine3d", root)
    t0 = time.time()
    (folder / "started").write_text(f"{t0}\n")  # for ``progress`` while the run goes on
    with open(folder / "log.txt", "w") as fh:
        proc = subprocess.Popen(cmd, cwd=data, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit if limit > 0 else None)
            stopped = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            rc, stopped = None, True
    wall = time.time() - t0
    marker = folder / "note.txt" if side == "ours" else None
    res = {"command": " ".join(cmd), "wall_s": wall, "rc": rc, "stopped_at_limit": stopped,
           "iterations": per_iteration(data / root, truth, t0, marker),
           "schedule": vr.schedule_trace(data / root)}  # orders, counters, changes: why the iteration counts differ
    halves = halves_of(data / root, data)
    if halves:
        res["maps"] = judge_maps(*halves, data / "state1.mrc", data / "mask.mrc", folder / "judge", info["angpix"],
                                 frame=frame_of(data / root, truth))
        res["maps"]["halves"] = [str(h) for h in halves]
    return res


DEFAULTS = dict(job="refine3d", K=1, iter=1, tau2_fudge=1.0, psi_step=6.0, diameter=180.0, ini_high=30.0,
                healpix_order=2, auto_local_healpix_order=4, offset_range=5.0, offset_step=2.0, seed=1,
                relion_ranks=3, ours_ranks=1, mpiexec="", relion_j=4, relion_pool=30, relion_extra="",
                ours_extra="", relion_no_norm=False, cpu=False)


def science(a) -> None:
    data = Path(a.data).resolve()
    info = json.loads((data / "data.json").read_text())
    truth = by_number(vr.particles_of(data / "truth.star"))
    out = {"gpu": gpu_name(), "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "data": info,
           "args": vars(a)}

    def save():
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(out, indent=1))

    if not (data / "mask.mrc").exists():  # one soft mask from the true map for every side
        t = np.asarray(read_mrc(data / "state1.mrc").data, np.float64)
        thr = a.mask_threshold if a.mask_threshold > 0 else float(0.02 * t.max())
        ngr(["mask_create", "--i", "state1.mrc", "--o", "mask.mrc", "--lowpass", "15", "--ini_threshold",
             str(thr), "--extend_inimask", "3", "--width_soft_edge", "6"], data / "mask.log", data)
    if a.true_poses:
        true_poses(a, data, info, out)
        save()
    for side in [s for s in a.sides.split(",") if s]:  # none: the mask and the true-pose maps only
        out[side] = run_side(side, a, data, info, truth)
        summary = {k: v for k, v in out[side].items() if k not in ("maps", "iterations")}
        summary["last"] = out[side]["iterations"][-1] if out[side]["iterations"] else None
        summary["maps"] = {k: v for k, v in out[side].get("maps", {}).items() if not isinstance(v, list)}
        print(side, json.dumps(summary), flush=True)
        save()


def true_poses(a, data: Path, info: dict, out: dict) -> None:
    """Each half reconstructed from the true poses (the best any refinement of these images can do), judged."""
    tp = data / "true_poses"
    tp.mkdir(exist_ok=True)
    parts = vr.particles_of(data / "particles.star")
    opt = starfile.read(data / "particles.star", always_dict=True)["optics"]
    tr = by_number(vr.particles_of(data / "truth.star"))
    bn = by_number(parts)
    for c in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst"):
        bn[c] = tr.loc[bn.index, c].to_numpy()
    starfile.write({"optics": opt, "particles": bn.reset_index(drop=True)}, tp / "true_poses.star", overwrite=True)
    t = time.time()
    reconstruct_halves(tp / "true_poses.star", data, tp)
    out["true_poses"] = judge_maps(tp / "half1.mrc", tp / "half2.mrc", data / "state1.mrc", data / "mask.mrc",
                                   tp / "judge", info["angpix"])
    out["true_poses"]["reconstruct_s"] = time.time() - t
    print("true poses:", {k: v for k, v in out["true_poses"].items() if not isinstance(v, list)}, flush=True)


def progress(a) -> None:
    """The finished iterations of a side's run that may still be going on (resolution, errors against the truth,
    wall time), printed as JSON lines: what a run stopped by the session's end had reached."""
    data = Path(a.data).resolve()
    truth = by_number(vr.particles_of(data / "truth.star"))
    tag = f"{a.side}_refine3d_{a.tag}" if a.tag else f"{a.side}_refine3d"
    folder = data / tag
    t0 = float((folder / "started").read_text())
    marker = folder / "note.txt" if a.side == "ours" else None
    for row in per_iteration(folder / "run", truth, t0, marker):
        print(json.dumps({"side": a.side, **row}))
    print(json.dumps({"side": a.side, "running_s": round(time.time() - t0, 1)}))


def plot(a) -> None:
    """The gold-standard FSCs, the map-vs-truth FSCs (as is, and dashed against the truth turned and shifted into each
    refinement's frame) and each iteration's median angular error (raw, and dashed after each half's frame turn)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r = json.loads(Path(a.json).read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    labels = {"true_poses": "true poses", "ours": "napari-gpu-relion", "relion": "RELION 5"}
    for name, colour in (("true_poses", "k"), ("ours", "tab:blue"), ("relion", "tab:orange")):
        m = r.get(name, {}).get("maps") if name != "true_poses" else r.get("true_poses")
        if not m:
            continue
        res = np.asarray(m["resolution_of_shell_A"], float)
        x = np.where(res > 0, 1.0 / np.maximum(res, 1e-9), 0.0)
        label = labels[name]
        axes[0].plot(x, m["fsc_corrected"], colour, label=f"{label}: {m['gold_standard_masked_A']:.2f} Å")
        axes[1].plot(x[:len(m["fsc_map_vs_truth"])], m["fsc_map_vs_truth"][:len(x)], colour,
                     label=f"{label}: {m['map_vs_truth_fsc05_A']:.2f} Å")
        if "fsc_map_vs_truth_frame_aligned" in m:
            f = m["fsc_map_vs_truth_frame_aligned"]
            axes[1].plot(x[:len(f)], f[:len(x)], colour, ls="--", lw=1,
                         label=f"{label}, truth in its frame ({m['frame_turn_deg']:.2f}°)")
    for name, colour in (("ours", "tab:blue"), ("relion", "tab:orange")):
        its = [i for i in r.get(name, {}).get("iterations", []) if "median_angular_error_frame_aligned_deg" in i]
        if not its:
            continue
        n = [i["iteration"] if i["iteration"] != "final" else its[-2]["iteration"] + 1 for i in its]
        axes[2].plot(n, [i["median_angular_error_deg"] for i in its], colour, marker=".", label=f"{labels[name]}")
        axes[2].plot(n, [i["median_angular_error_frame_aligned_deg"] for i in its], colour, ls="--", marker=".",
                     label=f"{labels[name]}, after each half's frame turn")
    for ax, title, line in ((axes[0], "gold-standard FSC (masked, corrected)", 0.143),
                            (axes[1], "map vs truth FSC (masked)", 0.5)):
        ax.axhline(line, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("resolution (1/Å)")
        ax.set_title(title)
        ax.set_ylim(-0.05, 1.02)
        ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    axes[2].yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[2].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
    axes[2].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[2].set_xlabel("iteration (the last: final)")
    axes[2].set_ylabel("median angular error (°)")
    axes[2].set_title("poses against the true poses")
    axes[2].legend(fontsize=7)
    d = r["data"]
    gpus = r["gpu"].splitlines()  # nvidia-smi names every GPU of the host; each side ran on one
    host = gpus[0] if len(gpus) == 1 else f"one {gpus[0]} of a {len(gpus)}-GPU host"
    fig.suptitle(f"EMD-11007, {d['n']} particles, box {d['box']} at {d['angpix']} Å/px, SNR {d['snr']} "
                 f"({host})", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print("wrote", a.png)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("science")
    s.add_argument("--data", required=True)
    s.add_argument("--sides", default="ours,relion")
    s.add_argument("--tag", default="")
    s.add_argument("--limit_s", type=str, default="0",
                   help="stop a side after this many seconds (0 = never); one per side, comma-separated")
    s.add_argument("--no_true_poses", dest="true_poses", action="store_false",
                   help="skip the true-pose reconstructions")
    s.add_argument("--diameter", type=float, default=180.0)
    s.add_argument("--ini_high", type=float, default=30.0)
    s.add_argument("--offset_range", type=float, default=5.0)
    s.add_argument("--offset_step", type=float, default=2.0)
    s.add_argument("--ours_extra", default="")
    s.add_argument("--relion_extra", default="")
    s.add_argument("--mask_threshold", type=float, default=0.0,
                   help="mask_create --ini_threshold on the true map (0 = 2 %% of its maximum)")
    s.add_argument("--cpu", action="store_true", help="ours on the CPU (a small trial of this script)")
    s.add_argument("--out", default=None)
    p = sub.add_parser("plot")
    p.add_argument("json")
    p.add_argument("png")
    g = sub.add_parser("progress")
    g.add_argument("--data", required=True)
    g.add_argument("--side", default="relion")
    g.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    {"science": science, "plot": plot, "progress": progress}[a.cmd](a)


if __name__ == "__main__":
    main()

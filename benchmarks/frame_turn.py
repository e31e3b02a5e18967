"""Does an auto-refine's frame turn away from the truth's, and when? (issue 48: ours' raw angular error at box 256)

A C1 refinement's map and poses are fixed only up to a common turn G (poses A = B G, the map V(G y)). Each half set
has its own reference and may turn; the raw angular error counts the turn once per particle. This runs our
auto-refine of our simulator's EMD-11007 particles (box 64, 2.5 Å/px, global search from the map low-passed to 30 Å)
and, per iteration, prints and writes each half's fitted turn (as a rotation vector, degrees), its change from the
previous iteration, the iteration's random perturbation of the sampling, and the raw and frame-aligned median errors;
at the end the final map's FSC against the truth, as it is and turned into the fitted frame.

  python benchmarks/frame_turn.py --work /tmp/ft --n 600 --snr 0.3 --seed 1 --out benchmarks/results/x.json
  [--without_direction_prior_at 4]   iteration 4 again from iteration 3's files with a uniform direction prior
                                     (RELION's pdf_direction left out), beside the run's own iteration 4
(A run already in --work/sim_n<N>_snr<SNR>_run_s<seed> is judged again without running.)
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import mrcfile
import numpy as np
import starfile
from scipy.spatial.transform import Rotation

sys.path.insert(0, str(Path(__file__).resolve().parent))
import subpixel_offsets as so  # noqa: E402
import vs_relion as vr  # noqa: E402

from napari_gpu_relion.compute.fsc import fsc  # noqa: E402
from napari_gpu_relion.compute.geometry import euler_to_matrix  # noqa: E402
from napari_gpu_relion.compute.sampling import angular_step  # noqa: E402
from napari_gpu_relion.compute.symmetry_alignment import rotate_map  # noqa: E402


def rotation_vector_deg(G: np.ndarray) -> list[float]:
    """The turn G as axis x angle (degrees)."""
    return [round(float(x), 4) for x in np.degrees(Rotation.from_matrix(G).as_rotvec())]


#: RELION 5's auto-refine of the same particles with the same options (``--relion_env``: a script that sets
#: RELION_BIN and the ``rl`` wrapper, as benchmarks/build_relion_cpu.sh's env.sh; split halves need MPI: 3 ranks).
RELION = ("rl mpirun --allow-run-as-root --oversubscribe -n 3 $RELION_BIN/relion_refine_mpi --i particles.star "
          "--ref reference.mrc --o {out}/run --auto_refine --split_random_halves --ini_high 30 --particle_diameter 150 "
          "--ctf --flatten_solvent --zero_mask --healpix_order 2 --auto_local_healpix_order 4 --offset_range 5 "
          "--offset_step 2 --random_seed {seed} --oversampling 1 --low_resol_join_halves 40 --pad 2 --j 1 "
          "--dont_combine_weights_via_disc --sym C1")


def ours_orders_and_perturbations(log: Path, folder: Path) -> dict:
    """{iteration: (HEALPix order, perturbation)} of our run, from its log and optimiser STARs."""
    text = log.read_text() if log.exists() else ""
    orders = {int(m.group(1)): int(m.group(2))
              for m in re.finditer(r"iteration (\d+): image size .*?HEALPix order (\d+)", text)}
    out = {}
    for it, order in orders.items():
        opt = folder / f"run_it{it:03d}_optimiser.star"
        p = re.search(r"_rlnGpuRelion_perturb\s+(\S+)", opt.read_text()) if opt.exists() else None
        out[it] = (order, float(p.group(1)) if p else None)
    return out


def relion_orders_and_perturbations(folder: Path) -> dict:
    """{iteration: (HEALPix order, perturbation)} of a RELION run, from its sampling STARs."""
    out = {}
    for f in folder.glob("run_it*_sampling.star"):
        it = int(re.search(r"_it(\d+)_", f.name).group(1))
        text = f.read_text()
        out[it] = (int(re.search(r"_rlnHealpixOrder\s+(\S+)", text).group(1)),
                   float(re.search(r"_rlnSamplingPerturbInstance\s+(\S+)", text).group(1)))
    return out


def judge_iterations(folder: Path, truth, sampling: dict) -> list[dict]:
    """Per iteration (and the final one): each half's frame turn and its change, the sampling's perturbation (as a
    rotation vector), the raw and frame-aligned median angular errors."""
    rows, prev = [], None
    for it, f in vr.iteration_data_stars(folder / "run"):
        d = so.keyed(starfile.read(f)["particles"]).loc[truth.index]
        raw, _ = vr.pose_differences(truth, d)
        fa = vr.frame_aligned_pose_errors(truth, d)
        G = fa["turn"]
        order, pert = sampling.get(it, (None, None))
        row = {"iteration": it if it is not None else "final", "order": order,
               "turn_deg": {h: rotation_vector_deg(g) for h, g in G.items()},
               "median_angular_error_deg": float(np.median(raw)),
               "median_angular_error_frame_aligned_deg": float(np.median(fa["angular_deg"]))}
        if prev is not None:
            row["turn_change_deg"] = {h: rotation_vector_deg(prev[h].T @ G[h]) for h in G}
        if order is not None and pert is not None:
            dd = pert * angular_step(order)
            row["perturbation_deg"] = rotation_vector_deg(euler_to_matrix(dd, dd, dd))
        rows.append(row)
        print(folder.name, json.dumps(row), flush=True)
        prev = G
    return rows


def map_vs_truth(folder: Path, truth, truth_path: Path) -> dict | None:
    """The final map's mean FSC (shells 8-25, a sphere of radius 28 px) against the truth: as it is, turned into the
    fitted frame, turned and shifted, and turned or shifted the other way."""
    final = folder / "run_class001.mrc"
    if not final.exists():
        return None
    G, t, _, _ = vr.frame_fit(*vr.pose_arrays(truth, so.keyed(starfile.read(folder / "run_data.star")["particles"])
                                                .loc[truth.index]))
    truth_map = mrcfile.read(truth_path).astype(np.float64)
    mp = mrcfile.read(final).astype(np.float64)
    n = truth_map.shape[0]
    r = np.sqrt(sum(g ** 2 for g in np.meshgrid(*(np.arange(n) - n // 2,) * 3, indexing="ij")))
    msk = (r < 28).astype(float)
    t_px = t / so.ANGPIX
    out = {name: float(fsc(mp * msk, v * msk)[8:26].mean()) for name, v in (
        ("as_is", truth_map), ("turned", rotate_map(truth_map, G.T, order=3)),
        ("turned_and_shifted", vr.truth_in_frame(truth_map, G, t_px)),
        ("turned_the_other_way", rotate_map(truth_map, G, order=3)),
        ("turned_and_shifted_the_other_way", vr.truth_in_frame(truth_map, G, -t_px)))}
    out["frame_turn_deg"] = rotation_vector_deg(G)
    out["frame_shift_A"] = [float(x) for x in t]
    print(folder.name, json.dumps(out))
    return out


def relion_run(sim: Path, seed: int, relion_env: str) -> tuple[Path, str]:
    """RELION's auto-refine of ``sim``'s particles (RELION above) in ``sim/relion_s<seed>``, run unless its final
    data STAR is there; returns that folder and the command."""
    rdir = sim / f"relion_s{seed}"
    rdir.mkdir(exist_ok=True)
    cmd = RELION.format(seed=seed, out=rdir.name)
    if not (rdir / "run_data.star").exists():
        with open(rdir / "log.txt", "w") as fh:
            rc = subprocess.run(["bash", "-c", f". {relion_env} && {cmd}"], cwd=sim, stdout=fh,
                                stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"RELION failed (rc {rc}); see {rdir / 'log.txt'}")
    return rdir, cmd


def simulate(work: Path, n: int, snr: float) -> Path:
    """Our simulator's particles (kept in a folder named by their number and SNR, made once)."""
    sim = work / f"sim_n{n}_snr{snr:g}"
    if (sim / "particles.star").exists():
        return sim
    so.write_map64(work)  # the truth of every simulation here
    so.run("simulate", "--o", sim, "--map", work / "map64.mrc", "--box", so.BOX, "--angpix", so.ANGPIX,
           "--n_particles", n, "--snr", snr, "--n_micrographs", 0, "--ini_high", 30, "--seed", 3, "--overwrite")
    return sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--snr", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--relion_env", help="RELION's environment script: judge RELION's run of the same particles too")
    ap.add_argument("--without_direction_prior_at", type=int, default=0,
                    help="run this iteration again from the previous one's files without the direction prior")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    sim = simulate(a.work, a.n, a.snr)
    folder = sim.parent / f"{sim.name}_run_s{a.seed}"
    folder.mkdir(exist_ok=True)
    log = sim.parent / f"{folder.name}.log"
    args = ["refine3d", "--i", sim / "particles.star", "--ref", sim / "reference.mrc", "--o", folder / "run",
            "--ini_high", 30, "--particle_diameter", 150, "--ctf", "--flatten_solvent", "--zero_mask",
            "--healpix_order", 2, "--auto_local_healpix_order", 4, "--offset_range", 5, "--offset_step", 2,
            "--random_seed", a.seed, "--cpu"]
    t0 = time.time()
    if not (folder / "run_it001_data.star").exists():
        with open(log, "w") as fh:
            rc = subprocess.run([sys.executable, "-m", "napari_gpu_relion.cli", *map(str, args)], stdout=fh,
                                stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"refine3d failed (rc {rc}); see {log}")
    truth = so.keyed(starfile.read(sim / "particles.star")["particles"])
    res = {"gpu": "CPU", "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "n": a.n, "snr": a.snr,
           "seed": a.seed, "command": "napari-gpu-relion " + " ".join(map(str, args)),
           "iterations": judge_iterations(folder, truth, ours_orders_and_perturbations(log, folder)),
           "map_vs_truth_mean_fsc_shells_8_25": map_vs_truth(folder, truth, a.work / "map64.mrc"),
           "judged_s": time.time() - t0}
    if a.relion_env:
        rdir, cmd = relion_run(sim, a.seed, a.relion_env)
        res["relion"] = {"command": cmd}
        res["relion"]["iterations"] = judge_iterations(rdir, truth, relion_orders_and_perturbations(rdir))
        res["relion"]["map_vs_truth_mean_fsc_shells_8_25"] = map_vs_truth(rdir, truth, a.work / "map64.mrc")
    if a.without_direction_prior_at:
        res["without_direction_prior"] = again_without_direction_prior(folder, a.without_direction_prior_at, truth)
        print(json.dumps(res["without_direction_prior"]))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


#: Run by again_without_direction_prior in its own process: refine3d --continue with the global searches' direction
#: prior (RELION's pdf_direction, per HEALPix index, carried from the previous iteration) left out.
_NO_PRIOR = """
import sys
from napari_gpu_relion.jobs import refine3d
refine3d.Refine3D.expectation_options = lambda self, it, h: {}
from napari_gpu_relion.cli import main
sys.exit(main(sys.argv[1:]))
"""


def again_without_direction_prior(folder: Path, it: int, truth) -> dict:
    """Iteration ``it`` of the run in ``folder`` again from iteration it-1's files with a uniform direction prior
    (stopped once its data STAR is written); the turn each half's frame made in that iteration and the errors,
    with the prior (the run's own) and without."""
    cont = folder.parent / f"{folder.name}_without_direction_prior_it{it:03d}"
    cont.mkdir(exist_ok=True)
    for f in folder.glob(f"run_it{it - 1:03d}_*"):
        if not (cont / f.name).exists():
            (cont / f.name).write_bytes(f.read_bytes())
    target = cont / f"run_it{it:03d}_data.star"
    if not target.exists():
        with open(cont / "log.txt", "w") as fh:
            proc = subprocess.Popen([sys.executable, "-c", _NO_PRIOR, "refine3d", "--continue",
                                     str(cont / f"run_it{it - 1:03d}_optimiser.star"), "--o", str(cont / "run"),
                                     "--cpu"], stdout=fh, stderr=subprocess.STDOUT)
            while proc.poll() is None and not (target.exists() and (cont / f"run_it{it:03d}_optimiser.star").exists()):
                time.sleep(2)
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    out = {}
    before = so.keyed(starfile.read(folder / f"run_it{it - 1:03d}_data.star")["particles"]).loc[truth.index]
    G0 = vr.frame_aligned_pose_errors(truth, before)["turn"]
    for name, f in (("with_prior", folder / f"run_it{it:03d}_data.star"), ("without_prior", target)):
        d = so.keyed(starfile.read(f)["particles"]).loc[truth.index]
        raw, _ = vr.pose_differences(truth, d)
        fa = vr.frame_aligned_pose_errors(truth, d)
        out[name] = {"turn_change_deg": {h: rotation_vector_deg(G0[h].T @ G) for h, G in fa["turn"].items()},
                     "median_angular_error_deg": float(np.median(raw)),
                     "median_angular_error_frame_aligned_deg": float(np.median(fa["angular_deg"]))}
    return out


if __name__ == "__main__":
    main()

"""Science and speed check of the 3D initial model from the particles alone (issue #22 "done when", full size),
beside RELION 5's "3D initial model" on the same particle files (``--relion``) and followed by 3D auto-refines
(``--refine_check``).

Simulates particles of the pseudo-atomic phantom (CTF, offsets, SNR) and gives both programs a particles STAR
without any alignment (no angles, offsets 0: particles_input.star; the truth stays in particles.star). Per seed
it runs our ``initial_model`` with no reference and, with ``--relion``, ``relion_refine --grad --denovo_3dref``
with the options RELION's GUI job passes (``relion_command``), and reports for both: the wall time, the number of
iterations, the correlation of every final class map with the truth after the best rotation, shift and hand
(compute/initial_model.aligned_map_correlation, one function for both programs) at 30 Å and 20 Å, and the "time
to a usable model": the first written iteration whose best class correlates >= 0.8 with the truth at 30 Å, with
the seconds from the program's start to that iteration's map file (both programs write run_itNNN_class001.mrc
every --write_iter iterations: RELION's --grad_write_iter, the same for both). Writes JSON naming the hardware.

``--refine_check`` then runs our 3D auto-refine (refine3d, the options benchmarks/vs_relion.py gives it, with the
offsets scaled to this box) on the same particles twice: from our initial model's largest class as it is (no
alignment to the truth: the refinement does not depend on the frame, and a user has no truth) and from the truth,
both low-passed to 60 Å by refine3d's --ini_high 60; it reports both gold-standard resolutions (FSC 0.143 of the
unfiltered half maps) and the median angular error of the refinement from the truth (issue #22: "a 3D auto-refine
started from it reaches the same resolution as one started from the 60 Å low-passed truth").

RELION is found as benchmarks/vs_relion.py finds it: ``$RB/env.sh`` (default /root/rb/env.sh, made by
../shared/relion_gpu/build_relion.sh) sets RELION_BIN and the ``rl`` wrapper; vs_relion.relion runs the command.
``--dry_run`` prints every command (ours as the equivalent command line) without running anything.

Run (the issue's case, on a GPU machine with RELION built):
  python benchmarks/initial_model.py --n 5000 --box 64 --angpix 3 --snr 0.05 --iter 200 --seeds 1 2 3 --relion
      --refine_check --out benchmarks/results/initial_model_vs_relion_h100.json
K=2 with 20 % junk: add --K 2 --junk 0.2 (pure-noise images at the particles' noise level; per seed and program
where the junk went, by image name, and every class's correlation with the truth).
One seed per call fits a time limit per command: the data are made again (deterministic), and the refinement from
the truth is read back from <work>/refine_truth/result.json when the data and its options are the same.
Small CPU variant: python benchmarks/initial_model.py --n 300 --box 24 --angpix 8 --snr 0.2 --iter 30 --cpu
    --ini_subset 100 --fin_subset 300 --ini_resol 40 --fin_resol 24 --seeds 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shlex
import shutil
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd
import starfile
from science_refine import half_map_resolution
from vs_relion import ANG, particles_of, relion

from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.compute.initial_model import aligned_map_correlation
from napari_gpu_relion.events import Finished
from napari_gpu_relion.io.jobdir import RunFiles
from napari_gpu_relion.io.model_star import read_optimiser_star
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.jobs import initial_model, refine3d
from napari_gpu_relion.jobs.common import flag_of
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime.device import select_backend

#: What the truth is compared at, and the "usable model" threshold (issue #22: >= 0.8 to 30 Å).
RESOLUTIONS_A = (30.0, 20.0)


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------

def image_key(name: str) -> str:
    """An image's name without the folders of its stack (``000012@/abs/particles/junk.mrcs`` ->
    ``12@junk.mrcs``): jobs write the names they resolved, so names are compared by this."""
    idx, stack = str(name).split("@", 1)
    return f"{int(idx)}@{Path(stack).name}"


def keyed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` indexed by ``image_key`` of its rlnImageName."""
    return df.set_index(df["rlnImageName"].map(image_key))


def strip_alignment(src: Path, dst: Path) -> Path:
    """``src`` without what a real data set would not know: angles and classes dropped, offsets 0."""
    star = starfile.read(src, always_dict=True)
    parts = star["particles"].drop(columns=[c for c in (*ANG, "rlnClassNumber") if c in star["particles"]])
    for c in ("rlnOriginXAngst", "rlnOriginYAngst"):
        parts[c] = 0.0
    star["particles"] = parts
    starfile.write(star, dst, overwrite=True)
    return dst


def add_junk(data: Path, fraction: float, snr: float, seed: int) -> tuple[Path, set[str]]:
    """particles_junk.star in ``data``: the particles and pure-noise images (a ``fraction`` of the whole, noise
    as strong as the particles' own: image variance x 1/(1 + snr)), shuffled; returns it and the image names of
    the junk."""
    star = starfile.read(data / "particles.star", always_dict=True)
    parts = star["particles"]
    n = len(parts)
    m = int(round(fraction * n / (1.0 - fraction)))
    first = parts["rlnImageName"].iloc[0].split("@")[1]
    stack = read_mrc(data / first).data
    sd = float(np.std(stack)) * np.sqrt(1.0 / (1.0 + snr))
    rng = np.random.default_rng(seed)
    junk_name = str(Path(first).with_name("junk.mrcs"))
    write_mrc(data / junk_name, rng.normal(0.0, sd, (m,) + stack.shape[1:]).astype(np.float32),
              float(star["optics"]["rlnImagePixelSize"].iloc[0]))
    rows = parts.sample(m, replace=True, random_state=seed).copy()  # CTF and optics of real rows
    rows["rlnImageName"] = [f"{i + 1:06d}@{junk_name}" for i in range(m)]
    both = pd.concat([parts, rows], ignore_index=True)
    star["particles"] = both.iloc[rng.permutation(n + m)].reset_index(drop=True)
    out = data / "particles_junk.star"
    starfile.write(star, out, overwrite=True)
    return out, set(rows["rlnImageName"].map(image_key))


def junk_report(data_star: Path, junk: set[str], K: int) -> dict:
    """Where the junk went (matched by image name, so any row order): per class its particles and junk; the
    class with most junk, its share of all junk and its purity."""
    d = particles_of(data_star)
    cls = d["rlnClassNumber"].to_numpy() - 1
    flag = d["rlnImageName"].map(image_key).isin(junk).to_numpy()
    per = [{"class": k + 1, "particles": int((cls == k).sum()), "junk": int((flag & (cls == k)).sum())}
           for k in range(K)]
    j = max(per, key=lambda c: c["junk"])
    return {"classes": per, "junk_class": j["class"], "junk_in_junk_class": j["junk"] / max(1, int(flag.sum())),
            "junk_class_purity": j["junk"] / max(1, j["particles"])}


# --------------------------------------------------------------------------------------------------------------
# The two programs' commands
# --------------------------------------------------------------------------------------------------------------

def ours_options(a, star: Path, root: Path, seed: int) -> dict:
    """Our initial_model's Params, RELION's GUI defaults where the benchmark does not set them."""
    return dict(i=star, o=root, iter=a.iter, K=a.K, sym="C1", ctf=True, particle_diameter=a.diameter + 15,
                flatten_solvent=True, zero_mask=True, pad=a.pad, healpix_order=a.healpix_order,
                offset_range=a.offset_range, offset_step=a.offset_step, tau2_fudge=a.tau2_fudge, random_seed=seed,
                grad_ini_subset=a.ini_subset, grad_fin_subset=a.fin_subset, grad_ini_resol=a.ini_resol,
                grad_fin_resol=a.fin_resol, write_iter=a.write_iter, cpu=a.cpu)


def cli_command(job: str, params_cls, opts: dict) -> str:
    """The command line of our job with these Params fields (what note.txt would say)."""
    flags = {f.name: flag_of(f) for f in fields(params_cls)}
    parts = ["napari-gpu-relion", job]
    for k, v in opts.items():
        if v is False or v is None:
            continue
        parts += [flags[k]] if v is True else [flags[k], str(v)]
    return shlex.join(parts)


def relion_command(a, star: Path, root: Path, seed: int) -> str:
    """relion_refine as RELION 5.0.1's GUI "3D initial model" job runs it (src/pipeline_jobs.cpp,
    RelionJob::getCommandsInimodelJob), with this benchmark's values; to run under ``. $RB/env.sh`` in the folder
    of the particles STAR (RELION resolves image names from its working folder)."""
    o = [f"--o {root}", f"--iter {a.iter}", "--grad --denovo_3dref", f"--i {star.name}", "--ctf", f"--K {a.K}",
         "--sym C1", "--flatten_solvent", "--zero_mask", "--dont_combine_weights_via_disc", "--preread_images",
         f"--pool {a.relion_pool}", f"--pad {a.pad}", f"--particle_diameter {a.diameter + 15:g}",
         "--oversampling 1", f"--healpix_order {a.healpix_order}", f"--offset_range {a.offset_range:g}",
         f"--offset_step {a.offset_step:g}", "--auto_sampling", f"--tau2_fudge {a.tau2_fudge:g}",
         f"--j {a.relion_j}", *([f"--gpu {a.relion_gpu}"] if a.relion_gpu else []),  # "": RELION's CPU build
         # not passed by the GUI job: a fixed seed (else time(NULL)) and the write interval both programs share
         f"--random_seed {seed}", f"--grad_write_iter {a.write_iter}"]
    if a.ini_subset > 0:
        o.append(f"--grad_ini_subset {a.ini_subset}")
    if a.fin_subset > 0:
        o.append(f"--grad_fin_subset {a.fin_subset}")
    if a.relion_extra:
        o.append(a.relion_extra)
    return "rl $RELION_BIN/relion_refine " + " ".join(o)


def refine_options(a, star: Path, ref: Path, root: Path) -> dict:
    """refine3d as benchmarks/vs_relion.py runs it (common_options, job refine3d), at this box: the mask of the
    initial model, offsets searched 5 px in 1 px steps (RELION's GUI defaults; the particles are within 3 px)."""
    return dict(i=star, ref=ref, o=root, ctf=True, particle_diameter=a.diameter + 15, flatten_solvent=True,
                zero_mask=True, offset_range=a.refine_offset_range, offset_step=a.refine_offset_step, pad=2,
                random_seed=a.refine_seed, ini_high=60.0, sym="C1", healpix_order=a.refine_healpix_order,
                auto_local_healpix_order=4, low_resol_join_halves=40.0, norm=True, scale=True,
                auto_iter_max=a.refine_iter_max, cpu=a.cpu)


def relion_env() -> Path:
    return Path(os.environ.get("RB", "/root/rb")) / "env.sh"


# --------------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------------

def _cc(task: tuple) -> float:
    """One correlation with the truth (a process-pool task: the rotation search takes seconds per map)."""
    path, truth_path, angpix, res = task
    got = np.asarray(read_mrc(path).data, np.float64)
    truth = np.asarray(read_mrc(truth_path).data, np.float64)
    return float(aligned_map_correlation(got, truth, angpix, res)["cc"])


def iteration_maps(root: Path, K: int) -> dict[int, list[Path]]:
    """{iteration: [class maps]} of the run_itNNN_classKKK.mrc files under rootname ``root`` (iteration 0,
    RELION's starting point, left out)."""
    out: dict[int, list[Path]] = {}
    for f in root.parent.glob(root.name + "_it*_class*.mrc"):
        m = re.fullmatch(re.escape(root.name) + r"_it(\d+)_class(\d+)\.mrc", f.name)
        if m and int(m.group(1)) > 0:
            out.setdefault(int(m.group(1)), []).append(f)
    return {it: sorted(v) for it, v in sorted(out.items()) if len(v) == K}


def evaluate_run(root: Path, K: int, t0: float, truth_path: Path, angpix: float, pool, usable_cc: float) -> dict:
    """Per written iteration: seconds from ``t0`` to its maps and every class's cc with the truth at 30 Å; the
    last iteration's classes also at 20 Å; the first iteration whose best class reaches ``usable_cc`` at 30 Å."""
    maps = iteration_maps(root, K)
    if not maps:
        return {"error": f"no {root.name}_itNNN_classNNN.mrc files in {root.parent}"}
    last = max(maps)
    tasks = [(str(p), str(truth_path), angpix, RESOLUTIONS_A[0]) for it in maps for p in maps[it]]
    tasks += [(str(p), str(truth_path), angpix, res) for p in maps[last] for res in RESOLUTIONS_A[1:]]
    ccs = iter(pool.map(_cc, tasks))
    curve = {it: [next(ccs) for _ in maps[it]] for it in maps}
    final = {f"class{k + 1}": {f"{RESOLUTIONS_A[0]:g}A": curve[last][k]} for k in range(K)}
    for k in range(K):
        for res in RESOLUTIONS_A[1:]:
            final[f"class{k + 1}"][f"{res:g}A"] = next(ccs)
    seconds = {it: max(p.stat().st_mtime for p in maps[it]) - t0 for it in maps}
    usable = next((it for it in maps if max(curve[it]) >= usable_cc), None)
    return {"iterations": last, "cc_best_aligned": final,
            "per_iteration": [{"iteration": it, "seconds": seconds[it], "cc30_per_class": curve[it]} for it in maps],
            "usable": None if usable is None else {"iteration": usable, "seconds": seconds[usable],
                                                   "cc30": max(curve[usable])}}


def largest_class_map(root: Path, final_model: Path) -> Path:
    """The class with the largest rlnClassDistribution in a model STAR (RELION's job hands that one on:
    relion_align_symmetry --select_largest_class)."""
    classes = starfile.read(final_model, always_dict=True)["model_classes"]
    k = int(np.argmax(classes["rlnClassDistribution"].to_numpy()))
    return root.parent / Path(str(classes["rlnReferenceImage"].iloc[k])).name


def run_refine(a, star: Path, ref: Path, root: Path, truth: pd.DataFrame) -> dict:
    """One refine3d to convergence: wall, iterations, resolution (the job's own gold-standard FSC 0.143, and the
    unmasked FSC 0.143 of the unfiltered half maps as science_refine.py computes it) and the median angular
    error from the truth (real particles only)."""
    shutil.rmtree(root.parent, ignore_errors=True)
    t0 = time.time()
    fin = [e for e in refine3d.run(refine3d.Params(**refine_options(a, star, ref, root))) if isinstance(e, Finished)]
    wall = time.time() - t0
    files = RunFiles(root)
    res = half_map_resolution(files.unfiltered_half_map(1), files.unfiltered_half_map(2))
    d = keyed(particles_of(files.data()))
    real = d.index.intersection(truth.index)  # the junk has no truth
    err = angular_distance_deg(euler_to_matrix(*(d.loc[real, c].to_numpy() for c in ANG)),
                               euler_to_matrix(*(truth.loc[real, c].to_numpy() for c in ANG)))
    model = starfile.read(files.model(), always_dict=True)["model_general"]
    return {"reference": str(ref), "wall_s": wall,
            "iterations": int(read_optimiser_star(files.optimiser())["rlnCurrentIteration"]),
            "resolution_A": float(model["rlnCurrentResolution"]), "resolution_half_maps_unmasked_A": float(res),
            "median_angular_error_deg": float(np.median(err)), "summary": fin[-1].summary if fin else None}


def truth_refine(a, star: Path, truth_path: Path, truth_star: pd.DataFrame) -> dict:
    """The refinement from the truth, once per data set: a later call of the benchmark (another seed, the same
    data and refine options) reads it back from refine_truth/result.json instead of running it again."""
    root = a.work / "refine_truth" / "run"
    key = {"data": [a.n, a.box, a.angpix, a.snr, a.diameter, a.junk, star.name],
           "options": {k: str(v) for k, v in refine_options(a, star, truth_path, root).items() if k != "cpu"}}
    saved = root.parent / "result.json"
    if saved.is_file():
        old = json.loads(saved.read_text())
        if old.get("key") == key:
            return old["result"] | {"reused_from": str(saved)}
    r = run_refine(a, star, truth_path, root, truth_star)
    saved.write_text(json.dumps({"key": key, "result": r}, indent=1))
    return r


# --------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--box", type=int, default=64)
    ap.add_argument("--angpix", type=float, default=3.0)
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--diameter", type=float, default=150.0, help="phantom diameter (Å); the mask is 15 Å wider")
    ap.add_argument("--iter", type=int, default=200)
    ap.add_argument("--K", type=int, default=1)
    ap.add_argument("--ini_subset", type=int, default=-1, help="--grad_ini_subset of both (-1: RELION's rule)")
    ap.add_argument("--fin_subset", type=int, default=-1, help="--grad_fin_subset of both (-1: RELION's rule)")
    ap.add_argument("--ini_resol", type=float, default=35.0, help="ours only (RELION 5 reads it but never uses it)")
    ap.add_argument("--fin_resol", type=float, default=15.0, help="ours only (RELION 5 reads it but never uses it)")
    ap.add_argument("--pad", type=int, default=1, help="--pad of both (1: RELION's GUI job)")
    ap.add_argument("--healpix_order", type=int, default=1, help="RELION's GUI job: 1")
    ap.add_argument("--offset_range", type=float, default=6.0, help="pixels; RELION's GUI job: 6")
    ap.add_argument("--offset_step", type=float, default=2.0, help="pixels; RELION's GUI job: 2")
    ap.add_argument("--tau2_fudge", type=float, default=4.0, help="RELION's GUI default: 4")
    ap.add_argument("--write_iter", type=int, default=10, help="maps every this many iterations, both programs "
                    "(RELION's --grad_write_iter, default 10): the resolution of the time to a usable model")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--junk", type=float, default=0.0, help="fraction of pure-noise images added (0: none)")
    ap.add_argument("--usable_cc", type=float, default=0.8, help="a usable model: best class cc >= this at 30 Å")
    ap.add_argument("--relion", action="store_true", help="also run RELION 5 (relion_refine --grad --denovo_3dref)")
    ap.add_argument("--relion_j", type=int, default=4)
    ap.add_argument("--relion_pool", type=int, default=30)
    ap.add_argument("--relion_gpu", default="0",
                    help="RELION's --gpu; empty for a CPU build (benchmarks/build_relion_cpu.sh)")
    ap.add_argument("--relion_extra", default="", help="more relion_refine options, e.g. '--maxsig 100'")
    ap.add_argument("--refine_check", action="store_true", help="then refine3d from our model and from the truth")
    ap.add_argument("--refine_healpix_order", type=int, default=2)
    ap.add_argument("--refine_offset_range", type=float, default=5.0)
    ap.add_argument("--refine_offset_step", type=float, default=1.0)
    ap.add_argument("--refine_seed", type=int, default=1, help="random seed (halves) of both refinements")
    ap.add_argument("--refine_iter_max", type=int, default=999, help="refine3d --auto_iter_max (999: to convergence)")
    ap.add_argument("--eval_workers", type=int, default=os.cpu_count() or 1,
                    help="processes for the correlations with the truth (each map takes 10-30 s)")
    ap.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_initial_model"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.work = a.work.resolve()

    data = a.work / "data"
    star = data / ("particles_junk.star" if a.junk > 0 else "particles_input.star")
    if a.dry_run:
        for seed in a.seeds:
            out = a.work / f"seed{seed}"
            ours = ours_options(a, star, out / "ours" / "run", seed)
            print(f"# seed {seed}: ours\n{cli_command('initial_model', initial_model.Params, ours)}")
            if a.relion:
                print(f"# seed {seed}: RELION (in {data})\n. {relion_env()} && cd {data} && "
                      f"{relion_command(a, star, out / 'relion' / 'run', seed)}")
            if a.refine_check:
                im = out / "ours" / ("run_class001.mrc" if a.K == 1 else "run_classNNN.mrc")
                opts = refine_options(a, star, im, out / "refine" / "run")
                print(f"# seed {seed}: refine3d from our initial model (its largest class)\n"
                      f"{cli_command('refine3d', refine3d.Params, opts)}")
        if a.refine_check:
            opts = refine_options(a, star, data / "truth.mrc", a.work / "refine_truth" / "run")
            print(f"# refine3d from the truth (low-passed to 60 Å by --ini_high 60)\n"
                  f"{cli_command('refine3d', refine3d.Params, opts)}")
        return
    if a.relion and not relion_env().is_file():
        raise SystemExit(f"--relion: {relion_env()} not found (build RELION with ../shared/relion_gpu/"
                         "build_relion.sh, or set RB to its build folder)")

    make_sample_data(data, box=a.box, angpix=a.angpix, n_particles=a.n, snr=a.snr, diameter=a.diameter,
                     n_micrographs=0)
    truth_path = data / "truth.mrc"
    truth_star = keyed(particles_of(data / "particles.star"))
    junk: set[str] = set()
    if a.junk > 0:
        with_junk, junk = add_junk(data, a.junk, a.snr, 0)
        strip_alignment(with_junk, star)
    else:
        strip_alignment(data / "particles.star", star)
    be = select_backend(cpu=a.cpu)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if shutil.which("nvidia-smi") else ""
    result = {"benchmark": "initial_model", "args": {k: str(v) for k, v in vars(a).items()}, "backend": be.name,
              "gpu": gpu or None, "host": platform.node(), "machine": platform.machine(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "input_star": str(star), "runs": []}

    def save():
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1))

    pool = ProcessPoolExecutor(max_workers=max(1, a.eval_workers), mp_context=mp.get_context("spawn"))
    refine_truth = None
    for seed in a.seeds:
        out = a.work / f"seed{seed}"
        shutil.rmtree(out, ignore_errors=True)
        run: dict = {"seed": seed}
        # ours
        opts = ours_options(a, star, out / "ours" / "run", seed)
        t0 = time.time()
        fin = [e for e in initial_model.run(initial_model.Params(**opts)) if isinstance(e, Finished)][-1]
        wall = time.time() - t0
        ours = {"command": cli_command("initial_model", initial_model.Params, opts), "wall_s": wall,
                "s_per_iteration": wall / a.iter, "summary": fin.summary}
        ours.update(evaluate_run(out / "ours" / "run", a.K, t0, truth_path, a.angpix, pool, a.usable_cc))
        if junk:
            ours["junk"] = junk_report(out / "ours" / "run_data.star", junk, a.K)
        run["ours"] = ours
        print(json.dumps({"seed": seed, "ours": {k: v for k, v in ours.items() if k != "per_iteration"}}),
              flush=True)
        # RELION
        if a.relion:
            (out / "relion").mkdir(parents=True)
            cmd = relion_command(a, star, out / "relion" / "run", seed)
            t0 = time.time()
            try:
                wall = relion(f"cd {data} && {cmd}", out / "relion" / "log.txt")
                rel = {"command": cmd, "wall_s": wall, "s_per_iteration": wall / a.iter}
                rel.update(evaluate_run(out / "relion" / "run", a.K, t0, truth_path, a.angpix, pool, a.usable_cc))
                if junk:
                    rel["junk"] = junk_report(out / "relion" / f"run_it{a.iter:03d}_data.star", junk, a.K)
            except SystemExit as exc:  # vs_relion.relion exits on a failed command: keep what was measured
                rel = {"command": cmd, "error": str(exc)[-3000:]}
            run["relion"] = rel
            print(json.dumps({"seed": seed, "relion": {k: v for k, v in rel.items() if k != "per_iteration"}}),
                  flush=True)
            if "wall_s" in rel:
                run["ratio_wall_relion_over_ours"] = rel["wall_s"] / ours["wall_s"]
                if rel.get("usable") and ours.get("usable"):
                    run["ratio_time_to_usable_relion_over_ours"] = rel["usable"]["seconds"] / ours["usable"]["seconds"]
        # the auto-refine check
        if a.refine_check:
            if refine_truth is None:
                refine_truth = truth_refine(a, star, truth_path, truth_star)
                result["refine_from_truth"] = refine_truth
                print(json.dumps({"refine_from_truth": refine_truth}), flush=True)
            ref = largest_class_map(out / "ours" / "run", out / "ours" / "run_model.star")
            r = run_refine(a, star, ref, out / "refine" / "run", truth_star)
            r["median_angular_error_deg_note"] = "in the initial model's frame and hand: not an error"
            r["resolution_minus_truth_start_A"] = r["resolution_A"] - refine_truth["resolution_A"]
            r["half_maps_resolution_minus_truth_start_A"] = (r["resolution_half_maps_unmasked_A"]
                                                             - refine_truth["resolution_half_maps_unmasked_A"])
            run["refine_from_initial_model"] = r
            print(json.dumps({"seed": seed, "refine_from_initial_model": r}), flush=True)
        result["runs"].append(run)
        save()
    pool.shutdown()
    print(json.dumps(result, indent=1))
    save()


if __name__ == "__main__":
    main()

"""Ours' auto-refine continued from RELION's iteration N for one iteration: is ours' gold-standard FSC near 0.143 lower
than RELION's given the same state, or only along its own trajectory? (issue 48)

In whole runs of the same particles (frame_turn.py: our simulator's EMD-11007 at box 64, RELION 5's CPU build) ours'
FSC near the crossing was 0.009 below RELION's on average (fsc_near_crossing.py, 44 iterations of four seeds), which
moves the reported resolution, and with it the convergence, by a shell now and then. Here RELION's run_itNNN files
(half maps and model STARs: noise spectra, direction priors; data STAR: poses, norms, halves; optimiser, sampling
and model values: resolution, image-size increment, <Pmax>, HEALPix order, local searches, offset range and sigma,
accuracies, the convergence counters) become our refine3d's state, which then runs iteration N+1 with RELION's
perturbation of the sampling (``continue_from_relion.run_with_relion_perturbation``) and the same options; its
half-1 model STAR's FSC is compared with RELION's iteration N+1 (fsc_near_crossing.compare), with the image size and
HEALPix order each program used, so that a state that did not carry over shows.

    python benchmarks/continue_refine_from_relion.py --work /tmp/drift --n 600 --snr 0.3 --seed 1 \\
        --relion_env /tmp/rbcpu/env.sh --its 4-12 [--ours_extra "--no-subpixel_offsets"] --out results/X.json

``--work`` is frame_turn.py's (its simulated set and RELION's run ``relion_s<seed>`` are made there when missing).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import starfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frame_turn  # noqa: E402
from compare_iteration_fsc import iterations  # noqa: E402
from continue_from_relion import general, relion_state, run_with_relion_perturbation  # noqa: E402
from fsc_near_crossing import compare  # noqa: E402

from napari_gpu_relion.compute.schedule import EMState, round_half_away  # noqa: E402
from napari_gpu_relion.io.model_star import params_to_optimiser, state_to_optimiser, write_optimiser_star  # noqa: E402
from napari_gpu_relion.jobs import em, refine3d  # noqa: E402

#: ours' options: frame_turn.py's refine3d, RELION's (frame_turn.RELION) in our names
OPTIONS = ["--ini_high", "30", "--particle_diameter", "150", "--ctf", "--flatten_solvent", "--zero_mask",
           "--healpix_order", "2", "--auto_local_healpix_order", "4", "--offset_range", "5", "--offset_step", "2",
           "--low_resol_join_halves", "40", "--pad", "2"]


def relion_refine_state(stem: str, box: int, apix: float, seed: int) -> EMState:
    """Our EMState after RELION's auto-refine iteration ``stem`` (run_itNNN): continue_from_relion.relion_state's
    values (half 1's model STAR) and the auto-refine's own (local searches, the convergence counters, the changes)."""
    opt, model = general(Path(stem + "_optimiser.star")), general(Path(stem + "_half1_model.star"))
    st = relion_state(stem, box, apix, seed, model_star="_half1_model.star")
    sigma_rot = float(model.get("rlnSigmaPriorRotAngle", 0.0))
    st.local, st.sigma_ang = sigma_rot > 0, max(sigma_rot, 0.0)
    best = float(opt.get("rlnBestResolutionThusFar", 0.0))  # 1/Å
    st.best_res_shell = round_half_away(box * apix * best) if best > 0 else 0
    st.nr_iter_wo_resol_gain = int(opt["rlnNumberOfIterWithoutResolutionGain"])
    st.nr_iter_wo_large_changes = int(opt["rlnNumberOfIterWithoutChangingAssignments"])
    st.smallest_angle_change = float(opt["rlnSmallestChangesOrientations"])
    st.smallest_offset_change = float(opt["rlnSmallestChangesOffsets"])
    st.smallest_class_change = int(opt["rlnSmallestChangesClasses"])
    st.last_angle_change = float(opt["rlnChangesOptimalOrientations"])
    st.last_offset_change_A = float(opt["rlnChangesOptimalOffsets"])
    return st


def our_params(sim: Path, folder: Path, seed: int, extra: list[str]) -> refine3d.Params:
    from napari_gpu_relion.cli import build_parser  # noqa: PLC0415

    args = build_parser().parse_args(["refine3d", "--i", str(sim / "particles.star"), "--ref",
                                      str(sim / "reference.mrc"), "--o", str(folder / "run"), "--random_seed",
                                      str(seed), *OPTIONS, *extra, "--cpu"])
    return refine3d.Params(**{f: getattr(args, f) for f in refine3d.Params.__dataclass_fields__})


def prepare(sim: Path, rdir: Path, it: int, seed: int, extra: list[str], tag: str) -> Path:
    """Our folder with RELION's iteration-``it`` half maps and model STARs (map names made local), data STAR and an
    optimiser STAR our --continue reads; returns that optimiser STAR."""
    stem = f"{rdir / 'run'}_it{it:03d}"
    folder = sim / f"ours_from_{rdir.name}_it{it:03d}{'_' + tag if tag else ''}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for h in (1, 2):
        for m in sorted(rdir.glob(f"run_it{it:03d}_half{h}_class*.mrc")):
            shutil.copy(m, folder / m.name)
        text = Path(f"{stem}_half{h}_model.star").read_text()
        text = re.sub(r"\S*/(run_it\d{3}_half\d_class\d{3}\.mrc)", r"\1", text)
        (folder / f"run_it{it:03d}_half{h}_model.star").write_text(text)
    shutil.copy(f"{stem}_data.star", folder / f"run_it{it:03d}_data.star")
    box = int(np.asarray(starfile.read(sim / "particles.star", always_dict=True)["optics"]["rlnImageSize"])[0])
    apix = frame_turn.so.ANGPIX
    st = relion_refine_state(stem, box, apix, seed)
    p = our_params(sim, folder, seed, extra)
    entries = {"rlnOutputRootName": "run", "rlnModelStarFile": f"run_it{it:03d}_half1_model.star",
               "rlnModelStarFile2": f"run_it{it:03d}_half2_model.star",
               "rlnExperimentalDataStarFile": f"run_it{it:03d}_data.star", "rlnCurrentIteration": it}
    entries.update(params_to_optimiser(p, em.saved_options(refine3d.Params)))
    entries.update(state_to_optimiser(st))
    return write_optimiser_star(folder / f"run_it{it:03d}_optimiser.star", entries)


def used(root: Path, it: int) -> dict:
    """The image size and HEALPix order iteration ``it`` of a run used (its model STAR; RELION's sampling STAR,
    ours' optimiser STAR)."""
    model = general(Path(f"{root}_it{it:03d}_half1_model.star"))
    order = general(Path(f"{root}_it{it:03d}_sampling.star")).get("rlnHealpixOrder")
    if order is None:
        order = general(Path(f"{root}_it{it:03d}_optimiser.star")).get("rlnGpuRelion_order")
    return {"image_size": model.get("rlnCurrentImageSize"), "order": order,
            "resolution_A": model.get("rlnCurrentResolution"), "ave_pmax": model.get("rlnAveragePmax")}


class _Enough(Exception):
    """Raised at the start of the iteration after the one to compare: its files are whole (the job drains its
    writes when it stops), and the final iteration that --auto_iter_max would add is not run."""


def one_iteration(argv: list[str], sim: Path, relion_root: Path, log: Path, last: int) -> None:
    """Our refine3d --continue (in this process, RELION's perturbations) stopped before iteration ``last`` + 1."""
    update = refine3d.Refine3D.update_sampling

    def until_last(self):
        if self.state.iteration > last:
            raise _Enough
        return (yield from update(self))

    refine3d.Refine3D.update_sampling = until_last
    try:
        rc = run_with_relion_perturbation(argv, sim, relion_root, log)
        raise SystemExit(f"ours from iteration {last - 1} ended (rc {rc}) before iteration {last + 1}; see {log}")
    except _Enough:
        pass
    finally:
        refine3d.Refine3D.update_sampling = update


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--snr", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--relion_env", required=True, help="RELION's environment script (build_relion_cpu.sh's env.sh)")
    ap.add_argument("--its", default="3-12", help="RELION's iterations to continue from (A-B or a,b,c)")
    ap.add_argument("--ours_extra", default="", help="more options for ours (e.g. --no-subpixel_offsets)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    sim = frame_turn.simulate(a.work, a.n, a.snr).resolve()
    t0 = time.time()
    rdir, cmd = frame_turn.relion_run(sim, a.seed, a.relion_env)
    relion_s = time.time() - t0
    its = (list(range(int(a.its.split("-")[0]), int(a.its.split("-")[1]) + 1)) if "-" in a.its
           else [int(x) for x in a.its.split(",")])
    extra = a.ours_extra.split()
    rows = []
    for it in its:
        if not Path(f"{rdir / 'run'}_it{it + 1:03d}_half1_model.star").exists():
            continue
        opt = prepare(sim, rdir, it, a.seed, extra, a.tag)
        t1 = time.time()
        one_iteration(["refine3d", "--continue", str(opt), "--cpu"], sim, rdir / "run", opt.parent / "log.txt",
                      it + 1)
        ours_root, relion_root = opt.parent / "run", rdir / "run"
        fsc = [r for r in compare(ours_root, relion_root) if r["iteration"] == it + 1]
        fo, fr = iterations(ours_root)[it + 1]["fsc"], iterations(relion_root)[it + 1]["fsc"]
        row = {"from_iteration": it, "seconds": round(time.time() - t1, 1),
               "ours": used(ours_root, it + 1), "relion": used(relion_root, it + 1), **(fsc[0] if fsc else {}),
               "fsc_ours": [round(float(x), 4) for x in fo], "fsc_relion": [round(float(x), 4) for x in fr]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("fsc_")}), flush=True)
    d = np.array([r["mean_difference_near_crossing"] for r in rows if "mean_difference_near_crossing" in r])
    res = {"gpu": "CPU", "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "n": a.n, "snr": a.snr,
           "seed": a.seed, "relion_command": cmd, "relion_s": round(relion_s, 1), "ours_options": OPTIONS + extra,
           "rows": rows, "mean_difference": float(d.mean()) if d.size else None,
           "sd_difference": float(d.std()) if d.size else None,
           "crossings_differ": int(sum(r.get("crossing_ours") != r.get("crossing_relion") for r in rows))}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

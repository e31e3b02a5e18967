"""Continue a RELION 3D classification with ours from RELION's iteration N (issue 16: where do the two part?).

RELION's run_itNNN files (model STAR: class maps, noise spectrum, class and direction priors; data STAR: the
particles' angles, offsets and classes; optimiser and sampling STARs: resolution, image-size increment,
<Pmax>, offset sigma) become the state of our class3d, which then runs iterations N+1.. with the options of
``vs_relion.py run`` (the same command-line options). Our files go to ``DATA/ours_from_<relion tag>_itNNN``.
The JSON holds our class sizes, purity and changes per iteration (vs_relion.evaluate) and, for iteration N+1,
how many particles ours and RELION put in the same class from the same state (the random perturbation of the
sampling differs: each program draws its own).

Run (GPU machine, after ``vs_relion.py run --job class3d --sides relion ...``):
  python benchmarks/continue_from_relion.py --data /root/p60 --relion relion_class3d_k2s1/run --it 4 --K 2 \
      --iter 25 --seed 1 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion  # noqa: E402

from napari_gpu_relion.compute.relion_random import next_perturbation  # noqa: E402
from napari_gpu_relion.compute.schedule import EMState, round_half_away  # noqa: E402
from napari_gpu_relion.io.model_star import (  # noqa: E402
    params_to_optimiser,
    state_to_optimiser,
    write_optimiser_star,
)
from napari_gpu_relion.jobs import class3d, em  # noqa: E402


def general(path: Path) -> dict:
    return vs_relion._star_general(path)


def our_params(a, data: Path, folder: Path) -> class3d.Params:
    """The Params our class3d gets from ``vs_relion.py run``'s options (the same command line)."""
    argv = vs_relion.our_command(a, "class3d", f"{folder.name}/run")[4:]
    from napari_gpu_relion.cli import build_parser
    args = build_parser().parse_args(["class3d", *argv])
    kw = {f: getattr(args, f) for f in class3d.Params.__dataclass_fields__}
    kw["i"] = data / kw["i"]
    kw["ref"] = data / kw["ref"]
    return class3d.Params(**kw)


def relion_state(stem: str, box: int, apix: float, seed: int, model_star: str = "_model.star") -> EMState:
    """Our EMState after RELION's iteration ``stem`` (run_itNNN): what the next iteration's sizes and searches
    are computed from (``model_star``: the model STAR's suffix, an auto-refine's _half1_model.star)."""
    opt, model = general(Path(stem + "_optimiser.star")), general(Path(stem + model_star))
    smp_path = Path(stem + "_sampling.star")  # RELION writes none for iteration 0: its iteration 1's
    smp = general(smp_path if smp_path.exists() else Path(re.sub(r"_it000$", "_it001", stem) + "_sampling.star"))
    st = EMState()
    st.iteration = int(opt["rlnCurrentIteration"])
    st.order = int(smp["rlnHealpixOrder"])
    st.offset_range = float(smp["rlnOffsetRange"]) / apix
    st.offset_step = float(smp["rlnOffsetStep"]) / apix
    st.sigma_offset_A = float(model["rlnSigmaOffsetsAngst"])
    st.res_shell = round_half_away(box * apix / float(model["rlnCurrentResolution"]))
    st.incr_size = int(opt["rlnIncrementImageSize"])
    st.has_high_fsc_at_limit = bool(int(opt["rlnHasHighFscAtResolLimit"]))
    st.ave_pmax = float(model["rlnAveragePmax"])
    # RELION's sequential runs write no sampling STAR at iteration 0: the perturbation then is the setup draw
    # (unseeded: srand(1)'s, for every seed)
    st.perturb = float(smp["rlnSamplingPerturbInstance"]) if smp_path.exists() else \
        next_perturbation(0.0, seed, 0)
    st.norm_average = float(model["rlnNormCorrectionAverage"])
    st.acc_rot = float(opt["rlnOverallAccuracyRotations"])
    st.acc_trans_A = float(opt["rlnOverallAccuracyTranslationsAngst"])
    return st


def prepare(a, data: Path, relion_root: Path, it: int) -> Path:
    """Our folder with RELION's iteration-``it`` model (maps copied beside it), data STAR and an optimiser STAR
    that our --continue reads; returns that optimiser STAR."""
    stem = f"{relion_root}_it{it:03d}"
    folder = data / f"ours_from_{relion_root.parent.name}_it{it:03d}{'_' + a.tag if a.tag else ''}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    text = Path(stem + "_model.star").read_text()
    for m in sorted(relion_root.parent.glob(f"{relion_root.name}_it{it:03d}_class*.mrc")):
        shutil.copy(m, folder / m.name)
    text = re.sub(r"\S*/(" + re.escape(relion_root.name) + r"_it\d{3}_class\d{3}\.mrc)", r"\1", text)
    (folder / f"run_it{it:03d}_model.star").write_text(text)
    shutil.copy(stem + "_data.star", folder / f"run_it{it:03d}_data.star")
    info = json.loads((data / "data.json").read_text())
    p = our_params(a, data, folder)
    st = relion_state(stem, int(info["box"]), float(info["angpix"]), a.seed)
    if a.image_size:  # the next iteration's images at this size: the increment, not the resolution, is changed
        st.has_high_fsc_at_limit = False
        st.incr_size = a.image_size // 2 - st.res_shell
    entries = {"rlnOutputRootName": "run", "rlnModelStarFile": f"run_it{it:03d}_model.star",
               "rlnExperimentalDataStarFile": f"run_it{it:03d}_data.star", "rlnCurrentIteration": it}
    entries.update(params_to_optimiser(p, em.saved_options(class3d.Params)))
    entries.update(state_to_optimiser(st))
    entries[class3d.SEEDING] = 1
    return write_optimiser_star(folder / f"run_it{it:03d}_optimiser.star", entries)


def run_with_relion_perturbation(argv: list[str], data: Path, relion_root: Path, log: Path,
                                 relion_offset_units: bool = False, adaptive_fraction: float = 0.0,
                                 relion_seeds: bool = False) -> int:
    """Our CLI in this process (cwd ``data``) with schedule.next_perturbation answering RELION's
    rlnSamplingPerturbInstance of the iteration being set up, where RELION wrote one; with
    ``relion_offset_units`` also RELION's offset-prior arithmetic (a diagnostic: never the product's); with
    ``relion_seeds`` the seeding iteration's random class of each particle is RELION's (its iteration-1 class:
    each particle searched only that one), so that a run continued from RELION's iteration 0 can follow it."""
    import contextlib
    import functools
    import os

    from napari_gpu_relion import cli
    from napari_gpu_relion.compute import estep, schedule
    from napari_gpu_relion.jobs import em

    init = class3d.Class3D.__init__
    if relion_seeds:
        first = vs_relion.particles_of(Path(f"{relion_root}_it001_data.star")).set_index("rlnImageName")

        def seeded(self, p):
            init(self, p)
            names = self.ps.table.particles["rlnImageName"].to_numpy()
            self.seed_class = first.loc[names, "rlnClassNumber"].to_numpy(int) - 1

        class3d.Class3D.__init__ = seeded

    ours = schedule.next_perturbation

    def relions(previous: float, seed: int, iteration: int) -> float:
        f = Path(f"{relion_root}_it{iteration:03d}_sampling.star")
        return float(general(f)["rlnSamplingPerturbInstance"]) if f.exists() else ours(previous, seed, iteration)

    schedule.next_perturbation = relions
    log_trans_prior = estep._log_trans_prior
    if relion_offset_units:
        def relion_units(offsets_round_px, trans_px, pixel_size, sigma_A, xp, prior_A):
            """RELION 5.0.1's arithmetic (benchmarks/README.md, "a unit mix in its offset prior"): the sampled
            translation in Å added to the old offset in pixels, the sum then scaled by the pixel size."""
            return log_trans_prior(offsets_round_px, np.asarray(trans_px) * pixel_size, pixel_size, sigma_A, xp,
                                   prior_A)
        estep._log_trans_prior = relion_units
    setup = em.EStepSetup
    if adaptive_fraction:
        em.EStepSetup = functools.partial(setup, adaptive_fraction=adaptive_fraction)
    here = Path.cwd()
    try:
        os.chdir(data)
        with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            return cli.main(argv)
    finally:
        os.chdir(here)
        schedule.next_perturbation = ours
        class3d.Class3D.__init__ = init
        estep._log_trans_prior = log_trans_prior
        em.EStepSetup = setup


def classes_of(path: Path, index) -> np.ndarray:
    return vs_relion.particles_of(path).set_index("rlnImageName").loc[index, "rlnClassNumber"].to_numpy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--relion", required=True, help="RELION's rootname under --data (e.g. relion_class3d_x/run)")
    ap.add_argument("--it", type=int, required=True, help="RELION's iteration to start from")
    ap.add_argument("--data", required=True)
    for k, v in (("--K", 2), ("--iter", 25), ("--seed", 1)):
        ap.add_argument(k, type=int, default=v)
    for k, v in (("--tau2_fudge", 4.0), ("--diameter", 280.0), ("--ini_high", 60.0), ("--offset_range", 5.0),
                 ("--offset_step", 2.0), ("--psi_step", 12.0)):
        ap.add_argument(k, type=float, default=v)
    ap.add_argument("--healpix_order", type=int, default=2)
    ap.add_argument("--auto_local_healpix_order", type=int, default=4)
    ap.add_argument("--ours_extra", default="")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--relion_no_norm", action="store_true",
                    help="as vs_relion.py run's: RELION's run had neither --norm nor --scale; ours runs without both")
    ap.add_argument("--relion_perturbation", action="store_true",
                    help="run in this process with RELION's own random perturbation of the sampling for every "
                         "iteration whose run_itNNN_sampling.star RELION wrote (ours draws its own otherwise), so "
                         "that both programs search the same grid")
    ap.add_argument("--relion_offset_units", action="store_true",
                    help="with --relion_perturbation: RELION 5.0.1's offset-prior arithmetic in our E-step (a "
                         "diagnostic of where the programs part, not the product's prior)")
    ap.add_argument("--relion_seeds", action="store_true",
                    help="with --relion_perturbation and --it 0: each particle's random class of the seeding "
                         "iteration is RELION's (its iteration-1 class)")
    ap.add_argument("--adaptive_fraction", type=float, default=0.0,
                    help="with --relion_perturbation: the E-step's significant fraction (RELION's "
                         "--adaptive_fraction; 0: the default 0.999); higher keeps more coarse samples")
    ap.add_argument("--image_size", type=int, default=0,
                    help="the first continued iteration's image size (pixels; 0: the schedule's, RELION's rule)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if (a.relion_offset_units or a.adaptive_fraction or a.relion_seeds) and not a.relion_perturbation:
        ap.error("--relion_offset_units, --adaptive_fraction and --relion_seeds run in this process: give "
                 "--relion_perturbation")
    data = Path(a.data).resolve()
    relion_root = data / a.relion
    opt = prepare(a, data, relion_root, a.it)
    cmd = [sys.executable, "-m", "napari_gpu_relion.cli", "class3d", "--continue", str(opt),
           *(a.ours_extra.split() if a.ours_extra else []), *(["--cpu"] if a.cpu else [])]
    t0 = time.time()
    if a.relion_perturbation:
        rc = run_with_relion_perturbation(cmd[3:], data, relion_root, opt.parent / "log.txt",
                                          a.relion_offset_units, a.adaptive_fraction, a.relion_seeds)
    else:
        with open(opt.parent / "log.txt", "w") as fh:
            rc = subprocess.run(cmd, cwd=data, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"ours failed (rc {rc})\n" + (opt.parent / "log.txt").read_text()[-3000:])
    info = json.loads((data / "data.json").read_text())
    truth = vs_relion.particles_of(data / "truth.star").set_index("rlnImageName")
    res = {"relion_run": a.relion, "from_iteration": a.it, "command": " ".join(cmd), "wall_s": time.time() - t0,
           "args": vars(a)}
    res.update(vs_relion.evaluate(opt.parent / "run", truth, "class3d", info["angpix"]))
    nxt = a.it + 1
    ours_next, relion_next = opt.parent / f"run_it{nxt:03d}_data.star", Path(f"{relion_root}_it{nxt:03d}_data.star")
    if ours_next.exists() and relion_next.exists():
        co, cr = classes_of(ours_next, truth.index), classes_of(relion_next, truth.index)
        res["next_iteration_same_class"] = float((co == cr).mean())
        res["next_iteration_crosstab_ours_rows_relion_columns"] = pd.crosstab(co, cr).to_dict()
        po, pr = (vs_relion.particles_of(f).set_index("rlnImageName").loc[truth.index]
                  for f in (ours_next, relion_next))
        ang = vs_relion.pose_differences(po, pr)[0]
        res["next_iteration_median_angle_ours_vs_relion_deg"] = float(np.median(ang))
        res["next_iteration_same_class_and_within_5deg"] = float(((co == cr) & (ang < 5.0)).mean())
    print(json.dumps({k: v for k, v in res.items() if k not in ("class_sizes", "args")}), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

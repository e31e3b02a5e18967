"""The standard benchmark's shape (issue 48 item 3): 3D classification K=6 with `--healpix_order 2 --offset_range 5
--offset_step 2 --tau2_fudge 4`, ours and RELION 5 on the same data and the same GPU, one after the other; with
``run --job class2d --K 200`` its 2D classification (``--psi_step 6``).

Two steps, on the GPU machine with RELION built (``. /root/rb/env.sh``, see gpu_env.sh):

1. ``make-data``: as ``vs_relion.py make-data`` (same layout: particles.star, truth.star, ref.mrc, state1/2.mrc,
   data.json; the same angle tables, noise SD and map resampling), but RELION's ``relion_project`` runs in --jobs
   parallel processes on chunks of the angle tables (it is one thread; 20,000 images of 256^2 take minutes alone).
2. ``run``: each side named in --sides with its own iteration count and time limit (a side stopped at its limit
   is judged at its last finished iteration): per-iteration wall times from the run_itNNN files (as vs_relion.py),
   particle-iterations per second per iteration, the ratio per iteration, class purity against the two states.
   RELION in its one-GPU class3d layout (vs_relion.py: ``relion_refine --gpu 0 --j 4 --pool 30
   --dont_combine_weights_via_disc --preread_images``, one process).

  python benchmarks/standard_class3d.py make-data --map .relion_kit/emd_11007_centred192.mrc --map_angpix 0.834 \
      --angpix 1.05 --box 256 --n 20000 --states 2 --snr 0.05 --jobs 16 --out /root/s256
  python benchmarks/standard_class3d.py run --data /root/s256 --sides ours,relion --iters 25,3 --limits 200,200 \
      --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import starfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion as vr  # noqa: E402
from realistic import by_number, gpu_name  # noqa: E402

from napari_gpu_relion.io.mrc import read_mrc, write_mrc  # noqa: E402


def make_data(a) -> None:
    t0 = time.time()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    angpix = a.angpix if a.angpix > 0 else 65 * 5.0 / a.box
    v1 = vr.resampled_map(Path(a.map), a.box, a.map_angpix, angpix)
    maps = [v1] + ([vr.remove_sphere(v1, a.sphere_radius_A / angpix, a.seed)] if a.states == 2 else [])
    rng = np.random.default_rng(a.seed)
    n_per = [a.n // a.states + (1 if s < a.n % a.states else 0) for s in range(a.states)]
    write_mrc(out / "ref.mrc", v1, angpix)
    tables, first, sd = [], 0, None
    for s, (vol, n) in enumerate(zip(maps, n_per, strict=True), start=1):
        write_mrc(out / f"state{s}.mrc", vol, angpix)
        optics, parts = vr.angles_table(n, a.box, angpix, rng, s, first, (a.defocus_min_A, a.defocus_max_A),
                                        a.preferred)
        tables.append((s, optics, parts))
        first += n
        if s == 1:  # the noise SD from the noise-free projections of the first 300 (as vs_relion.py)
            starfile.write({"optics": optics, "particles": parts.iloc[:300]}, out / "probe.star", overwrite=True)
            vr.relion(f"cd {out} && rl $RELION_BIN/relion_project --i state1.mrc --o probe --ang probe.star --ctf "
                      f"--angpix {angpix}", out / "probe.log")
            sd = float(np.sqrt(np.asarray(read_mrc(out / "probe.mrcs").data, np.float64).var() / a.snr))
    t_probe = time.time() - t0
    jobs = []  # (state, chunk, rows)
    for s, optics, parts in tables:
        edges = np.linspace(0, len(parts), max(1, a.jobs // a.states) + 1).astype(int)
        for c in range(len(edges) - 1):
            chunk = parts.iloc[edges[c]:edges[c + 1]]
            if len(chunk):
                starfile.write({"optics": optics, "particles": chunk}, out / f"angles{s}_{c:02d}.star",
                               overwrite=True)
                jobs.append((s, c, chunk))

    def project(job):
        s, c, _ = job
        vr.relion(f"cd {out} && rl $RELION_BIN/relion_project --i state{s}.mrc --o proj{s}_{c:02d} "
                  f"--ang angles{s}_{c:02d}.star --ctf --angpix {angpix} --add_noise --white_noise {sd}",
                  out / f"proj{s}_{c:02d}.log")
        return job

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        done = list(pool.map(project, jobs))
    t_proj = time.time() - t0 - t_probe
    frames, truths = [], []
    for s, c, chunk in done:  # the order of the jobs: state, then chunk
        d = starfile.read(out / f"proj{s}_{c:02d}.star", always_dict=True)
        p = d["particles"].reset_index(drop=True)
        if len(p) != len(chunk):
            sys.exit(f"relion_project wrote {len(p)} of {len(chunk)} images for state {s} chunk {c}")
        frames.append(p)
        t = chunk[[*vr.ANG, "rlnOriginXAngst", "rlnOriginYAngst", "rlnGpuRelionTrueState"]].reset_index(drop=True)
        t.insert(0, "rlnImageName", p["rlnImageName"].to_numpy())
        truths.append(t)
    optics = starfile.read(out / f"proj{done[0][0]}_{done[0][1]:02d}.star", always_dict=True)["optics"]
    parts = pd.concat(frames, ignore_index=True)
    parts = parts[[c for c in parts.columns if c != "rlnGpuRelionTrueState"]].copy()
    if a.zero_offsets:
        parts[["rlnOriginXAngst", "rlnOriginYAngst"]] = 0.0
    starfile.write({"particles": pd.concat(truths, ignore_index=True)}, out / "truth.star", overwrite=True)
    starfile.write({"optics": optics, "particles": parts}, out / "particles.star", overwrite=True)
    info = {"box": a.box, "angpix": angpix, "n": int(a.n), "states": a.states, "snr": a.snr, "noise_sd": sd,
            "sphere_radius_A": a.sphere_radius_A if a.states == 2 else None, "zero_offsets": a.zero_offsets,
            "map": str(a.map), "map_angpix": a.map_angpix, "seed": a.seed,
            "defocus_A": [a.defocus_min_A, a.defocus_max_A], "preferred": a.preferred,
            "made_by": f"relion_project in {len(jobs)} parallel chunks", "made_s": time.time() - t0,
            "projection_s": t_proj}
    (out / "data.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info), flush=True)


def run_side(side: str, a, iters: int, limit: float, data: Path) -> dict:
    ns = argparse.Namespace(job=a.job, K=a.K, iter=iters, tau2_fudge=a.tau2_fudge, psi_step=6.0,
                            diameter=a.diameter, ini_high=a.ini_high, healpix_order=a.healpix_order,
                            auto_local_healpix_order=4, offset_range=a.offset_range, offset_step=a.offset_step,
                            seed=a.seed, relion_ranks=a.relion_ranks, relion_gpu=a.relion_gpu, ours_ranks=1, mpiexec="",
                            relion_j=a.relion_j,
                            relion_pool=a.relion_pool, relion_extra=a.relion_extra, ours_extra=a.ours_extra,
                            relion_no_norm=False, cpu=a.cpu)
    tag = f"{side}_{a.job}_{a.tag}" if a.tag else f"{side}_{a.job}"
    folder = data / tag
    folder.mkdir(exist_ok=True)
    root = f"{tag}/run"
    if side == "relion":
        line = vr.relion_command(ns, a.job, root)
        cmd = ["bash", "-c", f". {os.environ.get('RB', '/root/rb')}/env.sh && cd {data} && {line}"]
    else:
        cmd = vr.our_command(ns, a.job, root)
        line = " ".join(cmd)
    t0 = time.time()
    with open(folder / "log.txt", "w") as fh:
        proc = subprocess.Popen(cmd, cwd=data, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit if limit > 0 else None)
            stopped = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(3)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rc, stopped = None, True
    wall = time.time() - t0
    its, startup = vr.iteration_times(data / root, t0, folder / "note.txt" if side == "ours" else None)
    n = json.loads((data / "data.json").read_text())["n"]
    res = {"command": line, "wall_s": wall, "rc": rc, "stopped_at_limit": stopped, "iterations_asked": iters,
           "iterations_done": len(its), "iteration_s": its, "startup_s": startup,
           "particle_iterations_per_s": [n / t for t in its],
           "schedule": vr.schedule_trace(data / root)}
    if its:
        try:
            res.update(evaluate(data / root, by_number(vr.particles_of(data / "truth.star")), poses=a.job != "class2d"))
        except Exception as exc:  # noqa: BLE001  (a judged figure missing must not lose the timings)
            res["evaluate_error"] = repr(exc)
    return res


def evaluate(root: Path, truth: pd.DataFrame, poses: bool = True) -> dict:
    """Per finished iteration: class purity against the true states, the fraction of particles that changed
    class, the class sizes, and (``poses``: 3D jobs) the median angular error against the true angles
    (vs_relion.evaluate's figures, the particles matched by image number and stack name). A 2D job's in-plane
    angle in its own class's frame has no true value to compare with: its JSON had a meaningless 3D figure until
    the forty-seventh session."""
    states = truth["rlnGpuRelionTrueState"].to_numpy()
    res = {"purity": [], "changed": [], "class_sizes": [], "median_angular_error_deg": []}
    prev = None
    for f in sorted(root.parent.glob(root.name + "_it*_data.star")):
        if re.search(r"_it000_", f.name):
            continue
        d = by_number(vr.particles_of(f)).loc[truth.index]
        c = d["rlnClassNumber"].to_numpy()
        tab = pd.crosstab(c, states)
        res["purity"].append(float(tab.max(axis=1).sum() / len(c)))
        res["class_sizes"].append({int(k): int(v) for k, v in pd.Series(c).value_counts().items()})
        res["changed"].append(None if prev is None else float((c != prev).mean()))
        if poses:
            err, _ = vr.pose_differences(truth, d)
            res["median_angular_error_deg"].append(float(np.median(err)))
        prev = c
    return res


def run(a) -> None:
    data = Path(a.data).resolve()
    info = json.loads((data / "data.json").read_text())
    out = {"gpu": "CPU" if a.cpu else gpu_name(), "host": platform.node(), "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "data": info, "args": vars(a)}
    sides = a.sides.split(",")
    iters = [int(x) for x in str(a.iters).split(",")]
    limits = [float(x) for x in str(a.limits).split(",")]

    def save():
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(out, indent=1))

    for k, side in enumerate(sides):
        r = run_side(side, a, iters[min(k, len(iters) - 1)], limits[min(k, len(limits) - 1)], data)
        out[side] = r
        brief = {x: r[x] for x in ("wall_s", "rc", "stopped_at_limit", "iterations_done", "startup_s")}
        brief["iteration_s"] = [round(t, 2) for t in r["iteration_s"]]
        brief["p_it_per_s"] = [round(t) for t in r["particle_iterations_per_s"]]
        brief["purity"] = r.get("purity")
        print(side, json.dumps(brief), flush=True)
        save()
    if "ours" in out and "relion" in out:
        o, r = out["ours"]["iteration_s"], out["relion"]["iteration_s"]
        m = min(len(o), len(r))
        out["ratio_per_iteration"] = [r[i] / o[i] for i in range(m)]
        print("RELION / ours per iteration:", " ".join(f"{x:.1f}" for x in out["ratio_per_iteration"]))
        save()


def merge(a) -> None:
    """One JSON from a run of each side (two runs in one call, one after the other), with the ratio per
    iteration."""
    parts = [json.loads(Path(j).read_text()) for j in a.json_files]
    out = {k: v for k, v in parts[0].items() if k not in ("ours", "relion")}
    out["runs"] = {}
    for j, p in zip(a.json_files, parts, strict=True):
        for side in ("ours", "relion"):
            if side in p:
                out[side] = p[side]
                out["runs"][side] = {"file": Path(j).name, "date": p["date"], "args": p["args"]}
    out.pop("args", None)
    if "ours" in out and "relion" in out:
        o, r = out["ours"]["iteration_s"], out["relion"]["iteration_s"]
        out["ratio_per_iteration"] = [r[i] / o[i] for i in range(min(len(o), len(r)))]
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out.get(k) for k in ("gpu", "ratio_per_iteration")}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-data")
    m.add_argument("--map", default=str(vr.DEFAULT_MAP))
    m.add_argument("--out", required=True)
    m.add_argument("--box", type=int, default=256)
    m.add_argument("--angpix", type=float, default=0.0)
    m.add_argument("--map_angpix", type=float, default=0.0)
    m.add_argument("--defocus_min_A", type=float, default=8000.0)
    m.add_argument("--defocus_max_A", type=float, default=25000.0)
    m.add_argument("--preferred", type=float, default=0.0)
    m.add_argument("--n", type=int, default=20000)
    m.add_argument("--states", type=int, default=2, choices=(1, 2))
    m.add_argument("--snr", type=float, default=0.05)
    m.add_argument("--sphere_radius_A", type=float, default=30.0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--zero_offsets", action="store_true")
    m.add_argument("--jobs", type=int, default=16, help="relion_project processes at once")
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--sides", default="ours,relion")
    r.add_argument("--iters", default="25,3", help="iterations asked of each side, comma-separated")
    r.add_argument("--limits", default="0", help="seconds after which each side is stopped (0 = never)")
    r.add_argument("--tag", default="")
    r.add_argument("--job", choices=("class3d", "class2d"), default="class3d",
                   help="class2d: the standard benchmark's 2D classification (--K 200, --psi_step 6)")
    r.add_argument("--K", type=int, default=6)
    r.add_argument("--tau2_fudge", type=float, default=4.0)
    r.add_argument("--diameter", type=float, default=180.0)
    r.add_argument("--ini_high", type=float, default=60.0)
    r.add_argument("--healpix_order", type=int, default=2)
    r.add_argument("--offset_range", type=float, default=5.0)
    r.add_argument("--offset_step", type=float, default=2.0)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--relion_ranks", type=int, default=1)
    r.add_argument("--relion_gpu", default="0", help="RELION's --gpu (several GPUs: 0:1:2:3)")
    r.add_argument("--relion_j", type=int, default=4)
    r.add_argument("--relion_pool", type=int, default=30)
    r.add_argument("--relion_extra", default="")
    r.add_argument("--ours_extra", default="")
    r.add_argument("--cpu", action="store_true", help="both on the CPU (a trial of this script)")
    r.add_argument("--out")
    g = sub.add_parser("merge")
    g.add_argument("json_files", nargs="+")
    g.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    {"make-data": make_data, "run": run, "merge": merge}[a.cmd](a)


if __name__ == "__main__":
    main()

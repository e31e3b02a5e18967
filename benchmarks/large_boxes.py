"""Large boxes on one GPU (issue 21): 3D auto-refine of simulated particles at box 512, 800, 1024, by us and
(``--relion``) by RELION 5's GPU build on the same particles with the same options, and (``--postprocess``) our
post-processing of the final half maps at the largest box.

For each box: simulate --n particles (the phantom of jobs/simulate.py scaled so that the particle spans 80 % of
the box, CTF, SNR 0.05; kept in --work and reused by later calls with the same settings), then

* ours: refine3d for --iter iterations and its final joined iteration at the full image size, in this process.
  The memory plan chooses the padding (pad 2, or pad 1 when only that fits, said in its messages). Per
  iteration: the wall time, and from a MemoryTrace (compute/backend.py: a CuPy memory hook on the GPU,
  tracemalloc on the CPU) the most bytes in use during each step (sampling and reference preparation, each
  E-step batch's passes and insertion, the M-step's FSC, half maps / unfiltered half maps / joined map, the
  files), so the JSON says which step sets each iteration's peak, and the pool's size.
* RELION (``--relion``): ``mpirun -n 3 relion_refine_mpi --auto_refine --split_random_halves --gpu 0`` with the
  same options and the padding ours used, stopped after the same --iter iterations by RELION's
  ``--auto_iter_max`` (which ends the run there without a final iteration), then the final joined iteration at
  full size as RELION runs it when a run is continued with ``--continue run_itNNN_optimiser.star
  --force_converge`` (ml_optimiser.cpp: "Force an auto-refinement run to converge immediately upon
  continuation": has_converged, join the halves, all data to Nyquist). Per iteration: seconds from the
  modification times of its run_itNNN files (the final one: the continuation's wall time, its start-up
  included); whether it ran, and if not, the end of its log (out of memory, a killed rank); the most GPU memory
  nvidia-smi saw (RELION's allocator takes most of the free memory at start, so this is not its need) and the
  least available host memory.
* post-processing (``--postprocess``, largest box): jobs/postprocess.py on our final unfiltered half maps with a
  soft spherical mask, on the same device: wall time and peak memory by step.

``--side_limit_s`` stops a side that runs longer (ours between events, RELION by killing its process group) and
``--budget_s`` keeps the whole call under a limit (each side gets what is left); the JSON is written after each
side, so a call stopped later keeps what it measured. Our per-iteration map files are deleted as the run goes and
each box's outputs at its end (``--keep`` keeps them): box 1024 writes 4.3 GB per map.

Run (GPU machine with RELION built from ../shared/relion_gpu, ``. /root/rb/env.sh`` works):
  python benchmarks/large_boxes.py --boxes 512,800,1024 --n 100 --iter 2 --relion --postprocess \
      --side_limit_s 240 --budget_s 580 --out results/large_boxes_h100.json
All of it takes more than one 10-minute call: benchmarks/README.md (large boxes) splits it into three on one
machine (``--data_only``; ours with ``--postprocess``; RELION with ``--skip_ours --ours_from``).
``--dry_run`` prints the data, our command and RELION's commands per box and runs nothing; on the CPU
(``--boxes 48 --n 40 --iter 1 --cpu --postprocess``) it checks that the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from napari_gpu_relion.compute.backend import to_host
from napari_gpu_relion.compute.masks import soft_spherical_mask
from napari_gpu_relion.events import Finished, IterationFinished, Message
from napari_gpu_relion.io.mrc import write_mrc
from napari_gpu_relion.jobs import em, postprocess, refine3d
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime.device import select_backend
from napari_gpu_relion.runtime.memory import GIB, MemoryTrace, choose_padding, free_cached_memory

#: The free memory the plan assumes for --dry_run without --memory_limit (an H100 80GB with CuPy loaded).
DRY_RUN_FREE_GIB = 78.6


# --------------------------------------------------------------------------------------------------------------
# data and commands
# --------------------------------------------------------------------------------------------------------------

def pixel_size(box: int, a) -> float:
    return a.particle_A / (0.8 * box)  # the particle spans 80 % of the box


def data_for(box: int, a, work: Path) -> Path:
    """The simulated particles of this box (made once; reused while the settings are the same)."""
    d = work / f"box{box}" / "data"
    stamp = {"box": box, "n": a.n, "snr": a.snr, "particle_A": a.particle_A}
    f = d / "stamp.json"
    if (d / "particles.star").is_file() and f.is_file() and json.loads(f.read_text()) == stamp:
        return d
    make_sample_data(d, box=box, angpix=pixel_size(box, a), n_particles=a.n, snr=a.snr, diameter=a.particle_A,
                     ini_high=60.0, n_micrographs=0)
    f.write_text(json.dumps(stamp))
    return d


def planned_pad(box: int, budget_bytes: int) -> tuple[int, str | None]:
    """The padding our refine3d chooses for this box with this budget (jobs/em.py plan_job_memory)."""
    plan, note = choose_padding(2, box=box, ndim=3, n_classes=1, n_halves=2, budget_bytes=budget_bytes,
                                rows_per_particle=1)
    return plan.pad, note


def our_command(a, data: Path, root: Path) -> str:
    """The command line of what run_ours does in this process."""
    cmd = (f"python -m napari_gpu_relion.cli refine3d --i {data}/particles.star --ref {data}/reference.mrc "
           f"--o {root} --ctf --particle_diameter {a.particle_A:g} --auto_iter_max {a.iter}")
    if a.memory_limit > 0:
        cmd += f" --memory_limit {a.memory_limit:g}"
    return cmd + (" --cpu" if a.cpu else "")


def relion_commands(a, root: Path, pad: int) -> tuple[str, str]:
    """RELION's two calls, run in the data folder: --iter iterations of auto-refine (RELION's --auto_iter_max
    stops there without a final iteration), then its final joined iteration at full size by continuing with
    --force_converge. The options are ours (jobs/refine3d.py, jobs/em.py defaults) in RELION's names: RELION's
    own defaults differ for --offset_range (6), --low_resol_join_halves (-1) and --random_seed (the time)."""
    same = (f"--i particles.star --ref reference.mrc --ctf --particle_diameter {a.particle_A:g} --ini_high 60 "
            f"--sym C1 --healpix_order 2 --auto_local_healpix_order 4 --offset_range 5 --offset_step 2 "
            f"--offset 10 --low_resol_join_halves 40 --tau2_fudge 1 --pad {pad} --oversampling 1 --random_seed 0")
    how = (f"--gpu 0 --j {a.relion_j} --pool {a.relion_pool} --dont_combine_weights_via_disc --preread_images")
    mpirun = (f"rl mpirun --allow-run-as-root -x LD_LIBRARY_PATH -n {a.relion_ranks} "
              f"$RELION_BIN/relion_refine_mpi")
    first = f"{mpirun} {same} --o {root}/run --auto_refine --split_random_halves --auto_iter_max {a.iter} {how}"
    final = f"{mpirun} --continue {root}/run_it{a.iter:03d}_optimiser.star --o {root}/final --force_converge {how}"
    return first, final


# --------------------------------------------------------------------------------------------------------------
# ours
# --------------------------------------------------------------------------------------------------------------

def _delete_old_iteration_maps(folder: Path, current: int) -> None:
    for f in folder.glob("run_it*.mrc"):
        m = re.match(r"run_it(\d+)_", f.name)
        if m and int(m.group(1)) < current:
            f.unlink(missing_ok=True)


def run_ours(box: int, a, be, data: Path, folder: Path, limit_s: float) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    rows, messages, status = [], [], "finished"
    t0 = t_it = time.time()
    job = None
    with MemoryTrace(be) as trace:
        try:
            p = refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=folder / "run", ctf=True,
                                particle_diameter=a.particle_A, auto_iter_max=a.iter, cpu=a.cpu,
                                memory_limit=a.memory_limit)
            job = refine3d.Refine3D(p)
            gen = em.run(job)
            try:
                for ev in gen:
                    if isinstance(ev, Message):
                        messages.append(ev.text)
                    elif isinstance(ev, IterationFinished):
                        now = time.time()
                        rows.append({"iteration": ev.iteration, "seconds": round(now - t_it, 2),
                                     "resolution_A": ev.resolution_A})
                        t_it = now
                        print(box, "ours", rows[-1], flush=True)
                        if not a.keep:
                            _delete_old_iteration_maps(folder, ev.iteration)
                    elif isinstance(ev, Finished):
                        status = "finished"
                    if limit_s and time.time() - t0 > limit_s:
                        status = f"stopped at the time limit ({limit_s:.0f} s)"
                        break
            finally:
                gen.close()
        except Exception as exc:  # noqa: BLE001 - a box that fails is a result too
            status = f"error: {type(exc).__name__}: {exc}"
    for row in rows:
        steps = trace.by_iteration.get(row["iteration"], {})
        row["peak_GiB"] = max((s["peak_GiB"] for s in steps.values()), default=None)
        row["peak_step"] = max(steps, key=lambda k: steps[k]["peak_GiB"]) if steps else None
        if be.is_gpu and steps:
            row["pool_GiB"] = list(steps.values())[-1].get("pool_GiB")
        row["steps"] = steps
    plan = [m for m in messages if m.startswith("memory plan of the whole run")]
    pad_note = [m for m in messages if "running with --pad 1" in m]
    return {"status": status, "command": our_command(a, data, folder / "run"),
            "pad": None if job is None else int(job.p.pad), "wall_s": round(time.time() - t0, 1),
            "plan": plan[0] if plan else None, "pad_fallback": pad_note[0] if pad_note else None,
            "iterations": rows, "iteration_s": [r["seconds"] for r in rows],
            "timings": [m.strip() for m in messages if " timing: " in m]}


def run_postprocess(box: int, a, be, ours: Path, folder: Path) -> dict:
    """Our post-processing of the final half maps, with a soft spherical mask (radius 0.4 box + 4 px, i.e. the
    particle and a margin; soft edge 0.04 box), on the backend of the refinement."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    apix = pixel_size(box, a)
    mask = folder / "mask.mrc"
    write_mrc(mask, to_host(soft_spherical_mask(box, 0.4 * box + 4, 0.04 * box, 3, be.xp)), apix)
    free_cached_memory(be)
    p = postprocess.Params(i=ours / "run_half1_class001_unfil.mrc", i2=ours / "run_half2_class001_unfil.mrc",
                           o=folder / "PostProcess", mask=mask, adhoc_bfac=-50.0, cpu=a.cpu)
    t0 = time.time()
    status, summary = "finished", None
    with MemoryTrace(be) as trace:
        try:
            for ev in postprocess.run(p):
                if isinstance(ev, Finished):
                    summary = ev.summary
        except Exception as exc:  # noqa: BLE001
            status = f"error: {type(exc).__name__}: {exc}"
        steps = trace.rows
    return {"status": status, "box": box, "wall_s": round(time.time() - t0, 1), "summary": summary,
            "peak_GiB": max((s["peak_GiB"] for s in steps.values()), default=None), "steps": steps,
            "device": be.name}


# --------------------------------------------------------------------------------------------------------------
# RELION
# --------------------------------------------------------------------------------------------------------------

class Sampler:
    """The most GPU memory nvidia-smi reports and the least MemAvailable of the host, once a second."""

    def __init__(self):
        self.gpu_mib, self.host_available_gib, self._stop = 0, None, threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.gpu_mib = max(self.gpu_mib, int(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            try:
                with open("/proc/meminfo") as fh:
                    kb = next(int(x.split()[1]) for x in fh if x.startswith("MemAvailable:"))
                gib = kb / 1024**2
                self.host_available_gib = gib if self.host_available_gib is None else min(self.host_available_gib,
                                                                                          gib)
            except (OSError, StopIteration):
                pass

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=10)


def relion_call(cmd: str, cwd: Path, log: Path, limit_s: float) -> dict:
    """One RELION command through the build's env.sh, in its own process group (killed whole at the limit)."""
    rb = os.environ.get("RB", "/root/rb")
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(["bash", "-c", f". {rb}/env.sh && cd {shlex.quote(str(cwd))} && {cmd}"],
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=limit_s if limit_s > 0 else None)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    return {"rc": rc, "timed_out": timed_out, "wall_s": round(time.time() - t0, 1), "t0": t0}


def relion_error(log: Path, lines: int = 25) -> str:
    """What RELION said when it failed: its ERROR / out-of-memory / killed lines, else the end of its log."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    keys = re.compile(r"error|out of memory|bad_alloc|killed|signal|exited on|abort|cuda", re.IGNORECASE)
    hits = [ln for ln in text if keys.search(ln)]
    return "\n".join((hits[-12:] if hits else []) + ["--- last lines ---"] + text[-lines:])


def relion_iteration_times(root: Path, t_start: float) -> tuple[list[float], float | None]:
    """Seconds of each finished iteration from the latest modification time of its run_itNNN files (iteration
    0's files, where written, end the start-up); and the start-up."""
    ends: dict[int, float] = {}
    for f in root.parent.glob(root.name + "_it*"):
        m = re.match(re.escape(root.name) + r"_it(\d+)_", f.name)
        if m:
            k = int(m.group(1))
            ends[k] = max(ends.get(k, 0.0), f.stat().st_mtime)
    done = sorted(k for k in ends if k == 0 or (root.parent / f"{root.name}_it{k:03d}_optimiser.star").exists())
    prev = ends.get(0, t_start)
    times = []
    for k in done:
        if k:
            times.append(round(ends[k] - prev, 2))
            prev = ends[k]
    return times, (round(ends[0] - t_start, 2) if 0 in ends else None)


def run_relion(box: int, a, data: Path, folder: Path, pad: int, limit_s: float) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    first, final = relion_commands(a, folder, pad)
    out: dict = {"pad": pad, "commands": [first, final]}
    t0 = time.time()
    with Sampler() as sampler:
        r1 = relion_call(first, data, folder / "log_run.txt", limit_s)
        times, startup = relion_iteration_times(folder / "run", r1["t0"])
        out.update(iteration_s=times, startup_s=startup, run=r1)
        ok = r1["rc"] == 0 and len(times) == a.iter
        if not ok:
            out["status"] = "stopped at the time limit" if r1["timed_out"] else f"failed (rc {r1['rc']})"
            out["error"] = relion_error(folder / "log_run.txt")
        else:
            left = limit_s - (time.time() - t0) if limit_s > 0 else 0
            if limit_s > 0 and left < 10:
                out["status"] = "no time left for the final iteration"
            else:
                r2 = relion_call(final, data, folder / "log_final.txt", left)
                out["final"] = r2
                made = Path(f"{folder}/final_model.star").exists()
                if r2["rc"] == 0 and made:
                    out["status"] = "finished"
                    out["final_s"] = r2["wall_s"]
                    out["iteration_s"] = times + [r2["wall_s"]]
                else:
                    out["status"] = ("final iteration stopped at the time limit" if r2["timed_out"]
                                     else f"final iteration failed (rc {r2['rc']})")
                    out["error"] = relion_error(folder / "log_final.txt")
    out["finished_iterations"] = len(out["iteration_s"])
    out["wall_s"] = round(time.time() - t0, 1)
    out["gpu_peak_MiB_nvidia_smi"] = sampler.gpu_mib or None
    out["host_min_available_GiB"] = None if sampler.host_available_gib is None else round(
        sampler.host_available_gib, 1)
    return out


def wait_for_relion(seconds: float) -> str | None:
    """None when RELION's relion_refine_mpi is there (waiting up to ``seconds`` for a build in the background),
    else why not."""
    rb = Path(os.environ.get("RB", "/root/rb"))
    binary = rb / "build" / "bin" / "relion_refine_mpi"
    t0 = time.time()
    while not (binary.is_file() and (rb / "env.sh").is_file()):
        if time.time() - t0 > seconds:
            return f"no RELION build: {binary} or {rb / 'env.sh'} missing (build it with ../shared/relion_gpu)"
        time.sleep(5)
    time.sleep(3)  # the linker may still be writing it
    return None


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------

def _clean(folder: Path) -> None:
    for pattern in ("*.mrc", "*.mrcs"):
        for f in folder.rglob(pattern):
            f.unlink(missing_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--boxes", default="512,800,1024")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--iter", type=int, default=3, help="iterations before the final one (--auto_iter_max)")
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--particle_A", type=float, default=300.0)
    ap.add_argument("--memory_limit", type=float, default=0.0)
    ap.add_argument("--work", default="large_boxes_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--relion", action="store_true", help="also RELION 5 (mpirun relion_refine_mpi --gpu)")
    ap.add_argument("--skip_ours", action="store_true", help="RELION only (with the padding our plan chooses)")
    ap.add_argument("--postprocess", action="store_true", help="post-process our half maps at the largest box")
    ap.add_argument("--relion_ranks", type=int, default=3)
    ap.add_argument("--relion_j", type=int, default=4)
    ap.add_argument("--relion_pool", type=int, default=30)
    ap.add_argument("--wait_relion_s", type=float, default=0.0,
                    help="wait this long for a RELION build running in the background")
    ap.add_argument("--side_limit_s", type=float, default=0.0, help="most seconds per side and box (0: none)")
    ap.add_argument("--budget_s", type=float, default=0.0, help="most seconds for the whole call (0: none)")
    ap.add_argument("--keep", action="store_true", help="keep the maps (default: delete them as the runs go)")
    ap.add_argument("--dry_run", action="store_true", help="print the commands per box and run nothing")
    ap.add_argument("--data_only", action="store_true", help="make (or check) the particles of each box and stop")
    ap.add_argument("--ours_from", default=None,
                    help="a JSON of an earlier call: our per-iteration times beside RELION's (with --skip_ours)")
    a = ap.parse_args(argv)
    boxes = [int(b) for b in a.boxes.split(",")]
    work = Path(a.work).resolve()
    t_call = time.time()
    if a.dry_run:
        budget = int((a.memory_limit or DRY_RUN_FREE_GIB) * GIB)
        for box in boxes:
            pad, note = planned_pad(box, budget)
            d = work / f"box{box}"
            first, final = relion_commands(a, d / "relion", pad)
            print(f"# box {box}: {a.n} particles, {pixel_size(box, a):.4f} Å/px, data in {d / 'data'}; padding "
                  f"{pad} (plan at {budget / GIB:.1f} GiB{': ' + note if note else ''})")
            print(f"ours:   {our_command(a, d / 'data', d / 'ours' / 'run')}")
            print(f"RELION: cd {d / 'data'} && {first}")
            print(f"RELION: cd {d / 'data'} && {final}")
            if a.postprocess and box == max(boxes):
                print(f"post:   python -m napari_gpu_relion.cli postprocess --i {d}/ours/run_half1_class001_unfil.mrc "
                      f"--i2 {d}/ours/run_half2_class001_unfil.mrc --mask {d}/postprocess/mask.mrc --adhoc_bfac -50 "
                      f"--o {d}/postprocess/PostProcess" + (" --cpu" if a.cpu else ""))
        return
    if a.data_only:
        for box in boxes:
            t0 = time.time()
            print(box, data_for(box, a, work), f"{time.time() - t0:.1f} s", flush=True)
        return
    earlier = {}
    if a.ours_from:
        earlier = {b["box"]: b["ours"] for b in json.loads(Path(a.ours_from).read_text())["boxes"] if "ours" in b}
    be = select_backend(cpu=a.cpu)
    out = {"device": be.name, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a),
           "boxes": []}

    def save():
        text = json.dumps(out, indent=1)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(text)
        return text

    def limit() -> float | None:
        """Seconds for the next side: --side_limit_s, at most what --budget_s leaves (None: nothing left)."""
        lim = a.side_limit_s
        if a.budget_s > 0:
            left = a.budget_s - (time.time() - t_call) - 15
            if left < 30:
                return None
            lim = left if lim <= 0 else min(lim, left)
        return lim

    relion_missing = wait_for_relion(a.wait_relion_s) if a.relion else None
    for box in boxes:
        res: dict = {"box": box, "angpix": pixel_size(box, a), "n_particles": a.n}
        out["boxes"].append(res)
        t0 = time.time()
        data = data_for(box, a, work)
        res["data_s"] = round(time.time() - t0, 1)
        folder = work / f"box{box}"
        pad = None
        if not a.skip_ours:
            lim = limit()
            if lim is None:
                res["ours"] = {"status": "skipped: the call's budget is spent"}
            else:
                res["ours"] = run_ours(box, a, be, data, folder / "ours", lim)
                pad = res["ours"]["pad"]
            save()
            if a.postprocess and box == max(boxes) and res["ours"].get("status") == "finished":
                res["postprocess"] = run_postprocess(box, a, be, folder / "ours", folder / "postprocess")
                print(box, "postprocess", {k: v for k, v in res["postprocess"].items() if k != "steps"}, flush=True)
                save()
            if not a.keep:
                _clean(folder / "ours")
                _clean(folder / "postprocess")
        if a.relion:
            if pad is None and earlier.get(box, {}).get("pad"):
                pad = int(earlier[box]["pad"])  # the padding our run of that call used
            if pad is None:
                pad, _ = planned_pad(box, int(a.memory_limit * GIB) if a.memory_limit > 0 else be.free_bytes())
            lim = limit()
            if relion_missing:
                res["relion"] = {"status": relion_missing}
            elif lim is None:
                res["relion"] = {"status": "skipped: the call's budget is spent",
                                 "commands": list(relion_commands(a, folder / "relion", pad))}
            else:
                res["relion"] = run_relion(box, a, data, folder / "relion", pad, lim)
            print(box, "relion", {k: v for k, v in res["relion"].items() if k not in ("commands", "error")},
                  flush=True)
            if res["relion"].get("error"):
                print(res["relion"]["error"], flush=True)
            if not a.keep:
                _clean(folder / "relion")
        if "ours" not in res and box in earlier:
            res["ours_from"] = {"file": a.ours_from, "iteration_s": earlier[box].get("iteration_s"),
                                "pad": earlier[box].get("pad"), "status": earlier[box].get("status")}
        ours_s = (res.get("ours") or res.get("ours_from") or {}).get("iteration_s") or []
        rel_s = res.get("relion", {}).get("iteration_s") or []
        if ours_s and rel_s:
            n = min(len(ours_s), len(rel_s))
            res["relion_over_ours_per_iteration"] = [round(r / o, 2) for r, o in zip(rel_s[:n], ours_s[:n],
                                                                                      strict=True)]
        save()
    print(save())
    sys.stdout.flush()


if __name__ == "__main__":
    main()

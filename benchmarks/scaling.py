"""Benchmark: MPI scaling of an EM job, particle-iterations per second for 1, 2, 4, ... ranks.

Simulates a particle set (benchmarks' usual phantom, CTF, SNR 0.05), then runs the same job under
``mpiexec -n N python -m napari_gpu_relion.cli <job> ...`` for every N, with the same seed, and reports per N:
the wall time of the whole job, the E-step time (the sum of the iterations' "E-step" times that class2d/class3d
print, which include waiting for the slowest rank and the allreduce), particle-iterations per second (particles x
iterations / E-step time; / wall time for refine3d, which prints none), the speed-up over the first N, and the
fraction of particles with the same class and orientation as with the first N (results must not depend on N).

GPUs: ``--gpu 0:1:2:3`` is passed on (RELION's syntax: ranks take the GPUs in turn; ``--gpu 0`` puts every rank
on GPU 0, to see whether ranks sharing one GPU help). Without --gpu and with --cpu the ranks run NumPy
(OMP_NUM_THREADS = cores / ranks each, or --threads).

``--data DIR`` takes a set made elsewhere instead (particles.star and ref.mrc or reference.mrc, e.g. by
``standard_class3d.py make-data``: EMD-11007 through relion_project) and ``--extra`` adds options to every run
(the standard benchmark's ``--tau2_fudge 4 --offset_range 5 --offset_step 2``). Each row names its GPUs
(``gpus``: the distinct devices its ranks use) and its ``speedup`` over the first row (E-step particle-iterations
per second) and ``wall_speedup`` (whole job).

Run: python benchmarks/scaling.py [--job class3d] [--ranks 1,2,4] [--n_particles 2000] [--box 64] [--K 4]
     [--iter 3] [--cpu | --gpu 0:1:2:3] [--data DIR] [--extra "..."] [--mpiexec "PATH [FLAGS]"]
     [--out benchmarks/results/scaling_<hardware>.json]
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
import tempfile
import time
from pathlib import Path

import numpy as np
import starfile

from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.jobs.simulate import make_sample_data

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mpi_library(python: str) -> str:
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return r.stdout.strip() or r.stderr.strip()[-200:]


def reference(data: Path) -> Path:
    """The set's starting map: reference.mrc (our simulator) or ref.mrc (standard_class3d.py, vs_relion.py)."""
    return data / "reference.mrc" if (data / "reference.mrc").is_file() else data / "ref.mrc"


def gpus_used(gpu: str, ranks: int) -> int:
    """Distinct GPUs that ``ranks`` ranks use with ``--gpu`` (ranks take the listed devices in turn)."""
    if not gpu:
        return 0
    return len(set(gpu.replace(",", ":").split(":")[:ranks]))


def job_args(a, data: Path, out: Path) -> list[str]:
    common = ["--i", str(data / "particles.star"), "--o", str(out / "run"), "--ctf", "--random_seed", "1"]
    common += ["--cpu"] if a.cpu else (["--gpu", a.gpu] if a.gpu else [])
    extra = shlex.split(a.extra)  # last: an option given here wins over the defaults below
    if a.job == "class2d":
        return ["class2d", *common, "--K", str(a.K), "--iter", str(a.iter), *extra]
    if a.job == "class3d":
        return ["class3d", *common, "--ref", str(reference(data)), "--K", str(a.K), "--iter", str(a.iter),
                "--healpix_order", str(a.healpix_order), "--ini_high", "40", *extra]
    return ["refine3d", *common, "--ref", str(reference(data)), "--healpix_order", str(a.healpix_order),
            "--auto_iter_max", str(a.iter - 1), *extra]


def result_star(a, out: Path) -> Path:
    return out / ("run_data.star" if a.job == "refine3d" else f"run_it{a.iter:03d}_data.star")


def model_resolution(a, out: Path) -> float | None:
    """rlnCurrentResolution (Å, RELION's SSNR-based current resolution) of the run's last model STAR."""
    path = out / ("run_model.star" if a.job == "refine3d" else f"run_it{a.iter:03d}_model.star")
    if not path.is_file():
        return None
    general = starfile.read(path)["model_general"]
    return float(general["rlnCurrentResolution"])


TIMING = re.compile(r"iteration (\d+) timing: E-step ([\d.]+) s(?: \(waiting for the slowest rank ([\d.]+) s, "
                    r"sums over ranks ([\d.]+) s through ([^)]*\)?)\))?, M-step ([\d.]+) s")
PER_RANK = re.compile(r"iteration (\d+) per rank: particles ([\d /]+), E-step ([\d. /]+) s, waiting ([\d. /]+) s, "
                      r"sent ([\d. /]+) MB(?:, of the E-step reading images ([\d. /]+) s)?")
READING = re.compile(r"iteration (\d+) timing: .*; the E-step read images for ([\d.]+) s")
FILES = re.compile(r"iteration (\d+) timing: .*, files ([\d.]+) s")
MSTEP_PARTS = re.compile(r"iteration (\d+) timing: .*M-step [\d.]+ s \(([^)]*)\)")
STARTUP = re.compile(r"start-up: ([\d.]+) s before iteration \d+(?: \((.*)\))?")
AFTER_LAST = re.compile(r"the last iteration's files were whole ([\d.]+) s after it(?: \(the slowest: (.*)\))?")
DONE = re.compile(r"^\[done in ([\d.]+) s\]", re.M)
BEFORE_JOB = re.compile(r"the process started ([\d.]+) s before the job")


def fixed_costs(stdout: str) -> dict:
    """The time a job spends outside its iterations (what more GPUs do not shorten): from its start to iteration 1
    with the steps of it, waiting for the last files after the last iteration, the job's own time (s)."""
    start, after, done = STARTUP.search(stdout), AFTER_LAST.search(stdout), DONE.search(stdout)
    before = BEFORE_JOB.search(stdout)
    steps = _parts(start[2] or "") if start else {}
    return {"startup_s": float(start[1]) if start else None, "startup_steps_s": steps,
            "files_after_last_iteration_s": float(after[1]) if after else 0.0,
            "slowest_last_files_s": _parts(after[2] or "") if after else {},
            "job_s": float(done[1]) if done else None,
            "process_before_job_s": float(before[1]) if before else None,
            "files_per_iteration_s": [float(m[1]) for m in FILES.findall(stdout)],
            "mstep_parts_per_iteration_s": [_parts(m[1]) for m in MSTEP_PARTS.findall(stdout)]}


def _parts(text: str) -> dict[str, float]:
    """'a 1.20 s, b c 0.30 s' -> {'a': 1.2, 'b c': 0.3}"""
    return {k.strip(): float(v) for k, v in re.findall(r"([^,(]+?) ([\d.]+) s(?:,|$)", text)}


def per_rank(stdout: str) -> list[dict]:
    """Each iteration's E-step, wait and MB sent of every rank (the jobs' 'per rank' lines)."""
    return [{"iteration": int(m[0]), "particles": [int(v) for v in m[1].split(" / ")],
             "estep_s": [float(v) for v in m[2].split(" / ")], "waiting_s": [float(v) for v in m[3].split(" / ")],
             "sent_MB": [float(v) for v in m[4].split(" / ")],
             "reading_s": [float(v) for v in m[5].split(" / ")] if m[5] else None} for m in PER_RANK.findall(stdout)]


def agreement(x: Path, y: Path) -> tuple[float, float]:
    p, q = starfile.read(x)["particles"], starfile.read(y)["particles"]
    A = euler_to_matrix(*(p[c].to_numpy() for c in ANG))
    B = euler_to_matrix(*(q[c].to_numpy() for c in ANG))
    return (float((angular_distance_deg(A, B) < 0.01).mean()),
            float((p["rlnClassNumber"].to_numpy() == q["rlnClassNumber"].to_numpy()).mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=("class2d", "class3d", "refine3d"), default="class3d")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--n_particles", type=int, default=2000)
    ap.add_argument("--box", type=int, default=64)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--iter", type=int, default=3)
    ap.add_argument("--healpix_order", type=int, default=2)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--gpu", default="")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS per rank with --cpu (0: cores / ranks; 1 compares ranks, not threads)")
    ap.add_argument("--mpiexec", default="")
    ap.add_argument("--work", default="", help="folder for the data and runs (default: a temporary one)")
    ap.add_argument("--data", default="", help="a particle set made elsewhere (particles.star, ref.mrc)")
    ap.add_argument("--extra", default="", help="options added to every run of the job")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    mpiexec = shlex.split(a.mpiexec) if a.mpiexec else [
        str(Path(sys.executable).parent / "mpiexec") if (Path(sys.executable).parent / "mpiexec").is_file()
        else shutil.which("mpiexec")]
    if not mpiexec[0]:
        sys.exit("no mpiexec: pip install -e '.[mpi]' or give --mpiexec")
    work = Path(a.work or tempfile.mkdtemp(prefix="scaling_"))
    data = Path(a.data) if a.data else work / "data"
    if a.data:
        a.n_particles = len(starfile.read(data / "particles.star", always_dict=True)["particles"])
    elif not (data / "particles.star").is_file():
        make_sample_data(data, box=a.box, angpix=3.0 * 64 / a.box, n_particles=a.n_particles, snr=0.05,
                         n_micrographs=0)
    ranks = [int(r) for r in a.ranks.split(",")]
    cores = os.cpu_count() or 1
    res = {"job": a.job, "args": vars(a), "host": platform.node(), "cpu": f"{cpu_model()} ({cores} cores)",
           "mpi": mpi_library(sys.executable), "date": time.strftime("%Y-%m-%d"), "results": []}
    first = None
    for i, n in enumerate(ranks):  # a rank count given twice (--ranks 1,1,2): runs of their own, the repeat's
        out = work / (f"{a.job}_n{n}" if ranks.count(n) == 1 else f"{a.job}_n{n}_{i}")  # agreement = float noise
        shutil.rmtree(out, ignore_errors=True)
        env = dict(os.environ)
        threads = a.threads or max(1, cores // n)
        if a.cpu:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [*mpiexec, "-n", str(n), sys.executable, "-m", "napari_gpu_relion.cli", *job_args(a, data, out)]
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.time() - t0
        if r.returncode:
            sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        (out / "log.txt").write_text(r.stdout + r.stderr)
        backend = re.search(r"^\[\w+\] .* on (.*)$", r.stdout, re.M)
        images = re.search(r"^\s*(images .*(?:kept|read from the disk).*)$", r.stdout, re.M)
        timing = {int(m[0]): m for m in TIMING.findall(r.stdout)}  # iteration -> (it, E, wait, sum, path, M)
        estep = sum(float(m[1]) for m in timing.values())
        iters = len(timing) or a.iter
        row = {"ranks": n, "gpus": gpus_used(a.gpu, n), "threads_per_rank": threads if a.cpu else None,
               "backend": backend.group(1) if backend else "?", "wall_s": round(wall, 2),
               "iterations": iters, "estep_s": round(estep, 2),
               "waiting_s": round(sum(float(m[2] or 0) for m in timing.values()), 2),
               "summing_s": round(sum(float(m[3] or 0) for m in timing.values()), 2),
               "summing_per_iteration_s": [float(m[3] or 0) for m in timing.values()],
               "reduction_path": next((m[4] for m in timing.values() if m[4]), None),
               "mstep_s": round(sum(float(m[5]) for m in timing.values()), 2),
               "particle_iterations_per_s": round(a.n_particles * iters / (estep or wall), 1),
               "resolution_A": model_resolution(a, out), "per_rank": per_rank(r.stdout),
               "images": images.group(1).strip() if images else None,
               "estep_per_iteration_s": [float(m[1]) for m in timing.values()],
               "reading_per_iteration_s": [float(m[1]) for m in READING.findall(r.stdout)]} | fixed_costs(r.stdout)
        if first is None:
            first = (out, row)
        else:
            row["speedup"] = round(row["particle_iterations_per_s"] / first[1]["particle_iterations_per_s"], 2)
            row["wall_speedup"] = round(first[1]["wall_s"] / row["wall_s"], 2)
            same_angle, same_class = agreement(result_star(a, first[0]), result_star(a, out))
            row["same_orientation_as_first"], row["same_class_as_first"] = same_angle, same_class
        res["results"].append(row)
        print(json.dumps(row), flush=True)
    res["hardware"] = res["results"][0]["backend"]
    text = json.dumps(res, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

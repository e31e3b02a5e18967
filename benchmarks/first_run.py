"""A user's first job on a machine against the same job run again (issue 46: kernels built ahead).

Each job runs as a fresh process (`napari-gpu-relion <job> ...`), as a user starts it; the script times the whole
process and reads the job's own line "GPU kernels: N modules compiled into CuPy's cache by ...". Steps, in order, each
`name=job args` (args after the job name as on the command line; `{data}` is replaced by --data, `{out}` by a
fresh folder per run):

    python benchmarks/first_run.py --data D --out R.json --step "cold:class3d=class3d --i {data}/particles.star ..."

A step whose name starts with "warmup" runs `napari-gpu-relion warmup` and is timed too. The JSON names the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

LINE = re.compile(r"GPU kernels: (\d+) modules compiled into CuPy's cache")


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
        return out or "no GPU"
    except OSError:
        return "no GPU"


def cache_timeline(since: float) -> list[int]:
    """Modules written into CuPy's disk cache (CUPY_CACHE_DIR) in each whole second after ``since`` (epoch s): when a
    first run's compiles happened, beside its log's steps."""
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    ages = [int(q.stat().st_mtime - since) for q in cache.glob("*.cubin") if q.stat().st_mtime >= since]
    return [ages.count(s) for s in range(max(ages) + 1)] if ages else []


KERNEL = re.compile(r"__global__\s+void\s+(\w+)")


def cache_modules(since: float) -> list[tuple[float, str]]:
    """(seconds after ``since``, first kernel's name) of each module written into CuPy's disk cache since then, in
    time order, where CuPy saved its source (CUPY_CACHE_SAVE_CUDA_SOURCE=1; else []): which modules a first run
    waited for, told by name from the shipped list's order (the compile ahead writes in that order)."""
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    out = []
    for q in cache.glob("*.cubin"):
        t = q.stat().st_mtime
        src = q.with_name(q.name + ".cu")
        if t >= since and src.is_file():
            found = KERNEL.search(src.read_text(errors="replace"))
            out.append((round(t - since, 3), found.group(1) if found else "?"))
    return sorted(out)


def run_step(name: str, args: str, data: str, work: Path, logs: Path | None = None) -> dict:
    out = work / name.replace(":", "_")
    argv = args.replace("{data}", data).replace("{out}", str(out)).split()
    t, since = time.perf_counter(), time.time()
    r = subprocess.run([sys.executable, "-m", "napari_gpu_relion.cli", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t
    text = r.stdout + r.stderr
    if logs is not None:  # the whole log: its start-up line and iterations say where a first run's time went
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{name.replace(':', '_')}.log").write_text(text)
    m = LINE.findall(text)
    row = {"step": name, "argv": argv, "wall_s": round(wall, 2), "returncode": r.returncode,
           "modules_compiled": int(m[-1]) if m else None,
           "kernel_line": next((ln.strip() for ln in text.splitlines() if "GPU kernels:" in ln), None)}
    row["log_lines"] = [ln.strip() for ln in text.splitlines() if "compiled" in ln][-6:]
    # where the start-up went (the process before the job, the initial model, iteration 1's E-step)
    row["startup_lines"] = [ln.strip() for ln in text.splitlines()
                            if "the process started" in ln or "start-up:" in ln or "iteration 1 timing" in ln]
    row["cache_modules_per_s"] = cache_timeline(since)
    if os.environ.get("CUPY_CACHE_SAVE_CUDA_SOURCE") == "1":
        row["cache_modules"] = cache_modules(since)
    if r.returncode:
        row["tail"] = text[-2000:]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", default="/tmp/first_run")
    ap.add_argument("--out", required=True)
    ap.add_argument("--step", action="append", default=[], help="name=args")
    ap.add_argument("--logs", default=None, help="a folder for each step's whole log")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for s in a.step:  # the JSON is written after every step: a call cut short keeps the steps it finished
        rows.append(run_step(s.split("=", 1)[0], s.split("=", 1)[1], a.data, work,
                             Path(a.logs) if a.logs else None))
        Path(a.out).write_text(json.dumps({"gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"), "steps": rows},
                                          indent=1))


if __name__ == "__main__":
    main()

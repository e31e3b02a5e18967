"""Large boxes on one GPU (issue 21): 3D auto-refine of simulated particles at box 512, 800, 1024, with the
memory plan's padding choice, the peak device memory of every iteration and the wall time per iteration.

For each box: simulate --n particles (the phantom of jobs/simulate.py scaled to the box, CTF, SNR 0.05), run
refine3d for --iter iterations (and its final iteration) and record, per iteration, the largest number of bytes
CuPy's arrays held at any moment (a memory hook on the pool) and the pool's size at the iteration's end; the
plan's table and choice (pad 2 or 1) are in the job's messages. Flat peaks from iteration 2 on mean no creeping
memory. Writes JSON naming the device.

Run: python benchmarks/large_boxes.py --boxes 512,800,1024 --n 200 --iter 3 --out benchmarks/results/x.json
(on the CPU, e.g. --boxes 48 --n 40 --iter 1 --cpu, it only checks that the script works).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from napari_gpu_relion.compute.backend import select_backend
from napari_gpu_relion.jobs import refine3d
from napari_gpu_relion.jobs.events import IterationFinished, Message
from napari_gpu_relion.jobs.simulate import make_sample_data


class PeakHook:
    """The most bytes CuPy's memory pool had in use at any moment since the last reset (GPU only)."""

    def __init__(self, cp):
        from cupy.cuda import memory_hook  # noqa: PLC0415

        self.cp, self.peak = cp, 0
        pool = cp.get_default_memory_pool()

        class _Hook(memory_hook.MemoryHook):
            name = "peak"

            def malloc_postprocess(hook, **kw):  # noqa: N805
                self.peak = max(self.peak, pool.used_bytes())

        self.hook = _Hook()

    def reset(self) -> int:
        peak, self.peak = self.peak, self.cp.get_default_memory_pool().used_bytes()
        return peak


def run_box(box: int, a, be, work: Path) -> dict:
    apix = a.particle_A / (0.8 * box)  # the particle spans 80 % of the box
    data = make_sample_data(work / f"box{box}", box=box, angpix=apix, n_particles=a.n, snr=a.snr,
                            diameter=a.particle_A, ini_high=60.0, n_micrographs=0)
    out = work / f"box{box}" / "Refine3D" / "run"
    p = refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=out, ctf=True,
                        particle_diameter=a.particle_A, auto_iter_max=a.iter, cpu=a.cpu,
                        memory_limit=a.memory_limit)
    hook = PeakHook(be.xp) if be.is_gpu else None
    rows, messages, t0 = [], [], time.time()
    t_it = t0
    ctx = hook.hook if hook is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for ev in refine3d.run(p):
            if isinstance(ev, Message):
                messages.append(ev.text)
            elif isinstance(ev, IterationFinished):
                now = time.time()
                row = {"iteration": ev.iteration, "seconds": round(now - t_it, 2), "resolution_A": ev.resolution_A}
                if hook is not None:
                    pool = be.xp.get_default_memory_pool()
                    row |= {"peak_used_GiB": round(hook.reset() / 2**30, 3),
                            "pool_total_GiB": round(pool.total_bytes() / 2**30, 3)}
                rows.append(row)
                t_it = now
                print(box, row, flush=True)
    except Exception as exc:  # noqa: BLE001 - a box that fails is a result too
        return {"box": box, "error": f"{type(exc).__name__}: {exc}", "iterations": rows, "messages": messages}
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    plan = [m for m in messages if m.startswith("memory plan of the whole run")]
    pad_note = [m for m in messages if "running with --pad 1" in m]
    return {"box": box, "angpix": apix, "n_particles": a.n, "wall_s": round(time.time() - t0, 1),
            "plan": plan[0] if plan else None, "pad_fallback": pad_note[0] if pad_note else None,
            "iterations": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--boxes", default="512,800,1024")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--iter", type=int, default=3)
    ap.add_argument("--snr", type=float, default=0.05)
    ap.add_argument("--particle_A", type=float, default=300.0)
    ap.add_argument("--memory_limit", type=float, default=0.0)
    ap.add_argument("--work", default="large_boxes_work")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    be = select_backend(cpu=a.cpu)
    work = Path(a.work)
    results = [run_box(int(b), a, be, work) for b in a.boxes.split(",")]
    out = {"device": be.name, "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "args": vars(a),
           "boxes": results}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

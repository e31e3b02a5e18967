"""Where a whole EM job's time goes, per iteration: wraps the steps of jobs/em.py and compute/estep.py with
synchronised timers (so the sum is slower than a plain run by the synchronisations) and runs any job from its
command line. Timers nest: expectation_batch includes the estep steps below it. Iteration 1 counts from the job's
Started event; the initialisation before it (initial references, noise spectra, memory plan) is initialisation_s.

With --kernel_trace N, iteration N also runs under torch.profiler (CUPTI: every kernel of the process, CuPy's and
cuBLAS's included; needs PyTorch): per timed step, its synchronised wall against the time the GPU was busy in it and
its kernel count, and per kernel name its count and time, so that launch and host overhead is told from GPU work.

With --host_profile N, iteration N runs under cProfile (without the synchronised timers: use --no_timers): the
Python functions that take the job thread's host time (CuPy's per-call overhead included; not the read-ahead or
writer threads), by own time and by cumulative time. Both start when iteration N-1's IterationFinished event
arrives (inside that iteration's file writing, whose tail they see) and stop at iteration N's, which is yielded
while its own writing is under way (the trace then lacks that step's mark); their start-up counts in iteration N.

Run: python benchmarks/profile_job.py [--out results/x.json] [--kernel_trace 1] -- class3d --i particles.star ...
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

from napari_gpu_relion import cli
from napari_gpu_relion.compute import backprojector, estep, expectation, gpu_kernels, maximization
from napari_gpu_relion.events import IterationFinished, Message, Started
from napari_gpu_relion.jobs import em
from napari_gpu_relion.runtime import memory
from napari_gpu_relion.runtime.device import select_backend

TIMES: dict = defaultdict(float)
COUNTS: dict = defaultdict(int)
TRACE: dict = {"on": False}  # True while the kernel trace records: the timers then mark their ranges in it


class _Timer:
    """Adds the synchronised time of its block to TIMES[label] (and one to COUNTS[label])."""

    def __init__(self, be, label):
        self.be, self.label = be, label

    def __enter__(self):
        self.be.synchronize()
        self.mark = None
        if TRACE["on"]:
            import torch  # noqa: PLC0415

            self.mark = torch.profiler.record_function(self.label.strip())
            self.mark.__enter__()
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.be.synchronize()
        TIMES[self.label] += time.perf_counter() - self.t
        COUNTS[self.label] += 1
        if self.mark is not None:
            self.mark.__exit__(None, None, None)


class KernelTrace:
    """torch.profiler around one iteration; ``stop`` writes the Chrome trace and returns its summary."""

    def __init__(self, path: Path):
        self.path, self.prof = path, None

    def start(self):
        import torch  # noqa: PLC0415

        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        TRACE["on"] = True

    def stop(self) -> dict:
        TRACE["on"] = False
        self.prof.__exit__(None, None, None)
        self.prof.export_chrome_trace(str(self.path))
        return summarise_trace(json.loads(self.path.read_text()))


class HostProfile:
    """cProfile around one iteration; ``stop`` returns the top functions by own and by cumulative time."""

    def __init__(self, top: int = 150):
        self.top, self.prof = top, None

    def start(self):
        import cProfile  # noqa: PLC0415

        self.prof = cProfile.Profile()
        self.prof.enable()

    def stop(self) -> dict:
        import pstats  # noqa: PLC0415

        self.prof.disable()
        st = pstats.Stats(self.prof).stats  # (file, line, name) -> (prim. calls, calls, own, cumulative, callers)

        def name(key) -> str:
            f, line, fn = key
            return f"{Path(f).name}:{line}({fn})"

        rows = [{"function": name(k), "calls": int(nc), "own_ms": round(tt * 1e3, 2),
                 "cumulative_ms": round(ct * 1e3, 2)} for k, (_, nc, tt, ct, _) in st.items()]
        # who calls the functions of most own time (CuPy's C functions say nothing of where they are called from)
        heavy = sorted(st.items(), key=lambda kv: -kv[1][2])[:20]
        callers = {name(k): sorted(({"caller": name(c), "calls": int(v[1]), "own_ms": round(v[2] * 1e3, 2)}
                                    for c, v in v5[4].items()), key=lambda r: -r["own_ms"])[:8]
                   for k, v5 in heavy}
        return {"total_own_ms": round(sum(r["own_ms"] for r in rows), 1),
                "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:self.top],
                "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_ms"])[:self.top], "callers": callers}


def _covered(starts, ends):
    """x -> the busy time (µs) before x of the disjoint sorted intervals [starts, ends)."""
    import numpy as np  # noqa: PLC0415

    cum = np.concatenate([[0.0], np.cumsum(ends - starts)])

    def before(x: float) -> float:
        j = int(np.searchsorted(starts, x, side="right"))  # intervals that start at or before x
        if j == 0:
            return 0.0
        return float(cum[j - 1] + max(0.0, min(x, ends[j - 1]) - starts[j - 1]))

    return before


def summarise_trace(trace: dict) -> dict:
    """Per annotated step: wall (ms), GPU busy (ms, the union of its kernels' intervals) and kernel count; per
    kernel name: count and time (ms); the whole window's GPU busy fraction."""
    import numpy as np  # noqa: PLC0415

    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    kern = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    marks = [e for e in ev if e.get("cat") == "user_annotation" and "dur" in e]
    if not kern:
        return {"kernels": 0, "note": "no GPU kernels in the trace"}
    ks = np.array([float(e["ts"]) for e in kern])
    kd = np.array([float(e["dur"]) for e in kern])
    order = np.argsort(ks)
    ks, kd = ks[order], kd[order]
    ke = ks + kd
    # the union of the kernel intervals, as disjoint sorted intervals
    run_end = np.maximum.accumulate(ke)
    new = np.concatenate([[True], ks[1:] > run_end[:-1]])
    starts = ks[new]
    ends = np.maximum.reduceat(ke, np.flatnonzero(new))
    before = _covered(starts, ends)
    steps: dict = {}
    for e in marks:
        a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        s = steps.setdefault(e["name"], {"calls": 0, "wall_ms": 0.0, "gpu_busy_ms": 0.0, "kernels": 0})
        s["calls"] += 1
        s["wall_ms"] += (b - a) / 1e3
        s["gpu_busy_ms"] += float(before(b) - before(a)) / 1e3
        s["kernels"] += int(np.searchsorted(ks, b) - np.searchsorted(ks, a))
    by_name: dict = defaultdict(lambda: [0, 0.0])
    for e in kern:
        by_name[e["name"][:120]][0] += 1
        by_name[e["name"][:120]][1] += float(e["dur"]) / 1e3
    window = float(ke.max() - ks.min())
    return {"kernels": len(kern), "window_ms": window / 1e3, "gpu_busy_ms": float((ends - starts).sum()) / 1e3,
            "kernel_sum_ms": float(kd.sum()) / 1e3,
            "steps": dict(sorted(steps.items(), key=lambda kv: -kv[1]["wall_ms"])),
            "by_kernel": {k: {"count": c, "ms": round(t, 3)}
                          for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:60]}}


def wrap(owner, name, be, label):
    if not hasattr(owner, name) or not TRACE.get("timers", True):
        return
    fn = getattr(owner, name)

    def timed(*a, **k):
        with _Timer(be, label):
            return fn(*a, **k)

    setattr(owner, name, timed)


def wrap_generator(owner, name, be, label):
    """wrap for a generator method (the job's update_sampling, expectation, write): its time until it returns,
    the consumer's handling of what it yields included."""
    fn = getattr(owner, name)
    if not TRACE.get("timers", True):
        return

    def timed(*a, **k):
        with _Timer(be, label):
            return (yield from fn(*a, **k))

    setattr(owner, name, timed)


def _run_once(module, params, a, tracer, host) -> dict:
    """One run of the job: per-iteration walls and steps, the initialisation, the trace and host summaries."""
    TIMES.clear()
    COUNTS.clear()
    trace_summary = host_summary = None
    t0 = time.time()
    per_it, marks, last, last_calls = [], [0.0], dict(), dict()
    started, init_steps = None, {}
    for ev in module.run(params):
        if isinstance(ev, Started):  # the initialisation (references, noise spectra, memory plan) has ended
            started = time.time() - t0
            init_steps = {k: v for k, v in sorted(TIMES.items(), key=lambda kv: -kv[1]) if v > 1e-3}
            last, last_calls = dict(TIMES), dict(COUNTS)  # the initialisation's steps are not iteration 1's
            marks.append(started)
            if tracer and a.kernel_trace == 1:
                tracer.start()
            if host and a.host_profile == 1:
                host.start()
        if isinstance(ev, Message):
            print(" ", ev.text, flush=True)
        if isinstance(ev, IterationFinished):
            marks.append(time.time() - t0)
            snap = {k: v - last.get(k, 0.0) for k, v in TIMES.items() if v - last.get(k, 0.0) > 1e-3}
            calls = {k: v - last_calls.get(k, 0) for k, v in COUNTS.items() if v - last_calls.get(k, 0)}
            last, last_calls = dict(TIMES), dict(COUNTS)
            per_it.append({"iteration": ev.iteration, "wall_s": marks[-1] - marks[-2],
                           "steps_s": dict(sorted(snap.items(), key=lambda kv: -kv[1])), "calls": calls})
            print(f"iteration {ev.iteration}: {per_it[-1]['wall_s']:.1f} s  {ev.summary}", flush=True)
            for k, v in per_it[-1]["steps_s"].items():
                print(f"    {k:<40} {v:8.2f} s  ({COUNTS[k]} calls so far)")
            if host and ev.iteration == a.host_profile:  # first: the trace's export below is not the iteration's
                host_summary = {"iteration": ev.iteration, **host.stop()}
            if tracer and ev.iteration == a.kernel_trace:
                trace_summary = {"iteration": ev.iteration, **tracer.stop()}
                marks[-1] = time.time() - t0  # the trace's export is not the next iteration's
            if tracer and ev.iteration == a.kernel_trace - 1:
                tracer.start()
            if host and ev.iteration == a.host_profile - 1:
                host.start()
    return {"total_s": time.time() - t0, "initialisation_s": started, "initialisation_steps_s": init_steps,
            "iterations": per_it, "kernel_trace": trace_summary, "host_profile": host_summary}


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--fine_chunk_mib", type=int, default=0, help="override the fine-pass chunk budget (MiB)")
    ap.add_argument("--array_code", action="store_true",
                    help="CuPy's array code instead of the fused projection and insertion kernels (to compare)")
    ap.add_argument("--no_read_ahead", action="store_true",
                    help="read the first iteration's images in the job's thread (em.READ_AHEAD off, to compare)")
    ap.add_argument("--shared_factor", type=float, default=0,
                    help="override estep.SHARED_LAYOUT_FACTOR (chunks share rows up to this x their largest count)")
    ap.add_argument("--no_timers", action="store_true",
                    help="no synchronised timers: only the iteration walls (a plain run with the overrides above)")
    ap.add_argument("--kernel_trace", type=int, default=0,
                    help="iteration to run under torch.profiler (CUPTI), summarised per step and per kernel")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the job this many times in one process (later runs into <folder>_repN): iteration 1 "
                         "of a later run has no first-use costs (kernel loading) left; --host_profile profiles each")
    ap.add_argument("--host_profile", type=int, default=0,
                    help="iteration to run under cProfile (host time per Python function; with --no_timers)")
    a = ap.parse_args(argv[:split])
    TRACE["timers"] = not a.no_timers
    host = HostProfile() if a.host_profile else None
    tracer = KernelTrace(Path(a.out or "profile.json").with_suffix(".trace.json")) if a.kernel_trace else None
    gpu_kernels.ENABLED = not a.array_code
    em.READ_AHEAD = not a.no_read_ahead
    if a.shared_factor:
        estep.SHARED_LAYOUT_FACTOR = a.shared_factor
    if a.fine_chunk_mib:  # the plan's chunk is clamped to [CHUNK_BYTES, MAX_FINE_CHUNK_BYTES]: pin both
        memory.CHUNK_BYTES = memory.MAX_FINE_CHUNK_BYTES = a.fine_chunk_mib << 20
    args = cli.build_parser().parse_args(argv[split + 1:])
    module = importlib.import_module(args._module)
    params = module.Params(**{f.name: getattr(args, f.name) for f in fields(module.Params)})
    be = select_backend(cpu=getattr(params, "cpu", False))
    wrap(em.ParticleSet, "images", be, "read images (disk)")
    wrap(em, "prepare_batch", be, "prepare_batch")
    wrap(em, "expectation_batch", be, "expectation_batch")
    for name in ("_coarse_pass", "_significant_rows", "_fine_data", "_fine_chunk", "_add_power_beyond_fine",
                 "_insert_summed_slices", "_best_poses", "_add_mstep_sums"):
        wrap(estep, name, be, f"  {name}")
    for name in ("scores_shared", "scores_gathered", "posterior_weights", "fine_sums", "_project_rows",
                 "particle_terms", "segment_sum"):
        wrap(estep, name, be, f"    {name}")
    wrap(expectation, "significance_threshold", be, "      significance_threshold")
    for name in ("_threshold_by_sort", "_threshold_of_candidates"):
        wrap(expectation, name, be, f"        {name}")
    wrap(estep, "_with_union_slices", be, "    _with_union_slices")
    wrap(estep, "_chunk_layout", be, "    _chunk_layout")
    layout = estep._chunk_layout

    def counted_layout(*a, **k):  # how many fine chunks ran in each layout, and their particles
        lay = layout(*a, **k)
        kind = "shared" if lay.shared else "gathered"
        COUNTS[f"chunks {kind}"] += 1
        COUNTS[f"chunk particles {kind}"] += int(lay.parents.shape[0])
        COUNTS[f"chunk parent columns {kind}"] += int(lay.parents.shape[1])
        return lay

    estep._chunk_layout = counted_layout
    wrap(backprojector.BackProjector, "reconstruct", be, "BackProjector.reconstruct")
    for name in dir(maximization):
        if name.startswith(("reconstruct", "initial_noise", "update_")):
            wrap(maximization, name, be, f"maximization.{name}")
    for name in ("write_data_star", "write_optimiser_star", "write_mrc"):
        wrap(em, name, be, f"write: {name}")
    # every compute/ and io/ function the job module and the EM driver call by name, so that the time outside the
    # E-step (reference preparation, the M-step's steps, file writing) is named too
    for owner in {module, em, importlib.import_module("napari_gpu_relion.jobs.em_classification")}:
        for name, fn in list(vars(owner).items()):
            mod = getattr(fn, "__module__", "") or ""
            if callable(fn) and not isinstance(fn, type) and mod.startswith(("napari_gpu_relion.compute",
                                                                                "napari_gpu_relion.io")):
                if name not in ("expectation_batch", "prepare_batch", "to_host", "memory_mark", "get_array_module"):
                    wrap(owner, name, be, f"{owner.__name__.rsplit('.', 1)[-1]}: {name}")
    # the driver's steps as wholes (jobs/em.py's loop), so that host code between the named calls is counted too
    jobs = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, em.EMJob)]
    for cls in [c for c in jobs if not any(o is not c and issubclass(o, c) for o in jobs)]:  # once per method
        for name in ("update_sampling", "expectation", "write"):
            wrap_generator(cls, name, be, f"job step: {name}")
        for name in ("maximization", "update_resolution"):
            wrap(cls, name, be, f"job step: {name}")
    if a.repeat > 1 and getattr(params, "o", None) is None:
        sys.exit("--repeat needs the job's --o (each run writes into <folder>_repN)")
    runs = []
    for rep in range(max(1, a.repeat)):
        p = params
        if rep:  # the same job again in this process, into <folder>_repN: what the first run paid once shows
            values = {f.name: getattr(params, f.name) for f in fields(module.Params)}
            values["o"] = Path(f"{Path(params.o).parent}_rep{rep}") / Path(params.o).name
            p = module.Params(**values)
        runs.append(_run_once(module, p, a, tracer if not rep else None, HostProfile() if host and rep else host))
    per_it, started, init_steps, total = (runs[0][k] for k in ("iterations", "initialisation_s",
                                                               "initialisation_steps_s", "total_s"))
    trace_summary, host_summary = runs[0]["kernel_trace"], runs[0]["host_profile"]
    res = {"hardware": be.name, "argv": argv, "fused_kernels": gpu_kernels.ENABLED, "read_ahead": em.READ_AHEAD,
           "fine_chunk_bytes": memory.CHUNK_BYTES,
           "shared_layout_factor": estep.SHARED_LAYOUT_FACTOR,
           "timers": TRACE["timers"], "total_s": total, "initialisation_s": started,
           "initialisation_steps_s": init_steps,
           "iterations": per_it, "kernel_trace": trace_summary,
           "host_profile": host_summary,
           "repeats": [{k: r[k] for k in ("total_s", "initialisation_s", "iterations", "host_profile")}
                       for r in runs[1:]]}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

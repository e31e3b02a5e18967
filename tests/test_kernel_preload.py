"""A GPU job's background preparation of its kernels (runtime/kernel_preload.py) with stand-ins for the compile
ahead and the registry: on a machine where the job's kind was never compiled its shipped modules are compiled
while the registry is built and the libraries warmed, each in a thread of its own; the job's log counts the modules
compiled into CuPy's cache while it ran; off means off, the CPU starts nothing, and a job that ends does not wait for
a module being compiled. tests/test_gpu.py runs the real thing."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest

from napari_gpu_relion.compute.backend import gpu_available
from napari_gpu_relion.runtime import cupy_kernels, kernels
from napari_gpu_relion.runtime import kernel_preload as kp

ENTRIES = [{"source": "a", "options": ["--std=c++17"]}, {"source": "b", "options": ["--std=c++17"]}]


class _StandInDevice(contextlib.nullcontext):
    """cupy.cuda.Device's stand-in: a context manager with use()."""

    def use(self):
        pass


def _stand_ins(monkeypatch, tmp_path, compile_s: float = 0.0):
    calls = []
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("CUPY_CACHE_DIR", str(cache))
    monkeypatch.delenv("NAPARI_GPU_RELION_KERNEL_PRELOAD", raising=False)
    monkeypatch.setattr(cupy_kernels, "shipped_entries", lambda job: list(ENTRIES))

    def compile_ahead(entries, device, cache_dir, job=None, workers=None, stop=None, parent_context=None):
        calls.append(("compile", job, len(entries), threading.current_thread().name))
        t = time.perf_counter()
        while time.perf_counter() - t < compile_s and not (stop is not None and stop.is_set()):
            time.sleep(0.01)
        for e in entries:
            (cache_dir / f"{e['source']}.cubin").write_text("x")
        (cache_dir / f"compiled_{job}.done").write_text("x")
        return {"modules": len(entries), "of": len(entries), "seconds": 0.0, "stopped": False}

    monkeypatch.setattr(cupy_kernels, "compile_ahead", compile_ahead)
    monkeypatch.setattr(cupy_kernels, "compiled", lambda job, d: (d / f"compiled_{job}.done").exists())
    monkeypatch.setattr(kernels, "build", lambda device, stop: calls.append(
        ("registry", device, threading.current_thread().name)) or {"ops": 9, "seconds": 0.0})
    monkeypatch.setattr(kp, "_warm_libraries", lambda device, stop: calls.append(
        ("libraries", device, threading.current_thread().name)) or 0.0)
    monkeypatch.setattr(kp, "_make_context", lambda ahead: None)  # no CUDA context made inside the tests
    monkeypatch.setattr(kp, "_workers_allowed", lambda device, job: True)  # nor asked for its compute mode
    return calls, cache


def test_a_new_machine_compiles_the_kinds_modules_first_then_the_job_counts_its_own(monkeypatch, tmp_path):
    calls, cache = _stand_ins(monkeypatch, tmp_path)
    first = kp.Preload("class3d", 0).start()
    first.thread.join()
    assert sorted(c[0] for c in calls) == ["compile", "libraries", "registry"]
    threads = {c[0]: c[-1] for c in calls}
    assert len(set(threads.values())) == 3 and all(t.startswith("kernel preload") for t in threads.values())
    assert next(c for c in calls if c[0] == "compile")[1:3] == ("class3d", 2)
    (cache / "job_own.cubin").write_text("x")  # a module the job compiled at its first use
    first.finish()
    assert first.compiled == 3
    line = first.summary()
    assert "3 modules compiled into CuPy's cache by the compile ahead and the job" in line
    assert "2 of 2 shipped CuPy modules compiled ahead" in line and "9 fused ops built" in line

    calls.clear()
    second = kp.Preload("class3d", 0).start()  # the next job of the kind: nothing left to compile ahead
    second.thread.join()
    assert sorted(c[0] for c in calls) == ["libraries", "registry"]
    second.finish()
    assert second.compiled == 0 and second.summary().startswith("GPU kernels: 0 modules compiled into CuPy's "
                                                                 "cache by the job")
    calls.clear()
    other = kp.Preload("refine3d", 0).start()  # another kind was never compiled here
    other.thread.join()
    assert [c[:2] for c in calls if c[0] == "compile"] == [("compile", "refine3d")]
    other.finish()


def test_the_command_line_starts_the_compile_ahead_and_the_job_takes_it_over(monkeypatch, tmp_path):
    """The command line starts the shipped modules' compile for the job it names, on the GPU --gpu names first,
    before the job's imports; the job's preload takes it over (no second pool) and counts its modules as the job's.
    --cpu, a host's other ranks, a job without shipped modules and preloading off start nothing."""
    calls, cache = _stand_ins(monkeypatch, tmp_path)
    monkeypatch.setattr(cupy_kernels, "shipped_kinds", lambda: {"class3d", "refine3d"})
    monkeypatch.setattr(kp, "NVIDIA_CONTROL", tmp_path)  # stands for the driver's device: a GPU machine
    for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK",
              "PMI_LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    argv = ["class3d", "--i", "p.star", "--gpu", "1:0", "--K", "4"]
    early = kp.start_early("class3d", argv)
    assert early is not None and early.device == 1
    early.thread.join()
    assert [c[:3] for c in calls] == [("compile", "class3d", 2)]
    assert calls[0][3].startswith("kernel compile ahead")
    job = kp.Preload("class3d", 1).start()
    job.thread.join()
    assert sorted(c[0] for c in calls) == ["compile", "libraries", "registry"]  # no second compile
    job.finish()
    assert job.compiled == 2 and "2 of 2 shipped CuPy modules compiled ahead" in job.summary()
    assert kp._early is None  # noqa: SLF001 - handed over

    for args, env in ((["refine3d", "--cpu"], {}), (["refine3d", "--help"], {}),
                      (["refine3d", "--gpu", "0"], {"OMPI_COMM_WORLD_LOCAL_RANK": "1"}),
                      (["postprocess", "--gpu", "0"], {}),
                      (["refine3d", "--gpu", "0"], {"NAPARI_GPU_RELION_KERNEL_PRELOAD": "0"})):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert kp.start_early(args[0], args) is None, (args, env)
        for k in env:
            monkeypatch.delenv(k)
    if sys.platform.startswith("linux"):  # no NVIDIA driver (a CPU machine with CuPy installed): nothing starts
        monkeypatch.setattr(kp, "NVIDIA_CONTROL", tmp_path / "no_such_device")
        assert kp.start_early("class3d", ["class3d", "--gpu", "0"]) is None
        monkeypatch.setattr(kp, "NVIDIA_CONTROL", tmp_path)
    # one the job never takes over (its checks failed) is stopped at the command line's end: a compile that would
    # run for 5 s ends at once
    (tmp_path / "again").mkdir()
    _stand_ins(monkeypatch, tmp_path / "again", compile_s=5.0)
    monkeypatch.setattr(kp, "_make_context", lambda ahead: None)
    started = kp.start_early("class3d", ["class3d", "--gpu", "0"])
    time.sleep(0.3)
    assert started.thread.is_alive()
    kp.stop_early()
    started.thread.join(1.0)
    assert not started.thread.is_alive() and kp._early is None  # noqa: SLF001


def test_the_command_line_reads_abbreviated_options_and_the_first_rank_of_all(monkeypatch, tmp_path):
    """argparse takes unambiguous abbreviations: "--cp" runs on the CPU (nothing starts), "--gp 1" and "--gpu=1"
    name GPU 1. Under a launcher that gives no host rank, only the first rank of all starts the compile; a rank
    that does not compile for the host stops one handed to it."""
    _stand_ins(monkeypatch, tmp_path)
    monkeypatch.setattr(cupy_kernels, "shipped_kinds", lambda: {"class3d"})
    monkeypatch.setattr(kp, "NVIDIA_CONTROL", tmp_path)
    for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK",
              "PMI_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "NAPARI_GPU_RELION_MPI"):
        monkeypatch.delenv(v, raising=False)
    assert kp.start_early("class3d", ["class3d", "--cp"]) is None
    for argv in (["class3d", "--gp", "1"], ["class3d", "--gpu=1"]):
        got = kp.start_early("class3d", argv)
        assert got is not None and got.device == 1, argv
        got.thread.join()
        kp.stop_early()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert kp.start_early("class3d", ["class3d", "--gpu", "0"]) is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    early = kp.start_early("class3d", ["class3d", "--gpu", "0"])
    assert early is not None
    other = kp.Preload("class3d", 0, compile_ahead=False).start()  # a rank that does not compile for the host
    other.thread.join(2.0)
    assert early.stop.is_set() and not other.thread.is_alive()
    other.finish()


def test_off_means_off_and_the_cpu_starts_nothing(monkeypatch, tmp_path):
    calls, _ = _stand_ins(monkeypatch, tmp_path)
    monkeypatch.setenv("NAPARI_GPU_RELION_KERNEL_PRELOAD", "0")
    off = kp.Preload("refine3d", 0).start()
    assert off.thread is None
    off.finish()
    assert off.compiled == 0  # still counted: the measure of what a job compiles
    monkeypatch.delenv("NAPARI_GPU_RELION_KERNEL_PRELOAD")
    cpu = kp.Preload("refine3d", None).start()
    assert cpu.thread is None
    cpu.finish()
    assert cpu.summary() is None and calls == []


def test_a_job_that_ends_does_not_wait_for_a_module_being_compiled(monkeypatch, tmp_path):
    """A cancel at the start of a job on a new machine: the compile ahead may run for seconds; the job's end stops it
    and waits at most FINISH_WAIT_S."""
    calls, _ = _stand_ins(monkeypatch, tmp_path, compile_s=5.0)
    job = kp.Preload("class3d", 0).start()
    time.sleep(0.2)
    t = time.perf_counter()
    job.finish()
    assert time.perf_counter() - t < kp.FINISH_WAIT_S + 0.3
    job.thread.join(2.0)
    assert not job.thread.is_alive() and [c[0] for c in calls if c[0] == "compile"] == ["compile"]


_WARMED_SCANS = """
import json, re, sys
from pathlib import Path
import cupy as cp
import numpy as np
from napari_gpu_relion.compute import expectation
from napari_gpu_relion.runtime import cupy_kernels
from napari_gpu_relion.runtime import kernel_preload as kp
cache, warm = sys.argv[1], sys.argv[2] == "1"
rng = np.random.default_rng(0)

def weights(n):
    logits = rng.normal(0.0, 8.0, (64, n)).astype(np.float32)
    p = cp.asarray(np.exp(logits - logits.max(axis=1, keepdims=True)))
    p /= p.sum(axis=1, keepdims=True)
    return p

small, big = weights(2_000), weights(252_000)
expectation.significance_threshold(small, 0.999)  # every kernel of the threshold, with rows of < 512 candidates
if warm:
    kp.warm_scans(cp)
cp.cuda.Device().synchronize()
before, sources = cupy_kernels.cache_files(cache), set(Path(cache).glob("*.cu"))
k, w = expectation.significance_threshold(big, 0.999)
cp.cuda.Device().synchronize()
after = cupy_kernels.cache_files(cache)
# the kernels compiled by the long rows, by name (CUPY_CACHE_SAVE_CUDA_SOURCE keeps each module's source)
new = [n for q in sorted(set(Path(cache).glob("*.cu")) - sources)
       for n in re.findall(r"__global__\\s+void\\s+(\\w+\\s*\\([^)]*\\))", q.read_text(errors="replace"))]
counts = (big >= np.float32(expectation.candidate_floor(0.999, big.shape[1]))).sum(axis=1)
k_ref, _ = expectation._threshold_by_sort(big, 0.999)
print(json.dumps({"before": before, "after": after, "most": int(counts.max()), "n": big.shape[1],
                  "same": bool((k == k_ref).all()), "new_kernels": new}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
def test_the_warmed_scans_leave_nothing_for_the_significance_threshold_to_compile(tmp_path):
    """Fresh processes with fresh kernel caches (so that no kernel is already loaded): the significance threshold
    run first on rows of few candidates compiles every kernel but the scans of long rows; then on rows whose
    candidates exceed CuPy's scan block (class2d K=200 at box 360) it compiles modules without warm_scans (the
    control: what warm_scans is for) and none after it, and gives the full sort's threshold."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    got = {}
    for warm in ("0", "1"):
        cache = tmp_path / f"cache{warm}"
        env = dict(os.environ, CUPY_CACHE_DIR=str(cache), NAPARI_GPU_RELION_KERNEL_PRELOAD="0",
                   CUPY_CACHE_SAVE_CUDA_SOURCE="1")  # the got below names the kernels the long rows compiled
        r = subprocess.run([sys.executable, "-c", _WARMED_SCANS, str(cache), warm], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        got[warm] = json.loads(r.stdout.strip().splitlines()[-1])
    said = json.dumps(got)  # whole (pytest shortens a dict's repr): the kernels' names and parameters
    for g in got.values():
        assert 512 < g["most"] < g["n"] // 4, said  # the packed-candidates path, rows longer than a scan block
        assert g["same"], said
    assert got["0"]["after"] > got["0"]["before"], said  # long rows need kernels that short ones did not compile
    assert got["1"]["after"] == got["1"]["before"], said


def test_a_kind_whose_compile_ahead_compiled_nothing_is_not_compiled_again_at_once(monkeypatch, tmp_path):
    """After a compile ahead in which no module compiled (cupy_kernels writes its failed marker), the next job of
    the kind builds the registry and warms the libraries but starts no compile workers."""
    calls, cache = _stand_ins(monkeypatch, tmp_path)
    marker = cupy_kernels._failed_marker("class3d", cache)  # noqa: SLF001
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("0 of 2\n")
    job = kp.Preload("class3d", 0).start()
    job.thread.join()
    job.finish()
    assert sorted(c[0] for c in calls) == ["libraries", "registry"]
    marker.unlink()
    again = kp.Preload("class3d", 0).start()  # the control: without the marker it compiles
    again.thread.join()
    again.finish()
    assert [c[0] for c in calls].count("compile") == 1


def test_in_an_exclusive_compute_mode_the_job_keeps_the_gpu(monkeypatch, tmp_path):
    """The command line's GPU start makes the job's context first and tells the compile workers (they wait for it);
    on a GPU in an exclusive compute mode (clusters' EXCLUSIVE_PROCESS), where a worker's context would take the GPU
    from the job, it stops the compile ahead and keeps the kind's off for a while; in the default mode it goes on."""
    import multiprocessing  # noqa: PLC0415
    import types  # noqa: PLC0415

    make_context = kp._make_context  # noqa: SLF001 - the real one (the stand-ins replace it)
    workers_allowed = kp._workers_allowed  # noqa: SLF001
    _, cache = _stand_ins(monkeypatch, tmp_path)
    monkeypatch.setattr(kp, "_workers_allowed", workers_allowed)
    made = []
    for mode in (3, 0):
        fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
            Device=lambda i: _StandInDevice(),  # a context manager with use(), as cupy.cuda.Device
            runtime=types.SimpleNamespace(memGetInfo=lambda: made.append("context") or (1, 1),
                                          getDeviceProperties=lambda d, m=mode: {"computeMode": m})))
        monkeypatch.setitem(sys.modules, "cupy", fake)
        ahead = kp.CompileAhead("class3d", 0)
        ctx = multiprocessing.get_context("spawn")
        ahead.context_made = (ctx.Event(), ctx.Event())
        make_context(ahead)
        assert ahead.context_made[0].is_set() and made.pop() == "context"
        assert ahead.stop.is_set() == ahead.context_made[1].is_set() == (mode == 3), mode
        assert cupy_kernels.failed_recently("class3d", cache) == (mode == 3), mode
        cupy_kernels._failed_marker("class3d", cache).unlink(missing_ok=True)  # noqa: SLF001


def test_a_hosts_other_ranks_make_their_own_gpus_context_at_once(monkeypatch, tmp_path):
    """Issue 47's start-up: a rank other than the host's first compiles nothing but makes the CUDA context of the
    GPU backend_for will give it (--gpu's entries in turn, or the host's GPUs in turn) in a thread at once; a rank
    the launcher gives no host rank makes none (its GPU is not known yet), nor does --cpu."""
    import types  # noqa: PLC0415

    made = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 2)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    from napari_gpu_relion.runtime import device as runtime_device  # noqa: PLC0415

    monkeypatch.setattr(runtime_device, "make_context", lambda cp, device: made.append((cp, device)))
    monkeypatch.setattr(kp, "NVIDIA_CONTROL", tmp_path)
    monkeypatch.setattr(cupy_kernels, "shipped_kinds", lambda: {"class3d"})
    for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK",
              "PMI_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "NAPARI_GPU_RELION_MPI"):
        monkeypatch.delenv(v, raising=False)

    def started(argv, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        before = {t for t in threading.enumerate() if t.name == "GPU start"}
        assert kp.start_early(argv[0], argv) is None
        for t in threading.enumerate():
            if t.name == "GPU start" and t not in before:
                t.join(2.0)
        for k in env:
            monkeypatch.delenv(k)
        got = [d for _, d in made]
        made.clear()
        return got

    ompi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert started(["class3d", "--gpu", "0:1"], **ompi) == [1]
    assert started(["class3d", "--gpu", "3"], PMI_SIZE="3", MPI_LOCALRANKID="2") == []  # no GPU 3: backend_for says so
    assert started(["class3d"], SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3", SLURM_LOCALID="3") == [1]  # no --gpu:
    # the host's 2 GPUs in turn
    assert started(["class3d", "--cpu"], **ompi) == []
    assert started(["select", "--gpu", "0:1"], **ompi) == []  # not a GPU job
    assert started(["class3d", "--gpu", "0:1"], NAPARI_GPU_RELION_MPI="0", **ompi) == []  # MPI off: a single run
    # on --gpu's first GPU, which backend_for chooses; no context on GPU 1
    assert started(["class3d", "--gpu", "0:1"], OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1") == []


def test_a_readers_upload_sets_its_threads_device_once_and_gives_the_host_array_back_out_of_memory(monkeypatch):
    """compute.backend.thread_upload (the reader's copies to the GPU): each calling thread makes the job's device
    its own once, the copy is made on the stream current where thread_upload was called (the job's), and out of GPU
    memory the host array comes back unchanged (the job's thread copies it later) instead of an error."""
    import types  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from napari_gpu_relion.compute import backend  # noqa: PLC0415

    class OutOfMemoryError(Exception):
        pass

    used, streams, full, current = [], [], [False], [None]

    class Stream:
        ptr = 0  # the legacy default stream

        def __enter__(self):
            current[0] = self

        def __exit__(self, *exc):
            current[0] = None

    class Device:
        def __init__(self, d):
            self.d = d

        def use(self):
            used.append((threading.get_ident(), self.d))

    def asarray(a):
        streams.append(current[0])
        if full[0]:
            raise OutOfMemoryError
        return ("on the device", a)

    job_stream = Stream()
    fake = types.SimpleNamespace(asarray=asarray, cuda=types.SimpleNamespace(
        get_current_stream=lambda: job_stream, Device=Device, runtime=types.SimpleNamespace(streamPerThread=2),
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)))
    monkeypatch.setattr(backend, "_try_cupy", lambda: fake)
    upload = backend.thread_upload(3)
    a = np.ones(4)
    got = []
    worker = threading.Thread(target=lambda: got.extend([upload(a), upload(a)]))
    worker.start()
    worker.join()
    assert [g[0] for g in got] == ["on the device", "on the device"]
    assert used == [(worker.ident, 3)]  # once per thread
    assert streams == [job_stream, job_stream]
    full[0] = True
    assert upload(a) is a
    calls = len(streams)
    full[0] = False  # CuPy's retry after freeing its pools is not repeated for every later block
    assert upload(a) is a and len(streams) == calls
    job_stream.ptr = 2  # CuPy's per-thread default stream: a reader's copies would be on its own stream
    assert backend.thread_upload(3) is None

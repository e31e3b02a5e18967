"""The kernel preload (runtime/kernel_preload.py) against a stand-in for CuPy's compile function: what a job loads is
recorded and written down, the next job's thread loads it ahead, and the job is handed the very module the thread
loaded instead of loading it again; anything else goes to CuPy as before. tests/test_gpu.py runs it on real CuPy."""

from __future__ import annotations

import json
import sys
import threading
import types

import pytest

from napari_gpu_relion.runtime import kernel_preload as kp

HEADERS = "// cupy headers\n" * 50
SRC_A = 'extern "C" __global__ void ka(float* x) {}\nextern "C" __global__ void kb(float* x) {}'
SRC_B = 'extern "C" __global__ void kc(float* x) {}'


class FakeModule:
    def __init__(self, source: str):
        self.source, self.fetched = source, []

    def get_function(self, name: str):
        self.fetched.append(name)
        return name


def _fake_cupy(monkeypatch, tmp_path):
    """A fresh process: CuPy's modules with a compile function that records who called it, no preload state."""
    calls = []

    def compile_module(source, options=(), **kw):
        calls.append((source, tuple(options), kw, threading.current_thread().name))
        return FakeModule(source)

    compiler = types.ModuleType("cupy.cuda.compiler")
    compiler._compile_module_with_cache = compile_module
    cuda = types.ModuleType("cupy.cuda")
    cuda.compiler = compiler
    cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0)

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cuda.Device = Device
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    cupy._core = types.SimpleNamespace(core=types.SimpleNamespace(_get_header_source=lambda: HEADERS))
    for name, mod in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.compiler", compiler)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(kp, "_state", {"installed": None, "original": None, "headers": None})
    monkeypatch.setattr(kp, "_used", {})
    monkeypatch.setattr(kp, "_ready", {})
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NAPARI_GPU_RELION_KERNEL_PRELOAD", raising=False)
    return compiler, calls


def _a_process_that_used_a_and_b(monkeypatch, tmp_path, job: str) -> None:
    compiler, _ = _fake_cupy(monkeypatch, tmp_path)
    kp.install()
    compiler._compile_module_with_cache(SRC_A, (), extra_source=HEADERS)
    compiler._compile_module_with_cache(SRC_B, (), extra_source=HEADERS)
    kp.save_manifest(job)


def test_a_job_records_its_modules_and_the_next_is_handed_them_loaded_ahead(monkeypatch, tmp_path):
    compiler, calls = _fake_cupy(monkeypatch, tmp_path)
    first = kp.Preload("class3d", 0).start()
    first.thread.join()
    assert calls == [] and kp._ready == {}  # no manifest yet: nothing loaded ahead
    compiler._compile_module_with_cache(SRC_A, ("-O3",), extra_source=HEADERS, name_expressions=None)
    compiler._compile_module_with_cache(SRC_B, ("-O3",), extra_source="other headers")  # not written down
    compiler._compile_module_with_cache(SRC_B, (), log_stream=object())  # nor this
    assert len(calls) == 3  # every call reached CuPy
    first.finish(save=True)
    modules = json.loads(kp.manifest_path("class3d").read_text())["modules"]
    assert [m["source"] for m in modules] == [SRC_A]
    assert modules[0]["kw"]["extra_source"] == kp._HEADERS  # CuPy's headers are not copied into the manifest

    compiler, calls = _fake_cupy(monkeypatch, tmp_path)  # the next process
    second = kp.Preload("class3d", 0).start()
    second.thread.join()
    assert [(c[0], c[1], c[2]["extra_source"]) for c in calls] == [(SRC_A, ("-O3",), HEADERS)]
    assert calls[0][3].startswith("kernel preload")
    (loaded,) = kp._ready.values()
    assert loaded.fetched == ["ka", "kb"]  # its functions fetched in the thread too
    got = compiler._compile_module_with_cache(SRC_A, ("-O3",), extra_source=HEADERS, name_expressions=None)
    assert got is loaded and len(calls) == 1 and kp._ready == {}  # handed over, not loaded again
    other = compiler._compile_module_with_cache(SRC_A, ("-O2",), extra_source=HEADERS)  # other options: CuPy
    assert other is not loaded and len(calls) == 2 and calls[1][3] == threading.current_thread().name
    compiler._compile_module_with_cache(SRC_B, (), extra_source=HEADERS)
    second.finish(save=True)
    line = second.summary()
    assert "1 modules loaded ahead" in line and "1 of them used; 2 loaded at their first use" in line
    modules = json.loads(kp.manifest_path("class3d").read_text())["modules"]
    assert [(m["source"], m["options"]) for m in modules] == [(SRC_A, ["-O3"]), (SRC_A, ["-O2"]), (SRC_B, [])]
    assert not kp.manifest_path("refine3d").exists()  # one manifest per job kind


def test_modules_already_loaded_in_the_process_are_not_loaded_again_and_off_means_off(monkeypatch, tmp_path):
    _a_process_that_used_a_and_b(monkeypatch, tmp_path, "refine3d")
    compiler, calls = _fake_cupy(monkeypatch, tmp_path)
    kp.install()
    compiler._compile_module_with_cache(SRC_B, (), extra_source=HEADERS)  # this process has it already
    job = kp.Preload("refine3d", 0).start()
    job.thread.join()
    assert [c[0] for c in calls] == [SRC_B, SRC_A]  # the thread loaded only SRC_A
    job.finish(save=False)
    monkeypatch.setenv("NAPARI_GPU_RELION_KERNEL_PRELOAD", "0")
    assert kp.Preload("refine3d", 0).start().thread is None
    monkeypatch.delenv("NAPARI_GPU_RELION_KERNEL_PRELOAD")
    assert kp.Preload("refine3d", None).start().thread is None  # the CPU
    assert calls[-1][0] == SRC_A and len(calls) == 2  # neither started a thread that loaded anything


@pytest.mark.parametrize("text", ["", "{not json", json.dumps({"modules": [{"source": 3}]})])
def test_a_broken_manifest_loads_nothing_and_is_rewritten(monkeypatch, tmp_path, text):
    compiler, calls = _fake_cupy(monkeypatch, tmp_path)
    path = kp.manifest_path("class2d")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    job = kp.Preload("class2d", 0).start()
    job.thread.join()
    assert calls == [] and kp._ready == {}
    compiler._compile_module_with_cache(SRC_B, (), extra_source=HEADERS)
    job.finish(save=True)
    assert [m["source"] for m in json.loads(path.read_text())["modules"]][0] == SRC_B


def test_without_cupy_nothing_is_installed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails
    monkeypatch.setattr(kp, "_state", {"installed": None, "original": None, "headers": None})
    assert kp.install() is False
    assert kp.Preload("class3d", 0).start().thread is None


def test_a_job_that_ends_does_not_wait_for_a_module_being_compiled(monkeypatch, tmp_path):
    """A cancel at the start of a job on a new machine: the thread may be compiling a module (seconds); the job's
    end stops it between modules and waits at most FINISH_WAIT_S, and what the thread loads later is not lost."""
    import time  # noqa: PLC0415

    _a_process_that_used_a_and_b(monkeypatch, tmp_path, "class3d")
    compiler, calls = _fake_cupy(monkeypatch, tmp_path)
    slow = compiler._compile_module_with_cache

    def compiling(source, options=(), **kw):
        time.sleep(2.0)
        return slow(source, options, **kw)

    compiler._compile_module_with_cache = compiling
    job = kp.Preload("class3d", 0).start()
    time.sleep(0.2)  # the thread is compiling SRC_A
    t = time.perf_counter()
    job.finish(save=False)
    assert time.perf_counter() - t < kp.FINISH_WAIT_S + 0.3
    job.thread.join()
    assert [c[0] for c in calls] == [SRC_A]  # stopped before SRC_B

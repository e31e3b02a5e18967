"""The shipped list of CuPy kernel modules (runtime/cupy_kernels.py): well-formed, used only with the CuPy version
it was recorded with, each module with its own options (CuPy adds its include folders itself), compiled through
CuPy's public RawModule, and the marker that says a kind's modules were compiled. tests/test_gpu.py checks on a GPU
that a module compiled so is the one CuPy's own kernel finds in the cache."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from napari_gpu_relion.runtime import cupy_kernels


def _data() -> dict:
    return json.loads(gzip.decompress(cupy_kernels.SHIPPED.read_bytes()))


def test_the_shipped_list_names_each_module_once_with_its_job_kinds():
    data = _data()
    keys = [cupy_kernels.entry_key(e["source"], e["options"]) for e in data["modules"]]
    assert len(keys) == len(set(keys)) > 100
    assert {j for e in data["modules"] for j in e["jobs"]} == {"class3d", "refine3d", "class2d", "ctf_refine"}
    assert all("__global__" in e["source"] for e in data["modules"])
    # no path of the recording machine is left: CuPy's include folders are written against <site-packages>
    assert all(not o.startswith("-I/") for e in data["modules"] for o in e["options"])


def _fake_cupy(monkeypatch, tmp_path, version: str, fail: str | None = None):
    fake = types.ModuleType("cupy")
    fake.__version__ = version
    calls = []

    class RawModule:
        def __init__(self, code: str, options: tuple = ()):
            self.code, self.options = code, options

        def compile(self):
            if fail is not None and fail in self.code:
                raise RuntimeError("does not compile")
            calls.append((self.code, self.options))

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def use(self):
            used.append(self.i)

    used: list[int] = []
    fake.used = used  # the devices made current for good (compute.backend.use_device), in order
    fake.RawModule = RawModule
    fake.cuda = types.SimpleNamespace(Device=Device)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return calls


def test_entries_hold_their_own_options_and_another_version_takes_none(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_ACCELERATORS", "cub")  # the modules of a CuPy with CUB (the next test: without)
    data = _data()
    _fake_cupy(monkeypatch, tmp_path, data["cupy"])
    got = cupy_kernels.shipped_entries("class2d")
    mine = [e for e in data["modules"] if "class2d" in e["jobs"] and not e.get(cupy_kernels.WITHOUT_CUB)]
    assert len(got) == len(mine)
    for g, e in zip(got, mine, strict=True):
        assert g["source"] == e["source"]
        # the recorded options less the include folders, in their order (CuPy puts those around them again)
        assert g["options"] == [o for o in e["options"] if not o.startswith("-I")]
        assert g["options"] and all(not o.startswith("-I") for o in g["options"])
    assert {tuple(g["options"]) for g in got} >= {("--std=c++17",)}
    assert len(cupy_kernels.shipped_entries(None)) == sum(not e.get(cupy_kernels.WITHOUT_CUB) for e in data["modules"])
    _fake_cupy(monkeypatch, tmp_path / "other", "0.0.1")
    assert cupy_kernels.shipped_entries("class2d") == []


def test_cubs_block_reductions_are_left_out_where_cupy_is_set_not_to_use_cub(monkeypatch, tmp_path):
    data = _data()
    _fake_cupy(monkeypatch, tmp_path, data["cupy"])
    cub = [e for e in data["modules"] if "class3d" in e["jobs"] and cupy_kernels.CUB_REDUCTION in e["source"]]
    # modules recorded only without CUB (CuPy's own reductions in CUB's place): compiled ahead only without CUB
    own = [e for e in data["modules"] if "class3d" in e["jobs"] and e.get(cupy_kernels.WITHOUT_CUB)]
    assert own and not any(cupy_kernels.CUB_REDUCTION in e["source"] for e in own)
    monkeypatch.setenv("CUPY_ACCELERATORS", "cub")
    everything = cupy_kernels.shipped_entries("class3d")
    assert len(everything) == sum("class3d" in e["jobs"] for e in data["modules"]) - len(own)
    without = len(everything) - len(cub) + len(own)
    for setting, kept in ((None, len(everything)), ("cub", len(everything)), ("cutensor, cub", len(everything)),
                          ("", without), ("cutensor", without)):
        if setting is None:
            monkeypatch.delenv("CUPY_ACCELERATORS", raising=False)
        else:
            monkeypatch.setenv("CUPY_ACCELERATORS", setting)
        got = cupy_kernels.shipped_entries("class3d")
        assert len(got) == kept, setting
        assert any(cupy_kernels.CUB_REDUCTION in e["source"] for e in got) == (kept == len(everything))
        assert any(e["source"] == own[0]["source"] for e in got) == (kept == without)
    assert len(cub) >= 20
    # a cache compiled without them is not taken for one compiled with them
    monkeypatch.setenv("CUPY_ACCELERATORS", "")
    without = cupy_kernels._marker("class3d", tmp_path)  # noqa: SLF001
    monkeypatch.delenv("CUPY_ACCELERATORS")
    assert without != cupy_kernels._marker("class3d", tmp_path)  # noqa: SLF001


def test_a_worker_compiles_each_module_as_a_raw_module_and_counts_what_compiled(monkeypatch, tmp_path):
    calls = _fake_cupy(monkeypatch, tmp_path, "x", fail="broken")
    entries = [{"source": "a __global__", "options": ["--std=c++17"]},
               {"source": "broken __global__", "options": []},
               {"source": "b __global__", "options": ["-DFIRST_PASS=1", "--std=c++17"]}]
    assert cupy_kernels._compile_task(entries, 1) == 2
    assert calls == [("a __global__", ("--std=c++17",)), ("b __global__", ("-DFIRST_PASS=1", "--std=c++17"))]
    # the worker's device set for good, not in a block whose end would make device 0 current (and its context)
    assert sys.modules["cupy"].used == [1]


def test_the_cache_count_counts_compiled_modules_only(tmp_path):
    assert cupy_kernels.cache_files(tmp_path / "none") == 0
    for name in ("a.cubin", "b.cubin", "b.cubin.cu", "tmpx"):
        (tmp_path / name).write_text("x")
    (tmp_path / "napari_gpu_relion_preload").mkdir()
    assert cupy_kernels.cache_files(tmp_path) == 2


def test_the_modules_a_job_compiled_are_named_by_their_kernels_oldest_first(tmp_path):
    """new_module_names reads each new module's kernel entries (ELF sections ".text.<name>") from CuPy's cache files
    written at or after the time given, oldest first; older files and files of other kinds are left out."""
    import os  # noqa: PLC0415

    def module(name: str, entries: list[str], mtime: float) -> None:
        body = b"\x7fELF\x00" + b"".join(b"\x00.text." + e.encode() + b"\x00.nv.info." + e.encode() for e in entries)
        (tmp_path / name).write_bytes(b"0123abcd" + body)
        os.utime(tmp_path / name, (mtime, mtime))

    module("old.cubin", ["cupy_add__float32"], 1000.0)
    module("b.cubin", ["ngr_significant", "ngr_finish_scores"], 2002.0)
    module("a.cubin", ["cupy_bsum_shfl"], 2001.0)
    (tmp_path / "a.cubin.cu").write_text("extern C __global__ void cupy_bsum_shfl()")
    os.utime(tmp_path / "a.cubin.cu", (3000.0, 3000.0))
    assert cupy_kernels.new_module_names(tmp_path, 2000.0) == ["cupy_bsum_shfl", "ngr_significant+ngr_finish_scores"]
    assert cupy_kernels.new_module_names(tmp_path / "none", 0.0) == []


def test_the_marker_of_a_kind_is_written_when_its_modules_were_handled(tmp_path):
    assert not cupy_kernels.compiled("class3d", tmp_path)
    report = cupy_kernels.compile_ahead([], 0, tmp_path, "class3d")
    assert report["modules"] == report["of"] == 0 and not report["stopped"]
    assert cupy_kernels.compiled("class3d", tmp_path) and not cupy_kernels.compiled("refine3d", tmp_path)
    cupy_kernels.compile_ahead([], 0, tmp_path, None)  # warmup: every kind
    assert cupy_kernels.compiled("refine3d", tmp_path)


def test_no_marker_when_nothing_compiled(tmp_path):
    """A worker that compiles nothing (a spawned process: without CuPy, as on a machine without a GPU, or with a
    source that does not compile) leaves no marker, so that the next job tries again instead of taking the kind as
    compiled."""
    report = cupy_kernels.compile_ahead([{"source": "not CUDA", "options": []}], 0, tmp_path, "class2d", workers=1)
    assert report["modules"] == 0 and report["of"] == 1 and not report["stopped"]
    assert not cupy_kernels.compiled("class2d", tmp_path)
    # ... but not at once: the next jobs of the kind skip it for FAILED_RETRY_S, other kinds do not
    assert cupy_kernels.failed_recently("class2d", tmp_path) and not cupy_kernels.failed_recently("class3d", tmp_path)
    old = time.time() - cupy_kernels.FAILED_RETRY_S - 1
    marker = cupy_kernels._failed_marker("class2d", tmp_path)  # noqa: SLF001
    os.utime(marker, (old, old))
    assert not cupy_kernels.failed_recently("class2d", tmp_path)


@pytest.mark.parametrize(("name", "default", "chosen"), [("CUPY_ACCELERATORS", "", ("cub", "cub,cutensor")),
                                                          ("CUPY_NVRTC_USE_PCH", "1", ("0", "1"))])
def test_the_package_sets_cupys_compile_settings_unless_the_user_chose(name, default, chosen):
    """Importing the package (before CuPy) makes CuPy's reductions go without CUB (an empty CUPY_ACCELERATORS) and
    NVRTC use precompiled headers (CUPY_NVRTC_USE_PCH=1); a value the user set is kept."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = f"import os, napari_gpu_relion; print(repr(os.environ.get({name!r})))"
    for given, want in ((None, repr(default)), *((c, repr(c)) for c in chosen)):
        env = {k: v for k, v in os.environ.items() if k != name}
        if given is not None:
            env[name] = given
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, given


def test_the_cupy_version_is_read_without_importing_cupy(monkeypatch, tmp_path):
    """The command line's compile ahead reads CuPy's version from its _version.py: importing CuPy takes most of a
    second before the worker processes could start. A package whose import would fail shows it is not imported."""
    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "_version.py").write_text("__version__ = '14.2.0'\n")
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cupy_kernels.installed_cupy_version() == "14.2.0"
    assert "cupy" not in sys.modules
    (pkg / "_version.py").write_text("# no version here\n")
    assert cupy_kernels.installed_cupy_version() is None
    (pkg / "_version.py").write_text('__version__ = "14.2.0"\n')
    # being imported in another thread (the command line's GPU start): in sys.modules, its version not set yet
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    assert cupy_kernels.installed_cupy_version() == "14.2.0"
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__="9.9.9"))  # imported: its own
    assert cupy_kernels.installed_cupy_version() == "9.9.9"


def test_the_worker_count_follows_the_cores_unless_set(monkeypatch):
    monkeypatch.delenv("NAPARI_GPU_RELION_COMPILE_WORKERS", raising=False)
    for cores, want in ((1, 1), (2, 1), (8, 6), (16, 12), (64, 12)):
        monkeypatch.setattr(cupy_kernels.os, "cpu_count", lambda c=cores: c)
        assert cupy_kernels.default_workers() == want
    monkeypatch.setenv("NAPARI_GPU_RELION_COMPILE_WORKERS", "4")
    assert cupy_kernels.default_workers() == 4
    monkeypatch.setenv("NAPARI_GPU_RELION_COMPILE_WORKERS", "no")  # not a number: the cores decide
    assert cupy_kernels.default_workers() == 12


_FAKE_CUPY = """
import contextlib, os, time, types
__version__ = "fake"


class RawModule:
    def __init__(self, code, options=()):
        self.code = code

    def compile(self):
        with open(os.environ["FAKE_CUPY_LOG"], "a") as fh:
            fh.write(f"{os.getpid()} {self.code}\\n")
        time.sleep(float(os.environ.get("FAKE_CUPY_SECONDS", "0.3")))


class _Device(contextlib.nullcontext):
    def use(self):
        pass


cuda = types.SimpleNamespace(Device=lambda i: _Device())
"""


def _fake_cupy_for_workers(monkeypatch, tmp_path) -> Path:
    """A cupy package whose compile logs the module and sleeps, first on the spawned workers' path."""
    pkg = tmp_path / "fake" / "cupy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_FAKE_CUPY)
    log = tmp_path / "compiles.log"
    log.write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_CUPY_LOG", str(log))
    return log


def _lines(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.strip()]


_STOPPED = """
import json, os, sys, threading, time
from pathlib import Path
from napari_gpu_relion.runtime import cupy_kernels
log = Path(os.environ["FAKE_CUPY_LOG"])
lines = lambda: len([ln for ln in log.read_text().splitlines() if ln.strip()])
entries = [{"source": f"m{i}", "options": []} for i in range(60)]  # 9 s of compiles in 2 workers
stop, got = threading.Event(), {}
t = threading.Thread(target=lambda: got.update(cupy_kernels.compile_ahead(entries, 0, Path(sys.argv[1]), "class3d",
                                                                          workers=2, stop=stop)))
t.start()
deadline = time.monotonic() + 60
while lines() < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
started = lines()
stop.set()
t0 = time.monotonic()
t.join(5.0)
returned_s = time.monotonic() - t0
time.sleep(2.0)  # what the workers had in hand (a task of 2 modules each, and the queue's next) ends
settled = lines()
time.sleep(1.5)
print(json.dumps({"started": started, "returned_s": returned_s, "stopped": got.get("stopped"), "settled": settled,
                  "later": lines(), "marker": cupy_kernels.compiled("class3d", Path(sys.argv[1]))}))
"""


@pytest.mark.slow
def test_a_stopped_compile_ahead_cancels_what_it_had_not_started(monkeypatch, tmp_path):
    """Real worker processes (a stand-in CuPy whose compile takes 0.3 s): stopped after its first modules, the
    compile returns at once and its workers compile nothing more than what they had in hand, instead of the whole
    list (which, uncancelled, also held the interpreter's exit: a job that failed its checks waited for it)."""
    _fake_cupy_for_workers(monkeypatch, tmp_path)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _STOPPED, str(tmp_path / "cache")], capture_output=True, text=True,
                       timeout=120)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["started"] >= 2, got  # the workers compiled (else the stand-in was not theirs)
    assert got["stopped"] and got["returned_s"] < 1.0, got
    assert got["later"] == got["settled"] < 20 and not got["marker"], got
    # the interpreter's exit did not wait for the list: the script sleeps 3.5 s after the stop, the whole list
    # takes 9 s in the two workers
    assert wall < 8.0, (wall, got)


_ORPHAN = """
import os, sys, threading, time
from pathlib import Path
from napari_gpu_relion.runtime import cupy_kernels
entries = [{"source": f"m{i}", "options": []} for i in range(40)]
threading.Thread(target=cupy_kernels.compile_ahead, args=(entries, 0, Path(sys.argv[1])), kwargs={"workers": 2},
                 daemon=True).start()
log = Path(os.environ["FAKE_CUPY_LOG"])
while len([ln for ln in log.read_text().splitlines() if ln.strip()]) < 2:
    time.sleep(0.05)
os._exit(0)  # as an MPI rank's abort does: no clean-up of the pool
"""


def test_workers_end_with_the_process_that_started_them(monkeypatch, tmp_path):
    """A process that ends by os._exit (an MPI rank's abort) while its compile ahead runs: its workers, which would
    otherwise wait on the pool's queue for ever holding a CUDA context each, exit within seconds."""
    log = _fake_cupy_for_workers(monkeypatch, tmp_path)
    monkeypatch.setenv("FAKE_CUPY_SECONDS", "5")  # a worker is inside a compile when its parent goes
    r = subprocess.run([sys.executable, "-c", _ORPHAN, str(tmp_path / "cache")], timeout=60)
    assert r.returncode == 0
    pids = {int(ln.split()[0]) for ln in _lines(log)}
    assert pids

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), f"workers {pids} outlived their parent"


_WAITING = """
import json, multiprocessing, os, sys, threading, time
from pathlib import Path
from napari_gpu_relion.runtime import cupy_kernels
log = Path(os.environ["FAKE_CUPY_LOG"])
lines = lambda: len([ln for ln in log.read_text().splitlines() if ln.strip()])
ctx = multiprocessing.get_context("spawn")
made, abort = ctx.Event(), ctx.Event()
entries = [{"source": f"m{i}", "options": []} for i in range(4)]
got = {}
t = threading.Thread(target=lambda: got.update(cupy_kernels.compile_ahead(
    entries, 0, Path(sys.argv[1]), "class3d", workers=2, parent_context=(made, abort))))
t.start()
time.sleep(4.0)  # the workers are up long before this (about a second), and wait
before = lines()
if sys.argv[2] == "abort":  # the parent's context failed, or the GPU is exclusive: the workers compile nothing
    abort.set()
made.set()
t0 = time.monotonic()
t.join(30)
print(json.dumps({"before": before, "after": lines(), "joined_s": time.monotonic() - t0,
                  "modules": got.get("modules")}))
"""


@pytest.mark.slow
def test_the_workers_wait_for_their_parents_context(monkeypatch, tmp_path):
    """Real worker processes (the stand-in CuPy): with the parent's "made" event unset none compiles (so none makes
    a CUDA context before the job's); once it is set all the modules compile at once; with "abort" set too, none."""
    log = _fake_cupy_for_workers(monkeypatch, tmp_path)
    monkeypatch.setenv("FAKE_CUPY_SECONDS", "0.05")
    for how, want in (("go", 4), ("abort", 0)):
        log.write_text("")
        r = subprocess.run([sys.executable, "-c", _WAITING, str(tmp_path / f"cache_{how}"), how],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["before"] == 0 and got["after"] == got["modules"] == want, (how, got)
        assert got["joined_s"] < 5.0, (how, got)  # not the workers' own time-out (CONTEXT_WAIT_S)

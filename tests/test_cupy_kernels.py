"""The shipped list of CuPy kernel modules (runtime/cupy_kernels.py): well-formed, used only with the CuPy version
it was recorded with, its paths made this CuPy's, and the marker that says a kind's modules were compiled."""

from __future__ import annotations

import gzip
import json
import sys
import types

from napari_gpu_relion.runtime import cupy_kernels


def _data() -> dict:
    return json.loads(gzip.decompress(cupy_kernels.SHIPPED.read_bytes()))


def test_the_shipped_list_names_each_module_once_with_its_job_kinds():
    data = _data()
    keys = [json.dumps([e["source"], e["options"], sorted(e["kw"].items())]) for e in data["modules"]]
    assert len(keys) == len(set(keys)) > 100
    assert {j for e in data["modules"] for j in e["jobs"]} == {"class3d", "refine3d", "class2d"}
    assert all("__global__" in e["source"] and e["kw"].get("extra_source") == "<cupy headers>" for e in data["modules"])
    # no path of the recording machine is left: CuPy's include folders are written against <site-packages>
    assert all(not o.startswith("-I/") for e in data["modules"] for o in e["options"])


def _fake_cupy(monkeypatch, tmp_path, version: str):
    fake = types.ModuleType("cupy")
    fake.__version__ = version
    (tmp_path / "site" / "cupy").mkdir(parents=True)
    fake.__file__ = str(tmp_path / "site" / "cupy" / "__init__.py")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return tmp_path / "site"


def test_entries_take_this_cupys_paths_and_another_version_takes_none(monkeypatch, tmp_path):
    data = _data()
    site = _fake_cupy(monkeypatch, tmp_path, data["cupy"])
    got = cupy_kernels.shipped_entries("class2d")
    assert len(got) == sum("class2d" in e["jobs"] for e in data["modules"])
    includes = [o for e in got for o in e["options"] if o.startswith("-I")]
    assert includes and all(o.startswith(f"-I{site.resolve()}/") for o in includes)
    assert len(cupy_kernels.shipped_entries(None)) == len(data["modules"])
    _fake_cupy(monkeypatch, tmp_path / "other", "0.0.1")
    assert cupy_kernels.shipped_entries("class2d") == []


def test_the_marker_of_a_kind_is_written_when_its_modules_were_handled(tmp_path):
    assert not cupy_kernels.compiled("class3d", tmp_path)
    report = cupy_kernels.compile_ahead([], 0, tmp_path, "class3d")
    assert report["modules"] == report["of"] == 0 and not report["stopped"]
    assert cupy_kernels.compiled("class3d", tmp_path) and not cupy_kernels.compiled("refine3d", tmp_path)
    cupy_kernels.compile_ahead([], 0, tmp_path, None)  # warmup: every kind
    assert cupy_kernels.compiled("refine3d", tmp_path)

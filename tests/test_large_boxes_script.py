"""benchmarks/large_boxes.py's RELION side against a stand-in for RELION (RELION itself cannot run here): the two
calls it makes, the per-iteration times it reads from the files, a failure's message, a run stopped at the time
limit (its whole process group), and --dry_run."""

import importlib.util
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "large_boxes.py"
_spec = importlib.util.spec_from_file_location("large_boxes", _path)
large_boxes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(large_boxes)

FAKE = r'''#!/usr/bin/env python3
"""A stand-in for relion_refine_mpi: writes what RELION writes per iteration (FAKE_MODE: ok, oom, slow)."""
import os, sys, time
args = sys.argv[1:]
opt = lambda k: args[args.index(k) + 1] if k in args else None
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "oom":
    print(" ERROR: out of memory in CudaCustomAllocator"); sys.exit(1)
if mode == "slow":
    time.sleep(120)
out = opt("--o")
if "--continue" in args:
    assert "--force_converge" in args and os.path.isfile(opt("--continue")), args
    time.sleep(0.3)
    open(out + "_model.star", "w").write("final")
    sys.exit(0)
for k in ("--ctf", "--auto_refine", "--split_random_halves", "--pad", "--gpu", "--preread_images"):
    assert k in args, k
assert os.path.isfile("particles.star") and os.path.isfile("reference.mrc")
open(out + "_it000_data.star", "w").write("0")
for it in range(1, int(opt("--auto_iter_max")) + 1):
    time.sleep(0.3)
    for name in ("half1_model.star", "half2_model.star", "data.star", "optimiser.star"):
        open(f"{out}_it{it:03d}_{name}", "w").write(str(it))
'''


@pytest.fixture()
def fake_relion(tmp_path, monkeypatch):
    rb = tmp_path / "rb"
    (rb / "build" / "bin").mkdir(parents=True)
    for name, text in (("relion_refine_mpi", FAKE), ("mpirun", "#!/bin/bash\nshift 5\nexec \"$@\"\n")):
        f = rb / "build" / "bin" / name
        f.write_text(text)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    (rb / "env.sh").write_text(f'export RELION_BIN={rb}/build/bin PATH={rb}/build/bin:$PATH\nrl() {{ "$@"; }}\n')
    monkeypatch.setenv("RB", str(rb))
    data = tmp_path / "data"
    data.mkdir()
    (data / "particles.star").write_text("")
    (data / "reference.mrc").write_text("")
    return data


def _args(**kw):
    a = dict(particle_A=300.0, iter=2, relion_j=4, relion_pool=30, relion_ranks=3)
    a.update(kw)
    return SimpleNamespace(**a)


@pytest.mark.slow
def test_relion_side_runs_both_calls_and_times_each_iteration(fake_relion, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "ok")
    assert large_boxes.wait_for_relion(0) is None
    r = large_boxes.run_relion(512, _args(), fake_relion, tmp_path / "relion", pad=1, limit_s=60)
    assert r["status"] == "finished", r
    assert r["finished_iterations"] == 3 and len(r["iteration_s"]) == 3  # 2 + the final joined one
    assert all(t >= 0.25 for t in r["iteration_s"][:2]) and r["startup_s"] is not None
    first, final = r["commands"]
    assert "--pad 1" in first and "--auto_iter_max 2" in first and "--offset_range 5" in first
    assert f"--continue {tmp_path / 'relion'}/run_it002_optimiser.star" in final and "--force_converge" in final


def test_relion_failure_and_time_limit_are_results(fake_relion, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "oom")
    r = large_boxes.run_relion(800, _args(), fake_relion, tmp_path / "r1", pad=1, limit_s=60)
    assert r["status"].startswith("failed") and "out of memory" in r["error"] and r["finished_iterations"] == 0
    monkeypatch.setenv("FAKE_MODE", "slow")
    t0 = time.time()
    r = large_boxes.run_relion(800, _args(), fake_relion, tmp_path / "r2", pad=1, limit_s=2)
    assert r["status"] == "stopped at the time limit" and time.time() - t0 < 30
    left = subprocess.run(["pgrep", "-f", str(fake_relion.parent / "rb")], capture_output=True, text=True).stdout
    assert not left.strip()  # the whole process group was ended


def test_dry_run_prints_our_and_relions_commands(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    out = subprocess.run([sys.executable, str(_path), "--boxes", "512,1024", "--n", "100", "--iter", "2",
                          "--relion", "--postprocess", "--dry_run", "--work", str(tmp_path)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "padding 2" in out and "padding 1" in out  # box 512 keeps pad 2; 1024 falls back to pad 1
    assert out.count("relion_refine_mpi") == 4 and "--force_converge" in out and "postprocess" in out

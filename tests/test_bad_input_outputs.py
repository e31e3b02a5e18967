"""Outputs in the wrong place (issue 50, items 2, 7 and 8): an output written over an input or over another job's
files, an --o refused only after the first iteration wrote its maps or put beside the folder it names, and two
jobs on one --o at once. Each ends in ONE stderr line before any work (exit 2, no traceback) naming the paths,
with the inputs unchanged (bytes) and nothing written.

The command line runs in-process (``cli.main``) on a small simulated data set (10 particles of 32 px, one
micrograph); the whole file takes seconds.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_cases import fails, run_cli

from napari_gpu_relion import cli
from napari_gpu_relion.cancel import cancel_scope
from napari_gpu_relion.errors import InputError, JobCancelled
from napari_gpu_relion.io.jobdir import RunFiles
from napari_gpu_relion.io.micrographs import write_coordinate_list
from napari_gpu_relion.io.run_lock import RunLock, lock_path, read_holder
from napari_gpu_relion.jobs import class2d
from napari_gpu_relion.jobs.simulate import make_sample_data

SIM = dict(n_particles=10, box=32, angpix=4.0, diameter=80.0, n_micrographs=1, micrograph_size=128,
           particles_per_micrograph=4)
C2 = ["--K", "2", "--iter", "1", "--cpu"]


# ------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return make_sample_data(tmp_path_factory.mktemp("sample") / "d", **SIM)


def _coord_list(d: Path, where: Path, name: str = "autopick.star") -> Path:
    return write_coordinate_list(where / name, ["micrographs/mic001.mrc"], [str(d / "coords" / "mic001_truth.star")])


def _extract(d: Path, out: Path, *more) -> list:
    return ["extract", "--i", d / "micrographs.star", "--o", out, "--extract_size", "32", "--cpu", *more]


def _ok(capsys, argv: list) -> str:
    code, out, err = run_cli(capsys, argv)
    assert code == 0, (code, out, err)
    return out


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(q.relative_to(folder)): q.read_bytes() for q in sorted(folder.rglob("*")) if q.is_file()}


def _dead_pid() -> int:
    """The id of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------------------------------------------------
# (2) outputs written over inputs, or over another job's files


def test_extract_refuses_to_write_over_its_reextract_star(data, tmp_path, capsys):
    """Re-extracting DIR/particles.star into DIR replaced it (200 -> 20 particles, exit 0)."""
    out = tmp_path / "Extract"
    _ok(capsys, _extract(data, out, "--coord_list", _coord_list(data, tmp_path)))
    before = _tree(out)
    line = fails(capsys, _extract(data, out, "--reextract_data_star", out / "particles.star"),
                  "--reextract_data_star", out / "particles.star", "over the input")
    assert line.count(str(out / "particles.star")) == 2  # the output and the input, both named
    assert _tree(out) == before


def test_extract_refuses_a_coordinate_list_that_is_its_output(data, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    coords = _coord_list(data, out, "particles.star")
    before = coords.read_bytes()
    fails(capsys, _extract(data, out, "--coord_list", coords), "--coord_list", coords, "over the input")
    assert coords.read_bytes() == before
    assert sorted(q.name for q in out.iterdir()) == ["particles.star"]


def test_extract_refuses_a_micrographs_star_that_is_its_output(data, tmp_path, capsys):
    mics = data / "M" / "particles.star"
    mics.parent.mkdir()
    shutil.copy(data / "micrographs.star", mics)
    before = mics.read_bytes()
    argv = ["extract", "--i", mics, "--coord_list", _coord_list(data, tmp_path), "--o", mics.parent,
            "--extract_size", "32", "--cpu"]
    fails(capsys, argv, "--i", mics, "over the input")
    assert mics.read_bytes() == before
    assert sorted(q.name for q in mics.parent.iterdir()) == ["particles.star"]


def test_extract_compares_resolved_paths(data, tmp_path, capsys):
    """The same folder through a symbolic link (and a '..' detour) is still the input's folder."""
    out = tmp_path / "Extract"
    _ok(capsys, _extract(data, out, "--coord_list", _coord_list(data, tmp_path)))
    before = _tree(out)
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    fails(capsys, _extract(data, link / ".." / "link", "--reextract_data_star", out / "particles.star"),
           "--reextract_data_star", out / "particles.star")
    assert _tree(out) == before


def test_extract_refuses_another_jobs_particles_star(data, tmp_path, capsys):
    """--o the simulate job's folder: its particles.star (not an input) is another job's file."""
    before = _tree(data)
    fails(capsys, _extract(data, data, "--coord_list", _coord_list(data, tmp_path)),
           data, "particles.star", "written by a simulate job", "choose another --o")
    assert _tree(data) == before


def test_extract_refuses_a_users_own_particles_star(data, tmp_path, capsys):
    """A folder that no job wrote (no note.txt) holding a particles.star: the user's file stays."""
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(data / "particles.star", mine / "particles.star")
    before = _tree(mine)
    fails(capsys, _extract(data, mine, "--coord_list", _coord_list(data, tmp_path)),
           mine, "particles.star", "no note.txt")
    assert _tree(mine) == before


def test_extract_runs_again_in_its_own_folder(data, tmp_path, capsys):
    """The checks let a job write its own files again: extract re-run in the folder of an extract job."""
    out = tmp_path / "Extract"
    _ok(capsys, _extract(data, out, "--coord_list", _coord_list(data, tmp_path)))
    _ok(capsys, _extract(data, out, "--coord_list", _coord_list(data, tmp_path), "--invert_contrast"))
    assert (out / "note.txt").read_text().count("napari-gpu-relion extract") == 2


def test_rootname_that_is_an_existing_file(data, capsys):
    """class2d --o in/reference.mrc ran, writing reference.mrc_it001_* and into the folder's note.txt."""
    before = _tree(data)
    line = fails(capsys, ["class2d", "--i", data / "particles.star", "--o", data / "reference.mrc", *C2],
                  data / "reference.mrc", "is an existing file")
    assert "rootname" in line
    assert _tree(data) == before


def test_rootname_of_another_job_kind_is_refused_and_continue_still_works(data, tmp_path, capsys):
    run = tmp_path / "Class2D" / "job005" / "run"
    _ok(capsys, ["class2d", "--i", data / "particles.star", "--o", run, *C2])
    before = _tree(run.parent)
    fails(capsys, ["class3d", "--i", data / "particles.star", "--ref", data / "reference.mrc", "--o", run,
                    "--K", "2", "--iter", "1", "--cpu"],
           run.parent, "run_it001_", "written by a class2d job", "a class3d job does not write over")
    assert _tree(run.parent) == before
    # the same kind goes on: a --continue of that run
    _ok(capsys, ["class2d", "--continue", run.parent / "run_it001_optimiser.star", "--iter", "2", "--cpu"])
    assert (run.parent / "run_it002_optimiser.star").is_file()
    assert _tree(run.parent)["run_it001_data.star"] == before["run_it001_data.star"]


def test_new_run_refuses_an_input_of_its_own_rootname(data, tmp_path, capsys):
    """--i run_it002_data.star with --o run: iteration 2 of the new run would replace its input."""
    run = tmp_path / "Class2D" / "job006" / "run"
    _ok(capsys, ["class2d", "--i", data / "particles.star", "--o", run, "--K", "2", "--iter", "2", "--cpu"])
    before = _tree(run.parent)
    fails(capsys, ["class2d", "--i", run.parent / "run_it002_data.star", "--o", run, "--K", "2", "--iter", "3",
                    "--cpu"], "--i", run.parent / "run_it002_data.star", "a file of this rootname")
    assert _tree(run.parent) == before


# ------------------------------------------------------------------------------------------------------------
# (7) outputs refused too late, or put beside the folder they name


@pytest.mark.parametrize("job", ["class2d", "extract"])
def test_space_in_output_is_refused_at_the_start(job, data, tmp_path, capsys):
    """A space in --o failed after iteration 1 had written its maps (the optimiser STAR cannot hold it): refused
    before anything is written (STAR values cannot hold spaces; RELION's pipeline never makes such names)."""
    spaced = tmp_path / "my runs"
    argv = {"class2d": ["class2d", "--i", data / "particles.star", "--o", spaced / "run", *C2],
            "extract": _extract(data, spaced, "--coord_list", _coord_list(data, tmp_path))}[job]
    line = fails(capsys, argv, "my runs", "contains a space", "STAR")
    assert "without spaces" in line
    assert not spaced.exists()


def test_trailing_slash_means_the_folder(data, tmp_path, capsys):
    """--o Class2D/job005/ (not there yet) wrote Class2D/job005_it001_* beside the folder: RELION's <folder>/run."""
    folder = tmp_path / "Class2D" / "job005"
    _ok(capsys, ["class2d", "--i", data / "particles.star", "--o", f"{folder}/", *C2])
    assert (folder / "run_it001_optimiser.star").is_file()
    assert sorted(q.name for q in folder.parent.iterdir()) == ["job005"]
    assert not (folder / "run.lock").exists()  # given back at the end
    # the rule itself, on names whose folder is not there
    assert RunFiles.from_output(str(tmp_path / "Other") + "/").root == tmp_path / "Other" / "run"
    assert RunFiles.from_output(tmp_path / "Refine3D" / "job012").root == tmp_path / "Refine3D" / "job012" / "run"
    assert RunFiles.from_output(tmp_path / "Refine3D" / "myrun").root == tmp_path / "Refine3D" / "myrun"


# ------------------------------------------------------------------------------------------------------------
# (8) one job at a time on an --o


def test_second_job_on_a_locked_rootname_is_refused(data, tmp_path, capsys):
    """The test holds the lock as a running job would; the second job is refused before writing anything."""
    run = tmp_path / "InitialModel" / "job003" / "run"
    with RunLock.take(run, "initial_model") as held:
        assert lock_path(run).is_file()
        line = fails(capsys, ["class2d", "--i", data / "particles.star", "--o", run, *C2],
                      f"--o {run} is in use by {socket.gethostname()}:{os.getpid()} (started ", "initial_model")
        assert "wait for it to end" in line
        assert sorted(q.name for q in run.parent.iterdir()) == ["run.lock"]
        assert read_holder(run) == held.holder  # the holder's lock is untouched
    assert not run.parent.exists()  # given back: the lock file and the folder it made are gone
    _ok(capsys, ["class2d", "--i", data / "particles.star", "--o", run, *C2])  # free again


def test_a_lock_left_by_a_dead_process_is_taken_over(data, tmp_path, capsys):
    run = tmp_path / "Class2D" / "job007" / "run"
    run.parent.mkdir(parents=True)
    lock_path(run).write_text(f"host={socket.gethostname()}\npid={_dead_pid()}\nstarted=1700000000\njob=class2d\n")
    _ok(capsys, ["class2d", "--i", data / "particles.star", "--o", run, *C2])
    assert (run.parent / "run_it001_optimiser.star").is_file()
    assert not lock_path(run).exists()


def test_a_lock_of_another_host_is_not_taken_over(data, tmp_path, capsys):
    run = tmp_path / "Class2D" / "job008" / "run"
    run.parent.mkdir(parents=True)
    lock_path(run).write_text("host=some-other-node\npid=4242\nstarted=1700000000\njob=refine3d\n")
    fails(capsys, ["class2d", "--i", data / "particles.star", "--o", run, *C2],
           f"--o {run} is in use by some-other-node:4242 (started ", f"remove {lock_path(run)}")
    assert sorted(q.name for q in run.parent.iterdir()) == ["run.lock"]


def test_lock_given_back_after_an_error(data, tmp_path, capsys, monkeypatch):
    """A job stopped by an error (here: no room on the disk for its first iteration) gives the lock back."""
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 5000, 5000))
    run = tmp_path / "Class2D" / "job009" / "run"
    fails(capsys, ["class2d", "--i", data / "particles.star", "--o", run, *C2], "not enough free disk space")
    assert not run.parent.exists()
    monkeypatch.undo()
    RunLock.take(run).release()  # free


def test_lock_given_back_after_a_cancel(data, tmp_path):
    run = tmp_path / "Class2D" / "job010" / "run"
    p = class2d.Params(i=data / "particles.star", o=run, K=2, iter=3, cpu=True)
    seen = []
    with cancel_scope(lambda: len(seen) > 3), pytest.raises(JobCancelled):
        for ev in class2d.run(p):
            seen.append(ev)
            if len(seen) == 2:
                assert lock_path(run).is_file()  # held while the job runs
                with pytest.raises(InputError, match="is in use by"):
                    RunLock.take(run)
    assert not lock_path(run).exists()
    RunLock.take(run).release()  # free


def test_a_rootname_ending_in_a_slash_names_a_folder_of_any_name():
    """--o out/ (any folder name, existing or not): the rootname is out/run, as the trailing slash says."""
    from napari_gpu_relion.jobs import class2d

    parser = cli.build_parser()
    for value, want in (("Class2D/job005/", "Class2D/job005/run"), ("out/", "out/run"), ("out/r", "out/r")):
        args = parser.parse_args(["class2d", "--i", "p.star", "--o", value])
        assert str(args.o) == want, value
    assert dict(class2d.Params.__dataclass_fields__["o"].metadata).get("mode") == "root"


@pytest.mark.parametrize("job", ["extract", "autopick"])
def test_a_second_picking_or_extraction_on_one_folder_is_refused(data, tmp_path, capsys, job):
    """extract and autopick hold their output folder's lock too (<o>/particles.lock, <odir>/autopick.lock)."""
    out = tmp_path / "Job"
    root = out / ("particles" if job == "extract" else "autopick")
    args = (["extract", "--i", data / "micrographs.star", "--coord_list", _coord_list(data, tmp_path), "--o", out,
             "--extract_size", "32", "--cpu"] if job == "extract" else
            ["autopick", "--i", data / "micrographs.star", "--odir", out, "--LoG", "--LoG_diam_min", "100",
             "--LoG_diam_max", "160", "--cpu"])
    with RunLock.take(root, job):
        fails(capsys, args, f"{root} is in use by {socket.gethostname()}:{os.getpid()}", job)
        assert sorted(q.name for q in out.iterdir()) == [root.name + ".lock"]
    _ok(capsys, args)
    assert not lock_path(root).exists()


def test_autopick_refuses_an_output_folder_with_a_space_before_work(data, tmp_path, capsys):
    out = tmp_path / "Auto Pick"
    fails(capsys, ["autopick", "--i", data / "micrographs.star", "--odir", out, "--LoG", "--LoG_diam_min", "100",
                   "--LoG_diam_max", "160", "--cpu"], "--odir", "contains a space")
    assert not out.exists()

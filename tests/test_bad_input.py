"""A catalogue of mistakes (issue 17): wrong files, wrong values, wrong places. Every one must end in ONE line on
stderr naming what is wrong and where (file, line, column, value, path, bytes needed vs free), exit code 2, no
traceback, nothing written over an input and no NaN map written; and where the problem is visible at the start,
nothing written at all (the output folder does not appear).

Each case runs the command line in-process (``cli.main``) on a tiny simulated data set (8 particles of 16 px,
one 128 px micrograph), so the whole file takes seconds.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import mrcfile
import numpy as np
import pytest
import starfile
from cli_cases import fails as _fails
from cli_cases import run_cli as _run

from napari_gpu_relion import cli
from napari_gpu_relion.compute.backend import gpu_available
from napari_gpu_relion.errors import InputError, os_error_line, user_error_line
from napari_gpu_relion.io import atomic
from napari_gpu_relion.io.micrographs import write_coordinate_list
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.jobs import simulate

APIX = 6.0
SIM = dict(n_particles=8, box=16, angpix=APIX, diameter=60.0, n_micrographs=1, micrograph_size=128,
           particles_per_micrograph=3)
SIM_ARGS = [f"--{k}={v}" for k, v in SIM.items() if k != "diameter"] + [f"--particle_diameter={SIM['diameter']}"]
LOG = ["--LoG", "--LoG_diam_min", "40", "--LoG_diam_max", "60", "--cpu"]


# ------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """The tiny data set, made once; tests that change a file work on a copy (``data``)."""
    return simulate.make_sample_data(tmp_path_factory.mktemp("sample") / "d", **SIM)


@pytest.fixture(scope="module")
def class2d_run(sample, tmp_path_factory) -> Path:
    """One iteration of 2D classification of the sample (for --continue): its folder."""
    out = tmp_path_factory.mktemp("c2") / "Class2D"
    assert cli.main(["class2d", "--i", str(sample / "particles.star"), "--o", str(out / "run"), "--K", "2",
                     "--iter", "1", "--cpu"]) == 0
    return out


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes (to show that nothing changed)."""
    return {str(q.relative_to(folder)): q.read_bytes() for q in sorted(folder.rglob("*")) if q.is_file()}


def _set_pixels(stack: Path, index: int, value: float, everywhere: bool = False) -> None:
    """Image ``index`` (0-based) of ``stack``: one pixel (or all) set to ``value``."""
    with mrcfile.open(stack, mode="r+") as m:
        img = m.data[index].copy()
        if everywhere:
            img[...] = value
        else:
            img[5, 7] = value
        m.data[index] = img


def _set_value(path: Path, label: str, value: str) -> Path:
    """The value of ``label`` in a key-value STAR block (e.g. an optimiser STAR) replaced by ``value``."""
    lines = path.read_text().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.split()[:1] == [label])
    lines[i] = f"{label} {value}"
    path.write_text("\n".join(lines) + "\n")
    return path


def _edit(path: Path, old: str, new: str, count: int = 1) -> Path:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, count))
    return path


# ------------------------------------------------------------------------------------------------------------
# bad surroundings: output places


@pytest.mark.parametrize("job", ["simulate", "class2d", "postprocess", "autopick", "extract"])
def test_output_folder_that_is_an_existing_file(job, sample, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    argv = {
        "simulate": ["simulate", "--o", blocker],
        "class2d": ["class2d", "--i", sample / "particles.star", "--o", blocker / "run", "--cpu"],
        "postprocess": ["postprocess", "--i", sample / "truth.mrc", "--i2", sample / "reference.mrc",
                        "--o", blocker],
        "autopick": ["autopick", "--i", sample / "micrographs.star", "--odir", blocker, *LOG],
        "extract": ["extract", "--i", sample / "micrographs.star", "--coord_list", sample / "particles.star",
                    "--o", blocker, "--extract_size", "16", "--cpu"],
    }[job]
    line = _fails(capsys, argv, blocker, "existing file")
    assert "folder" in line
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("job", ["mask_create", "reconstruct", "simulate"])
def test_output_inside_a_file(job, sample, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    argv = {
        "mask_create": ["mask_create", "--i", sample / "truth.mrc", "--o", blocker / "sub" / "mask.mrc"],
        "reconstruct": ["reconstruct", "--i", sample / "particles.star", "--o", blocker / "map.mrc", "--cpu"],
        "simulate": ["simulate", "--o", blocker / "sim"],
    }[job]
    _fails(capsys, argv, blocker, "existing file")
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("job", ["reconstruct", "select"])
def test_output_file_that_is_an_existing_folder(job, sample, class2d_run, tmp_path, capsys):
    folder = tmp_path / ("map.mrc" if job == "reconstruct" else "sel.star")
    folder.mkdir()
    argv = {"reconstruct": ["reconstruct", "--i", sample / "particles.star", "--o", folder, "--cpu"],
            "select": ["select", "--i", class2d_run / "run_it001_data.star", "--o", folder]}[job]
    _fails(capsys, argv, folder, "existing folder")
    assert list(folder.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in a read-only folder")
def test_read_only_output_folder_by_permissions(sample, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _fails(capsys, ["mask_create", "--i", sample / "truth.mrc", "--o", ro / "mask.mrc"], ro, "read-only")
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("job", ["mask_create", "class2d", "extract"])
def test_read_only_file_system(job, sample, tmp_path, capsys, monkeypatch):
    """A read-only file system (EROFS; root cannot write there either): refused before any work."""
    ro = tmp_path / "mnt"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real(p, mode, **kw))
    argv = {"mask_create": ["mask_create", "--i", sample / "truth.mrc", "--o", ro / "job" / "mask.mrc"],
            "class2d": ["class2d", "--i", sample / "particles.star", "--o", ro / "Class2D" / "run", "--cpu"],
            "extract": ["extract", "--i", sample / "micrographs.star", "--coord_list", sample / "particles.star",
                        "--o", ro / "Extract", "--extract_size", "16", "--cpu"]}[job]
    _fails(capsys, argv, ro, "read-only")
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("job", ["class2d", "refine3d", "reconstruct", "simulate", "extract", "postprocess"])
def test_disk_too_full_for_the_first_files(job, sample, tmp_path, capsys, monkeypatch):
    """The free space is checked before the work: the line says the bytes needed and free, and the folder."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 5000, 5000))
    out = tmp_path / "out"
    argv = {
        "class2d": ["class2d", "--i", sample / "particles.star", "--o", out / "run", "--K", "2", "--cpu"],
        "refine3d": ["refine3d", "--i", sample / "particles.star", "--ref", sample / "reference.mrc",
                     "--o", out / "run", "--cpu"],
        "reconstruct": ["reconstruct", "--i", sample / "particles.star", "--o", out / "map.mrc", "--cpu"],
        "simulate": ["simulate", "--o", out, *SIM_ARGS],
        "extract": ["extract", "--i", sample / "micrographs.star", "--coord_list", _coord_list(sample, tmp_path),
                    "--o", out, "--extract_size", "16", "--cpu"],
        "postprocess": ["postprocess", "--i", sample / "truth.mrc", "--i2", sample / "reference.mrc", "--o", out],
    }[job]
    line = _fails(capsys, argv, "not enough free disk space", "5000 bytes", str(tmp_path))
    needed = int(line.split("(")[1].split(" bytes")[0])
    assert needed > 5000
    assert not out.exists()


def test_disk_full_while_writing_is_one_line_with_the_file(sample, tmp_path, capsys, monkeypatch):
    """ENOSPC raised by write() carries no file name: the line names the output file; no temporary stays."""
    def full(path, *a, **k):
        Path(path).write_bytes(b"")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mrcfile, "new", full)
    out = tmp_path / "job" / "mask.mrc"
    _fails(capsys, ["mask_create", "--i", sample / "truth.mrc", "--o", out, "--ini_threshold", "0.01"],
           "No space left on device", out)
    assert not out.exists()
    assert [q.name for q in out.parent.iterdir()] == ["note.txt"]


def test_os_errors_are_one_line_for_every_front_end():
    """The shared function that the CLI (and the widgets' error notification) show for an OSError."""
    exc = PermissionError(errno.EACCES, "Permission denied", "/data/Refine3D/job1/run_it001_data.star")
    assert os_error_line(exc) == "Permission denied: /data/Refine3D/job1/run_it001_data.star"
    assert user_error_line(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")) == \
        "Invalid cross-device link: /a -> /b"
    assert user_error_line(InputError("two\nlines", path="x.star")) == "x.star: two lines"
    assert user_error_line(KeyError("bug")) is None  # a bug keeps its traceback


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
def test_gpu_that_is_not_there(sample, tmp_path, capsys):
    _fails(capsys, ["reconstruct", "--i", sample / "particles.star", "--o", tmp_path / "r" / "m.mrc", "--gpu", "5"],
           "--gpu 5")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------------------
# left behind: temporaries of a job killed while writing


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_are_removed_at_start_and_live_ones_kept(sample, tmp_path, capsys):
    job = tmp_path / "MaskCreate"
    job.mkdir()
    tag = atomic._host_tag()
    stale_old = job / ".mask-tmp-0123456789ab.mrc"  # the earlier naming: no writer recorded
    stale_dead = job / f".mask-tmp-{tag}-{_dead_pid()}-89abcdef.mrc"  # its writer has exited
    live = job / f".mask-tmp-{tag}-1-89abcdef.mrc"  # pid 1 runs: a writer still at work
    foreign = job / ".notes-tmp-draft.txt"  # not our pattern
    for q in (stale_old, stale_dead, live, foreign):
        q.write_bytes(b"")
    code, out, err = _run(capsys, ["mask_create", "--i", sample / "truth.mrc", "--o", job / "mask.mrc"])
    assert code == 0, err
    assert not stale_old.exists() and not stale_dead.exists()
    assert live.exists() and foreign.exists()
    assert "removed 2 temporary file(s)" in out


def test_continue_removes_the_temporary_of_a_killed_iteration(class2d_run, tmp_path, capsys):
    run = Path(shutil.copytree(class2d_run, tmp_path / "Class2D"))
    left = run / f".run_it002_data-tmp-{atomic._host_tag()}-{_dead_pid()}-0011aabb.star"
    left.write_bytes(b"")  # what SIGKILL during the write of iteration 2's data STAR leaves
    code, out, err = _run(capsys, ["class2d", "--continue", run / "run_it001_optimiser.star", "--iter", "2",
                                   "--cpu"])
    assert code == 0, err
    assert not left.exists()
    assert not [q for q in run.iterdir() if "-tmp-" in q.name]
    assert (run / "run_it002_optimiser.star").is_file()
    # the iteration's summary is printed once (the jobs also sent it as a Message: every line twice), and the
    # start-up line names the iteration it comes before (it said "before iteration 1" after --continue)
    assert sum(line.strip().startswith("iteration 2: largest classes") for line in out.splitlines()) == 1, out
    assert "s before iteration 2" in out and "before iteration 1" not in out, out


# ------------------------------------------------------------------------------------------------------------
# bad STAR files


def test_duplicated_column_label(data, tmp_path, capsys):
    star = _edit(data / "particles.star", "_rlnClassNumber #16", "_rlnClassNumber #16\n_rlnAngleRot #17")
    lines = star.read_text().splitlines()
    star.write_text("\n".join(ln + " 5.0" if "@particles" in ln else ln for ln in lines) + "\n")
    line = _fails(capsys, ["reconstruct", "--i", star, "--o", tmp_path / "m" / "map.mrc", "--cpu"],
                  star, "rlnAngleRot", "twice")
    assert "line " in line
    assert not (tmp_path / "m").exists()


def test_star_without_the_particles_table(data, tmp_path, capsys):
    star = data / "particles.star"
    text = star.read_text()
    star.write_text(text[:text.index("data_particles")])  # the optics table only
    _fails(capsys, ["class2d", "--i", star, "--o", tmp_path / "c" / "run", "--cpu"], star, "no data_particles",
           "data_optics")
    assert not (tmp_path / "c").exists()


def test_missing_column(data, tmp_path, capsys):
    star = _edit(data / "particles.star", "_rlnAngleTilt #11", "_rlnAngleTiltX #11")
    _fails(capsys, ["reconstruct", "--i", star, "--o", tmp_path / "m.mrc", "--cpu"], star, "rlnAngleTilt")
    assert not (tmp_path / "m.mrc").exists()


def test_text_in_a_numeric_column(data, tmp_path, capsys):
    star = data / "particles.star"
    text = star.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("000003@"))
    fields = row.split()
    fields[3] = "abc"  # rlnDefocusU
    star.write_text(text.replace(row, " ".join(fields)))
    number = text.splitlines().index(row) + 1
    _fails(capsys, ["class2d", "--i", star, "--o", tmp_path / "c" / "run", "--ctf", "--cpu"], star,
           f"line {number}", "rlnDefocusU", "'abc'")


def test_two_pixel_sizes_say_what_the_user_can_do(data, tmp_path, capsys):
    star = data / "particles.star"
    text = star.read_text()
    group = next(ln for ln in text.splitlines() if ln.startswith("opticsGroup1"))
    text = text.replace(group, group + "\n" + group.replace("opticsGroup1 1", "opticsGroup2 2").replace(
        " 6.0 ", " 6.5 "))
    row = next(ln for ln in text.splitlines() if ln.startswith("000002@"))
    star.write_text(text.replace(row, row.replace(" simulated.mrc 1 ", " simulated.mrc 2 ")))
    line = _fails(capsys, ["class2d", "--i", star, "--o", tmp_path / "c" / "run", "--cpu"], star,
                  "rlnImagePixelSize", "6.5")
    assert "uniform_optics" not in line and "optics group" in line


def test_odd_box_says_what_the_user_can_do(data, tmp_path, capsys):
    star = data / "particles.star"
    group = next(ln for ln in star.read_text().splitlines() if ln.startswith("opticsGroup1"))
    _edit(star, group, group.replace(" 16 ", " 15 "))
    line = _fails(capsys, ["class2d", "--i", star, "--o", tmp_path / "c" / "run", "--cpu"], star, "15",
                  "rlnImageSize")
    assert "even_box" not in line and "--extract_size" in line


def test_subset_values_other_than_1_or_2(data, tmp_path, capsys):
    star = data / "particles.star"
    row = next(ln for ln in star.read_text().splitlines() if ln.startswith("000004@"))
    fields = row.split()
    fields[14] = "3"  # rlnRandomSubset
    _edit(star, row, " ".join(fields))
    _fails(capsys, ["refine3d", "--i", star, "--ref", data / "reference.mrc", "--o", tmp_path / "r" / "run",
                    "--cpu"], star, "rlnRandomSubset", "3")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------------------
# the particle stacks a STAR names


def test_image_number_beyond_the_stack(data, tmp_path, capsys):
    star = _edit(data / "particles.star", "000008@particles/particles.mrcs", "000009@particles/particles.mrcs")
    _fails(capsys, ["class2d", "--i", star, "--o", tmp_path / "c" / "run", "--cpu"], star, "image 9",
           "particles.mrcs", "only 8 images", "rlnImageName")
    assert not (tmp_path / "c").exists()


def test_stack_missing(data, tmp_path, capsys):
    (data / "particles" / "particles.mrcs").unlink()
    (data / "particles").rmdir()
    line = _fails(capsys, ["reconstruct", "--i", data / "particles.star", "--o", tmp_path / "m" / "map.mrc",
                           "--cpu"], "particles/particles.mrcs", data / "particles.star")
    assert "project_dir" not in line  # no option a user can type
    assert not (tmp_path / "m").exists()


def test_a_3d_map_named_as_the_particle_stack(data, tmp_path, capsys):
    star = data / "particles.star"
    text = star.read_text().replace("particles/particles.mrcs", "reference.mrc")
    star.write_text(text)
    line = _fails(capsys, ["refine3d", "--i", star, "--ref", data / "reference.mrc", "--o", tmp_path / "r" / "run",
                           "--cpu"], star, "reference.mrc", "3D map", "16 x 16 x 16", "rlnImageName")
    assert "space group 1" in line and ".mrcs" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["particles.mrcs", "particles.mrc"])
def test_a_stack_of_images_stays_a_stack_whatever_its_header(name, data, tmp_path, capsys):
    """RELION's .mrcs stacks are 3D arrays, and real .mrc stacks with a volume header exist (EMPIAR-10076): a
    stack that is not a cube is read as images whatever its header says."""
    stack = data / "particles" / "particles.mrcs"
    with mrcfile.open(stack, mode="r+") as m:
        m.set_volume()  # space group 1, mz = nz = 8 images of 16 x 16
    stack.rename(stack.with_name(name))
    star = _edit(data / "particles.star", "particles/particles.mrcs", f"particles/{name}", count=8)
    code, _, err = _run(capsys, ["reconstruct", "--i", star, "--o", tmp_path / "m.mrc", "--cpu"])
    assert code == 0, err
    assert np.isfinite(read_mrc(tmp_path / "m.mrc").data).all()


def test_images_of_another_size_than_rlnImageSize(data, tmp_path, capsys):
    imgs = np.random.default_rng(0).normal(size=(8, 20, 20)).astype(np.float32)
    write_mrc(data / "particles" / "particles.mrcs", imgs, APIX)
    _fails(capsys, ["class2d", "--i", data / "particles.star", "--o", tmp_path / "c" / "run", "--cpu"],
           "20 x 20", "rlnImageSize", "16")
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------------------------------
# pixel values: NaN, infinite, blank


def _em_argv(job: str, data: Path, out: Path) -> list:
    argv = [job, "--i", data / "particles.star", "--o", out / "run", "--cpu"]
    if job != "class2d":
        argv += ["--ref", data / "reference.mrc", "--healpix_order", "0"]
    return argv + (["--K", "2"] if job != "refine3d" else [])


@pytest.mark.parametrize("job", ["class2d", "class3d", "refine3d"])
@pytest.mark.parametrize("value,what", [(np.nan, "NaN"), (np.inf, "infinite")])
def test_nan_or_infinite_pixels_in_a_particle(job, value, what, data, tmp_path, capsys):
    _set_pixels(data / "particles" / "particles.mrcs", 4, value)
    _fails(capsys, _em_argv(job, data, tmp_path), "image 5 of stack", "particles.mrcs", what,
           data / "particles.star", "rlnImageName")
    assert not (tmp_path / "run_it001_optimiser.star").exists()
    assert not list(tmp_path.glob("*.mrc*"))


@pytest.mark.parametrize("job", ["class2d", "refine3d"])
def test_all_zero_particle_image(job, data, tmp_path, capsys):
    _set_pixels(data / "particles" / "particles.mrcs", 2, 0.0, everywhere=True)
    _fails(capsys, _em_argv(job, data, tmp_path), "image 3 of stack", "every pixel is 0", "blank")
    assert not list(tmp_path.glob("run_*"))


def test_reconstruct_of_a_stack_with_nan_writes_no_map(data, tmp_path, capsys):
    _set_pixels(data / "particles" / "particles.mrcs", 6, np.nan)
    out = tmp_path / "map.mrc"
    _fails(capsys, ["reconstruct", "--i", data / "particles.star", "--o", out, "--cpu"], "image 7 of stack", "NaN")
    assert not out.exists()


@pytest.mark.parametrize("job", ["refine3d", "class3d"])
@pytest.mark.parametrize("fill,what", [(np.nan, "NaN"), (0.0, "every value is 0")])
def test_nan_or_blank_reference(job, fill, what, data, tmp_path, capsys):
    ref = data / "reference.mrc"
    vol = np.array(read_mrc(ref).data)
    if np.isnan(fill):
        vol[3, 4, 5] = fill
    else:
        vol[...] = fill
    write_mrc(ref, vol, APIX)
    _fails(capsys, _em_argv(job, data, tmp_path), ref, "reference map", what)
    assert not list(tmp_path.glob("run*"))


def test_reference_of_another_box(data, tmp_path, capsys):
    write_mrc(data / "reference.mrc", np.random.default_rng(1).normal(size=(20, 20, 20)).astype(np.float32), APIX)
    _fails(capsys, _em_argv("refine3d", data, tmp_path), "box 20", "box 16", "--trust_ref_size")
    assert not list(tmp_path.glob("run*"))


def test_postprocess_nan_half_map(data, tmp_path, capsys):
    vol = np.array(read_mrc(data / "truth.mrc").data)
    vol[0, 0, 0] = np.nan
    write_mrc(data / "half1.mrc", vol, APIX)
    _fails(capsys, ["postprocess", "--i", data / "half1.mrc", "--i2", data / "reference.mrc", "--o",
                    tmp_path / "pp"], data / "half1.mrc", "NaN")
    assert not (tmp_path / "pp").exists()


@pytest.mark.parametrize("mask,what", [(np.zeros((16, 16, 16)), "empty"), (np.ones((12, 12, 12)), "(12, 12, 12)")])
def test_postprocess_empty_or_wrongly_sized_mask(mask, what, data, tmp_path, capsys):
    write_mrc(data / "mask.mrc", mask.astype(np.float32), APIX)
    _fails(capsys, ["postprocess", "--i", data / "truth.mrc", "--i2", data / "reference.mrc", "--mask",
                    data / "mask.mrc", "--o", tmp_path / "pp"], data / "mask.mrc", what)
    assert not (tmp_path / "pp").exists()


def test_mask_create_from_a_nan_map(data, tmp_path, capsys):
    vol = np.array(read_mrc(data / "truth.mrc").data)
    vol[8, 8, 8] = np.nan
    write_mrc(data / "nan.mrc", vol, APIX)
    _fails(capsys, ["mask_create", "--i", data / "nan.mrc", "--o", tmp_path / "m" / "mask.mrc"], data / "nan.mrc",
           "NaN")
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------------------------------------------------
# option values


@pytest.mark.parametrize("value", ["0", "-2", "nan"])
@pytest.mark.parametrize("job", ["reconstruct", "mask_create", "postprocess", "autopick", "extract"])
def test_angpix_zero_or_negative_is_not_read_as_not_given(job, value, sample, tmp_path, capsys):
    argv = {
        "reconstruct": ["reconstruct", "--i", sample / "particles.star", "--o", tmp_path / "o" / "m.mrc", "--cpu"],
        "mask_create": ["mask_create", "--i", sample / "truth.mrc", "--o", tmp_path / "o" / "mask.mrc"],
        "postprocess": ["postprocess", "--i", sample / "truth.mrc", "--i2", sample / "reference.mrc",
                        "--o", tmp_path / "o"],
        "autopick": ["autopick", "--i", sample / "micrographs.star", "--odir", tmp_path / "o", *LOG],
        "extract": ["extract", "--i", sample / "micrographs.star", "--coord_list", sample / "particles.star",
                    "--o", tmp_path / "o", "--extract_size", "16", "--cpu"],
    }[job]
    _fails(capsys, [*argv, "--angpix", value], "--angpix", f"got {value}", "-1")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,names", [
    (["autopick", "--angpix_ref", "0", "--ref", "{d}/reference.mrc"], ("--angpix_ref", "got 0")),
    (["reconstruct", "--maxres", "0"], ("--maxres", "got 0")),
    (["class2d", "--particle_diameter", "0"], ("--particle_diameter", "got 0")),
    (["class2d", "--K", "0"], ("--K", "got 0")),
    (["class2d", "--iter", "-3"], ("--iter", "got -3")),
    (["class2d", "--batch", "-1"], ("--batch", "got -1")),
    (["class3d", "--healpix_order", "-1", "--ref", "{d}/reference.mrc"], ("--healpix_order", "got -1")),
    (["refine3d", "--sym", "X99", "--ref", "{d}/reference.mrc"], ("X99",)),
    (["simulate", "--n_particles", "-5"], ("--n_particles", "got -5")),
    (["simulate", "--box", "15"], ("--box", "got 15")),
    (["simulate", "--n_micrographs", "-1"], ("--n_micrographs", "got -1")),
    (["simulate", "--micrograph_size", "8"], ("--micrograph_size", "got 8")),
    (["extract", "--extract_size", "0"], ("--extract_size", "got 0")),
    (["class2d", "--K", "two"], ("--K", "'two'")),  # a word where a number goes
    (["reconstruct", "--pad", "1.5"], ("--pad", "'1.5'")),
    (["class2d", "--bogus", "1"], ("--bogus",)),  # an option that does not exist
])
def test_option_values(argv, names, sample, tmp_path, capsys):
    job = argv[0]
    base = {
        "autopick": ["--i", sample / "micrographs.star", "--odir", tmp_path / "o", "--cpu"],
        "reconstruct": ["--i", sample / "particles.star", "--o", tmp_path / "o" / "m.mrc", "--cpu"],
        "class2d": ["--i", sample / "particles.star", "--o", tmp_path / "o" / "run", "--cpu"],
        "class3d": ["--i", sample / "particles.star", "--o", tmp_path / "o" / "run", "--cpu"],
        "refine3d": ["--i", sample / "particles.star", "--o", tmp_path / "o" / "run", "--cpu"],
        "simulate": ["--o", tmp_path / "o"],
        "extract": ["--i", sample / "micrographs.star", "--coord_list", sample / "particles.star",
                    "--o", tmp_path / "o", "--cpu"],
    }[job]
    rest = [a.replace("{d}", str(sample)) for a in argv[1:]]
    _fails(capsys, [job, *base, *rest], *names)
    assert not (tmp_path / "o").exists()


def test_missing_required_option_is_one_line(sample, capsys):
    _fails(capsys, ["reconstruct", "--i", sample / "particles.star"], "--o", "required")


# ------------------------------------------------------------------------------------------------------------
# --continue


def _continue(capsys, opt: Path, *names: str) -> str:
    return _fails(capsys, ["class2d", "--continue", opt, "--iter", "2", "--cpu"], *names)


def test_continue_changes_relions_options_and_names_those_it_does_not_apply(class2d_run, tmp_path, capsys):
    """--continue takes the run's saved options, except --iter, the runtime options and those RELION's --continue
    changes too (CONTINUE_CHANGES): --tau2_fudge 4 applies (the next model STAR has it), while --K 3 is named in one
    warning line with the value the run keeps; a bad value of a changeable option is one error line."""
    run = Path(shutil.copytree(class2d_run, tmp_path / "C"))
    code, out, err = _run(capsys, ["class2d", "--continue", run / "run_it001_optimiser.star", "--iter", "2",
                                   "--tau2_fudge", "4", "--K", "3", "--zero_mask", "--cpu"])
    assert code == 0, err
    lines = [line for line in out.splitlines() if "not applied" in line]
    assert len(lines) == 1, out
    assert "--K 3 (the run keeps 2)" in lines[0] and "--tau2_fudge 4" not in lines[0], lines
    assert "--zero_mask (the run keeps it off)" in lines[0], lines
    assert "--iter 2" not in lines[0] and "--cpu True" not in lines[0]
    model = starfile.read(run / "run_it002_model.star")["model_general"]
    assert float(model["rlnTau2FudgeFactor"]) == 4.0 and int(model["rlnNrClasses"]) == 2
    _fails(capsys, ["class2d", "--continue", run / "run_it001_optimiser.star", "--iter", "3", "--pad", "0",
                    "--cpu"], "--pad", "0")


def test_continue_from_a_missing_file(tmp_path, capsys):
    _continue(capsys, tmp_path / "run_it001_optimiser.star", tmp_path / "run_it001_optimiser.star", "--continue")


def test_continue_from_a_cut_optimiser_star(class2d_run, tmp_path, capsys):
    run = Path(shutil.copytree(class2d_run, tmp_path / "C"))
    opt = run / "run_it001_optimiser.star"
    text = opt.read_text()
    cut = text.index("_rlnExperimentalDataStarFile") + len("_rlnExperimentalDataStarFile")
    opt.write_text(text[:cut] + "\n")  # killed mid-line by a copy, or a disk that filled up
    _continue(capsys, opt, opt, "rlnExperimentalDataStarFile", "no value", "line 7")
    assert not (run / "run_it002_optimiser.star").exists()


@pytest.mark.parametrize("old,new,names", [
    ("_rlnExperimentalDataStarFile", "_rlnExperimentalDataFileX", ("rlnExperimentalDataStarFile", "lacks")),
    ("_rlnGpuRelionParam_psi_step ", "_rlnGpuRelionParam_psi_stepX ", ("rlnGpuRelionParam_psi_step", "lacks")),
    ("_rlnCurrentIteration", "one", ("rlnCurrentIteration", "'one'", "whole number")),
    ("_rlnGpuRelionParam_K", "2.5x", ("rlnGpuRelionParam_K", "'2.5x'")),
    ("_rlnExperimentalDataStarFile", "run_it009_data.star", ("run_it009_data.star", "not found")),
    ("_rlnModelStarFile", "run_it009_model.star", ("run_it009_model.star", "not found")),
])
def test_continue_from_a_damaged_optimiser_star(old, new, names, class2d_run, tmp_path, capsys):
    run = Path(shutil.copytree(class2d_run, tmp_path / "C"))
    opt = run / "run_it001_optimiser.star"
    if new.startswith("_"):
        _edit(opt, old, new)  # a label renamed
    else:
        _set_value(opt, old, new)
    _continue(capsys, opt, *names)
    assert not (run / "run_it002_optimiser.star").exists()


def test_continue_from_a_data_star(class2d_run, capsys):
    _continue(capsys, class2d_run / "run_it001_data.star", "run_it001_data.star", "not an optimiser STAR")


def test_continue_with_a_model_star_lacking_a_column(class2d_run, tmp_path, capsys):
    run = Path(shutil.copytree(class2d_run, tmp_path / "C"))
    _edit(run / "run_it001_model.star", "_rlnSigma2Noise", "_rlnSigma2NoiseX")
    _continue(capsys, run / "run_it001_optimiser.star", "run_it001_model.star", "rlnSigma2Noise")


# ------------------------------------------------------------------------------------------------------------
# simulate over an existing data set; an output over an input


def test_simulate_refuses_to_replace_a_data_set(sample, tmp_path, capsys):
    d = Path(shutil.copytree(sample, tmp_path / "d"))
    before = _tree(d)
    argv = ["simulate", "--o", d, *SIM_ARGS, "--seed", "7"]
    _fails(capsys, argv, d, "already holds", "particles.star", "--overwrite")
    assert _tree(d) == before
    code, _, err = _run(capsys, [*argv, "--overwrite"])
    assert code == 0, err
    assert (d / "particles" / "particles.mrcs").read_bytes() != before["particles/particles.mrcs"]  # seed 7


def test_simulate_with_overwrite_never_writes_over_its_map(sample, tmp_path, capsys):
    d = Path(shutil.copytree(sample, tmp_path / "d"))
    before = (d / "truth.mrc").read_bytes()
    _fails(capsys, ["simulate", "--o", d, "--map", d / "truth.mrc", "--overwrite", "--box", "16"], "truth.mrc",
           "overwrite an input")
    assert (d / "truth.mrc").read_bytes() == before


@pytest.mark.parametrize("job", ["mask_create", "select"])
def test_output_onto_the_input(job, sample, class2d_run, tmp_path, capsys):
    src = {"mask_create": sample / "truth.mrc", "select": class2d_run / "run_it001_data.star"}[job]
    copy = Path(shutil.copy(src, tmp_path / src.name))
    before = copy.read_bytes()
    _fails(capsys, [job, "--i", copy, "--o", copy], "overwrite an input", copy.name)
    assert copy.read_bytes() == before


# ------------------------------------------------------------------------------------------------------------
# micrographs for autopick and extract: missing or 3D stops before work unless --skip_bad_micrographs


def _coord_list(d: Path, where: Path, extra: str | None = None) -> Path:
    names = ["micrographs/mic001.mrc"] + ([extra] if extra else [])
    coords = [str(d / "coords" / "mic001_truth.star")] * len(names)
    return write_coordinate_list(where / "autopick.star", names, coords)


def _mics_with(data: Path, name: str) -> Path:
    star = data / "micrographs.star"
    row = next(ln for ln in star.read_text().splitlines() if ln.startswith("micrographs/mic001.mrc"))
    _edit(star, row, row + "\n" + row.replace("micrographs/mic001.mrc", name))
    return star


@pytest.mark.parametrize("kind", ["missing", "3D"])
def test_autopick_stops_before_work_on_a_bad_micrograph(kind, data, tmp_path, capsys):
    name = "micrographs/mic002.mrc" if kind == "missing" else "truth.mrc"
    star = _mics_with(data, name)
    line_no = star.read_text().splitlines().index(
        next(ln for ln in star.read_text().splitlines() if ln.startswith(name))) + 1
    odir = tmp_path / "AutoPick"
    line = _fails(capsys, ["autopick", "--i", star, "--odir", odir, *LOG], star, f"line {line_no}", name,
                  "--skip_bad_micrographs")
    assert ("not found" if kind == "missing" else "2D micrograph") in line
    assert not odir.exists()
    code, out, err = _run(capsys, ["autopick", "--i", star, "--odir", odir, *LOG, "--skip_bad_micrographs"])
    assert code == 0, err
    assert f"skipping micrograph {name}" in out and "1 failed" in out
    assert (odir / "micrographs" / "mic001_autopick.star").is_file()


def test_extract_stops_before_work_on_a_missing_micrograph(data, tmp_path, capsys):
    star = _mics_with(data, "micrographs/mic002.mrc")
    coords = _coord_list(data, tmp_path, "micrographs/mic002.mrc")
    out = tmp_path / "Extract"
    argv = ["extract", "--i", star, "--coord_list", coords, "--o", out, "--extract_size", "16", "--cpu"]
    _fails(capsys, argv, star, "micrographs/mic002.mrc", "not found", "--skip_bad_micrographs")
    assert not out.exists()
    code, stdout, err = _run(capsys, [*argv, "--skip_bad_micrographs"])
    assert code == 0, err
    assert "skipping micrograph micrographs/mic002.mrc" in stdout
    assert (out / "particles.star").is_file()


def test_extract_coordinates_outside_the_micrograph(data, tmp_path, capsys):
    coords = data / "coords" / "mic001_truth.star"
    row = next(ln for ln in coords.read_text().splitlines() if ln.strip() and ln.split()[0][0].isdigit())
    fields = row.split()
    fields[0] = "900.0"
    _edit(coords, row, " ".join(fields))
    out = tmp_path / "Extract"
    _fails(capsys, ["extract", "--i", data / "micrographs.star", "--coord_list", _coord_list(data, tmp_path), "--o",
                    out, "--extract_size", "16", "--cpu"], coords, "rlnCoordinateX", "900")
    assert not out.exists()

"""The command line turns bad surroundings into one line naming what is wrong and where, exit code 2, no
traceback: output paths inside a file or onto an existing file, and a GPU that is not there."""

from pathlib import Path

import numpy as np
import pytest

from napari_gpu_relion import cli
from napari_gpu_relion.compute.backend import gpu_available
from napari_gpu_relion.io.mrc import write_mrc


def _run(capsys, argv):
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.fixture
def volume(tmp_path):
    v = np.zeros((16, 16, 16), np.float32)
    v[5:11, 5:11, 5:11] = 1.0
    return write_mrc(tmp_path / "map.mrc", v, 2.0)


def test_output_inside_a_file_is_one_line_with_the_path(volume, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    code, err = _run(capsys, ["mask_create", "--i", str(volume), "--o", str(blocker / "sub" / "mask.mrc"),
                              "--ini_threshold", "0.5"])
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "error:" in err and str(blocker) in err


def test_output_onto_an_existing_folder_is_one_line(volume, tmp_path, capsys):
    folder = tmp_path / "mask.mrc"
    folder.mkdir()
    code, err = _run(capsys, ["mask_create", "--i", str(volume), "--o", str(folder), "--ini_threshold", "0.5"])
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(folder) in err


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
def test_a_gpu_that_is_not_there_is_refused_not_replaced_by_the_cpu(tmp_path, capsys):
    sample = Path(__file__).resolve().parents[1] / "sample_data"
    code, err = _run(capsys, ["refine3d", "--i", str(sample / "particles.star"), "--ref", str(sample / "reference.mrc"),
                              "--o", str(tmp_path / "Refine3D" / "run"), "--gpu", "5"])
    assert code == 2 and "--gpu 5" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "Refine3D").exists()  # refused before any file was written


def test_the_process_age_counts_from_the_process_start():
    """cli.process_age_s: the seconds since this process started (what a job's log reports as the time before the
    job), at least the time this test sleeps and less than the whole test session."""
    import time

    from napari_gpu_relion.cli import process_age_s

    a = process_age_s()
    if a is None:
        pytest.skip("no /proc on this system")
    time.sleep(0.3)
    b = process_age_s()
    assert 0.25 <= b - a <= 5.0, (a, b)
    assert 0.0 < a < 24 * 3600
    import subprocess
    import sys

    fresh = subprocess.run([sys.executable, "-c", "from napari_gpu_relion.cli import process_age_s; "
                            "print(process_age_s())"], capture_output=True, text=True, check=True).stdout
    assert 0.0 < float(fresh) < 30.0, fresh  # a new process: its imports, not the machine's uptime


_ENTRY = """
import atexit, multiprocessing, os, sys, time
atexit.register(lambda: print("the interpreter's exit ran", flush=True))
from napari_gpu_relion.cli import console_main
if __name__ == "__main__":
    sys.argv = ["napari-gpu-relion", *sys.argv[1:]]
    if os.environ.get("ALSO") == "profiler":
        sys.setprofile(lambda *a: None)
    if os.environ.get("ALSO") == "child":
        multiprocessing.get_context("spawn").Process(target=time.sleep, args=(2,), daemon=True).start()
    console_main()
"""


@pytest.mark.parametrize(("fast", "also"), [("1", ""), ("0", ""), ("1", "profiler"), ("1", "child")])
def test_the_command_line_ends_after_its_job_with_every_line_and_file_written(volume, tmp_path, fast, also):
    """console_main (the installed command's entry): after the job, every line reached the pipe and the file is
    whole; the exit code is main's (0, and 2 for bad input); with the fast exit (the default) the interpreter's
    teardown, atexit handlers included, is skipped; it runs with NAPARI_GPU_RELION_FAST_EXIT=0, under a profiler
    (which writes its file at that exit) and while a multiprocessing child lives (its exit waits for it)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import mrcfile  # noqa: PLC0415

    env = dict(os.environ, NAPARI_GPU_RELION_FAST_EXIT=fast, ALSO=also)
    skipped = fast == "1" and not also
    out = tmp_path / "mask.mrc"
    r = subprocess.run([sys.executable, "-c", _ENTRY, "mask_create", "--i", str(volume), "--o", str(out),
                        "--ini_threshold", "0.5"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert any(x.startswith("[done in") for x in lines), r.stdout
    assert ("the interpreter's exit ran" in lines) == (not skipped), r.stdout
    assert mrcfile.read(out).shape == (16, 16, 16)
    bad = subprocess.run([sys.executable, "-c", _ENTRY, "mask_create", "--i", str(tmp_path / "none.mrc"), "--o",
                          str(tmp_path / "m2.mrc"), "--ini_threshold", "0.5"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and "none.mrc" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr

"""The CTF refinement job's work around the fits (jobs/ctf_refine.py, issue 51: the whole command, not only the
refinement): the images read ahead in a background thread (the same images as load_images, also for part of a
batch after an out-of-memory retry and across two read blocks; a bad image's error raised in the job's thread), the
aberration plots drawn by a helper process (and in the job's process, with a warning, where the helper cannot run),
and the command line importing only the job it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mrcfile
import numpy as np
import pandas as pd
import pytest

from napari_gpu_relion.compute import ctf_refine as CR
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.particle_images import check_image_stacks, load_images
from napari_gpu_relion.io.star import read_particles, write_particles
from napari_gpu_relion.jobs import ctf_refine as J


def _stack_table(folder: Path, n: int = 40, box: int = 8, nan_at: int | None = None):
    """A STAR of ``n`` particles in two stacks (rows interleaved, so a batch reads both), images i + pixel/100."""
    rng = np.random.default_rng(0)
    imgs = (np.arange(n)[:, None, None] + rng.uniform(0, 0.01, (n, box, box))).astype(np.float32)
    if nan_at is not None:
        imgs[nan_at, 2, 3] = np.nan
    names = []
    for s in range(2):
        with mrcfile.new(folder / f"s{s}.mrcs", overwrite=True) as m:
            m.set_data(imgs[s::2])
            m.voxel_size = 2.0
        names += [(i, f"{k + 1:06d}@s{s}.mrcs") for k, i in enumerate(range(s, n, 2))]
    names = [name for _, name in sorted(names)]
    df = pd.DataFrame({"rlnImageName": names, "rlnOpticsGroup": np.ones(n, int)})
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["g1"], "rlnImagePixelSize": [2.0],
                           "rlnImageSize": [box], "rlnImageDimensionality": [2], "rlnVoltage": [300.0],
                           "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1]})
    write_particles(folder / "p.star", df, optics)
    return read_particles(folder / "p.star"), imgs


@pytest.mark.parametrize("threads", [1, 3])
def test_images_read_ahead_are_load_images(tmp_path, monkeypatch, threads):
    monkeypatch.chdir(tmp_path)
    table, imgs = _stack_table(tmp_path)
    locations = check_image_stacks(table)
    seq = np.random.default_rng(1).permutation(len(imgs))  # the batches' order of the rows
    cuts = np.array([0, 7, 20, 33, 40])
    reader = J._ImagesAhead(J._image_reader(table, locations), seq, cuts, ahead=1, threads=threads)
    try:
        for a, b in ((0, 7), (7, 12), (7, 10), (10, 25), (25, 40)):  # a batch; a retry's smaller part; across
            got = reader.take(a, b)
            np.testing.assert_array_equal(got, load_images(table, rows=seq[a:b]))
            np.testing.assert_array_equal(got, imgs[seq[a:b]])
    finally:
        reader.close()
    assert not reader.alive


@pytest.mark.filterwarnings("ignore:Data array contains NaN")
@pytest.mark.parametrize("threads", [1, 3])
def test_a_bad_image_is_raised_by_take_every_time(tmp_path, monkeypatch, threads):
    monkeypatch.chdir(tmp_path)
    table, imgs = _stack_table(tmp_path, nan_at=25)
    seq = np.arange(len(imgs))
    reader = J._ImagesAhead(J._image_reader(table, check_image_stacks(table)), seq, np.array([0, 20, 40]), ahead=1,
                            threads=threads)
    try:
        np.testing.assert_array_equal(reader.take(0, 20), imgs[:20])
        for _ in range(2):  # also when an out-of-memory retry asks again (never a wait for a block that never comes)
            with pytest.raises(InputError, match="NaN"):
                reader.take(20, 30)
    finally:
        reader.close()


def _plot_args(tmp_path: Path, name: str):
    pix = CR.fit_pixels(32, 2.0)
    phase = np.linspace(-1, 1, pix.npix)
    return (tmp_path / name, pix, phase, np.ones(pix.npix), 0.5 * phase, True, "a test plot")


def test_the_plot_helper_draws_the_plots(tmp_path):
    plotter = J._Plotter()
    try:
        plotter.submit(*_plot_args(tmp_path, "a.png"))
        plotter.submit(*_plot_args(tmp_path, "b.png"))
        plotter.start()
        paths, why = plotter.wait()
    finally:
        plotter.close()
    assert why is None and paths == [tmp_path / "a.png", tmp_path / "b.png"]
    for p in paths:
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize("exe", ["/nonexistent/python", "/bin/false"])
def test_without_the_helper_the_job_draws_the_plots_itself(tmp_path, monkeypatch, exe):
    monkeypatch.setattr(sys, "executable", exe)  # cannot start / exits at once
    plotter = J._Plotter()
    try:
        plotter.submit(*_plot_args(tmp_path, "a.png"))
        plotter.start()
        paths, why = plotter.wait()
    finally:
        plotter.close()
    assert why is not None and paths == [tmp_path / "a.png"]
    assert paths[0].read_bytes()[:4] == b"\x89PNG"


def test_the_command_line_imports_only_the_job_it_runs():
    code = ("import json, sys\nfrom napari_gpu_relion import cli\ntry:\n    cli.main(['ctf_refine', '--help'])\n"
            "except SystemExit:\n    pass\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith("
            "('napari_gpu_relion.jobs.', 'matplotlib', 'cupy')))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mods = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert "napari_gpu_relion.jobs.ctf_refine" in mods and "--fit_defocus" in r.stdout
    others = {m for m in mods if m.startswith("napari_gpu_relion.jobs.")} - {
        f"napari_gpu_relion.jobs.{m}" for m in ("ctf_refine", "common", "particles", "read_ahead", "reconstruct")}
    assert not others, others  # before: every job's module (80 of the package's modules, now 43)
    assert not {m for m in mods if m.startswith(("matplotlib", "cupy"))}

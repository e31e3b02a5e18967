"""Following a job folder (widgets/follow_model.py, no Qt): an iteration is shown once its model STAR(s) and every
image they name are written whole and left alone for settle_s seconds; a half-written iteration waits; the newest
complete state is shown once. Files are written from the test in RELION's layout, the post-processing STAR is a
real RELION one (shared/data)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from relion_files import class2d_iteration, copy_real, refine_iteration

from napari_gpu_relion.events import ClassAveragesUpdated, FscUpdated, MapUpdated
from napari_gpu_relion.io.mrc import write_mrc
from napari_gpu_relion.widgets.follow_model import FolderFollower, is_job_folder

JOB = "Class2D/job010"


def _later() -> float:
    """A time after every file written so far has settled."""
    return time.time() + 10.0


def _images(k: int, seed: int, box: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(k, box, box)).astype(np.float32)


def test_class2d_iterations_are_shown_as_they_complete(tmp_path):
    follower = FolderFollower(tmp_path / JOB, settle_s=0.0)
    assert follower.poll() == []  # no folder yet
    first = _images(4, 1)
    class2d_iteration(tmp_path, JOB, 1, first, [0.4, 0.3, 0.2, 0.1])
    assert is_job_folder(tmp_path / JOB)
    (ev,) = follower.poll(_later())
    assert isinstance(ev, ClassAveragesUpdated) and ev.name == "job010 classes"
    np.testing.assert_allclose(ev.images, first, rtol=1e-6)
    np.testing.assert_allclose(ev.distribution, [0.4, 0.3, 0.2, 0.1])
    np.testing.assert_allclose(ev.resolution_A, [10, 11, 12, 13])
    assert ev.pixel_size == pytest.approx(3.0)
    assert follower.poll(_later()) == []  # shown once

    second = _images(4, 2)
    stack, star = class2d_iteration(tmp_path, JOB, 2, second, [0.1, 0.2, 0.3, 0.4], model=False)
    assert follower.poll(_later()) == []  # the classes without their model STAR: not complete yet
    class2d_iteration(tmp_path, JOB, 2, second, [0.1, 0.2, 0.3, 0.4])
    (ev,) = follower.poll(_later())
    np.testing.assert_allclose(ev.images, second, rtol=1e-6)
    assert follower.shown.iteration == 2


def test_a_half_written_iteration_waits(tmp_path):
    follower = FolderFollower(tmp_path / JOB, settle_s=1.0)
    stack, star = class2d_iteration(tmp_path, JOB, 1, _images(3, 3), [0.5, 0.3, 0.2])
    whole = stack.read_bytes()
    stack.write_bytes(whole[: len(whole) - 100])  # the stack still being written
    assert follower.poll(_later()) == []
    stack.write_bytes(whole)
    assert follower.poll(time.time()) == []  # written just now: not settled for 1 s yet
    mtime = max(stack.stat().st_mtime, star.stat().st_mtime)
    assert follower.poll(mtime + 0.5) == []
    assert len(follower.poll(mtime + 1.5)) == 1

    truncated = star.read_text()
    class2d_iteration(tmp_path, JOB, 2, _images(3, 4), [0.2, 0.3, 0.5])
    star2 = tmp_path / JOB / "run_it002_model.star"
    star2.write_text(truncated[: truncated.index("data_model_classes")])  # no class table yet
    assert follower.poll(_later()) == []


def test_only_the_newest_complete_iteration_is_shown(tmp_path):
    for it in (1, 2, 3):
        class2d_iteration(tmp_path, JOB, it, _images(2, it), [0.5, 0.5])
    class2d_iteration(tmp_path, JOB, 4, _images(2, 4), [0.5, 0.5], model=False)  # iteration 4 under way
    follower = FolderFollower(tmp_path / JOB, settle_s=0.0)
    (ev,) = follower.poll(_later())
    np.testing.assert_allclose(ev.images, _images(2, 3), rtol=1e-6)
    assert follower.shown.iteration == 3
    assert follower.poll(_later()) == []


def test_refine_half_maps_and_fsc(tmp_path):
    job = "Refine3D/job012"
    box = 16
    fsc = np.clip(1.2 - np.arange(box // 2 + 1) / 5.0, 0, 1)
    rng = np.random.default_rng(5)
    halves = (rng.normal(size=(box,) * 3), rng.normal(size=(box,) * 3))
    follower = FolderFollower(tmp_path / job, settle_s=0.0)
    refine_iteration(tmp_path, job, 1, halves, fsc, which=(1,))
    assert follower.poll(_later()) == []  # half 2 not written yet
    refine_iteration(tmp_path, job, 1, halves, fsc, which=(2,))
    events = follower.poll(_later())
    maps = [e for e in events if isinstance(e, MapUpdated)]
    assert [m.name for m in maps] == ["job012 half1", "job012 half2"]
    np.testing.assert_allclose(maps[1].volume, halves[1], rtol=1e-6)
    (curve,) = [e for e in events if isinstance(e, FscUpdated)]
    np.testing.assert_allclose(curve.curves["gold-standard FSC"], np.round(fsc, 6))
    np.testing.assert_allclose(curve.resolution_inv_A, np.arange(box // 2 + 1) / (box * 3.0))
    # the curve's own FSC-0.143 crossing (first value below 0.143 at shell 6: shell 5 = 16 x 3 / 5 Å), not the
    # model's rlnCurrentResolution (RELION's SSNR-based current resolution)
    assert curve.resolution_A == pytest.approx(9.6)


def test_a_real_relion_postprocess_folder(tmp_path):
    folder = tmp_path / "PostProcess" / "job020"
    star = copy_real("relion_postprocess.star", folder / "postprocess.star")
    follower = FolderFollower(folder, settle_s=0.0)
    vol = np.random.default_rng(6).normal(size=(12, 12, 12)).astype(np.float32)
    write_mrc(folder / "postprocess_masked.mrc", vol, 7.5)
    events = follower.poll(_later())
    (curve,) = [e for e in events if isinstance(e, FscUpdated)]
    assert curve.resolution_A == pytest.approx(16.363636)
    assert set(curve.curves) == {"corrected", "unmasked", "masked", "phase randomised"}
    assert curve.curves["corrected"][5] == pytest.approx(0.996670)
    (m,) = [e for e in events if isinstance(e, MapUpdated)]
    assert m.name == "job020 postprocess" and m.pixel_size == pytest.approx(7.5)
    assert follower.poll(_later()) == []
    os.utime(star, ns=(star.stat().st_atime_ns, star.stat().st_mtime_ns + 10**9))  # post-processing run again
    assert len(follower.poll(_later())) == 2

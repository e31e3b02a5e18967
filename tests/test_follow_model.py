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


# ----------------------------------------------------------------------------------------------------------
# Issue 49: what a follow waits for is said, naming the files; the view follows the job kind; plots name the job


def _class3d_model(tmp_path, job: str, it: int, k: int) -> tuple[list, object]:
    """A 3D classification's model STAR naming ``k`` class maps (none written)."""
    from relion_files import write_model_star

    folder = tmp_path / job
    folder.mkdir(parents=True, exist_ok=True)
    refs = [f"{job}/run_it{it:03d}_class{c + 1:03d}.mrc" for c in range(k)]
    star = write_model_star(folder / f"run_it{it:03d}_model.star", refs, [1.0 / k] * k, [12.0] * k, 3, 16, 3.0)
    return [folder / r.split("/")[-1] for r in refs], star


def test_a_model_star_naming_maps_that_are_not_there_says_which(tmp_path):
    job = "Class3D/job007"
    maps, star = _class3d_model(tmp_path, job, 5, 2)
    follower = FolderFollower(tmp_path / job, settle_s=0.0)
    assert follower.poll(_later()) == []
    assert follower.waiting is not None
    assert "iteration 5" in follower.waiting and "run_it005_class001.mrc, run_it005_class002.mrc" in follower.waiting
    assert "run_it005_model.star" in follower.waiting and "not in" in follower.waiting
    vol = np.random.default_rng(7).normal(size=(16, 16, 16)).astype(np.float32)
    write_mrc(maps[0], vol, 3.0)
    assert follower.poll(_later()) == []
    assert "run_it005_class002.mrc" in follower.waiting and "class001" not in follower.waiting  # only the missing
    whole = write_mrc(maps[1], vol, 3.0).read_bytes()
    maps[1].write_bytes(whole[:-200])  # still being written
    assert follower.poll(_later()) == []
    assert "run_it005_class002.mrc not whole yet" in follower.waiting
    maps[1].write_bytes(whole)
    assert len(follower.poll(_later())) == 2 and follower.waiting is None  # both class maps shown


def test_many_missing_files_are_named_up_to_a_few(tmp_path):
    from napari_gpu_relion.widgets.follow_model import MAX_NAMED

    job = "Class3D/job008"
    _class3d_model(tmp_path, job, 1, MAX_NAMED + 3)
    follower = FolderFollower(tmp_path / job, settle_s=0.0)
    assert follower.poll(_later()) == []
    assert "and 3 more" in follower.waiting


def test_a_model_star_opened_as_a_file_names_its_missing_map(tmp_path):
    from napari_gpu_relion.errors import InputError
    from napari_gpu_relion.widgets.follow_model import model_snapshot

    _, star = _class3d_model(tmp_path, "Class3D/job009", 2, 1)
    with pytest.raises(InputError, match="run_it002_class001.mrc named in run_it002_model.star is not in"):
        model_snapshot(star)


def test_the_view_follows_the_kind_of_job():
    from napari_gpu_relion.events import Message, MicrographPicked, ParticlesExtracted
    from napari_gpu_relion.widgets.follow_model import view_of

    grid = ClassAveragesUpdated("classes", _images(2, 1), np.array([0.5, 0.5]), np.array([9.0, 9.0]), 3.0)
    assert view_of(grid) == 2
    assert view_of(MicrographPicked("m", 0, np.zeros((1, 2)), np.zeros(1))) == 2
    extracted = ParticlesExtracted("m", 0, np.zeros((1, 2)), 16, 3.0, _images(1, 2), 3.0)
    assert view_of(extracted) == 2
    assert view_of(MapUpdated("class001", np.zeros((8, 8, 8), np.float32), 3.0)) == 3
    assert view_of(FscUpdated(np.arange(3.0), {"fsc": np.ones(3)}, 10.0)) is None
    assert view_of(Message("hello")) is None


def test_job_labels_name_the_job_folder():
    from napari_gpu_relion.widgets.follow_model import job_label

    assert job_label("/data/project/Refine3D/job012") == "Refine3D/job012"
    assert job_label("/data/project/Refine3D/job012/run") == "Refine3D/job012"  # a rootname
    assert job_label("/data/project/MaskCreate/job014/mask.mrc") == "MaskCreate/job014"  # an output file
    assert job_label("/tmp/my_refinement") == "my_refinement"
    assert job_label("", "refine3d") == "refine3d" and job_label(None, "x") == "x"


def _postprocess_star(folder, with_fsc: bool = True):
    folder.mkdir(parents=True, exist_ok=True)
    text = "data_general\n\n_rlnFinalResolution  9.6\n\n"
    if with_fsc:
        rows = "".join(f"{k} {k / 48.0 + 1e-3:.6f} {max(0.0, 1.0 - k / 6.0):.4f}\n" for k in range(9))
        text += ("data_fsc\n\nloop_\n_rlnSpectralIndex #1\n_rlnResolution #2\n"
                 "_rlnFourierShellCorrelationCorrected #3\n" + rows)
    star = folder / "postprocess.star"
    star.write_text(text)
    return star


def test_a_postprocess_star_opened_as_a_file_comes_with_its_map_or_says_why_not(tmp_path):
    from napari_gpu_relion.errors import InputError
    from napari_gpu_relion.widgets.follow_model import postprocess_snapshot, snapshot_events

    folder = tmp_path / "PostProcess" / "job020"
    star = _postprocess_star(folder)
    snap = postprocess_snapshot(star)
    assert snap.images == ()  # no map beside it: the FSC alone
    (curve,) = snapshot_events(snap, "job020")
    assert isinstance(curve, FscUpdated) and curve.resolution_A == pytest.approx(9.6)
    assert curve.star == star  # the STAR it was read from
    vol = np.random.default_rng(8).normal(size=(12, 12, 12)).astype(np.float32)
    write_mrc(folder / "postprocess.mrc", vol, 4.0)
    write_mrc(folder / "postprocess_masked.mrc", vol, 4.0)
    snap = postprocess_snapshot(star)
    assert [p.name for p in snap.images] == ["postprocess_masked.mrc"]  # the masked map first
    events = snapshot_events(snap, "job020")
    assert [type(e).__name__ for e in events] == ["PostprocessFsc", "MapUpdated"]
    assert events[1].name == "job020 postprocess"
    bad = _postprocess_star(tmp_path / "PostProcess" / "job021", with_fsc=False)
    with pytest.raises(InputError, match="postprocess.star has no data_fsc block"):
        postprocess_snapshot(bad)

"""The Jobs dock in a real (Xvfb) viewer: it lists the jobs started from any dock of the session and chains a job's
output into the next job's dock (auto-picking -> extraction -> 2D classification, no path typed); following a job
folder updates the class grid when a new iteration's files appear, shows a real RELION post-processing's FSC, and
the reader opens a job folder (followed) or a model STAR (shown); the dock fits a 1366 x 768 screen."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("napari")

from qtpy.QtWidgets import QApplication  # noqa: E402
from relion_files import class2d_iteration, copy_real  # noqa: E402

from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: E402
from napari_gpu_relion.widgets.runner import JobState  # noqa: E402

PLUGIN = "napari-gpu-relion"
SCREEN = (1366, 768)

pytestmark = pytest.mark.usefixtures("config_dir")


@pytest.fixture
def sample_dir() -> Path:
    from napari_gpu_relion.jobs.simulate import sample_data_dir

    return Path(sample_data_dir())


def _panel(viewer, project: Path):
    _, panel = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    panel.project.line_edit.value = str(project)
    return panel


def _listed(panel, folder: Path, status: str | None = None):
    """The panel's record of ``folder`` once it lists it (with ``status``), else None (rescans as it asks)."""
    panel.refresh()
    for rec in panel.records:
        if rec.folder.resolve() == folder.resolve() and (status is None or rec.status == status):
            return rec
    return None


def _offers_of(panel, qtbot, folder: Path) -> list:
    """The offers of ``folder``'s job once the panel shows them (found by a scan in the worker thread)."""
    qtbot.waitUntil(lambda: panel.offers_folder is not None and panel.offers_folder.resolve() == folder.resolve(),
                    timeout=10_000)
    return panel.current_offers


def test_the_jobs_panel_chains_a_jobs_output_into_the_next(make_napari_viewer, qtbot, tmp_path, sample_dir, session,
                                                           errors):
    project = tmp_path / "project"
    project.mkdir()
    viewer = make_napari_viewer()
    _, panel = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")  # its project: the current folder, until ...
    _, pick = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    pick.set_values(i=sample_dir / "micrographs.star", odir=project / "AutoPick" / "job001", LoG=True,
                    LoG_diam_min=120.0, LoG_diam_max=180.0, cpu=True)
    job = pick.start_job()
    # the panel knows the job at once, from the dock that started it (before any file is written)
    qtbot.waitUntil(lambda: _listed(panel, project / "AutoPick/job001") is not None, timeout=5_000)
    assert panel.project_folder() == project  # ... a job of this session starts in <project>/<Type>/jobNNN
    assert _listed(panel, project / "AutoPick/job001").session  # a job of this session, not just a folder
    qtbot.waitUntil(lambda: job.done, timeout=60_000)
    assert job.state is JobState.FINISHED, pick.status_text
    qtbot.waitUntil(lambda: _listed(panel, project / "AutoPick/job001", "finished") is not None, timeout=10_000)
    assert panel.table.item(0, 0).text() == "AutoPick" and panel.table.item(0, 2).text() == "finished"

    panel.select_job(project / "AutoPick/job001")
    _offers_of(panel, qtbot, project / "AutoPick/job001")
    labels = [panel.offer_list.item(k).text() for k in range(panel.offer_list.count())]
    row = labels.index("Particle extraction ← coordinates (autopick.star)")
    panel.offer_list.setCurrentRow(row)
    panel.open_button.native.click()  # opens the extraction dock with the picks as its input
    ext = panel.last_opened
    assert ext is not None and ext.job_name == "extract"
    assert ext is viewer.window.dock_widgets["Particle extraction (napari-gpu-relion)"]
    values = ext.values()
    assert values["coord_list"] == project / "AutoPick/job001/autopick.star"
    assert values["i"] == sample_dir / "micrographs.star"  # the micrographs the picks belong to
    assert values["o"] == project / "Extract/job002"  # the next job number, RELION's layout

    ext.set_values(extract_size=64, norm=True, invert_contrast=True, cpu=True)
    job = ext.start_job()
    qtbot.waitUntil(lambda: job.done, timeout=60_000)
    assert job.state is JobState.FINISHED, ext.status_text
    qtbot.waitUntil(lambda: _listed(panel, project / "Extract/job002", "finished") is not None, timeout=10_000)
    panel.select_job(project / "Extract/job002")
    (offer,) = [o for o in _offers_of(panel, qtbot, project / "Extract/job002") if o.job == "class2d"]
    c2d = panel.open_offer(offer=offer)
    assert c2d.job_name == "class2d"
    assert c2d.values()["i"] == project / "Extract/job002/particles.star"
    assert c2d.values()["o"] == project / "Class2D/job003/run"  # the job folder; relion_refine's rootname in it
    assert not errors


def test_the_gui_thread_lists_no_folder_of_the_project(make_napari_viewer, qtbot, tmp_path, monkeypatch, session):
    """The offers of the selected job (the next job folder, the refinement's newest post-processing, its half maps)
    are found in the scan's worker thread, as the list is: the GUI thread lists no folder of the project, when a job
    is selected nor when a rescan finds a new post-processing."""
    from napari_gpu_relion.io.star import write_star_blocks
    from napari_gpu_relion.widgets import jobs_model as jm

    project = tmp_path / "project"
    ref = project / "Refine3D" / "job001"
    ref.mkdir(parents=True)
    for name in ("run_model.star", "run_data.star", "run_class001.mrc", "run_half1_class001_unfil.mrc",
                 "run_half2_class001_unfil.mrc", "RELION_JOB_EXIT_SUCCESS"):
        (ref / name).write_text("x")
    gui = threading.current_thread()
    listed: list[str] = []

    def spy(real):
        def listing(path="."):
            if threading.current_thread() is gui and str(project) in str(path):
                listed.append(str(path))
            return real(path)

        return listing

    monkeypatch.setattr(os, "listdir", spy(os.listdir))
    monkeypatch.setattr(os, "scandir", spy(os.scandir))
    viewer = make_napari_viewer()
    panel = _panel(viewer, project)
    qtbot.waitUntil(lambda: _listed(panel, ref, "finished") is not None, timeout=10_000)
    panel.select_job(ref)
    (offer,) = [o for o in _offers_of(panel, qtbot, ref) if o.job == "ctf_refine"]
    assert offer.values["m1"] == str(ref / "run_half1_class001_unfil.mrc") and not offer.values["f"]

    post = project / "PostProcess" / "job002"
    post.mkdir(parents=True)
    write_star_blocks(post / "postprocess.star", {"general": {
        "rlnUnfilteredMapHalf1": "Refine3D/job001/run_half1_class001_unfil.mrc",
        "rlnUnfilteredMapHalf2": "Refine3D/job001/run_half2_class001_unfil.mrc"}})

    def post_processed() -> bool:  # the next poll's scan finds it and offers it to CTF refinement
        panel.refresh()
        return any(o.job == "ctf_refine" and o.values.get("f") == str(post / "postprocess.star")
                   for o in panel.current_offers)

    qtbot.waitUntil(post_processed, timeout=10_000)
    assert not listed, listed
    # the same offers as the model's, new folders numbered after every listed job
    rec = next(r for r in panel.records if r.folder.resolve() == ref.resolve())
    expected = jm.offers(rec, project, [r.folder for r in panel.records])
    assert [(o.job, o.values) for o in panel.current_offers] == [(o.job, o.values) for o in expected]


def test_following_a_job_folder_updates_the_display(make_napari_viewer, qtbot, tmp_path, session, errors):
    """Files in RELION's layout are written from the test, iteration by iteration, into a folder being followed;
    then a folder with a real RELION postprocess.star."""
    project = tmp_path / "project"
    job = "Class2D/job010"
    viewer = make_napari_viewer()
    panel = _panel(viewer, project)
    panel.follow.interval = 0.1
    panel.follow.settle_s = 0.2
    rng = np.random.default_rng(0)
    first = rng.normal(size=(4, 16, 16)).astype(np.float32)
    class2d_iteration(project, job, 1, first, [0.4, 0.3, 0.2, 0.1])
    panel.follow_folder(project / job)
    assert panel.stop_button.enabled
    display = LiveDisplay.for_viewer(viewer)
    qtbot.waitUntil(lambda: "job010 classes" in viewer.layers and not display.pending
                    and "iteration 1 shown" in panel.follow_info.value, timeout=10_000)
    grid = viewer.layers["job010 classes"]
    shown_first = np.array(grid.data)
    assert shown_first.shape == (32, 32)  # 4 classes of 16 px, 2 x 2

    second = rng.normal(size=(4, 16, 16)).astype(np.float32)
    class2d_iteration(project, job, 2, second, [0.1, 0.2, 0.3, 0.4], model=False)  # maps first, model STAR last
    qtbot.wait(600)
    assert np.array_equal(grid.data, shown_first)  # no model STAR: the iteration is not complete yet
    class2d_iteration(project, job, 2, second, [0.1, 0.2, 0.3, 0.4])
    # the worker yields the maps' events, then the "shown" line: under load they arrive in separate turns
    qtbot.waitUntil(lambda: not np.array_equal(grid.data, shown_first) and not display.pending
                    and "iteration 2 shown" in panel.follow_info.value, timeout=10_000)
    assert viewer.layers["job010 classes"] is grid  # updated in place
    assert grid.metadata["order"][0] == 3  # the largest class of iteration 2 (class 4, 40 %) comes first

    post = project / "PostProcess" / "job011"
    copy_real("relion_postprocess.star", post / "postprocess.star")
    panel.follow_folder(post)  # a real RELION post-processing: its FSC plot
    qtbot.waitUntil(lambda: display.fsc is not None and "16.36" in display.fsc.axes.get_title(), timeout=10_000)
    panel.stop_following()
    assert not panel.follow.active and "stopped following" in panel.follow_info.value
    assert not errors


def test_the_reader_follows_a_job_folder_and_shows_a_model_star(make_napari_viewer, qtbot, tmp_path, session,
                                                                errors):
    project = tmp_path / "project"
    images = np.random.default_rng(1).normal(size=(2, 16, 16)).astype(np.float32)
    _, star = class2d_iteration(project, "Class2D/job004", 3, images, [0.7, 0.3])
    viewer = make_napari_viewer()
    assert viewer.open(str(star), plugin=PLUGIN) == []  # no layer of its own: the live display shows it
    grid = viewer.layers["job004 classes"]
    assert grid.data.shape == (16, 32)  # 2 classes side by side
    viewer.layers.clear()
    assert viewer.open(str(project / "Class2D/job004"), plugin=PLUGIN) == []
    panel = viewer.window.dock_widgets["Jobs (napari-gpu-relion)"]
    assert panel.follow.active and panel.follow.folder == project / "Class2D/job004"
    qtbot.waitUntil(lambda: "job004 classes" in viewer.layers, timeout=10_000)
    panel.stop_following()
    assert not errors


def test_the_jobs_dock_fits_a_1366x768_screen(make_napari_viewer, session):
    viewer = make_napari_viewer()
    main = viewer.window._qt_window  # noqa: SLF001 - the QMainWindow's minimum size is what the screen must hold
    _, panel = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    viewer.window.add_plugin_dock_widget(PLUGIN, "2D classification")
    QApplication.processEvents()
    hint = main.minimumSizeHint()
    assert hint.width() <= SCREEN[0] and hint.height() <= SCREEN[1], hint
    assert panel.native.minimumSizeHint().width() <= 480

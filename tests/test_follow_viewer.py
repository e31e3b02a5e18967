"""Following job folders and opening their files in a real (Xvfb) viewer (issue 49): the viewer's 2D/3D view
follows the kind of job shown, the FSC plot is titled with its job and cleared when another job is followed, the
Jobs dock names the files a followed folder waits for, and a postprocess.star opened as a file shows its FSC curves
with the map beside it, or says that there is none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("napari")

from relion_files import class2d_iteration, refine_iteration, write_model_star  # noqa: E402

from napari_gpu_relion.io.mrc import write_mrc  # noqa: E402
from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: E402

PLUGIN = "napari-gpu-relion"
BOX = 16

pytestmark = pytest.mark.usefixtures("config_dir")


def _panel(viewer, project: Path):
    _, panel = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    panel.project.line_edit.value = str(project)
    panel.follow.interval = 0.1
    panel.follow.settle_s = 0.0
    return panel


def _refine(project: Path, job: str = "Refine3D/job012") -> Path:
    rng = np.random.default_rng(3)
    blob = np.exp(-((np.indices((BOX,) * 3) - BOX / 2) ** 2).sum(0) / 8.0)
    halves = tuple(blob + 0.05 * rng.normal(size=(BOX,) * 3) for _ in range(2))
    refine_iteration(project, job, 3, halves, np.clip(1.2 - np.arange(BOX // 2 + 1) / 5.0, 0, 1))
    return project / job


def _class2d(project: Path, job: str = "Class2D/job010") -> Path:
    images = np.random.default_rng(4).normal(size=(4, BOX, BOX)).astype(np.float32)
    class2d_iteration(project, job, 2, images, [0.4, 0.3, 0.2, 0.1])
    return project / job


@pytest.mark.slow
def test_the_view_follows_the_kind_of_job_followed(make_napari_viewer, qtbot, tmp_path, session, errors):
    """A 3D refinement followed: the 3D view, the FSC titled with the job; then a 2D classification: the 2D view
    with the class grid flat in it, and the refinement's FSC cleared (saying whose curves are awaited); then the
    refinement again: the 3D view and its curves."""
    project = tmp_path / "project"
    refine, classes = _refine(project), _class2d(project)
    viewer = make_napari_viewer()
    panel = _panel(viewer, project)
    display = LiveDisplay.for_viewer(viewer)
    panel.follow_folder(refine)
    qtbot.waitUntil(lambda: "job012 half1" in viewer.layers and display.fsc is not None
                    and display.fsc.axes is not None and not display.pending, timeout=15_000)
    assert viewer.dims.ndisplay == 3
    assert display.fsc.axes.get_title().startswith("Refine3D/job012\n")  # the plot names its job
    assert display.fsc.source == "Refine3D/job012"

    panel.follow_folder(classes)
    assert display.fsc.axes is None and display.fsc.message == "FSC of Class2D/job010: none yet"  # cleared at once
    qtbot.waitUntil(lambda: "job010 classes" in viewer.layers and not display.pending, timeout=15_000)
    assert viewer.dims.ndisplay == 2  # the 2D job's results in the 2D view
    grid = viewer.layers["job010 classes"]
    assert grid.ndim == 2 and grid.visible and grid.data.shape == (2 * BOX, 2 * BOX)
    assert "job012 half1" not in viewer.layers  # the maps kept aside while the 2D view is shown

    panel.follow_folder(refine)
    qtbot.waitUntil(lambda: display.fsc.axes is not None and not display.pending and viewer.dims.ndisplay == 3,
                    timeout=15_000)
    assert display.fsc.axes.get_title().startswith("Refine3D/job012\n")
    panel.stop_following()
    assert not errors


def test_the_users_view_is_kept_while_the_same_job_goes_on(make_napari_viewer, qtbot, tmp_path, session, errors):
    """The view follows a job once, at its first result: the user who turns to the 2D view (napari's button) while
    a followed refinement goes on keeps it; its next iteration's maps are updated aside, and come back in 3D."""
    project = tmp_path / "project"
    refine = _refine(project)
    viewer = make_napari_viewer()
    viewer.add_image(np.zeros((2, 32, 32), np.float32), name="micrographs", metadata={"kind": "micrographs"})
    panel = _panel(viewer, project)
    display = LiveDisplay.for_viewer(viewer)
    panel.follow_folder(refine)
    qtbot.waitUntil(lambda: "job012 half1" in viewer.layers and not display.pending, timeout=15_000)
    assert viewer.dims.ndisplay == 3
    viewer.dims.ndisplay = 2
    assert "job012 half1" not in viewer.layers  # kept aside in the 2D view
    before = display.map_updates["job012 half1"]
    rng = np.random.default_rng(9)
    refine_iteration(project, "Refine3D/job012", 4, (rng.normal(size=(BOX,) * 3), rng.normal(size=(BOX,) * 3)),
                     np.clip(1.1 - np.arange(BOX // 2 + 1) / 5.0, 0, 1))
    qtbot.waitUntil(lambda: "iteration 4 shown" in panel.follow_info.value and not display.pending,
                    timeout=15_000)
    assert display.map_updates["job012 half1"] > before and viewer.dims.ndisplay == 2  # updated, view kept
    viewer.dims.ndisplay = 3
    assert "job012 half1" in viewer.layers
    panel.stop_following()
    assert not errors


def test_the_jobs_dock_names_the_maps_a_followed_folder_waits_for(make_napari_viewer, qtbot, tmp_path, session,
                                                                 errors):
    project = tmp_path / "project"
    job = "Class3D/job007"
    folder = project / job
    folder.mkdir(parents=True)
    refs = [f"{job}/run_it004_class00{k}.mrc" for k in (1, 2)]
    write_model_star(folder / "run_it004_model.star", refs, [0.5, 0.5], [12.0, 12.0], 3, BOX, 3.0)
    viewer = make_napari_viewer()
    panel = _panel(viewer, project)
    panel.follow_folder(folder)
    qtbot.waitUntil(lambda: "run_it004_class002.mrc" in panel.follow_info.value, timeout=10_000)
    text = panel.follow_info.value.replace("\u200b", "")
    assert "waiting for a complete iteration" in text
    assert "run_it004_class001.mrc, run_it004_class002.mrc named in run_it004_model.star are not in" in text
    vol = np.random.default_rng(6).normal(size=(BOX,) * 3).astype(np.float32)
    for k in (1, 2):
        write_mrc(folder / f"run_it004_class00{k}.mrc", vol, 3.0)
    qtbot.waitUntil(lambda: "iteration 4 shown" in panel.follow_info.value, timeout=10_000)
    assert "waiting" not in panel.follow_info.value
    panel.stop_following()
    assert not errors


def _postprocess_star(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{k} {k / 48.0 + 1e-3:.6f} {max(0.0, 1.0 - k / 6.0):.4f} {max(0.0, 1.0 - k / 7.0):.4f}\n"
                   for k in range(9))
    star = folder / "postprocess.star"
    star.write_text("data_general\n\n_rlnFinalResolution  9.6\n\ndata_fsc\n\nloop_\n_rlnSpectralIndex #1\n"
                    "_rlnResolution #2\n_rlnFourierShellCorrelationCorrected #3\n"
                    "_rlnFourierShellCorrelationUnmaskedMaps #4\n" + rows)
    return star


def test_opening_a_postprocess_star_shows_its_curves_and_map_or_says_why_not(make_napari_viewer, tmp_path,
                                                                             monkeypatch, errors):
    from napari_gpu_relion.widgets import display as display_module

    said: list[str] = []
    monkeypatch.setattr(display_module, "show_info", lambda text: said.append(str(text)))
    star = _postprocess_star(tmp_path / "PostProcess" / "job020")
    viewer = make_napari_viewer()
    display = LiveDisplay.for_viewer(viewer)
    assert viewer.open(str(star), plugin=PLUGIN) == []  # no layer of its own: the live display shows it
    title = "PostProcess/job020\nResolution 9.60 Å (FSC = 0.143)"
    assert display.fsc is not None and display.fsc.axes.get_title() == title
    assert said[-1] == ("PostProcess/job020: FSC curves (9.60 Å at FSC 0.143) shown; no map beside postprocess.star "
                        "(postprocess_masked.mrc or postprocess.mrc) to show")

    blob = np.exp(-((np.indices((BOX,) * 3) - BOX / 2) ** 2).sum(0) / 8.0).astype(np.float32)
    write_mrc(star.parent / "postprocess_masked.mrc", blob, 4.0)
    assert viewer.open(str(star), plugin=PLUGIN) == []
    assert "job020 postprocess" in viewer.layers and viewer.dims.ndisplay == 3  # the sharpened, masked map
    assert viewer.layers["job020 postprocess"].metadata["path"].endswith("postprocess_masked.mrc")
    assert said[-1] == "PostProcess/job020: FSC curves (9.60 Å at FSC 0.143) and postprocess_masked.mrc shown"
    assert not errors

"""Running jobs in a real (Xvfb) viewer (issue 18): Cancel is acknowledged at once and stops a job within 2 s;
closing the dock of a running job cancels it (and nothing of the closed widget is called afterwards); an
operating-system error is one line naming the path; result plots dock under the job docks; every dock fits a
1366 x 768 screen."""

from __future__ import annotations

import gc
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("napari")

from qtpy.QtWidgets import QApplication, QDockWidget  # noqa: E402

from napari_gpu_relion.errors import InputError  # noqa: E402
from napari_gpu_relion.events import (  # noqa: E402
    Finished,
    FscUpdated,
    MicrographPicked,
    Progress,
    Started,
)
from napari_gpu_relion.widgets import job_widget as jw  # noqa: E402
from napari_gpu_relion.widgets.display import FSC_DOCK, LiveDisplay  # noqa: E402
from napari_gpu_relion.widgets.job_widget import make_job_widget  # noqa: E402
from napari_gpu_relion.widgets.runner import JobState  # noqa: E402

PLUGIN = "napari-gpu-relion"
WIDGETS = ("Reconstruct", "Auto-picking", "Particle extraction", "2D classification", "3D classification",
           "Class selection", "3D auto-refine", "Post-process", "Mask creation")
SCREEN = (1366, 768)

pytestmark = pytest.mark.usefixtures("config_dir")


@dataclass(frozen=True)
class SlowParams:
    o: Path = field(metadata={"flag": "--o", "help": "Output folder"})
    steps: int = field(default=200, metadata={"flag": "--steps", "help": "Steps"})
    delay: float = field(default=0.05, metadata={"flag": "--delay", "help": "Seconds per step"})
    fsc: bool = field(default=False, metadata={"flag": "--fsc", "help": "Send an FSC curve each step"})

    def __post_init__(self):
        if self.o is None:
            raise InputError("--o is required")


def slow_run(p: SlowParams):
    """A job that works ``delay`` s between events (a batch), writing one file per step."""
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)  # an OSError here when --o lies under a file
    yield Started("slow", out, "CPU (test)")
    shells = np.arange(17)
    for k in range(p.steps):
        time.sleep(p.delay)
        (out / f"step{k:03d}.txt").write_text(str(k))
        yield Progress(k + 1, p.steps, "step")
        if p.fsc:
            yield FscUpdated(shells / 64.0, {"half maps": np.clip(1 - shells / 12, 0, 1)}, 8.0)
    yield Finished({"folder": out}, f"{p.steps} steps")


slow = types.ModuleType("slow_job")
slow.JOB_NAME = "slow"
slow.Params = SlowParams
slow.run = slow_run


def _wait(qtbot, predicate, timeout_ms: int = 10_000) -> None:
    qtbot.waitUntil(predicate, timeout=timeout_ms)


def test_cancel_is_acknowledged_at_once_and_stops_the_job_within_2_s(make_napari_viewer, qtbot, tmp_path, errors):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, slow)
    w.set_values(o=tmp_path / "job", delay=0.3)  # a "batch" of 0.3 s between two events
    w.run_button.native.click()
    _wait(qtbot, lambda: (tmp_path / "job" / "step001.txt").exists())
    assert "step" in w.status_text  # the status follows the job ...
    t0 = time.perf_counter()
    w.cancel_button.native.click()
    # ... and says at once, before any event is processed, that the cancel was heard
    assert w.status_text.startswith("slow: cancelling")
    assert not w.cancel_button.enabled and not w.run_button.enabled
    _wait(qtbot, lambda: w.job.done, 5_000)
    assert time.perf_counter() - t0 < 2.0
    assert w.job.state is JobState.CANCELLED and "cancelled" in w.status_text and w.run_button.enabled
    n = len(list((tmp_path / "job").glob("step*.txt")))
    time.sleep(0.5)
    assert len(list((tmp_path / "job").glob("step*.txt"))) == n < 200  # it stopped
    assert not errors


def test_cancel_stops_a_cpu_refine3d_within_2_s_in_iteration_1(make_napari_viewer, qtbot, tmp_path, errors):
    """The tutorial's 3D auto-refine on the CPU, cancelled 1 s into iteration 1's E-step (one batch of 200
    particles per half, 10-40 s on 2 cores): the worker's finished signal comes within 2 s of the click."""
    from test_cancel import tutorial_refine3d

    from napari_gpu_relion.jobs import refine3d

    viewer = make_napari_viewer()
    w = make_job_widget(viewer, refine3d)
    p = tutorial_refine3d(tmp_path / "Refine3D")
    w.set_values(i=p.i, o=tmp_path / "Refine3D", ref=p.ref, ctf=True, particle_diameter=160.0, flatten_solvent=True,
                 healpix_order=1, auto_local_healpix_order=3, cpu=True)
    w.run_button.native.click()
    # the E-step of iteration 1 has begun (the job's log line, in the status's tooltip under the progress line)
    _wait(qtbot, lambda: "memory plan" in (w.status.tooltip or ""), 60_000)
    qtbot.wait(1000)
    assert w.job.last_progress is None  # inside half 1's only batch
    with qtbot.waitSignal(w.job.worker.finished, timeout=10_000):
        t0 = time.perf_counter()
        w.cancel_button.native.click()
        assert w.status_text.startswith("refine3d: cancelling")
    assert time.perf_counter() - t0 < 2.0
    _wait(qtbot, lambda: w.job.done, 2_000)
    assert w.job.state is JobState.CANCELLED
    assert sorted(q.name for q in (tmp_path / "Refine3D").iterdir()) == ["note.txt"]
    assert not errors


def test_a_queued_job_says_when_it_starts(make_napari_viewer, qtbot, tmp_path, errors):
    from napari_gpu_relion.widgets.runner import JobRunner

    viewer = make_napari_viewer()
    runner = JobRunner("test-device")
    first, second = make_job_widget(viewer, slow, runner=runner), make_job_widget(viewer, slow, runner=runner)
    first.set_values(o=tmp_path / "a", steps=3, delay=0.1)
    second.set_values(o=tmp_path / "b", steps=2, delay=0.3)
    first.run_button.native.click()
    second.run_button.native.click()
    assert "queued" in second.status_text
    _wait(qtbot, lambda: second.job.state is JobState.RUNNING)
    assert "queued" not in second.status_text  # "starting", then the job's own progress
    _wait(qtbot, lambda: second.job.done)
    assert runner.close(5)


def test_jobs_queue_by_the_device_they_really_use():
    """Without a GPU, a job whose --cpu is not ticked runs on the CPU too: it shares the CPU's queue."""
    from types import SimpleNamespace

    from napari_gpu_relion.compute.backend import gpu_available

    cpu_job, gpu_job = SimpleNamespace(cpu=True, gpu=None), SimpleNamespace(cpu=False, gpu=1)
    assert jw._device_of(cpu_job) == "cpu"  # noqa: SLF001
    assert jw._device_of(gpu_job) == ("gpu1" if gpu_available() else "cpu")  # noqa: SLF001
    assert jw._device_of(SimpleNamespace(i="x")) == "cpu"  # noqa: SLF001 - a job without device options


def test_closing_the_dock_of_a_running_job_cancels_it(make_napari_viewer, qtbot, tmp_path, monkeypatch, errors):
    infos: list[str] = []
    monkeypatch.setattr(jw, "show_info", lambda msg: infos.append(str(msg)))
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, slow)
    dock = viewer.window.add_dock_widget(w, name="slow job")
    w.set_values(o=tmp_path / "job", delay=0.05)
    job = w.start_job()
    _wait(qtbot, lambda: (tmp_path / "job" / "step002.txt").exists())
    questions: list[str] = []
    w.ask = lambda question: questions.append(question) or False  # the user answers No ...
    dock.title.close_button.click()  # the dock's ✕, as a user closes it
    qtbot.wait(200)
    assert questions == [jw.CLOSE_QUESTION] == ["A job is running: cancel it and close?"]
    assert job.state is JobState.RUNNING and dock.widget() is w.native and "slow job" in viewer.window.dock_widgets
    w.ask = lambda question: questions.append(question) or True  # ... then Yes
    t0 = time.perf_counter()
    dock.title.close_button.click()
    _wait(qtbot, lambda: job.done, 5_000)
    assert time.perf_counter() - t0 < 2.0
    assert job.state is JobState.CANCELLED and len(questions) == 2
    assert "slow job" not in viewer.window.dock_widgets
    assert infos and "dock was closed" in infos[-1] and "cancelled" in infos[-1]
    assert not errors


def test_the_close_question_is_a_message_box_and_idle_docks_close_without_it(make_napari_viewer, qtbot, tmp_path,
                                                                              errors):
    """The default question is a modal message box (answered here by clicking its Yes button); a dock without a
    running job closes without a question."""
    from qtpy.QtCore import QTimer
    from qtpy.QtWidgets import QMessageBox

    viewer = make_napari_viewer()
    idle = make_job_widget(viewer, slow)
    idle_dock = viewer.window.add_dock_widget(idle, name="idle job")
    qtbot.wait(50)
    idle.ask = lambda question: pytest.fail(f"asked {question!r} without a running job")
    idle_dock.title.close_button.click()
    assert "idle job" not in viewer.window.dock_widgets

    w = make_job_widget(viewer, slow)
    dock = viewer.window.add_dock_widget(w, name="slow job")
    w.set_values(o=tmp_path / "job", delay=0.05)
    job = w.start_job()
    _wait(qtbot, lambda: (tmp_path / "job" / "step001.txt").exists())
    seen: list[str] = []

    def answer_yes() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, answer_yes)
            return
        seen.append(box.text())
        box.button(QMessageBox.StandardButton.Yes).click()

    QTimer.singleShot(20, answer_yes)
    dock.title.close_button.click()  # returns when the box was answered
    assert seen == [jw.CLOSE_QUESTION]
    _wait(qtbot, lambda: job.done, 5_000)
    assert job.state is JobState.CANCELLED and "slow job" not in viewer.window.dock_widgets
    assert not errors


def test_a_closed_autopick_dock_is_never_called_again(make_napari_viewer, qtbot, errors):
    """The former `destroyed` lambda raised "NameError: cannot access free variable 'display'" when the garbage
    collector had cleared its closure before Qt deleted the widget. Now no closure is connected: a closed widget
    ignores the display, Qt can delete it and Python collect it in either order, and the display holds its
    listeners weakly (a listener that is gone is dropped, never called)."""
    from qtpy.QtCore import QEvent

    viewer = make_napari_viewer()
    display = LiveDisplay.for_viewer(viewer)
    dock, w = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    dock.title.close_button.click()  # the dock's ✕
    display.handle(MicrographPicked("mic001.mrc", 0, np.array([[10.0, 20.0]]), np.array([0.5])))
    display.flush()
    assert "picks" in viewer.layers and w.picks_info.value == "no picks yet"  # the closed widget did not react
    native = w.native
    del w
    gc.collect()  # Python first ...
    native.deleteLater()
    del native
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)  # ... then Qt: `destroyed` is emitted
    gc.collect()

    class Listener:
        def __init__(self) -> None:
            self.calls = 0

        def on_picks(self, _layer) -> None:
            self.calls += 1

    listener = Listener()
    display.connect("picks", listener.on_picks)
    display.handle(MicrographPicked("mic001.mrc", 0, np.array([[30.0, 40.0]]), np.array([0.7])))
    display.flush()
    assert listener.calls == 1
    n_before = len(display._listeners["picks"])  # noqa: SLF001
    del listener
    gc.collect()
    display.handle(MicrographPicked("mic001.mrc", 0, np.array([[50.0, 60.0]]), np.array([0.9])))
    display.flush()  # the dead listener is dropped, not called
    assert len(display._listeners["picks"]) == n_before - 1  # noqa: SLF001
    assert not errors


def test_os_error_is_one_line_naming_the_path(make_napari_viewer, qtbot, tmp_path, errors):
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("x")
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, slow)
    w.set_values(o=a_file / "job001")
    w.run_button.native.click()
    _wait(qtbot, lambda: w.job.done)
    assert w.job.state is JobState.FAILED
    expected = f"slow failed: Not a directory: {a_file / 'job001'}"
    assert w.status_text == expected
    assert errors and errors[-1] == expected  # the notification: the same single line, no traceback
    assert "\n" not in errors[-1] and "Errno" not in errors[-1] and "Traceback" not in errors[-1]


def test_result_plots_are_tabs_under_the_job_docks(make_napari_viewer, qtbot, tmp_path, errors):
    """Issue 49: the plots are a group under the panel of job docks (never a column beside it, which left the canvas
    no room); the next job's dock is a tab of the panel, above the same plot dock."""
    viewer = make_napari_viewer(show=True)
    w = make_job_widget(viewer, slow)
    job_dock = viewer.window.add_dock_widget(w, name="slow job")
    w.set_values(o=tmp_path / "job", steps=2, delay=0.0, fsc=True)
    w.run_button.native.click()
    _wait(qtbot, lambda: w.job.done and not w.display.pending)
    fsc_dock = viewer.window.dock_widgets[FSC_DOCK].parentWidget()
    assert isinstance(fsc_dock, QDockWidget)
    main = job_dock.parentWidget()
    QApplication.processEvents()
    assert fsc_dock not in main.tabifiedDockWidgets(job_dock)  # not a tab over the job dock
    assert job_dock.isVisible() and fsc_dock.isVisible() and w.cancel_button.native.isVisible()
    assert fsc_dock.geometry().top() >= job_dock.geometry().bottom()  # under it, as wide
    assert abs(fsc_dock.geometry().left() - job_dock.geometry().left()) <= 2
    w2 = make_job_widget(viewer, slow)
    dock2 = viewer.window.add_dock_widget(w2, name="next job")
    QApplication.processEvents()
    assert job_dock in main.tabifiedDockWidgets(dock2)  # a tab of the panel
    w2.set_values(o=tmp_path / "job2", steps=2, delay=0.0, fsc=True)
    w2.run_button.native.click()
    _wait(qtbot, lambda: w2.job.done and not w2.display.pending)
    QApplication.processEvents()
    assert viewer.window.dock_widgets[FSC_DOCK].parentWidget() is fsc_dock  # the same plot dock, redrawn
    assert fsc_dock not in main.tabifiedDockWidgets(dock2)
    assert fsc_dock.geometry().top() >= dock2.geometry().bottom()
    assert not errors


def test_every_dock_fits_a_1366x768_screen(make_napari_viewer):
    """Each job dock alone, and two job docks at once (stacked in the right dock area), leave the main window a
    minimum size within 1366 x 768; the option tabs, Run/Cancel and the status line stay inside."""
    viewer = make_napari_viewer()
    main = viewer.window._qt_window  # noqa: SLF001 - the QMainWindow's minimum size is what the screen must hold
    for name in WIDGETS:
        dock, w = viewer.window.add_plugin_dock_widget(PLUGIN, name)
        QApplication.processEvents()
        hint = main.minimumSizeHint()
        assert hint.width() <= SCREEN[0] and hint.height() <= SCREEN[1], (name, hint)
        assert w.native.minimumSizeHint().width() <= 480, name  # leaves the canvas room beside the dock
        assert w.tabs.count() >= 2, name  # options in tabs
        viewer.window.remove_dock_widget(dock)
    viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    viewer.window.add_plugin_dock_widget(PLUGIN, "2D classification")
    QApplication.processEvents()
    hint = main.minimumSizeHint()
    assert hint.width() <= SCREEN[0] and hint.height() <= SCREEN[1], hint


def test_display_binning_and_lowpass_keep_the_picks_on_their_particles(make_napari_viewer, qtbot, monkeypatch,
                                                                       errors):
    """The picking dock's display controls re-render the micrographs binned 4x and low-passed at 30 Å, in a
    worker thread: every particle's displayed centre lies under its pick (in Å), the picks layer and the
    micrographs' original data are untouched, and binning 1 / low-pass 0 shows the original again."""
    import threading

    from napari_gpu_relion.widgets import micrograph_view as mv

    threads: list[str] = []
    real = mv.display_micrograph
    monkeypatch.setattr(mv, "display_micrograph",
                        lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k))
    apix = 2.0
    yy, xx = np.mgrid[0:200, 0:240]
    centres = [(0, 53, 71), (0, 140, 180), (1, 101, 37), (1, 30, 200)]  # (micrograph, y, x) pixels
    mics = np.zeros((2, 200, 240), np.float32)
    for m, y, x in centres:
        mics[m] += np.exp(-((yy - y) ** 2 + (xx - x) ** 2) / (2 * 6.0**2))
    viewer = make_napari_viewer()
    layer = viewer.add_image(mics, name="micrographs", scale=(1, apix, apix),
                             metadata={"kind": "micrographs", "pixel_size": apix})
    picks = viewer.add_points(np.array([(m, y * apix, x * apix) for m, y, x in centres], float), name="picks")
    before = picks.data.copy()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    w.micrograph_display.bin_factor.value = 4
    w.micrograph_display.lowpass.value = 30.0
    _wait(qtbot, lambda: w.micrograph_display.renders == 1 and not w.micrograph_display.busy)
    assert threads and threading.main_thread().name not in threads  # rendered off the GUI thread
    assert layer.data.shape == (2, 50, 60) and tuple(layer.scale) == (1.0, 8.0, 8.0)
    assert layer.metadata[mv.SOURCE_KEY]["data"] is mics  # the data the picker would read is not changed
    np.testing.assert_array_equal(picks.data, before)
    for m, y, x in centres:
        world = np.array([m, y * apix, x * apix])  # the pick
        _, dy, dx = np.round(layer.world_to_data(world)).astype(int)  # the displayed pixel under it
        y0, x0 = max(dy - 5, 0), max(dx - 5, 0)
        window = np.clip(layer.data[m, y0:dy + 6, x0:dx + 6], 0, None)
        jj, ii = np.mgrid[0:window.shape[0], 0:window.shape[1]]
        cy, cx = (window * jj).sum() / window.sum() + y0, (window * ii).sum() / window.sum() + x0
        centre = np.asarray(layer.data_to_world([m, cy, cx]))  # the displayed particle's centre, in Å
        # within 0.5 Å: a binned layer drawn without its 3 Å shift (half a binned pixel less one pixel) would miss
        assert np.all(np.abs(centre[1:] - world[1:]) < 0.5), (m, y, x, centre)
    w.micrograph_display.bin_factor.value = 1
    w.micrograph_display.lowpass.value = 0.0
    _wait(qtbot, lambda: w.micrograph_display.renders >= 2 and not w.micrograph_display.busy)
    assert layer.data is mics and tuple(layer.scale) == (1.0, apix, apix) and tuple(layer.translate) == (0, 0, 0)
    assert not errors

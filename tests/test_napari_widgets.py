"""Job widgets, runner and live display of napari-gpu-relion in a real (Xvfb) napari viewer."""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("napari")

from magicgui.widgets import CheckBox, FileEdit, FloatSpinBox, LineEdit, SpinBox  # noqa: E402

from napari_gpu_relion.errors import InputError  # noqa: E402
from napari_gpu_relion.events import (  # noqa: E402
    Finished,
    FscUpdated,
    MapUpdated,
    MicrographPicked,
    Progress,
    Started,
)
from napari_gpu_relion.io.atomic import atomic_path  # noqa: E402
from napari_gpu_relion.io.mrc import read_mrc  # noqa: E402
from napari_gpu_relion.widgets import job_widget as jw  # noqa: E402
from napari_gpu_relion.widgets import runner as rn  # noqa: E402
from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: E402
from napari_gpu_relion.widgets.job_widget import make_job_widget  # noqa: E402
from napari_gpu_relion.widgets.runner import JobRunner, JobState  # noqa: E402

PLUGIN = "napari-gpu-relion"
PAYLOAD = 64 * 1024  # bytes per toy output file, written in chunks


# ----------------------------------------------------------------------------------------------------------
# A toy job module with the job convention: JOB_NAME, frozen Params with flag/help metadata, run() generator


def _md(flag: str, text: str) -> dict:
    return {"flag": flag, "help": text}


@dataclass(frozen=True)
class ToyParams:
    o: Path = field(metadata=_md("--o", "Output folder"))
    steps: int = field(default=4, metadata=_md("--steps", "Number of steps"))
    delay: float = field(default=0.0, metadata=_md("--delay", "Seconds of work per step (s)"))
    angpix: float = field(default=2.5, metadata=_md("--angpix", "Pixel size (Å)"))
    box: int = field(default=24, metadata=_md("--box", "Map box (px)"))
    maps: bool = field(default=True, metadata=_md("--maps", "Send a map every step"))
    picks: bool = field(default=False, metadata=_md("--picks", "Send picks of 3 micrographs"))
    fail_at: int | None = field(default=None, metadata=_md("--fail_at", "Raise a RuntimeError at this step"))
    sym: str = field(default="C1", metadata=_md("--sym", "Symmetry"))
    ref: Path | None = field(default=None, metadata=_md("--ref", "Optional reference map"))

    def __post_init__(self):
        if self.o is None:
            raise InputError("--o output folder is required")
        if self.steps < 1:
            raise InputError(f"--steps must be at least 1, got {self.steps}")


def _blob(box: int, k: int) -> np.ndarray:
    z, y, x = np.mgrid[:box, :box, :box] - box / 2
    return np.exp(-(x * x + y * y + z * z) / (2 * (box / 6) ** 2)).astype(np.float32) * (k + 1)


def toy_run(p: ToyParams):
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)
    yield Started("toy", out, "CPU (test)", "toy job")
    shells = np.arange(p.box // 2 + 1)
    for k in range(p.steps):
        if p.fail_at is not None and k == p.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        with atomic_path(out / f"step{k:03d}.bin") as tmp:  # cancel may land inside: temp file removed
            with open(tmp, "wb") as fh:
                for _ in range(4):
                    fh.write(bytes([k % 251]) * (PAYLOAD // 4))
                    if p.delay:
                        time.sleep(p.delay / 4)
                    yield Progress(k, p.steps, "writing")
        yield Progress(k + 1, p.steps, "step")
        if p.maps:
            yield MapUpdated("toy_map", _blob(p.box, k), p.angpix, out / "toy_map.mrc")
            fsc = np.clip(1.0 - shells / (shells[-1] * (0.5 + 0.1 * k)), -0.05, 1.0)
            yield FscUpdated(shells / (p.box * p.angpix), {"half maps": fsc}, p.box * p.angpix / (k + 4))
        if p.picks:
            for mic in range(3):
                n = 5 + mic
                yield MicrographPicked(f"mic{mic:03d}.mrc", mic, np.column_stack([np.arange(n) * 10.0 + mic,
                                                                                    np.arange(n) * 7.0]),
                                       np.linspace(0, 1, n))
    yield Finished({"folder": out}, f"{p.steps} steps")


toy = types.ModuleType("toy_job")
toy.JOB_NAME = "toy"
toy.Params = ToyParams
toy.run = toy_run


# ----------------------------------------------------------------------------------------------------------
# Fixtures


pytestmark = pytest.mark.usefixtures("config_dir")  # own settings folder per test (tests/conftest.py)


@pytest.fixture(scope="module")
def sample_dir() -> Path:
    from napari_gpu_relion.jobs.simulate import sample_data_dir

    return Path(sample_data_dir())


def _wait_done(qtbot, widget, timeout=20_000):
    """Until the job is done and the display has shown its last results (one per event-loop turn)."""
    qtbot.waitUntil(lambda: widget.job is not None and widget.job.done and not widget.display.pending,
                    timeout=timeout)


# ----------------------------------------------------------------------------------------------------------
# Building widgets from Params


def _assert_mesh_on_level(vertices: np.ndarray, volume: np.ndarray, level: float) -> None:
    """The mesh is the iso-surface: the volume, interpolated at its vertices (voxels), equals the level."""
    from scipy.ndimage import map_coordinates

    assert len(vertices) > 100
    values = map_coordinates(volume, vertices.T, order=1)
    np.testing.assert_allclose(values, level, atol=0.02 * (volume.max() - volume.min()))


def test_widget_built_from_params(make_napari_viewer):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    assert isinstance(w.inputs["o"], FileEdit) and w.inputs["o"].mode.value == "d"  # output folder
    assert isinstance(w.inputs["ref"], FileEdit) and w.inputs["ref"].mode.value == "r"  # input file
    assert isinstance(w.inputs["steps"], SpinBox) and w.inputs["steps"].max >= 2**31 - 1
    assert isinstance(w.inputs["delay"], FloatSpinBox)
    assert isinstance(w.inputs["maps"], CheckBox)
    assert isinstance(w.inputs["sym"], LineEdit)
    assert isinstance(w.inputs["fail_at"], LineEdit) and w.inputs["fail_at"].value == ""  # int | None
    assert w.inputs["steps"].label == "--steps"  # a flag the form table does not know: itself, folded
    assert "Number of steps" in w.inputs["steps"].tooltip and "--steps" in w.inputs["steps"].tooltip
    assert w.inputs["angpix"].value == pytest.approx(2.5)
    for name in ("run_button", "cancel_button", "progress", "status", "folder", "open_button"):
        assert getattr(w, name) is not None
    assert not w.cancel_button.enabled


def test_plugin_widgets_dock(make_napari_viewer):
    from napari_gpu_relion.jobs import (
        autopick,
        class2d,
        class3d,
        ctf_refine,
        extract,
        initial_model,
        local_resolution,
        mask_create,
        postprocess,
        reconstruct,
        refine3d,
        select,
    )

    viewer = make_napari_viewer()
    for name, module in (("Reconstruct", reconstruct), ("Post-process", postprocess),
                         ("Mask creation", mask_create), ("3D auto-refine", refine3d),
                         ("3D classification", class3d), ("Auto-picking", autopick),
                         ("Particle extraction", extract), ("2D classification", class2d),
                         ("Class selection", select), ("3D initial model", initial_model),
                         ("CTF refinement", ctf_refine), ("Local resolution", local_resolution)):
        _, w = viewer.window.add_plugin_dock_widget(PLUGIN, name)
        assert w.job_module is module
        label = w.inputs["i"].label
        assert not label.startswith("--") and label[0].isupper()  # words, not the flag
        assert "--i " in w.inputs["i"].tooltip  # the RELION flag is in the tooltip
    rec = viewer.window.add_plugin_dock_widget(PLUGIN, "Reconstruct")[1]
    assert rec.inputs["o"].mode.value == "w" and rec.inputs["gpu"].value == ""
    post = viewer.window.add_plugin_dock_widget(PLUGIN, "Post-process")[1]
    assert post.inputs["o"].mode.value == "d"


def test_parameters_remembered(make_napari_viewer, tmp_path, config_dir):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    w.inputs["o"].line_edit.value = str(tmp_path / "job001")
    w.inputs["steps"].value = 17
    w.inputs["delay"].value = 0.125
    w.inputs["maps"].value = False
    w.inputs["fail_at"].value = "3"
    w.inputs["sym"].value = "D7"
    assert (config_dir / "toy.json").is_file()
    w2 = make_job_widget(viewer, toy)
    values = w2.values()
    assert values["o"] == tmp_path / "job001"
    assert (values["steps"], values["delay"], values["maps"], values["fail_at"], values["sym"]) == \
        (17, 0.125, False, 3, "D7")
    assert values["ref"] is None
    assert w2.folder.value == str(tmp_path / "job001")
    (config_dir / "toy.json").write_text("{not json")  # a broken file falls back to defaults
    assert make_job_widget(viewer, toy).values()["steps"] == 4


# ----------------------------------------------------------------------------------------------------------
# Bad parameters


def test_bad_parameter_shows_error_and_starts_nothing(make_napari_viewer, tmp_path, errors):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    w.inputs["o"].line_edit.value = str(tmp_path / "job")
    w.inputs["steps"].value = 0
    w.run_button.native.click()
    assert w.job is None
    assert "--steps must be at least 1" in w.status_text
    assert errors and "--steps must be at least 1" in errors[-1]
    assert not (tmp_path / "job").exists()

    w.inputs["steps"].value = 2
    w.inputs["fail_at"].value = "two"  # unparsable optional int
    w.run_button.native.click()
    assert w.job is None and "--fail_at" in w.status_text

    w.inputs["fail_at"].value = ""
    w.inputs["o"].line_edit.value = ""  # missing required output
    w.run_button.native.click()
    assert w.job is None and "--o output folder is required" in w.status_text


def test_runtime_error_in_job_is_reported(make_napari_viewer, qtbot, tmp_path, errors):
    """superqt drops RuntimeErrors of generator workers; the runner must turn them into a visible error."""
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    w.set_values(o=tmp_path / "job", steps=5, fail_at=2)
    w.run_button.native.click()
    _wait_done(qtbot, w)
    assert w.job.state is JobState.FAILED
    assert isinstance(w.job.error, rn.JobError)
    assert "illegal memory access" in w.status_text
    assert any("illegal memory access" in e for e in errors)
    assert w.run_button.enabled and not w.cancel_button.enabled
    assert sorted(p.name for p in (tmp_path / "job").glob("step*.bin")) == ["step000.bin", "step001.bin"]


# ----------------------------------------------------------------------------------------------------------
# Running: layers updated in place


def test_toy_job_updates_layers_in_place(make_napari_viewer, qtbot, tmp_path, errors):
    viewer = make_napari_viewer()
    added = []
    viewer.layers.events.inserted.connect(lambda e: added.append(e.value.name))
    w = make_job_widget(viewer, toy)
    w.set_values(o=tmp_path / "job", steps=4, picks=True)
    w.run_button.native.click()
    assert w.cancel_button.enabled and not w.run_button.enabled
    _wait_done(qtbot, w)
    assert w.job.state is JobState.FINISHED, w.status_text
    assert not errors
    assert added.count("toy_map") == 1 and added.count("picks") == 1  # created once, then updated
    layer = viewer.layers["toy_map"]
    assert type(layer).__name__ == "Surface"  # the iso-surface as a mesh (computed in the worker thread)
    np.testing.assert_array_equal(layer.metadata["volume"], _blob(24, 3))  # the last iteration's map
    np.testing.assert_allclose(layer.scale, [2.5] * 3)
    assert tuple(str(u) for u in layer.units) == ("angstrom",) * 3
    level = layer.metadata["iso_level"]
    assert 0 < level < 4
    _assert_mesh_on_level(layer.data[0], _blob(24, 3), level)
    display = LiveDisplay.for_viewer(viewer)
    assert 1 <= display.map_updates["toy_map"] <= 4  # coalesced: at most one refresh per event
    assert display.fsc is not None and display.fsc.draw_count >= 1
    assert "Resolution" in display.fsc.axes.get_title() and "Å" in display.fsc.axes.get_title()
    picks = viewer.layers["picks"]
    assert picks.data.shape == (5 + 6 + 7, 3)
    assert "fom" in picks.features.columns
    np.testing.assert_array_equal(picks.data[:5, 2], np.arange(5) * 10.0)  # col = x
    display.set_pick_threshold(0.5)
    assert picks.shown.sum() == (picks.features["fom"] >= 0.5).sum() < len(picks.data)
    assert w.progress.value == w.progress.max == 4
    assert "finished" in w.status_text
    assert w.folder.value == str(tmp_path / "job")


# ----------------------------------------------------------------------------------------------------------
# Cancel, queue, responsiveness


def test_cancel_keeps_viewer_usable_and_files_complete(make_napari_viewer, qtbot, tmp_path, errors):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    out = tmp_path / "job"
    w.set_values(o=out, steps=100, delay=0.02, maps=False)
    w.run_button.native.click()
    qtbot.waitUntil(lambda: len(list(out.glob("step*.bin"))) >= 3, timeout=10_000)
    qtbot.wait(15)  # likely inside the chunked write of the next file
    w.cancel_button.native.click()
    _wait_done(qtbot, w, timeout=5_000)
    assert w.job.state is JobState.CANCELLED
    assert "cancelled" in w.status_text
    assert not errors
    files = sorted(out.iterdir())
    steps = [f for f in files if f.name.startswith("step")]
    assert 3 <= len(steps) < 100
    assert [f.name for f in files if f.name not in {s.name for s in steps}] == []  # no temp files left
    for k, f in enumerate(steps):
        assert f.name == f"step{k:03d}.bin"
        data = f.read_bytes()
        assert len(data) == PAYLOAD and data == bytes([k % 251]) * PAYLOAD
    time.sleep(0.2)
    assert len(list(out.glob("step*.bin"))) == len(steps)  # nothing written after the cancel
    # the viewer and the widget stay usable
    viewer.add_image(np.zeros((8, 8)), name="after")
    assert "after" in viewer.layers
    w.set_values(steps=2, delay=0.0)
    w.run_button.native.click()
    _wait_done(qtbot, w)
    assert w.job.state is JobState.FINISHED


def test_quit_from_task_list_or_closing_the_viewer_stops_the_job(make_napari_viewer, qtbot, tmp_path, errors):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    w.set_values(o=tmp_path / "a", steps=100, delay=0.02, maps=False)
    w.run_button.native.click()
    qtbot.waitUntil(lambda: (tmp_path / "a" / "step001.bin").exists(), timeout=10_000)
    w.job.worker.quit()  # what napari's task list (and closing the window) does
    _wait_done(qtbot, w, timeout=5_000)
    assert w.job.state is JobState.CANCELLED and not errors

    viewer.window.add_dock_widget(w, name="toy")
    w.set_values(o=tmp_path / "b")
    job = w.start_job()
    qtbot.waitUntil(lambda: (tmp_path / "b" / "step001.bin").exists(), timeout=10_000)
    viewer.close()  # the window goes, the widget is deleted: the job must stop and its thread end
    qtbot.waitUntil(lambda: not job.worker.is_running, timeout=5_000)
    assert len(list((tmp_path / "b").glob("step*.bin"))) < 100


def test_open_folder_button(make_napari_viewer, tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(jw, "_open_in_file_browser", lambda p: opened.append(p) or True)
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, toy)
    w.set_values(o=tmp_path / "job")
    assert w.folder.value == str(tmp_path / "job")
    w.open_button.native.click()
    assert opened == [] and "does not exist yet" in w.status_text
    (tmp_path / "job").mkdir()
    w.open_button.native.click()
    assert opened == [tmp_path / "job"]


def test_jobs_queue_one_at_a_time(make_napari_viewer, qtbot, tmp_path, errors):
    viewer = make_napari_viewer()
    runner = JobRunner("test-device")
    w1 = make_job_widget(viewer, toy, runner=runner)
    w2 = make_job_widget(viewer, toy, runner=runner)
    w1.set_values(o=tmp_path / "a", steps=10, delay=0.02, maps=False)
    w2.set_values(o=tmp_path / "b", steps=2, maps=False)
    started = []
    runner.on(Started, lambda ev: started.append(ev.output_dir.name))
    w1.run_button.native.click()
    w2.run_button.native.click()
    assert w1.job.state is JobState.RUNNING and w2.job.state is JobState.QUEUED
    assert "queued" in w2.status_text
    qtbot.waitUntil(lambda: w2.job.done, timeout=10_000)
    assert w1.job.state is JobState.FINISHED and w2.job.state is JobState.FINISHED
    assert started == ["a", "b"]
    # a queued job can be cancelled before it starts
    w1.run_button.native.click()
    w2.run_button.native.click()
    w2.cancel_button.native.click()
    assert w2.job.state is JobState.CANCELLED and not (tmp_path / "b" / "step009.bin").exists()
    assert runner.close(timeout=5) is True  # the worker thread has stopped
    qtbot.waitUntil(lambda: w1.job.done, timeout=5_000)  # its finished signal arrives through the event loop
    assert w1.job.state is JobState.CANCELLED


@pytest.mark.slow
def test_ui_stays_responsive_while_a_job_runs(make_napari_viewer, qtbot, tmp_path, errors):
    """A 20 ms QTimer is never more than 200 ms late (but once) while a job streams maps, FSC curves and picks.

    A first short run creates the layers and the FSC dock (napari builds a layer's visuals in the GUI
    thread: ~0.1-0.25 s each on this software-GL VM, once per session); the measured run updates them in
    place, as every iteration of a real job does.
    """
    from qtpy.QtCore import QTimer

    viewer = make_napari_viewer()
    viewer.add_image(np.zeros((3, 128, 128), np.float32), name="micrographs", scale=(1, 2.5, 2.5),
                     units=("angstrom",) * 3, metadata={"kind": "micrographs", "pixel_size": 2.5})
    w = make_job_widget(viewer, toy)
    w.set_values(o=tmp_path / "warmup", steps=2, box=48, picks=True)
    w.run_button.native.click()
    _wait_done(qtbot, w)
    display = LiveDisplay.for_viewer(viewer)
    # the new picks layer brought the 2D view back (maps are kept aside there, in the 3D view they come back)
    assert "picks" in viewer.layers and display.map_layer("toy_map") is not None

    w.set_values(o=tmp_path / "job", steps=30, delay=0.02, box=48, picks=True)
    lateness: list[float] = []
    last = [time.perf_counter()]

    def tick():
        now = time.perf_counter()
        lateness.append(now - last[0] - 0.020)
        last[0] = now

    timer = QTimer()
    timer.setInterval(20)
    timer.timeout.connect(tick)
    timer.start()
    qtbot.wait(60)
    lateness.clear()
    w.run_button.native.click()
    _wait_done(qtbot, w, timeout=30_000)
    timer.stop()
    assert w.job.state is JobState.FINISHED
    assert len(lateness) > 20
    # Work on the GUI thread recurs with every update (the map changes >= 3 times below), so it makes several ticks
    # late; one stall of the whole VM (2 shared cores, Xvfb beside us: 227 ms once in CI among ~40 ticks at 20-25 ms)
    # makes one. The worst single gap under load is measured by benchmarks/event_loop.py, not by a unit test.
    late = sorted(lateness)
    assert late[-2] < 0.200, f"GUI timer late by more than 200 ms {sum(x >= 0.2 for x in late)} times: {late[-3:]}"
    assert float(np.median(late)) < 0.020, f"GUI timer late by {np.median(late) * 1000:.0f} ms at the median"
    assert display.map_updates["toy_map"] >= 3  # the map kept changing while the job ran
    np.testing.assert_array_equal(display.map_layer("toy_map").metadata["volume"], _blob(48, 29))


def test_while_jobs_run_full_collections_come_in_gui_turns_of_their_own(qtbot):
    """While jobs run, the objects alive at the start are frozen and CPython makes no full collection by itself
    (one that starts inside a display update adds 20-90 ms to it); a GUI timer collects the garbage in cycles
    instead, never within GC_GAP_AFTER_UPDATE of a display update unless updates in a row put it off GC_MAX_DELAY,
    and a display update waits GC_GAP_AFTER_UPDATE after a collection. All is undone after the last job; nested
    blocks keep it until the outermost ends."""
    import gc
    import weakref

    from qtpy.QtCore import QTimer

    from napari_gpu_relion.widgets import runner

    class Node:
        pass

    def cycle() -> weakref.ref:
        """A reference cycle that becomes garbage only once it is in the oldest generation."""
        a, b = Node(), Node()
        a.other, b.other = b, a
        for _ in range(2):
            gc.collect(1)  # a young collection moves survivors up a generation
        return weakref.ref(a)

    before = gc.get_threshold()
    with runner.frozen_gc():
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[:2] == before[:2]
        assert gc.get_threshold()[2] > 10**6  # no automatic full collection
        ref = cycle()
        for _ in range(3):
            gc.collect(1)  # young collections cannot free it
        assert ref() is not None
        qtbot.waitUntil(lambda: ref() is None, timeout=int(4 * runner.GC_INTERVAL * 1000))
        assert 0 < runner.wait_after_collection() <= runner.GC_GAP_AFTER_UPDATE

        # a display update just now: the collection waits GC_GAP_AFTER_UPDATE after it
        ref = cycle()
        busy_from = time.monotonic()
        runner.note_gui_busy(3 * runner.GC_INTERVAL)
        qtbot.waitUntil(lambda: ref() is None, timeout=int(8 * runner.GC_INTERVAL * 1000))
        assert time.monotonic() - busy_from >= 3 * runner.GC_INTERVAL + runner.GC_GAP_AFTER_UPDATE - 0.005

        # display updates in a row (every 30 ms) put it off, but at most GC_MAX_DELAY
        busy = QTimer()
        busy.setInterval(30)
        busy.timeout.connect(lambda: runner.note_gui_busy())
        ref = cycle()
        busy_from = time.monotonic()
        runner.note_gui_busy()  # an update now, then every 30 ms
        busy.start()
        try:
            qtbot.waitUntil(lambda: ref() is None, timeout=int(4 * (runner.GC_MAX_DELAY + runner.GC_INTERVAL) * 1000))
        finally:
            busy.stop()
        assert runner.GC_MAX_DELAY - 0.005 <= time.monotonic() - busy_from

        with runner.frozen_gc():
            pass
        assert gc.get_threshold()[2] > 10**6 and gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert not runner._gc_timer.isActive()  # no timer collects outside jobs


# ----------------------------------------------------------------------------------------------------------
# The real jobs through their plugin widgets


def test_reconstruct_widget_shows_map(make_napari_viewer, qtbot, tmp_path, sample_dir, errors):
    from napari_gpu_relion.io.mrc import read_mrc

    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "Reconstruct")
    star = sample_dir / "particles.star"
    if not star.is_file():
        star = sample_dir / "particles" / "particles.star"
    out = tmp_path / "Reconstruct" / "job001" / "run_class001.mrc"
    w.inputs["i"].line_edit.value = str(star)
    w.inputs["o"].line_edit.value = str(out)
    w.inputs["ctf"].value = True
    w.inputs["cpu"].value = True
    w.run_button.native.click()
    _wait_done(qtbot, w, timeout=60_000)
    assert w.job.state is JobState.FINISHED, w.status_text
    assert not errors
    layer = viewer.layers[out.stem]
    written = read_mrc(out)
    assert layer.metadata["volume"].shape == written.data.shape
    np.testing.assert_allclose(layer.metadata["volume"], written.data)
    np.testing.assert_allclose(layer.scale, [written.pixel_size] * 3)
    assert w.folder.value == str(out.parent)
    assert (out.parent / "note.txt").is_file()


def test_postprocess_and_mask_widgets(make_napari_viewer, qtbot, tmp_path, sample_dir, errors):
    from napari_gpu_relion.jobs import reconstruct

    star = sample_dir / "particles.star"
    if not star.is_file():
        star = sample_dir / "particles" / "particles.star"
    halves = []
    for k in (1, 2):
        o = tmp_path / "Refine3D" / f"run_half{k}_class001_unfil.mrc"
        for _ in reconstruct.run(reconstruct.Params(i=star, o=o, ctf=True, subset=k, cpu=True)):
            pass
        halves.append(o)
    viewer = make_napari_viewer()
    _, mask_w = viewer.window.add_plugin_dock_widget(PLUGIN, "Mask creation")
    mask = tmp_path / "MaskCreate" / "mask.mrc"
    mask_w.set_values(i=sample_dir / "reference.mrc", o=mask, ini_threshold=0.3, width_soft_edge=3.0)
    mask_w.run_button.native.click()
    _wait_done(qtbot, mask_w)
    assert mask_w.job.state is JobState.FINISHED, mask_w.status_text
    assert "mask" in viewer.layers

    _, post_w = viewer.window.add_plugin_dock_widget(PLUGIN, "Post-process")
    post_w.set_values(i=halves[0], o=tmp_path / "PostProcess", mask=mask)
    post_w.run_button.native.click()
    _wait_done(qtbot, post_w)
    assert post_w.job.state is JobState.FINISHED, post_w.status_text
    assert not errors
    assert "postprocess" in viewer.layers
    display = LiveDisplay.for_viewer(viewer)
    assert display.fsc is not None and display.fsc.draw_count >= 1
    assert "Resolution" in display.fsc.axes.get_title()
    assert {"unmasked", "corrected"} <= {ln.get_label() for ln in display.fsc.axes.get_lines()}


@pytest.mark.slow
def test_refine3d_widget_shows_half_maps_each_iteration_and_fsc(make_napari_viewer, qtbot, tmp_path, errors):
    from napari_gpu_relion.jobs.simulate import make_sample_data

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=80, snr=0.3, diameter=134.4,
                            ini_high=60.0, n_micrographs=0)
    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "3D auto-refine")
    w.set_values(i=data / "particles.star", ref=data / "reference.mrc", o=tmp_path / "Refine3D", ctf=True,
                 particle_diameter=160.0, healpix_order=1, auto_iter_max=2, cpu=True)
    w.run_button.native.click()
    _wait_done(qtbot, w, timeout=240_000)
    assert w.job.state is JobState.FINISHED, w.status_text
    assert not errors
    display = LiveDisplay.for_viewer(viewer)
    assert display.map_updates.get("half1", 0) >= 2 and display.map_updates.get("half2", 0) >= 2
    assert display.map_updates.get("class001", 0) == 1  # the final joined map
    assert display.fsc is not None and display.fsc.draw_count >= 3
    assert viewer.layers["half1"].metadata["volume"].shape == (32, 32, 32)
    assert viewer.layers["half1"].visible and not viewer.layers["half2"].visible  # the halves lie on each other


@pytest.mark.slow
def test_class3d_widget_shows_one_map_per_class_each_iteration(make_napari_viewer, qtbot, tmp_path, errors):
    from napari_gpu_relion.jobs.simulate import make_sample_data

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=400, snr=0.3, diameter=134.4,
                            ini_high=60.0, n_micrographs=0, conformations=2)
    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "3D classification")
    w.set_values(i=data / "particles.star", ref=data / "reference.mrc", o=tmp_path / "Class3D", K=2, iter=6,
                 ctf=True, skip_align=True, particle_diameter=150.0, cpu=True)
    w.run_button.native.click()
    _wait_done(qtbot, w, timeout=240_000)
    assert w.job.state is JobState.FINISHED, w.status_text
    assert not errors
    display = LiveDisplay.for_viewer(viewer)
    # updated in place during the run (the display coalesces updates that arrive faster than it draws)
    assert display.map_updates.get("class001", 0) >= 2 and display.map_updates.get("class002", 0) >= 2
    a, b = viewer.layers["class001"].metadata["volume"], viewer.layers["class002"].metadata["volume"]
    assert a.shape == (32, 32, 32) and not np.allclose(a, b)
    np.testing.assert_allclose(a, read_mrc(tmp_path / "Class3D" / "run_it006_class001.mrc").data, atol=1e-6)


def test_autopick_and_extract_widgets(make_napari_viewer, qtbot, tmp_path, sample_dir, errors):
    """LoG picking from its widget puts the picks of every micrograph into one Points layer; the extraction
    widget then writes one stack per micrograph with as many boxes as picks inside."""
    import starfile

    viewer = make_napari_viewer()
    _, pick = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    pick.set_values(i=sample_dir / "micrographs.star", odir=tmp_path / "AutoPick", LoG=True, LoG_diam_min=120.0,
                    LoG_diam_max=180.0, cpu=True)
    pick.run_button.native.click()
    _wait_done(qtbot, pick, timeout=120_000)
    assert pick.job.state is JobState.FINISHED, pick.status_text
    LiveDisplay.for_viewer(viewer).flush()
    picks = viewer.layers["picks"]
    assert len(picks.data) > 10
    assert set(np.unique(picks.data[:, 0]).astype(int)) == {0, 1}  # both micrographs
    hist = pick.fom_histogram.histogram  # the FOM histogram follows the picks and the threshold slider
    assert hist is not None and int(hist.counts.sum()) == len(picks.data) and hist.threshold_position is None
    lo, hi = pick.fom_slider.min, pick.fom_slider.max
    pick.fom_slider.value = lo + 0.5 * (hi - lo)
    hist = pick.fom_histogram.histogram
    assert hist.threshold_position == pytest.approx(0.5 * (hi - lo) / (hist.edges[-1] - hist.edges[0]), abs=0.01)
    assert int(hist.shown.sum()) == int(pick.display.pick_model().n_shown)
    pick.fom_slider.value = lo  # everything shown again for the extraction below
    assert not pick.fom_histogram.grab().isNull() and pick.fom_histogram.draw_count > 0  # it paints
    _, ext = viewer.window.add_plugin_dock_widget(PLUGIN, "Particle extraction")
    ext.set_values(i=sample_dir / "micrographs.star", coord_list=tmp_path / "AutoPick" / "autopick.star",
                   o=tmp_path / "Extract", extract_size=64, norm=True, invert_contrast=True, cpu=True)
    ext.run_button.native.click()
    _wait_done(qtbot, ext, timeout=120_000)
    assert ext.job.state is JobState.FINISHED, ext.status_text
    parts = starfile.read(tmp_path / "Extract" / "particles.star")["particles"]
    assert len(parts) == len(picks.data)
    # the extraction shows its boxes over the micrographs (white squares of the box size, in Å like the picks) ...
    boxes = viewer.layers["extraction boxes"]
    assert len(boxes.data) == len(parts) and tuple(boxes.scale) == tuple(picks.scale)
    assert np.all(boxes.size == 64) and str(boxes.symbol[0]) == "square"
    np.testing.assert_array_equal(boxes.border_color[0], [1.0, 1.0, 1.0, 1.0])
    mine = picks.data[np.lexsort(picks.data.T[::-1])]
    drawn = boxes.data[np.lexsort(boxes.data.T[::-1])]
    np.testing.assert_array_equal(drawn[:, 0], mine[:, 0])  # the same micrographs
    assert np.all(np.abs(drawn[:, 1:] - mine[:, 1:]) <= 1.5)  # box centre: the truncated coordinate - 0.5 px
    # ... and a gallery of the particles of the micrograph extracted last, tile 0 its first particle
    gallery = viewer.layers["extracted particles"]
    last = Path(parts["rlnImageName"].iloc[-1].split("@")[1])
    stack = read_mrc(last).data
    n = min(len(stack), 64)
    ncol = int(np.ceil(np.sqrt(n)))
    assert gallery.data.shape == (int(np.ceil(n / ncol)) * 64, ncol * 64)
    first = stack[0].astype(np.float64)
    np.testing.assert_allclose(gallery.data[:64, :64], (first - first.mean()) / first.std(), atol=1e-4)
    assert gallery.translate[1] > 0  # beside the micrographs, not over them
    # ... and framed: the camera's view holds the gallery (it appeared off screen before)
    half = np.asarray(viewer.canvas.size, float)[-2:] / (2 * viewer.camera.zoom)
    centre = np.asarray(viewer.camera.center, float)[-2:]
    lo, hi = np.asarray(gallery.extent.world, float)[:, -2:]
    assert np.all(lo >= centre - half - 1e-6) and np.all(hi <= centre + half + 1e-6), (lo, hi, centre, half)
    assert not errors


@pytest.mark.slow
def test_class2d_widget_shows_a_labelled_class_grid(make_napari_viewer, qtbot, tmp_path, sample_dir, errors):
    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "2D classification")
    w.set_values(i=sample_dir / "particles.star", o=tmp_path / "Class2D", K=4, iter=2, ctf=True,
                 particle_diameter=160.0, cpu=True)
    statuses: list[str] = []
    w.run_button.native.click()
    w.runner.status_callbacks.append(statuses.append)  # the runner's status line (the job's events, in order)
    _wait_done(qtbot, w, timeout=240_000)
    assert w.job.state is JobState.FINISHED, w.status_text
    assert not errors
    # each iteration's summary reaches the runner's status (it came as a Message, which also printed twice)
    assert [t for t in statuses if ": iteration 2: largest classes" in t], statuses
    LiveDisplay.for_viewer(viewer).flush()
    grid = viewer.layers["classes"]
    assert grid.data.shape == (128, 128)  # 4 classes of 64 px in a 2 x 2 grid
    labels = viewer.layers["classes labels"]
    assert len(labels.data) == 4 and all("%" in t for t in labels.features["label"])
    tiles = read_mrc(tmp_path / "Class2D" / "run_it002_classes.mrcs").data
    first = grid.metadata["order"][0]  # the largest class is the top-left tile
    t = tiles[first]
    np.testing.assert_allclose(grid.data[:64, :64], (t - t.mean()) / t.std(), atol=1e-4)

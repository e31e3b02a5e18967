"""A job dock's progress bar around a cancel, in a real (Xvfb) viewer (issue 49): busy while the job is cancelling,
back to the bar as it stood once the job has stopped (it kept its busy animation for good)."""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("napari")

from napari_gpu_relion.events import Finished, Progress, Started  # noqa: E402
from napari_gpu_relion.widgets.job_widget import make_job_widget  # noqa: E402
from napari_gpu_relion.widgets.runner import JobState  # noqa: E402

pytestmark = pytest.mark.usefixtures("config_dir")


@dataclass(frozen=True)
class StepParams:
    o: Path = field(metadata={"flag": "--o", "help": "Output folder"})
    steps: int = field(default=100, metadata={"flag": "--steps", "help": "Steps"})


def step_run(p: StepParams):
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)
    yield Started("steps", out, "CPU (test)")
    for k in range(p.steps):
        time.sleep(0.1)
        (out / f"step{k:03d}.txt").write_text(str(k))
        yield Progress(k + 1, p.steps, "step")
    yield Finished({"folder": out}, f"{p.steps} steps")


steps = types.ModuleType("steps_job")
steps.JOB_NAME = "steps"
steps.Params = StepParams
steps.run = step_run


def test_the_bar_stops_its_busy_animation_once_a_cancelled_job_has_stopped(make_napari_viewer, qtbot, tmp_path,
                                                                           errors):
    viewer = make_napari_viewer()
    w = make_job_widget(viewer, steps)
    w.set_values(o=tmp_path / "job")
    w.run_button.native.click()
    qtbot.waitUntil(lambda: w.progress.value >= 3, timeout=10_000)
    w.cancel_button.native.click()
    assert w.progress.max == 0  # busy: the cancel is under way
    qtbot.waitUntil(lambda: w.job.done, timeout=5_000)
    qtbot.wait(300)  # events queued before the stop are dispatched
    assert w.job.state is JobState.CANCELLED
    assert w.progress.max == 100 and 3 <= w.progress.value < 100  # the bar as it stood, no busy animation
    assert not w.progress.native.maximum() == 0
    w.run_button.native.click()  # a new run starts from an empty bar
    assert w.progress.max >= 1
    qtbot.waitUntil(lambda: w.job.state is JobState.RUNNING and w.progress.value >= 1, timeout=10_000)
    w.cancel_button.native.click()
    qtbot.waitUntil(lambda: w.job.done, timeout=5_000)
    assert not errors

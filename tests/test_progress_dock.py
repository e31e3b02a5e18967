"""A job dock's bar and progress line during an iterative job, in a real (Xvfb) viewer (issue 49): "iteration i of
n" drawn on the bar, filled within each iteration by the E-step, busy through an auto-refine's M-step and never
at 100 % before the job has finished; after a cancel or an error the busy animation stops at once, the bar saying
where the job stopped. The strings themselves are tested without Qt (test_progress_model.py)."""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("napari")

from napari_gpu_relion.events import (  # noqa: E402
    Finished,
    IterationFinished,
    IterationStarted,
    Message,
    Progress,
    Started,
)
from napari_gpu_relion.widgets.job_widget import make_job_widget  # noqa: E402
from napari_gpu_relion.widgets.progress_model import BAR_STEPS  # noqa: E402
from napari_gpu_relion.widgets.runner import JobState  # noqa: E402

pytestmark = pytest.mark.usefixtures("config_dir")


@dataclass(frozen=True)
class FakeParams:
    o: Path = field(metadata={"flag": "--o", "help": "Output folder"})
    iterations: int = field(default=3, metadata={"flag": "--iterations", "help": "Iterations (0: converge)"})
    m_step_s: float = field(default=0.6, metadata={"flag": "--m_step_s", "help": "Seconds of each M-step"})
    fail_in_m_step: int = field(default=0, metadata={"flag": "--fail_in_m_step", "help": "Fail there"})


def fake_run(p: FakeParams):
    """An EM job's events: 3 iterations of 2 halves x 4 batches; with --iterations 0 an auto-refine whose third
    iteration is its final one."""
    out = Path(p.o)
    out.mkdir(parents=True, exist_ok=True)
    yield Started("fake", out, "CPU (test)")
    converges = p.iterations == 0
    for it in (1, 2, 3):
        yield Message(f"iteration {it}: image size 32")
        yield IterationStarted(it, p.iterations, it == 3, converges=converges, image_size=32, full_size=64,
                               angular_step=7.5)
        for half in (1, 2):
            for done in (10, 20, 30, 40):
                time.sleep(0.05)
                yield Progress(done, 40, f"it {it:03d} half {half}", it, p.iterations, (half - 1 + done / 40) / 2)
        time.sleep(p.m_step_s)  # the M-step: no events
        if p.fail_in_m_step == it:
            raise RuntimeError("out of memory in the M-step")
        yield IterationFinished(it, {}, None, 20.0 - it, None, f"resolution {20.0 - it:.2f} Å")
    yield Finished({"folder": out}, "done")


fake = types.ModuleType("fake_em_job")
fake.JOB_NAME = "fake"
fake.Params = FakeParams
fake.run = fake_run


def _bar(w) -> tuple[int, int, str]:
    bar = w.progress.native
    return bar.value(), bar.maximum(), bar.format()


def _watch(qtbot, w, seconds: float = 30.0) -> list[tuple[int, int, str, str]]:
    """(value, maximum, bar text, status) each time they change, until the job is done; the last entry is the state
    after it (the dock may show "finished" a moment before the job's done flag is seen: that state is the last
    one, not one of the running ones)."""
    seen: list[tuple[int, int, str, str]] = []
    end = time.monotonic() + seconds
    while not (w.job is not None and w.job.done) and time.monotonic() < end:
        now = (*_bar(w), w.status_text)
        if now[2] == "finished":
            break
        if not seen or seen[-1] != now:
            seen.append(now)
        qtbot.wait(10)
    qtbot.wait(200)
    seen.append((*_bar(w), w.status_text))
    return seen


@pytest.mark.slow
def test_classification_bar_shows_iteration_of_n_and_is_full_only_at_the_end(make_napari_viewer, qtbot, tmp_path,
                                                                             errors):
    w = make_job_widget(make_napari_viewer(), fake)
    w.set_values(o=tmp_path / "job", iterations=3, m_step_s=0.3)
    w.run_button.native.click()
    seen = _watch(qtbot, w)
    assert w.job.state is JobState.FINISHED and not errors
    texts = {t for _, _, t, _ in seen}
    assert any(t.startswith("iteration 2 of 3 · ") for t in texts), texts
    assert any(s.startswith("fake: iteration 2 of 3: E-step half 2 ") for *_, s in seen)
    assert any(s.startswith("fake: iteration 3 of 3: M-step") for *_, s in seen)
    running = seen[:-1]
    assert all(0 <= v < m for v, m, _, _ in running if m > 0)  # never full while it runs
    assert seen[-1][:2] == (BAR_STEPS, BAR_STEPS) and "finished" in seen[-1][3]


@pytest.mark.slow
def test_auto_refine_bar_fills_per_iteration_and_is_busy_in_the_m_step(make_napari_viewer, qtbot, tmp_path, errors):
    w = make_job_widget(make_napari_viewer(), fake)
    w.set_values(o=tmp_path / "job", iterations=0, m_step_s=0.6)
    w.run_button.native.click()
    seen = _watch(qtbot, w)
    assert w.job.state is JobState.FINISHED and not errors
    assert not any(" of " in t for _, _, t, _ in seen)  # no made-up total
    assert any(t.startswith("iteration 2 · E-step ") for _, _, t, _ in seen)
    assert any(t.startswith("final iteration 3 · E-step ") for _, _, t, _ in seen)
    busy = [s for v, m, _, s in seen if m == 0]
    assert any("M-step: reconstructing the maps" in s for s in busy)
    assert any(s.startswith("fake: final iteration 3 (18.0 Å, halves joined): M-step: the final map from both halves "
                            "at the full size (64 px)") for s in busy), busy
    full = [x for x in seen[:-1] if 0 < x[1] <= x[0]]
    assert not full, full  # never full while it runs
    # the job's log lines do not hide the progress line while it iterates: they go to the status's tooltip
    assert not any(s.startswith("fake: iteration 2: image size") for *_, s in seen)
    assert w.status.tooltip == "fake: iteration 3: image size 32"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "error"])
def test_the_busy_bar_stops_at_once_after_a_cancel_or_an_error_in_the_m_step(make_napari_viewer, qtbot, tmp_path,
                                                                             errors, how):
    w = make_job_widget(make_napari_viewer(), fake)
    w.set_values(o=tmp_path / "job", iterations=0, m_step_s=1.5, fail_in_m_step=2 if how == "error" else 0)
    w.run_button.native.click()
    qtbot.waitUntil(lambda: "iteration 2" in w.status_text and "M-step" in w.status_text, timeout=20_000)
    assert w.progress.native.maximum() == 0  # busy: the M-step's length is not known
    if how == "cancel":
        w.cancel_button.native.click()
    qtbot.waitUntil(lambda: w.job.done, timeout=10_000)
    qtbot.wait(50)  # one turn of the event loop: the state's handler has run
    value, maximum, text = _bar(w)
    assert maximum > 0, "the bar kept its busy animation"
    assert (value, maximum) == (BAR_STEPS, BAR_STEPS) or value < maximum
    word = "cancelled" if how == "cancel" else "failed"
    assert text == f"{word} in iteration 2"
    assert w.job.state is (JobState.CANCELLED if how == "cancel" else JobState.FAILED)
    qtbot.wait(300)  # nothing late brings the animation back
    assert w.progress.native.maximum() > 0

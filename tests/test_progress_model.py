"""The progress line of a dock (issue 18): "iteration n of max" and an estimate of the time left (no Qt)."""

from __future__ import annotations

import pytest

from napari_gpu_relion.events import Progress
from napari_gpu_relion.widgets.progress_model import BAR_STEPS, ProgressClock, format_duration, run_fraction


def test_iterative_job_with_a_maximum_shows_iteration_of_max_and_the_time_left():
    clock = ProgressClock()
    first = clock.report("class2d", Progress(0, 200, "it 001", 1, 10, 0.0), now=100.0)
    assert first.text == "class2d: iteration 1 of 10 (it 001 0/200)" and first.seconds_left is None
    # 25 s later a quarter of the run is done: 75 s are left
    r = clock.report("class2d", Progress(100, 200, "it 003 half 2", 3, 10, 0.5), now=125.0)
    assert r.seconds_left == pytest.approx(75.0)
    assert r.text == "class2d: iteration 3 of 10 (it 003 half 2 100/200), about 1 min left"
    assert (r.value, r.maximum) == (BAR_STEPS // 4, BAR_STEPS)  # the bar follows the whole run


def test_a_job_that_stops_at_convergence_shows_its_iteration_without_a_maximum_or_eta():
    clock = ProgressClock()
    for now, done in ((0.0, 50), (30.0, 100)):
        r = clock.report("refine3d", Progress(done, 200, "it 002 half 1", 2, 0, done / 400), now=now)
    assert r.text == "refine3d: iteration 2 (it 002 half 1 100/200)" and r.seconds_left is None
    assert (r.value, r.maximum) == (100, 200)  # the bar follows this iteration's E-step


def test_a_job_without_iterations_estimates_from_done_of_total():
    clock = ProgressClock()
    clock.report("extract", Progress(1, 10, "extracting"), now=0.0)
    early = clock.report("extract", Progress(2, 10, "extracting"), now=1.0)
    assert early.seconds_left is None  # not before MIN_SECONDS_FOR_ETA
    r = clock.report("extract", Progress(4, 10, "extracting"), now=6.0)
    assert r.seconds_left == pytest.approx(6.0 * 0.6 / 0.3)
    assert r.text == "extract: extracting 4/10, about 12 s left" and (r.value, r.maximum) == (4, 10)


def test_run_fraction_and_durations():
    assert run_fraction(Progress(5, 10, "", 2, 4, 0.5)) == pytest.approx(1.5 / 4)
    assert run_fraction(Progress(5, 10, "", 2, 0, 0.5)) is None
    assert run_fraction(Progress(3, 12)) == pytest.approx(0.25)
    assert [format_duration(s) for s in (4.4, 59.4, 61, 3 * 3600 + 7 * 60)] == ["4 s", "59 s", "1 min", "3 h 07 min"]

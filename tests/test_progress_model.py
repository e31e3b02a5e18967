"""A dock's progress line and bar (issues 18 and 49, widgets/progress_model.py): event sequences as the EM jobs send
them (IterationStarted, the E-step's Progress, IterationFinished, Finished) and the strings and bar they give.

What a user must be able to trust: "iteration i of n" only where n is known (2D/3D classification, the initial
model), "iteration i" with the resolution and the angular step for auto-refine (no made-up total), the bar filling
within each iteration from the E-step's particles, the M-step (the final iteration's, at full size, takes minutes)
busy and never at 100 %, the bar full only at Finished, a time left only where it is honest, and a stopped run's bar
never busy. The last test runs a real (small) auto-refine and checks the same of its own events."""

from __future__ import annotations

import pytest

from napari_gpu_relion.events import Finished, IterationFinished, IterationStarted, Message, Progress
from napari_gpu_relion.widgets.progress_model import (
    BAR_STEPS,
    ESTEP_SHARE,
    MIN_SECONDS_FOR_ETA,
    EtaClock,
    RunProgress,
    bar_percent,
    format_duration,
    run_fraction,
)


def _estep(it: int, iterations: int, half: int, halves: int, done: int, total: int) -> Progress:
    """The EM driver's Progress of the E-step (jobs/em.py: stage, iteration_fraction over the halves)."""
    stage = f"it {it:03d}" + (f" half {half}" if halves > 1 else "")
    return Progress(done, total, stage, it, iterations, (half - 1 + done / total) / halves)


def _refine_iteration(it: int, t: float, *, final: bool = False, step: float = 15.0, local: bool = False,
                      res: float = 14.77, seconds_per_batch: float = 10.0):
    """(time, event) of one auto-refine iteration: 2 halves of 150 particles in batches of 50."""
    out = [(t, IterationStarted(it, 0, final, converges=True, image_size=26 if not final else 96, full_size=96,
                                angular_step=step, local=local))]
    for half in (1, 2):
        for done in (50, 100, 150):
            t += seconds_per_batch
            out.append((t, _estep(it, 0, half, 2, done, 150)))
    out.append((t + 1.0, Message(f"  iteration {it} timing: ...")))
    out.append((t + 120.0 if final else t + 2.0,
                IterationFinished(it, {}, None, res, None, f"resolution {res:.2f} Å (FSC 0.143)")))
    return out


def _feed(progress: RunProgress, events):
    """Every report, with the event that made it."""
    return [(ev, r) for now, ev in events if (r := progress.update(ev, now)) is not None]


def test_auto_refine_shows_iteration_resolution_angular_step_and_a_bar_per_iteration():
    p = RunProgress("refine3d")
    events = _refine_iteration(1, 0.0) + _refine_iteration(2, 100.0, step=7.5, local=True, res=12.5)
    reports = _feed(p, events)
    texts = [r.text for _, r in reports]
    assert texts[0] == "refine3d: iteration 1 (15° steps, global): preparing the E-step"
    assert texts[1] == "refine3d: iteration 1 (15° steps, global): E-step half 1 50/150"
    first = reports[1][1]
    assert (first.value, first.maximum) == (round(BAR_STEPS / 6), BAR_STEPS)  # the bar: this iteration's E-step
    assert first.bar_text == "iteration 1 · E-step 16 %"
    half2 = reports[5][1]  # half 2 100/150: the bar goes on over the second half
    assert half2.text.startswith("refine3d: iteration 1 (15° steps, global): E-step half 2 100/150")
    assert (half2.value, half2.maximum) == (round(BAR_STEPS * 5 / 6), BAR_STEPS)
    # the E-step's last batch: the M-step runs, for a time nobody knows: busy, not 100 %
    m_step = reports[6][1]
    assert m_step.text == "refine3d: iteration 1 (15° steps, global): M-step: reconstructing the maps, then the files"
    assert m_step.maximum == 0
    assert reports[7][1].text == "refine3d: iteration 1: resolution 14.77 Å (FSC 0.143)"
    # the next iteration: the resolution RELION users converge by, the new sampling; the last one's summary under it
    assert texts[8] == ("refine3d: iteration 2 (14.8 Å, 7.5° steps, local): preparing the E-step\n"
                        "iteration 1: resolution 14.77 Å (FSC 0.143)")
    assert p.in_iterations
    assert reports[8][1].value == 0 and reports[8][1].bar_text == "iteration 2 · E-step 0 %"
    assert all(" of " not in t for t in texts)  # no total: auto-refine stops when it has converged
    assert not any(r.maximum > 0 and r.value >= r.maximum for _, r in reports)  # never full while it runs


def test_auto_refines_final_iteration_is_its_own_phase_and_the_bar_is_full_only_at_finished():
    p = RunProgress("refine3d")
    events = _refine_iteration(1, 0.0, res=13.0) + _refine_iteration(2, 100.0, final=True, res=12.0)
    events.append((500.0, Finished({}, "final resolution 12.00 Å")))
    reports = _feed(p, events)
    final = [r for ev, r in reports if isinstance(ev, IterationStarted) and ev.final][0]
    assert final.text == ("refine3d: final iteration 2 (13.0 Å, halves joined): preparing the E-step\n"
                          "iteration 1: resolution 13.00 Å (FSC 0.143)")
    assert final.bar_text == "final iteration 2 · E-step 0 %"
    estep = [r for ev, r in reports if isinstance(ev, Progress) and ev.iteration == 2]
    assert estep[2].text.startswith("refine3d: final iteration 2 (13.0 Å, halves joined): E-step half 1 150/150")
    assert estep[2].bar_text == "final iteration 2 · E-step 50 %"
    # the final M-step: reconstruction at the full size (minutes at box 360), said as such, the bar busy
    assert estep[-1].text == ("refine3d: final iteration 2 (13.0 Å, halves joined): M-step: the final map from both "
                              "halves at the full size (96 px), then the files\n"
                              "iteration 1: resolution 13.00 Å (FSC 0.143)")
    assert estep[-1].maximum == 0
    done = [r for ev, r in reports if isinstance(ev, IterationFinished) and ev.iteration == 2][0]
    assert done.text == "refine3d: final iteration 2: resolution 12.00 Å (FSC 0.143)" and done.maximum == 0
    end = reports[-1][1]
    assert (end.value, end.maximum) == (BAR_STEPS, BAR_STEPS) and end.bar_text == "finished"
    assert all(r.value < r.maximum for _, r in reports[:-1] if r.maximum > 0)


def test_an_e_steps_time_left_is_shown_once_it_has_run_a_while():
    p = RunProgress("refine3d")
    p.update(IterationStarted(9, 0, True, converges=True, full_size=360), 0.0)
    assert "left" not in p.update(_estep(9, 0, 1, 2, 100, 1000), 60.0).text  # the first batch starts the clock
    early = p.update(_estep(9, 0, 1, 2, 110, 1000), 61.0)
    assert early.seconds_left is None and "left" not in early.text
    r = p.update(_estep(9, 0, 1, 2, 1000, 1000), 120.0)  # 45 % of the E-step in 60 s: 50 % left, 67 s
    assert r.seconds_left == pytest.approx(60.0 * 0.5 / 0.45)
    assert r.text.endswith("E-step half 1 1000/1000, about 1 min left in this E-step")


def test_classification_shows_iteration_of_n_a_whole_run_bar_and_the_time_left():
    p = RunProgress("class2d")
    n = 10
    first = p.update(IterationStarted(1, n, False, image_size=32, full_size=64, angular_step=6.0), 100.0)
    assert first.text == "class2d: iteration 1 of 10: preparing the E-step"
    assert (first.value, first.maximum, first.bar_text) == (0, BAR_STEPS, "iteration 1 of 10 · 0 %")
    start = p.update(_estep(1, n, 1, 1, 50, 200), 100.0)
    assert start.text == "class2d: iteration 1 of 10: E-step 50/200" and start.seconds_left is None
    p.update(IterationStarted(3, n, False), 120.0)
    r = p.update(_estep(3, n, 1, 1, 100, 200), 125.0)
    run = (2 + ESTEP_SHARE * 0.5) / n
    run0 = ESTEP_SHARE * 0.25 / n
    assert r.seconds_left == pytest.approx(25.0 * (1 - run) / (run - run0))
    assert r.text == f"class2d: iteration 3 of 10: E-step 100/200, about {format_duration(r.seconds_left)} left"
    assert r.value == round(run * BAR_STEPS) and r.bar_text == f"iteration 3 of 10 · {bar_percent(r.value, 1000)} %"
    m = p.update(_estep(3, n, 1, 1, 200, 200), 130.0)
    assert m.text.startswith("class2d: iteration 3 of 10: M-step: reconstructing the maps, then the files, about")
    assert m.value == round((2 + ESTEP_SHARE) / n * BAR_STEPS) and m.maximum == BAR_STEPS  # the run bar, not busy
    between = p.update(IterationFinished(3, {}, None, 20.0, None, "largest classes 30%"), 131.0)
    assert between.text == "class2d: iteration 3 of 10: largest classes 30%"
    assert between.value == 3 * BAR_STEPS // n


def test_the_last_iterations_m_step_is_not_100_percent():
    p = RunProgress("class3d")
    p.update(IterationStarted(25, 25, True), 0.0)
    m = p.update(_estep(25, 25, 1, 1, 400, 400), 1.0)
    assert m.maximum == BAR_STEPS and m.value < BAR_STEPS and bar_percent(m.value, m.maximum) == 99
    assert m.bar_text == "iteration 25 of 25 · 99 %"
    last = p.update(IterationFinished(25, {}, None, 9.0, None, "done"), 2.0)
    assert last.maximum == 0  # the report and files after the last iteration: busy, not 100 %
    end = p.update(Finished({}), 3.0)
    assert (end.value, end.maximum) == (BAR_STEPS, BAR_STEPS)


def test_the_initial_model_shows_no_time_left_for_the_run():
    """Its mini-batches grow over the run: the share of iterations done says nothing of the time left."""
    p = RunProgress("initial_model")
    p.update(IterationStarted(1, 100, False, even_cost=False), 0.0)
    p.update(_estep(1, 100, 1, 2, 10, 50), 1.0)
    p.update(IterationStarted(40, 100, False, even_cost=False), 60.0)
    r = p.update(_estep(40, 100, 1, 2, 50, 100), 70.0)
    assert r.text == "initial_model: iteration 40 of 100: E-step half 1 50/100" and r.seconds_left is None
    assert r.value == round((39 + ESTEP_SHARE * 0.25) / 100 * BAR_STEPS)


def test_a_stopped_run_is_never_busy_and_says_where_it_stopped():
    p = RunProgress("refine3d")
    p.update(IterationStarted(4, 0, False, converges=True, angular_step=7.5), 0.0)
    p.update(_estep(4, 0, 1, 2, 150, 150), 5.0)  # half 1 done: 50 %
    m = p.update(_estep(4, 0, 2, 2, 150, 150), 9.0)  # M-step: busy
    assert m.maximum == 0
    assert p.stopped("cancelling", (0, 0)) == (0, 0, "")  # busy until the job has stopped
    assert p.stopped("cancelled", (0, 0)) == (500, BAR_STEPS, "cancelled in iteration 4")  # the last bar, not busy
    assert p.stopped("failed", (0, 0)) == (500, BAR_STEPS, "failed in iteration 4")
    assert p.stopped("cancelled", (0, 0), before_cancel=(300, BAR_STEPS))[:2] == (300, BAR_STEPS)
    fresh = RunProgress("autopick")  # stopped before any progress: an empty bar, not busy
    assert fresh.stopped("failed", (0, 0)) == (0, 1, "failed at 0 %")


def test_older_events_without_iteration_started_still_show_iteration_of_max():
    p = RunProgress("class2d")
    r = p.update(Progress(100, 200, "it 003", 3, 10, 0.5), 0.0)
    assert r.text == "class2d: iteration 3 of 10: E-step 100/200"
    r = RunProgress("refine3d").update(Progress(100, 200, "it 002 half 1", 2, 0, 0.25), 0.0)
    assert r.text == "refine3d: iteration 2: E-step half 1 100/200" and (r.value, r.maximum) == (250, BAR_STEPS)


def test_a_job_without_iterations_estimates_from_done_of_total():
    p = RunProgress("extract")
    p.update(Progress(1, 10, "extracting"), 0.0)
    early = p.update(Progress(2, 10, "extracting"), 1.0)
    assert early.seconds_left is None  # not before MIN_SECONDS_FOR_ETA
    r = p.update(Progress(4, 10, "extracting"), 6.0)
    assert r.seconds_left == pytest.approx(6.0 * 0.6 / 0.3)
    assert r.text == "extract: extracting 4/10, about 12 s left" and (r.value, r.maximum) == (4, 10)
    assert r.bar_text == ""  # Qt's own percentage
    assert p.update(Message("a line"), 7.0) is None


def test_one_clock_estimates_the_time_left_of_the_run_and_of_an_e_step():
    """The rate since the first reading: nothing before MIN_SECONDS_FOR_ETA nor before its least share is done,
    nothing once done; reset starts again (a new E-step)."""
    clock = EtaClock(0.05)
    assert clock.seconds_left(0.1, 10.0) is None  # the first reading
    assert clock.seconds_left(0.5, 10.0 + MIN_SECONDS_FOR_ETA / 2) is None  # too soon
    assert clock.seconds_left(0.12, 20.0) is None  # too little done
    assert clock.seconds_left(0.3, 20.0) == pytest.approx(10.0 * 0.7 / 0.2)
    assert clock.seconds_left(1.0, 30.0) is None  # done
    clock.reset()
    assert clock.seconds_left(0.5, 40.0) is None and clock.seconds_left(0.75, 45.0) == pytest.approx(5.0)


def test_run_fraction_durations_and_percentages():
    assert run_fraction(Progress(5, 10, "", 2, 4, 0.5)) == pytest.approx(1.5 / 4)
    assert run_fraction(Progress(5, 10, "", 2, 0, 0.5)) is None
    assert run_fraction(Progress(3, 12)) == pytest.approx(0.25)
    assert [format_duration(s) for s in (4.4, 59.4, 61, 3 * 3600 + 7 * 60)] == ["4 s", "59 s", "1 min", "3 h 07 min"]
    assert [bar_percent(v, 1000) for v in (0, 996, 999, 1000)] == [0, 99, 99, 100]  # 100 % only when done


@pytest.mark.slow
def test_a_real_auto_refine_sends_what_the_dock_needs(tmp_path):
    """A small auto-refine (80 particles, box 32, --auto_iter_max 1): every iteration starts with IterationStarted,
    the last one is the final one (then a full-size M-step, busy), the bar never full before Finished."""
    from napari_gpu_relion.jobs import refine3d
    from napari_gpu_relion.jobs.simulate import make_sample_data

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=80, snr=0.3, diameter=134.4,
                            ini_high=60.0, n_micrographs=0)
    events = list(refine3d.run(refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc",
                                               o=tmp_path / "r" / "run", ctf=True, cpu=True, healpix_order=1,
                                               particle_diameter=160.0, auto_iter_max=1, batch=20)))
    starts = [ev for ev in events if isinstance(ev, IterationStarted)]
    assert [ev.iteration for ev in starts] == [1, 2] and [ev.final for ev in starts] == [False, True]
    assert all(ev.converges and ev.full_size == 32 for ev in starts) and starts[-1].image_size == 32
    assert starts[0].angular_step == 30.0 and not starts[0].local  # HEALPix order 1
    p = RunProgress("refine3d")
    reports = _feed(p, [(float(k), ev) for k, ev in enumerate(events)])
    for k, ev in enumerate(events):  # each iteration's E-step comes after its IterationStarted
        if isinstance(ev, Progress):
            before = [e for e in events[:k] if isinstance(e, IterationStarted)]
            assert before and before[-1].iteration == ev.iteration
    texts = [r.text for _, r in reports]
    assert any(t.startswith("refine3d: final iteration 2 (") and "E-step half 2" in t for t in texts)
    m_steps = [r for _, r in reports if "M-step" in r.text]
    assert len(m_steps) == 2 and all(r.maximum == 0 for r in m_steps)
    assert "the final map from both halves at the full size (32 px)" in m_steps[-1].text
    assert all(r.value < r.maximum for _, r in reports[:-1] if r.maximum > 0)
    assert isinstance(reports[-1][0], Finished) and reports[-1][1].value == reports[-1][1].maximum > 0

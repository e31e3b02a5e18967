"""A job's progress line and bar from its events (no Qt, no napari; issues 18 and 49).

An iterative job (relion_refine's: 3D auto-refine, 2D and 3D classification, the 3D initial model) says when an
iteration starts (``IterationStarted``: its number, the last one, whether it is the final one, its sampling), how
far its E-step is (``Progress`` with ``iteration_fraction``) and when the iteration is done (``IterationFinished``).
:class:`RunProgress` turns them into what the dock shows, in phases:

* *preparing* (from IterationStarted to the E-step's first batch), *E-step* (the particles of each half), *M-step*
  (from the E-step's last batch to IterationFinished: reconstruction, then the files), *between iterations*. The
  status line says the iteration and its phase, and under it the last iteration's summary (its resolution, changes,
  classes), which the user judges the run by while the next one runs.
* A job with a known number of iterations (classification, the initial model): "iteration i of n"; the bar is the
  whole run, each iteration's share filled by its E-step up to :data:`ESTEP_SHARE` and by its M-step at its end,
  so it is full only at Finished. Where the iterations cost about the same (classification, not the initial
  model's growing mini-batches) the time left is estimated from the share of the run done.
* A job that stops when it has converged (auto-refine): "iteration i" and the state it converges by (the
  resolution of the last iteration, the angular step, global or local searches), no made-up total and no time
  left for the run; the bar is the iteration's E-step, then busy through the M-step (unknown length: the final
  iteration's, at the full size, took minutes), never full while work goes on; the time left of an E-step is
  shown once it has run a while. Its final iteration (the halves joined at the full image size) is named as such.

A job without iterations (picking, extraction, ...) shows "stage done/total" and the time left.

:meth:`RunProgress.stopped` says what the bar shows once the job's state changes: busy while it is cancelling, and
never busy once it has stopped (cancelled or failed: the bar as it last stood with a value; finished: full).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..events import Finished, IterationFinished, IterationStarted, Progress

__all__ = ["BAR_STEPS", "ESTEP_SHARE", "MIN_SECONDS_FOR_ETA", "RunProgress", "ProgressReport", "format_duration",
           "run_fraction", "bar_in_state", "bar_percent", "EtaClock"]

#: Steps of the progress bar of a run whose total is known as a fraction.
BAR_STEPS = 1000
#: No estimate of the time left before this many seconds (of the run, or of an E-step) have passed.
MIN_SECONDS_FOR_ETA = 3.0
#: Least share of the run done before its time left is estimated.
MIN_RUN_FRACTION_FOR_ETA = 0.01
#: Least share of an E-step done before its time left is estimated.
MIN_ESTEP_FRACTION_FOR_ETA = 0.05
#: Share of an iteration's room in a whole-run bar that its E-step fills (the M-step and the files the rest).
ESTEP_SHARE = 0.9


@dataclass(frozen=True)
class ProgressReport:
    """What the dock shows: the status line, the progress bar (``value`` of ``maximum``; a maximum of 0 is the
    busy bar) and the text drawn on the bar (``bar_text``; "" for the plain percentage)."""

    text: str
    value: int
    maximum: int
    seconds_left: float | None = None
    bar_text: str = ""


def run_fraction(ev: Progress) -> float | None:
    """Fraction (0..1) of the whole run done by the E-step's count alone: over all iterations where the job has a
    maximum, else ``done / total`` of a job that is not iterative; None for an iterative job that stops when it has
    converged."""
    if ev.iteration > 0:
        if ev.iterations <= 0:
            return None
        frac = (ev.iteration - 1 + _clip(ev.iteration_fraction)) / ev.iterations
        return _clip(frac)
    if ev.total <= 0:
        return None
    return _clip(ev.done / ev.total)


def format_duration(seconds: float) -> str:
    """"45 s", "3 min", "1 h 20 min" (rounded)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    m = int(round(s / 60))
    if m < 60:
        return f"{m} min"
    return f"{m // 60} h {m % 60:02d} min"


def bar_percent(value: int, maximum: int) -> int:
    """The percentage a bar shows: rounded down, so that 100 % means done (Qt rounds 99.6 % up)."""
    return int(math.floor(100.0 * value / maximum + 1e-9)) if maximum > 0 else 0


def _clip(x: float) -> float:
    return min(max(float(x), 0.0), 1.0)


def _half_of(stage: str) -> str:
    """"half 1" of the EM driver's stage "it 005 half 1" ("" without halves); another stage as it is."""
    return re.sub(r"^it \d+\s*", "", stage).strip()


class EtaClock:
    """The time left of a fraction that grows from 0 to 1, at the rate since its first reading: no estimate before
    :data:`MIN_SECONDS_FOR_ETA` seconds and ``min_done`` of the fraction have passed, nor once it is done."""

    def __init__(self, min_done: float) -> None:
        self.min_done = min_done
        self.start: tuple[float, float] | None = None  # (time, fraction) of the first reading

    def reset(self) -> None:
        """Start again at the next reading."""
        self.start = None

    def seconds_left(self, frac: float, now: float) -> float | None:
        """Seconds left at fraction ``frac`` (0..1) at time ``now`` (None: no estimate yet)."""
        if self.start is None:
            self.start = (now, frac)
            return None
        t0, f0 = self.start
        elapsed, done = now - t0, frac - f0
        if elapsed < MIN_SECONDS_FOR_ETA or done < self.min_done or frac >= 1.0:
            return None
        return elapsed * (1.0 - frac) / done


class RunProgress:
    """The progress of one run of job ``job`` (make a new one for each run): :meth:`update` with each event (and
    the time, in seconds), :meth:`stopped` when the job's state changes."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.iteration = 0
        self.iterations = 0
        self.final = False
        self.converges = False
        self.even_cost = True
        self.full_size = 0
        self.angular_step = 0.0
        self.local = False
        self.resolution_A: float | None = None  # of the last finished iteration
        self.last_summary = ""  # "iteration 3: <its summary>", the second line while the next one runs
        self.phase = ""  # "", "preparing", "E-step", "M-step", "between", "finished"
        #: the last bar with a value (what a cancelled or failed run goes back to)
        self.last_bar: tuple[int, int] | None = None
        self._shown: ProgressReport | None = None
        self._run_clock = EtaClock(MIN_RUN_FRACTION_FOR_ETA)  # the whole run's, from its first E-step batch
        self._estep_clock = EtaClock(MIN_ESTEP_FRACTION_FOR_ETA)  # this E-step's

    # ---- events ------------------------------------------------------------------------------------------------

    def update(self, ev: object, now: float) -> ProgressReport | None:
        """The report after event ``ev`` (None: the event changes nothing that the dock shows)."""
        if isinstance(ev, IterationStarted):
            return self._show(self._iteration_started(ev))
        if isinstance(ev, Progress):
            return self._show(self._progress(ev, now))
        if isinstance(ev, IterationFinished):
            return self._show(self._iteration_finished(ev))
        if isinstance(ev, Finished):
            self.phase = "finished"
            top = self._shown.maximum if self._shown is not None and self._shown.maximum > 0 else BAR_STEPS
            return self._show(ProgressReport(f"{self.job}: finished", top, top, 0.0,
                                             "finished" if self.iteration else ""))
        return None

    def _show(self, report: ProgressReport) -> ProgressReport:
        self._shown = report
        if report.maximum > 0:
            self.last_bar = (report.value, report.maximum)
        return report

    def _iteration_started(self, ev: IterationStarted) -> ProgressReport:
        self.iteration, self.iterations, self.final = ev.iteration, max(ev.iterations, 0), ev.final
        self.converges, self.even_cost, self.full_size = ev.converges, ev.even_cost, ev.full_size
        self.angular_step, self.local = ev.angular_step, ev.local
        self.phase = "preparing"
        self._estep_clock.reset()
        if self._whole_run_bar:
            value = self._bar_value((self.iteration - 1) / self.iterations)
            return ProgressReport(self._lines("preparing the E-step"), value, BAR_STEPS, None,
                                  self._bar_text(value))
        return ProgressReport(self._lines("preparing the E-step"), 0, BAR_STEPS, None,
                              self._bar_text(0, estep=True))

    def _progress(self, ev: Progress, now: float) -> ProgressReport:
        if ev.iteration <= 0:
            return self._plain(ev, now)
        if ev.iteration != self.iteration:  # no IterationStarted (an older job): what Progress says
            self.iteration, self.iterations = ev.iteration, max(ev.iterations, 0)
            self.final = self.converges = False
            self._estep_clock.reset()
        frac = _clip(ev.iteration_fraction)
        where = " ".join(x for x in (_half_of(ev.stage), f"{ev.done}/{ev.total}") if x)
        if frac >= 1.0 - 1e-9 and ev.done >= ev.total:  # the E-step's last batch: the M-step runs now
            self.phase = "M-step"
            return self._m_step(now)
        self.phase = "E-step"
        estep_left = self._estep_clock.seconds_left(frac, now)
        estep_eta = self._eta_text(estep_left, " in this E-step")
        if self._whole_run_bar:
            run = (self.iteration - 1 + ESTEP_SHARE * frac) / self.iterations
            left = self._run_clock.seconds_left(run, now)
            eta = self._eta_text(left) if self.even_cost else estep_eta
            value = self._bar_value(run)
            return ProgressReport(self._lines(f"E-step {where}{eta}"), value, BAR_STEPS,
                                  left if self.even_cost else estep_left, self._bar_text(value))
        value = self._bar_value(frac)
        return ProgressReport(self._lines(f"E-step {where}{estep_eta}"), value, BAR_STEPS, estep_left,
                              self._bar_text(value, estep=True))

    def _m_step(self, now: float) -> ProgressReport:
        if self.final and self.converges:
            size = f" ({self.full_size} px)" if self.full_size else ""
            what = f"M-step: the final map from both halves at the full size{size}, then the files"
        else:
            what = "M-step: reconstructing the maps, then the files"
        if self._whole_run_bar:
            run = (self.iteration - 1 + ESTEP_SHARE) / self.iterations
            left = self._run_clock.seconds_left(run, now) if self.even_cost else None
            value = self._bar_value(run)
            return ProgressReport(self._lines(f"{what}{self._eta_text(left)}"), value, BAR_STEPS, left,
                                  self._bar_text(value))
        return ProgressReport(self._lines(what), 0, 0)  # busy: how long it takes is not known

    def _iteration_finished(self, ev: IterationFinished) -> ProgressReport:
        name = "final iteration" if self.final and self.converges and ev.iteration == self.iteration else "iteration"
        self.iteration = ev.iteration
        if ev.resolution_A is not None and math.isfinite(ev.resolution_A):
            self.resolution_A = float(ev.resolution_A)
        self.phase = "between"
        of = f" of {self.iterations}" if self._whole_run_bar else ""
        text = f"{self.job}: {name} {ev.iteration}{of}" + (f": {ev.summary}" if ev.summary else " done")
        self.last_summary = f"{name} {ev.iteration}: {ev.summary}" if ev.summary else ""
        if self._whole_run_bar and ev.iteration < self.iterations:
            value = self._bar_value(ev.iteration / self.iterations)
            return ProgressReport(text, value, BAR_STEPS, None, self._bar_text(value))
        # the job goes on (the next iteration's sampling, or its last steps after the last iteration): busy
        return ProgressReport(text, 0, 0)

    def _plain(self, ev: Progress, now: float) -> ProgressReport:
        """A job without iterations: "stage done/total", the time left, the bar done of total."""
        stage = f"{ev.stage} " if ev.stage else ""
        frac = run_fraction(ev)
        left = self._run_clock.seconds_left(frac, now) if frac is not None else None
        total = max(int(ev.total), 0)
        return ProgressReport(f"{self.job}: {stage}{ev.done}/{ev.total}{self._eta_text(left)}",
                              min(int(ev.done), total) if total else 0, total, left)

    @property
    def in_iterations(self) -> bool:
        """An iterative run between its first IterationStarted (or iteration's Progress) and its end: the progress
        line says more than the job's log lines."""
        return self.iteration > 0 and self.phase != "finished"

    # ---- words -------------------------------------------------------------------------------------------------

    @property
    def _whole_run_bar(self) -> bool:
        """The bar shows the whole run: the number of iterations is known (not a cap of a converging job)."""
        return self.iterations > 0 and not self.converges

    def _head(self) -> str:
        """"class2d: iteration 3 of 25", "refine3d: iteration 4 (13.7 Å, 7.5° steps, local)", "refine3d: final
        iteration 9 (12.0 Å, halves joined)": a converging job's resolution after the last iteration, its angular
        step (the coarse HEALPix step, as RELION's "Angular step") and its searches."""
        i = self.iteration
        if not self.converges:
            of = f" of {self.iterations}" if self.iterations > 0 else ""
            return f"{self.job}: iteration {i}{of}"
        state = []
        if self.resolution_A is not None:
            state.append(f"{self.resolution_A:.1f} Å")
        if self.final:
            state.append("halves joined")
        elif self.angular_step > 0:
            state.append(f"{self.angular_step:g}° steps" + (", local" if self.local else ", global"))
        # no cap (--auto_iter_max): the final iteration comes after it, so it is no count either
        name = "final iteration" if self.final else "iteration"
        return f"{self.job}: {name} {i}" + (f" ({', '.join(state)})" if state else "")

    def _lines(self, phase: str) -> str:
        """The progress line ("<head>: <phase>") and, under it, the last iteration's summary (its resolution,
        changes, classes: what the user judges the run by while the next iteration runs)."""
        line = f"{self._head()}: {phase}"
        return f"{line}\n{self.last_summary}" if self.last_summary else line

    def _bar_text(self, value: int, estep: bool = False) -> str:
        """On the bar: "iteration 3 of 25 · 10 %" (the run), "iteration 4 · E-step 64 %" (a converging job's)."""
        pct = bar_percent(value, BAR_STEPS)
        if estep:
            return f"{'final ' if self.final else ''}iteration {self.iteration} · E-step {pct} %"
        of = f" of {self.iterations}" if self.iterations > 0 else ""
        return f"iteration {self.iteration}{of} · {pct} %"

    @staticmethod
    def _bar_value(frac: float) -> int:
        """A whole-run fraction as the bar's value: full only at Finished."""
        return min(int(round(_clip(frac) * BAR_STEPS)), BAR_STEPS - 1)

    # ---- time left ---------------------------------------------------------------------------------------------

    @staticmethod
    def _eta_text(left: float | None, where: str = "") -> str:
        """", about 3 min left" (``where``: " in this E-step"); "" without an estimate."""
        return f", about {format_duration(left)} left{where}" if left is not None else ""

    # ---- the job's state ---------------------------------------------------------------------------------------

    def stopped(self, state: str, shown: tuple[int, int],
                before_cancel: tuple[int, int] | None = None) -> tuple[int, int, str]:
        """(value, maximum, bar text) of the bar in job state ``state`` (runner.JobState's words), from the bar as
        shown and as it stood when Cancel was clicked; a stopped run goes back to its last bar with a value and
        says where it stopped on the bar ("cancelled in iteration 4")."""
        value, maximum = bar_in_state(state, shown, before_cancel or self.last_bar)
        if state in ("cancelled", "failed"):
            where = f" in iteration {self.iteration}" if self.iteration else f" at {bar_percent(value, maximum)} %"
            return value, maximum, f"{state}{where}"
        return value, maximum, ""


def bar_in_state(state: str, bar: tuple[int, int], before_cancel: tuple[int, int] | None = None) -> tuple[int, int]:
    """(value, maximum) of the progress bar in the job state ``state`` (runner.JobState's words), from the bar as
    shown (``bar``) and as it stood when Cancel was clicked (``before_cancel``). A maximum of 0 is Qt's busy bar:
    shown while the job is cancelling, never after it stopped."""
    value, maximum = bar
    if state == "cancelling":
        return 0, 0
    if state == "finished":
        top = max(maximum, 1)
        return top, top
    if state in ("cancelled", "failed"):
        if maximum <= 0 and before_cancel is not None:
            value, maximum = before_cancel
        return (min(max(value, 0), maximum), maximum) if maximum > 0 else (0, 1)
    return value, maximum

"""A job's progress line and bar from its Progress events (no Qt, no napari): "iteration n of max" for an iterative
job and an estimate of the time left where the job knows how much work remains.

The estimate is the time so far divided by the fraction of the run done since the first Progress event, times
the fraction left: iterations differ in cost (the image size grows), so it is rough ("about") and shown only after
:data:`MIN_SECONDS_FOR_ETA` seconds and 1 % of the run.

:func:`bar_in_state` says what the bar shows as the job's state changes: busy while it is cancelling, and never
busy once it has stopped (cancelled or failed: the bar as it stood; finished: full).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..events import Progress

__all__ = ["BAR_STEPS", "MIN_SECONDS_FOR_ETA", "ProgressClock", "ProgressReport", "format_duration", "run_fraction",
           "bar_in_state"]

#: Steps of the progress bar of a run whose total is known as a fraction.
BAR_STEPS = 1000
#: No estimate of the time left before this many seconds of a run have passed.
MIN_SECONDS_FOR_ETA = 3.0


@dataclass(frozen=True)
class ProgressReport:
    """What the dock shows: the status line and the progress bar (value of maximum)."""

    text: str
    value: int
    maximum: int
    seconds_left: float | None = None


def run_fraction(ev: Progress) -> float | None:
    """Fraction (0..1) of the whole run done: over all iterations where the job has a maximum, else ``done /
    total`` of a job that is not iterative; None for an iterative job that stops when it has converged."""
    if ev.iteration > 0:
        if ev.iterations <= 0:
            return None
        frac = (ev.iteration - 1 + min(max(ev.iteration_fraction, 0.0), 1.0)) / ev.iterations
        return min(max(frac, 0.0), 1.0)
    if ev.total <= 0:
        return None
    return min(max(ev.done / ev.total, 0.0), 1.0)


def format_duration(seconds: float) -> str:
    """"45 s", "3 min", "1 h 20 min" (rounded)."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    m = int(round(s / 60))
    if m < 60:
        return f"{m} min"
    return f"{m // 60} h {m % 60:02d} min"


class ProgressClock:
    """Turns the Progress events of one run into :class:`ProgressReport` s (make a new one for each run)."""

    def __init__(self) -> None:
        self._start: tuple[float, float] | None = None  # (time, fraction) of the first event with a fraction

    def report(self, job: str, ev: Progress, now: float) -> ProgressReport:
        stage = f"{ev.stage} " if ev.stage else ""
        where = f"{stage}{ev.done}/{ev.total}"
        frac = run_fraction(ev)
        left = self._seconds_left(frac, now)
        eta = f", about {format_duration(left)} left" if left is not None else ""
        if ev.iteration > 0:
            of = f" of {ev.iterations}" if ev.iterations > 0 else ""
            text = f"{job}: iteration {ev.iteration}{of} ({where}){eta}"
            if frac is not None:
                return ProgressReport(text, int(round(frac * BAR_STEPS)), BAR_STEPS, left)
            return ProgressReport(text, min(ev.done, ev.total), max(ev.total, 0), left)  # this iteration's E-step
        total = max(int(ev.total), 0)
        return ProgressReport(f"{job}: {where}{eta}", min(int(ev.done), total) if total else 0, total, left)

    def _seconds_left(self, frac: float | None, now: float) -> float | None:
        if frac is None:
            return None
        if self._start is None:
            self._start = (now, frac)
            return None
        t0, f0 = self._start
        elapsed, done = now - t0, frac - f0
        if elapsed < MIN_SECONDS_FOR_ETA or done < 0.01 or frac >= 1.0:
            return None
        return elapsed * (1.0 - frac) / done


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

"""The per-micrograph skeleton shared by the jobs that treat each micrograph on its own (autopick, extract).

Every MPI rank takes its contiguous block of the micrographs (runtime.distributed.world().share). In rounds that
all ranks run together, each rank hands its next micrograph(s) to the job's ``work`` (read, process on the
backend, possibly write its own outputs); rank 0 gathers what every rank did, reports the unreadable micrographs,
hands the results to the job's ``collect`` (write per-micrograph outputs, yield their events) and yields a
Progress event. The job's events reach the user through runtime.distributed.root_events (rank 0's only).
Memory decisions stay in runtime.memory; this module holds no numerical algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..cancel import check_cancel
from ..errors import InputError
from ..events import Message, Progress
from ..io.micrographs import UnusableMicrograph, read_micrograph
from ..runtime.distributed import SingleProcess


@dataclass
class Round:
    """What one rank did in one round."""

    results: list = field(default_factory=list)  # handed to ``collect`` on rank 0 (every rank's, in rank order)
    failures: list[str] = field(default_factory=list)  # "name: reason" of micrographs that could not be read
    done: int = 0  # micrographs consumed (0: the same ones again next round, e.g. after running out of memory)
    progress: bool = True  # False: no Progress event for this round (unless another rank's round asks for one)


#: ``work(i, stop)``: a generator over the micrographs from index i of this rank's block [i, stop) (it takes as
#: many as it likes, at least one unless it retries) that yields events and returns a Round.
Work = Callable[[int, int], Generator[Any, None, Round]]


def read_or_skip(entry, skip_bad: bool, read: Callable = read_micrograph) -> tuple[Any, str | None]:
    """``read(entry.path)``, or (None, "name: reason") when it cannot be read and ``skip_bad`` is set (otherwise
    the error propagates).

    A micrograph whose pixels cannot be used (UnusableMicrograph: NaN or infinite pixels, or blank) is skipped
    whatever ``skip_bad`` says: its pixels are seen only now, after other micrographs' outputs were written, and
    stopping here would waste them (under MPI it would also stop one rank alone). The job warns "skipping
    micrograph <name>: <count> of <n> pixels are NaN" and counts it among the failed ones; it never writes a NaN
    particle or an empty pick list for it."""
    try:
        return read(entry.path), None
    except UnusableMicrograph as exc:
        return None, f"{entry.name}: {exc.reason}"
    except (InputError, OSError, ValueError) as exc:
        if not skip_bad:
            raise
        return None, f"{entry.name}: {exc}"


def failure_report(failures: list[str]) -> Message:
    """The closing warning that lists the micrographs that could not be read."""
    return Message(f"{len(failures)} micrograph(s) could not be read:\n  " + "\n  ".join(failures), "warning")


def over_micrographs(comm: SingleProcess, n: int, work: Work, collect: Callable[[list], Iterator],
                     label: str) -> Generator[Any, None, list[str]]:
    """Run ``work`` over this rank's block of ``n`` micrographs in rounds; on rank 0, after each round, warn
    "skipping micrograph ..." for every unreadable one, ``yield from collect(results)`` (all ranks' results of the
    round, in rank order) and yield Progress(micrographs done, n, ``label``). A cancel point before each round.

    Returns the unreadable micrographs ("name: reason"): on rank 0 every rank's, in micrograph order; elsewhere
    this rank's."""
    block = comm.share(n)  # this rank's micrographs: [i, stop)
    i, stop = (int(block[0]), int(block[-1]) + 1) if block.size else (n, n)
    done = 0
    failures_by_rank: list[list[str]] = [[] for _ in range(comm.size)]
    while comm.any(i < stop):  # one round: every rank does its next micrograph(s) (or none), rank 0 collects
        check_cancel()  # before a micrograph (never between writing its files)
        r = (yield from work(i, stop)) if i < stop else Round(progress=False)
        i += r.done
        rounds = comm.gather(r)
        if not comm.is_root:
            failures_by_rank[0] += r.failures
            continue
        for rank, rr in enumerate(rounds):
            failures_by_rank[rank] += rr.failures
            for f in rr.failures:
                yield Message(f"skipping micrograph {f}", "warning")
        yield from collect([x for rr in rounds for x in rr.results])
        done += sum(rr.done for rr in rounds)
        if any(rr.progress for rr in rounds):
            yield Progress(done, n, label)
    return [f for fs in failures_by_rank for f in fs]

"""What the jobs do with the communicator (napari_gpu_relion.parallel) when they run over several MPI ranks.

Every rank runs the same job on its share of the particles (or micrographs); these helpers sum what the E-step
accumulated on each rank, merge the per-particle results so that every rank holds the whole particle set (the
M-step then runs on every rank on identical sums and gives identical models), and pass only rank 0's events on.
With one process (``SingleProcess``) each of them is a no-op.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator

import numpy as np

from ..compute.backprojector import insertion_reach, support_index
from ..compute.estep import EStepSums
from ..parallel import SingleProcess
from ..events import Message, Started

#: EStepSums fields that are sums over particles (arrays, then scalars); the others describe the shapes.
SUMMED_ARRAYS = ("sigma2", "sumw_group", "pdf_class", "pdf_direction", "offset_sum", "xa", "aa")
SUMMED_SCALARS = ("sigma_offset", "sum_weight", "log_likelihood", "sum_pmax", "n_particles")
SHAPE_FIELDS = ("backprojectors", "n_shells", "n_groups", "n_dirs", "n_scale_groups")
#: The per-particle hidden variables the E-step sets (jobs/em.run_estep), merged from every rank.
PARTICLE_RESULTS = ("angles", "offsets_px", "classes", "pmax", "nr_significant", "log_likelihood", "residual_power")


def accumulator_grids(acc) -> list:
    """The arrays of a BackProjector (data_re, data_im, weight) or of a BackProjectorStack (one array each)."""
    return list(acc.arrays) if hasattr(acc, "arrays") else [acc.data_re, acc.data_im, acc.weight]


def sum_estep(comm: SingleProcess, sums: EStepSums, acc) -> None:
    """Sum one half's E-step accumulators over the ranks, in place: the back-projector grids and every summed
    field of ``sums`` (one collective for the small arrays and scalars, one per large grid). Of the grids only
    the block that insertion up to the accumulators' r_max can reach travels (at low resolution a small part of
    the padded grid; the rest is zero on every rank)."""
    if comm.size == 1:
        return
    grids = accumulator_grids(acc)
    ix = support_index(grids[0].shape[-acc.ndim:], insertion_reach(acc.pad, acc.r_max), acc.xp)
    block = grids if ix is None else [g[(Ellipsis, *ix)] for g in grids]  # copies of the block
    comm.sum_arrays(block + [getattr(sums, f) for f in SUMMED_ARRAYS])
    if ix is not None:
        for g, b in zip(grids, block, strict=True):
            g[(Ellipsis, *ix)] = b
    totals = comm.sum_scalars([getattr(sums, f) for f in SUMMED_SCALARS])
    for f, v in zip(SUMMED_SCALARS, totals, strict=True):
        setattr(sums, f, type(getattr(sums, f))(round(v) if f == "n_particles" else v))


def merge_particles(comm: SingleProcess, ps, mine: np.ndarray) -> None:
    """Give every rank the E-step's per-particle results of every other rank's rows (``mine`` on this one)."""
    if comm.size == 1:
        return
    for rows, values in comm.allgather((mine, [getattr(ps, f)[mine] for f in PARTICLE_RESULTS])):
        for f, v in zip(PARTICLE_RESULTS, values, strict=True):
            getattr(ps, f)[rows] = v


def describe_backends(names: list[str]) -> str:
    """"CPU (...)" for one rank; "3 MPI ranks: GPU 0 (...) x 2, GPU 1 (...)" for several."""
    if len(names) == 1:
        return names[0]
    counts = Counter(names)
    parts = [name if c == 1 else f"{name} x {c}" for name, c in counts.items()]
    return f"{len(names)} MPI ranks: " + ", ".join(parts)


def root_events(comm: SingleProcess, events: Iterator) -> Iterator:
    """Run a job's event generator on every rank and pass on rank 0's events only. At the Started event (which
    every rank reaches) rank 0 names the backends of all ranks and, in a Message, each rank's host and process
    id (what a launcher's report of a killed process names)."""
    for ev in events:
        if isinstance(ev, Started) and comm.size > 1:
            ranks = comm.gather((ev.backend, comm.host, os.getpid()))
            if comm.is_root:
                yield dataclasses.replace(ev, backend=describe_backends([b for b, _, _ in ranks]))
                yield Message("MPI ranks (host:pid): " + ", ".join(f"{r} {h}:{pid}" for r, (_, h, pid)
                                                                    in enumerate(ranks)))
            continue
        if comm.is_root:
            yield ev

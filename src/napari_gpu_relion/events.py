"""Events: the contract between a running job and every front end (napari widgets, the CLI, tests).

A job is ``run(params) -> Iterator[Event]``. Events carry host (NumPy) data only, never device arrays, so a
GUI thread can use them directly. The front end may stop iterating at any event (cancel); a job writes every
file atomically, so what it already wrote stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Event:
    """Base class of all job events."""


@dataclass(frozen=True)
class Started(Event):
    job: str  # e.g. "reconstruct"
    output_dir: Path | None
    backend: str  # e.g. "GPU 0 (NVIDIA H200, 139.8 GiB)"
    message: str = ""


@dataclass(frozen=True)
class Progress(Event):
    """``done`` of ``total`` items of ``stage``. An iterative job also says which ``iteration`` it is in (from 1),
    of how many (``iterations``; 0 where it stops at convergence, as auto-refine) and the fraction of that
    iteration's work done (``iteration_fraction``, 0..1): a front end shows "iteration n of max" and an ETA."""

    done: int
    total: int
    stage: str = ""
    iteration: int = 0
    iterations: int = 0
    iteration_fraction: float = 0.0


@dataclass(frozen=True)
class IterationStarted(Event):
    """An iterative job (relion_refine's: refine, classification, initial model) begins ``iteration`` (from 1),
    with its sampling decided: what a front end shows beside the E-step's Progress events.

    ``iterations``: the last iteration at the latest (0: none set); ``converges``: the job may stop earlier, once
    it has converged (auto-refine: ``iterations`` is then --auto_iter_max, a cap, not a count); ``final``: this is
    the job's last iteration (auto-refine's: the halves joined, at the full image size); ``image_size`` of
    ``full_size`` pixels; ``angular_step`` (degrees; the in-plane step in 2D; 0 where particles keep their
    orientations) and ``local`` (local angular searches); ``even_cost``: the iterations cost about the same, so
    that the share of iterations done estimates the time left (not the initial model's growing mini-batches)."""

    iteration: int
    iterations: int = 0
    final: bool = False
    converges: bool = False
    image_size: int = 0
    full_size: int = 0
    angular_step: float = 0.0
    local: bool = False
    even_cost: bool = True


@dataclass(frozen=True)
class Message(Event):
    """A line for the log (warnings included)."""

    text: str
    level: str = "info"  # "info" | "warning"


@dataclass(frozen=True)
class MapUpdated(Event):
    """A 3D map (or half map) produced or updated: display it in place under ``name``.

    With ``surface_values`` (a map on the same grid, e.g. the local resolution in Å) the map's surface is coloured
    by those values (its colour range from their percentiles inside ``values_mask``, > 0.5; voxels equal to
    ``values_missing`` have no value), and ``values_label`` (with its unit) names them; ``values_path`` is their
    file."""

    name: str  # e.g. "half1", "class001", "postprocess"
    volume: np.ndarray
    pixel_size: float
    path: Path | None = None
    surface_values: np.ndarray | None = None
    values_mask: np.ndarray | None = None
    values_label: str = ""
    values_path: Path | None = None
    values_missing: float | None = 0.0


@dataclass(frozen=True)
class ClassAveragesUpdated(Event):
    """2D class averages (K, N, N) with their class distributions (K,) and resolutions (K,) in Å: shown as one
    grid under ``name``, sorted by distribution, each labelled."""

    name: str
    images: np.ndarray
    distribution: np.ndarray
    resolution_A: np.ndarray
    pixel_size: float
    path: Path | None = None


@dataclass(frozen=True)
class FscUpdated(Event):
    """An FSC curve: shells 0..N/2 with their resolutions (1/Å) and named curves."""

    resolution_inv_A: np.ndarray
    curves: dict[str, np.ndarray]
    resolution_A: float
    threshold: float = 0.143


@dataclass(frozen=True)
class MicrographPicked(Event):
    name: str
    index: int
    coords: np.ndarray  # (n, 2) x, y pixels
    scores: np.ndarray  # (n,)


@dataclass(frozen=True)
class ParticlesExtracted(Event):
    """The particles of one micrograph were extracted (their stack ``path`` is written): the integer coordinates
    (n, 2) x, y in pixels of micrograph ``index`` (row of the micrographs STAR; box j covers pixels x - B/2 ..
    x + B/2 - 1 of side B = ``box_size``), and the first few extracted images (m, b, b) (m <= n) for a gallery,
    with their pixel size (Å, after rescaling)."""

    name: str
    index: int
    coords: np.ndarray
    box_size: int
    micrograph_pixel_size: float
    images: np.ndarray
    pixel_size: float
    path: Path | None = None


@dataclass(frozen=True)
class IterationFinished(Event):
    iteration: int
    references: dict[str, np.ndarray] = field(default_factory=dict)
    class_distribution: np.ndarray | None = None
    resolution_A: float | None = None
    fsc: np.ndarray | None = None
    summary: str = ""


@dataclass(frozen=True)
class Finished(Event):
    outputs: dict[str, Path]
    summary: str = ""

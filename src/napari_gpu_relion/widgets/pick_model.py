"""The picks of the auto-picking display as plain data (no Qt, no napari): what widgets/display.py shows in
its Points layer "picks" and what "Save picks" writes.

One flat table, row i being point i of the layer: the micrograph index, (x, y) in micrograph pixels, the
figure of merit (FOM) and whether the pick was made by hand. Each micrograph keeps its name. A job's picks of
a micrograph replace that micrograph's rows (:meth:`PickModel.set_micrograph`); picks added by hand carry
RELION's manual-pick markers (FOM, class and psi -999) and are never hidden by the threshold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .style import MANUAL_PICK_COLOR, hex_to_rgb, ramp_colours

__all__ = ["PickModel", "CoordinateTable", "FomHistogram", "MANUAL_PICK_VALUE"]

#: RELION's "not given" value of FOM, class and psi (what its manual picker writes).
MANUAL_PICK_VALUE = -999


@dataclass(frozen=True)
class CoordinateTable:
    """The columns of one micrograph's coordinate STAR as "Save picks" writes them (shown picks only)."""

    index: int  # micrograph index (0-based)
    name: str  # micrograph name, "" when unknown
    x: np.ndarray  # micrograph pixels
    y: np.ndarray
    fom: np.ndarray
    class_number: np.ndarray
    psi: np.ndarray

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class FomHistogram:
    """What the picking dock's FOM histogram draws: equal bins over the automatic picks' FOMs (edges (n+1,),
    counts (n,)), how many of each bin are shown (FOM >= threshold), and the threshold line's position as a
    fraction of the axis (0 = left edge, 1 = right edge; None when everything is shown)."""

    edges: np.ndarray
    counts: np.ndarray
    shown: np.ndarray
    threshold: float
    threshold_position: float | None

    @property
    def n_bins(self) -> int:
        return len(self.counts)


class PickModel:
    """Picks per micrograph with their FOMs, the FOM threshold, hand edits (see the module docstring)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.mic = np.empty(0, np.int64)
        self.xy = np.empty((0, 2), np.float64)
        self.fom = np.empty(0, np.float64)
        self.manual = np.empty(0, bool)
        #: Picks with a lower FOM are hidden (and not saved); -inf shows everything.
        self.threshold: float = -np.inf

    def __len__(self) -> int:
        return len(self.mic)

    # -- changes -------------------------------------------------------------------------------------------

    def set_micrograph(self, index: int, name: str, coords: Sequence | np.ndarray,
                       scores: Sequence | np.ndarray) -> None:
        """The job's picks of micrograph ``index`` ((n, 2) x, y pixels and their n FOMs) replace the rows it had;
        other micrographs (with their hand edits) are kept. Rows stay grouped by micrograph, ascending."""
        xy = np.asarray(coords, dtype=np.float64).reshape(-1, 2)
        fom = np.asarray(scores, dtype=np.float64).ravel()
        if len(fom) != len(xy):
            raise ValueError(f"{len(xy)} picks but {len(fom)} scores")
        index = int(index)
        keep = self.mic != index
        self._set_rows(np.concatenate([self.mic[keep], np.full(len(xy), index, np.int64)]),
                       np.concatenate([self.xy[keep], xy]), np.concatenate([self.fom[keep], fom]),
                       np.concatenate([self.manual[keep], np.zeros(len(xy), bool)]))
        order = np.argsort(self.mic, kind="stable")
        self._set_rows(self.mic[order], self.xy[order], self.fom[order], self.manual[order])
        self.names[index] = str(name)

    def add(self, mic: int, x: float, y: float) -> int:
        """A pick made by hand on micrograph ``mic`` at (x, y) pixels, appended; returns its row."""
        self._set_rows(np.append(self.mic, np.int64(mic)), np.vstack([self.xy, [[x, y]]]),
                       np.append(self.fom, float(MANUAL_PICK_VALUE)), np.append(self.manual, True))
        return len(self) - 1

    def remove(self, rows: Iterable[int]) -> None:
        """Delete the picks of ``rows`` (the micrographs keep their names)."""
        rows = np.asarray(sorted({int(r) for r in rows}), dtype=np.int64)
        self._set_rows(np.delete(self.mic, rows), np.delete(self.xy, rows, axis=0), np.delete(self.fom, rows),
                       np.delete(self.manual, rows))

    def replace(self, mic: Sequence | np.ndarray, xy: Sequence | np.ndarray, fom: Sequence | np.ndarray,
                manual: Sequence | np.ndarray, names: Sequence[str] | Mapping[int, str] = ()) -> None:
        """All rows at once, in the given order (the picks layer as the user edited it). Names of micrographs
        not known yet are taken from ``names`` (by index); known ones stay."""
        self._set_rows(np.asarray(mic, dtype=np.int64).ravel(), np.asarray(xy, dtype=np.float64).reshape(-1, 2),
                       np.asarray(fom, dtype=np.float64).ravel(), np.asarray(manual, dtype=bool).ravel())
        items = names.items() if isinstance(names, Mapping) else enumerate(names)
        given = {int(m): str(nm) for m, nm in items if nm}
        for m in np.unique(self.mic).tolist():
            if m not in self.names and m in given:
                self.names[m] = given[m]

    def clear(self) -> None:
        """Forget all picks and micrograph names (the threshold stays)."""
        self.names.clear()
        self._set_rows(np.empty(0, np.int64), np.empty((0, 2)), np.empty(0), np.empty(0, bool))

    def _set_rows(self, mic: np.ndarray, xy: np.ndarray, fom: np.ndarray, manual: np.ndarray) -> None:
        if not len(mic) == len(xy) == len(fom) == len(manual):
            raise ValueError(f"rows differ in length: mic {len(mic)}, xy {len(xy)}, fom {len(fom)}, "
                             f"manual {len(manual)}")
        self.mic, self.xy, self.fom, self.manual = mic, xy, fom, manual

    # -- what is shown -------------------------------------------------------------------------------------

    @property
    def shown(self) -> np.ndarray:
        """Per row: FOM at least the threshold, or picked by hand."""
        return (self.fom >= self.threshold) | self.manual

    @property
    def n_shown(self) -> int:
        return int(np.count_nonzero(self.shown))

    def fom_range(self) -> tuple[float, float] | None:
        """(lowest, highest) FOM of the automatic picks; None without any."""
        fom = self.fom[~self.manual & np.isfinite(self.fom)]
        return (float(fom.min()), float(fom.max())) if len(fom) else None

    def border_colours(self) -> np.ndarray:
        """(n, 4) RGBA ring colour of every pick: its FOM on the picks' ramp (widgets/style.py) from the lowest to
        the highest FOM of the automatic picks; picks added by hand in their own colour (MANUAL_PICK_COLOR)."""
        lo, hi = self.fom_range() or (0.0, 0.0)
        out = ramp_colours(self.fom, lo, hi)
        out[self.manual] = (*hex_to_rgb(MANUAL_PICK_COLOR), 1.0)
        return out

    def slider_range(self) -> tuple[float, float] | None:
        """(lowest, upper end) of the FOM threshold slider over the automatic picks: the highest FOM, except that
        an outlier at the top (further above the next FOM than the rest of the picks span; at most 1 % of the
        picks, from 8 picks on) does not stretch the slider and squeeze every other pick into its first steps.
        Picks above the upper end are never hidden by the slider."""
        fom = np.sort(self.fom[~self.manual & np.isfinite(self.fom)])
        if not len(fom):
            return None
        top = len(fom) - 1
        if len(fom) >= 8:
            for _ in range(max(1, len(fom) // 100)):
                if top >= 2 and fom[top] - fom[top - 1] > fom[top - 1] - fom[0]:
                    top -= 1
                else:
                    break
        return float(fom[0]), float(fom[top])

    def fom_histogram(self, bins: int = 40) -> FomHistogram | None:
        """Histogram of the automatic picks' FOMs over [lowest, highest] in ``bins`` equal bins (the highest
        FOM in the last bin), with the threshold line; None without automatic picks."""
        fom = self.fom[~self.manual & np.isfinite(self.fom)]
        if not len(fom):
            return None
        lo, hi = float(fom.min()), float(fom.max())
        if hi <= lo:
            hi = lo + max(abs(lo), 1.0) * 1e-3
        edges = np.linspace(lo, hi, int(bins) + 1)
        counts, _ = np.histogram(fom, edges)
        shown, _ = np.histogram(fom[fom >= self.threshold], edges)
        t = self.threshold
        pos = None if not np.isfinite(t) or t <= lo else float(np.clip((t - lo) / (hi - lo), 0.0, 1.0))
        return FomHistogram(edges, counts.astype(np.int64), shown.astype(np.int64), float(t), pos)

    def micrograph_indices(self) -> list[int]:
        """Micrographs with a name or with picks, ascending."""
        return sorted({m for m, nm in self.names.items() if nm} | set(self.mic.tolist()))

    def micrograph_names(self) -> list[str]:
        """Names by micrograph index ("" where unknown), up to the highest index with picks or a name."""
        indices = set(self.names) | set(self.mic.tolist())
        out = [""] * (max(indices) + 1 if indices else 0)
        for m, nm in self.names.items():
            out[m] = nm
        return out

    # -- saving --------------------------------------------------------------------------------------------

    def coordinate_tables(self) -> list[CoordinateTable]:
        """What "Save picks" writes: per micrograph (:meth:`micrograph_indices`) its shown picks, in row order,
        with class and psi -999 (the job gives neither). A micrograph without shown picks gets an empty table."""
        shown = self.shown
        tables = []
        for m in self.micrograph_indices():
            rows = shown & (self.mic == m)
            n = int(np.count_nonzero(rows))
            tables.append(CoordinateTable(m, self.names.get(m, ""), self.xy[rows, 0], self.xy[rows, 1],
                                          self.fom[rows], np.full(n, MANUAL_PICK_VALUE, np.int64),
                                          np.full(n, float(MANUAL_PICK_VALUE))))
        return tables

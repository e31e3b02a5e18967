"""The factored log prior of an E-step pass's samples (:class:`SampleLogPrior`): what the array code of
expectation.py and the fused CUDA kernels of gpu_posterior.py both read (so neither imports the other for it)."""

from __future__ import annotations

from dataclasses import dataclass

from .backend import get_array_module

__all__ = ["SampleLogPrior"]


@dataclass(frozen=True)
class SampleLogPrior:
    """The log prior of every sample (i, r, c) of scores (I, R, C), kept small: table[i, r // row_group,
    c // col_group] (+ column[i or 0, c]). The coarse pass's is (translation prior (+ class prior) per particle,
    translation and class) + (orientation prior per column); the fine pass's is the coarse parents' prior per
    particle, translation and parent. The GPU kernels read it as it is; :meth:`full` makes the (I, R, C) array
    for the array code, adding in the same order."""

    table: object  # (I, A, B) float64
    row_group: int = 1  # score rows per table row
    col_group: int = 1  # score columns per table column
    column: object = None  # (1 or I, C) float64 or None

    def full(self, shape: tuple[int, int, int]):
        """The (I, R, C) float64 log prior of scores of this shape."""
        xp = get_array_module(self.table)
        I, R, C = shape
        A, B = self.table.shape[1], self.table.shape[2]
        t = xp.broadcast_to(self.table[:, :, None, :, None], (I, A, self.row_group, B, self.col_group))
        t = t.reshape(I, A * self.row_group, B * self.col_group)[:, :R, :C]
        return t if self.column is None else t + self.column[:, None, :]

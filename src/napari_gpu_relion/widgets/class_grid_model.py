"""The 2D class grid as plain data (no Qt, no napari): what widgets/display.py shows as one image with labels
and a selection outline, and what a click on it selects.

K class averages of N x N pixels are laid out row by row, largest class first, in ceil(sqrt(K)) columns. Tile
i shows the 0-based class ``order[i]``; RELION numbers classes from 1, and so does the selection. Pixel i is
centred at i, so tiles start at -0.5 px.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ClassGrid", "grid_shape", "tile_at", "class_at", "tile_corners", "compose_tiles"]


def grid_shape(K: int) -> tuple[int, int]:
    """(rows, columns) of the class grid of K tiles: ceil(sqrt(K)) columns, filled row by row."""
    ncol = max(1, math.ceil(math.sqrt(K)))
    return max(1, math.ceil(K / ncol)), ncol


def tile_at(y: float, x: float, K: int, N: int, pixel_size: float = 1.0) -> int | None:
    """Index (0-based, row-major) of the tile under (y, x) in Å (pixels times ``pixel_size``) of a grid of K
    tiles of N x N pixels, or None outside the tiles. Pixel i is centred at i, so tiles start at -0.5 px."""
    nrow, ncol = grid_shape(K)
    row = math.floor((y / pixel_size + 0.5) / N)
    col = math.floor((x / pixel_size + 0.5) / N)
    if not (0 <= row < nrow and 0 <= col < ncol):
        return None
    tile = row * ncol + col
    return tile if tile < K else None


def class_at(y: float, x: float, order: Any, N: int, pixel_size: float = 1.0) -> int | None:
    """RELION class number (1-based) shown under (y, x) in Å; ``order[i]`` is the 0-based class of tile i."""
    order = np.asarray(order)
    tile = tile_at(y, x, len(order), N, pixel_size)
    return None if tile is None else int(order[tile]) + 1


def tile_corners(tile: int, ncol: int, N: int, inset: float = 0.0) -> np.ndarray:
    """(4, 2) corners (y, x) in pixels of tile ``tile`` of a grid with ``ncol`` columns of N-pixel tiles, moved
    ``inset`` pixels inwards (so that outlines of neighbouring tiles stay apart)."""
    r, c = divmod(int(tile), ncol)
    y0, x0 = r * N - 0.5 + inset, c * N - 0.5 + inset
    size = N - 2 * inset
    return np.array([[y0, x0], [y0, x0 + size], [y0 + size, x0 + size], [y0 + size, x0]], dtype=np.float64)


def compose_tiles(images: Any, order: Any = None) -> np.ndarray:
    """One image of the (K, N, N) ``images`` in a :func:`grid_shape` grid, tile i showing ``images[order[i]]``
    (default: in their order), each scaled to its own mean and std (the class grid, the particle gallery)."""
    imgs = np.asarray(images, dtype=np.float32)
    K, N = imgs.shape[0], imgs.shape[-1]
    order = np.arange(K) if order is None else np.asarray(order)
    nrow, ncol = grid_shape(K)
    grid = np.zeros((nrow * N, ncol * N), np.float32)
    for tile, k in enumerate(order):  # K tiles (a display copy, not a hot path)
        r, c = divmod(tile, ncol)
        im = imgs[k]
        grid[r * N:(r + 1) * N, c * N:(c + 1) * N] = (im - im.mean()) / (im.std() or 1.0)
    return grid


class ClassGrid:
    """One iteration's class grid: layout, labels and the selected classes (1-based numbers)."""

    def __init__(self, distribution: Any, resolution_A: Any, tile_size: int, path: Path | str | None = None,
                 selected: Any = ()) -> None:
        self.distribution = np.asarray(distribution, dtype=np.float64).ravel()
        self.resolution_A = np.asarray(resolution_A, dtype=np.float64).ravel()
        if len(self.resolution_A) != len(self.distribution):
            raise ValueError(f"{len(self.distribution)} class distributions but {len(self.resolution_A)} "
                             "resolutions")
        self.tile_size = int(tile_size)
        self.path = None if path is None else Path(path)
        #: tile i shows the 0-based class order[i]: largest class first, ties in class order
        self.order = np.argsort(-self.distribution, kind="stable")
        self.selected: set[int] = set()
        for k in selected:
            self.toggle(k)

    @property
    def K(self) -> int:
        return len(self.distribution)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of tiles."""
        return grid_shape(self.K)

    @property
    def image_shape(self) -> tuple[int, int]:
        """(height, width) of the grid image in pixels."""
        nrow, ncol = self.shape
        return nrow * self.tile_size, ncol * self.tile_size

    @property
    def outline_width(self) -> float:
        """Width (pixels) of a selection outline, also its inset into the tile."""
        return max(1.0, self.tile_size / 32)

    # -- layout --------------------------------------------------------------------------------------------

    def tile_of(self, class_number: int) -> int:
        """The tile (0-based) that shows class ``class_number`` (1-based)."""
        self._check(class_number)
        return int(np.flatnonzero(self.order == int(class_number) - 1)[0])

    def tile_origin(self, tile: int) -> tuple[int, int]:
        """(row, column) in pixels of the first pixel of tile ``tile``."""
        r, c = divmod(int(tile), self.shape[1])
        return r * self.tile_size, c * self.tile_size

    def class_at(self, y: float, x: float) -> int | None:
        """The class (1-based) under (y, x) in pixels of the grid image, None outside the tiles."""
        return class_at(y, x, self.order, self.tile_size)

    def compose(self, images: Any) -> np.ndarray:
        """The grid image of the (K, N, N) class averages: each tile scaled to its own mean and std."""
        imgs = np.asarray(images, dtype=np.float32)
        if imgs.shape != (self.K, self.tile_size, self.tile_size):
            raise ValueError(f"expected {self.K} images of {self.tile_size} x {self.tile_size}, got {imgs.shape}")
        return compose_tiles(imgs, self.order)

    def label_positions(self) -> np.ndarray:
        """(K, 2) (y, x) pixels of each tile's label, 1 px inside its top-left corner, in tile order."""
        return np.array([self.tile_origin(t) for t in range(self.K)], dtype=np.float64).reshape(-1, 2) + 1.0

    def labels(self) -> list[str]:
        """Per tile: "class: distribution %, resolution Å" ("4: 35.0% 12 Å")."""
        return [f"{k + 1}: {100 * self.distribution[k]:.1f}% {self.resolution_A[k]:.0f} Å" for k in self.order]

    # -- selection -----------------------------------------------------------------------------------------

    def _check(self, class_number: int) -> None:
        if not 1 <= int(class_number) <= self.K:
            raise ValueError(f"class {class_number} is not one of 1..{self.K}")

    def toggle(self, class_number: int) -> bool:
        """Select or deselect class ``class_number`` (1-based); True if it is selected now."""
        self._check(class_number)
        k = int(class_number)
        now = k not in self.selected
        (self.selected.add if now else self.selected.discard)(k)
        return now

    def toggle_at(self, y: float, x: float) -> int | None:
        """Toggle the class under (y, x) pixels; returns its number, None outside the tiles."""
        k = self.class_at(y, x)
        if k is not None:
            self.toggle(k)
        return k

    def selected_classes(self) -> list[int]:
        return sorted(self.selected)

    def keep_selection_of(self, previous: ClassGrid | None) -> None:
        """Take over the selection of the grid this one redraws (the job's next iteration): classes 1..K, none
        when the job folder changed (another job)."""
        if previous is None:
            return
        if previous.path is not None and self.path is not None and previous.path.parent != self.path.parent:
            return
        self.selected = {k for k in previous.selected if 1 <= k <= self.K}

    def selection_outlines(self) -> list[np.ndarray]:
        """(4, 2) corners (y, x) pixels of each selected tile, inset by :attr:`outline_width`, by class."""
        ncol = self.shape[1]
        return [tile_corners(self.tile_of(k), ncol, self.tile_size, self.outline_width)
                for k in self.selected_classes()]

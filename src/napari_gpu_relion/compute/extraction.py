"""Particle extraction math (relion_pick_extract_post.md section 2): box cutting with RELION's edge handling,
Fourier rescaling, dust removal, ramp subtraction and background-ring normalisation, contrast inversion.

All functions work on batches (n, B, B) with NumPy or CuPy; coordinates are micrograph pixels (x = column,
y = row). A box of even size B around coordinate pixel (x, y) covers columns x - B/2 .. x + B/2 - 1, so the
coordinate pixel lands on the box centre B/2 (RELION's logical origin).
"""

from __future__ import annotations

import numpy as np

from .backend import get_array_module
from .fourier import check_even, fourier_resize, round_half_away


def truncate_coordinates(x, y) -> tuple[np.ndarray, np.ndarray]:
    """RELION's (long) cast: truncation toward zero, not rounding (255.9 -> 255)."""
    return np.trunc(np.asarray(x, np.float64)).astype(np.int64), np.trunc(np.asarray(y, np.float64)).astype(np.int64)


def box_inside(x_int, y_int, box: int, ny: int, nx: int) -> np.ndarray:
    """True where the whole box lies inside an ny x nx micrograph."""
    h = box // 2
    x, y = np.asarray(x_int), np.asarray(y_int)
    return (x - h >= 0) & (x + h <= nx) & (y - h >= 0) & (y + h <= ny)


def box_touches(x_int, y_int, box: int, ny: int, nx: int) -> np.ndarray:
    """True where at least one pixel of the box lies inside the micrograph (RELION errors out otherwise)."""
    h = box // 2
    x, y = np.asarray(x_int), np.asarray(y_int)
    return (x + h - 1 >= 0) & (x - h < nx) & (y + h - 1 >= 0) & (y - h < ny)


def cut_boxes(mic, x_int, y_int, box: int):
    """Boxes (n, box, box) float32 around integer coordinates, by one gather; pixels beyond the micrograph
    take the nearest edge pixel's value (RELION keeps partially outside particles this way)."""
    check_even(box)
    xp = get_array_module(mic)
    ny, nx = mic.shape[-2:]
    off = xp.arange(box) - box // 2
    xi = xp.asarray(np.asarray(x_int, np.int64))
    yi = xp.asarray(np.asarray(y_int, np.int64))
    rows = xp.clip(yi[:, None] + off[None, :], 0, ny - 1)
    cols = xp.clip(xi[:, None] + off[None, :], 0, nx - 1)
    return mic[rows[:, :, None], cols[:, None, :]].astype(np.float32)


def rescale_boxes(boxes, new_size: int):
    """Fourier crop/pad B -> b (mean-preserving, RELION's --scale)."""
    if new_size == boxes.shape[-1]:
        return boxes
    return fourier_resize(boxes.astype(np.float32), int(new_size), 2).astype(np.float32)


def background_mask(box: int, radius: float, xp=np):
    """(box, box) bool: pixels with i^2 + j^2 > radius^2 (logical coordinates from the centre, strict)."""
    c = xp.arange(box, dtype=np.float64) - box // 2
    return (c[:, None] ** 2 + c[None, :] ** 2) > radius**2


def _bg_stats(imgs, bg):
    """Mean and population std (n,) of each image over the background pixels (float64 sums)."""
    v = imgs[:, bg]
    mu = v.mean(axis=1, dtype=np.float64)
    sd = v.std(axis=1, dtype=np.float64)
    return mu, sd


def background_stats(imgs, radius_px: float):
    """(mean, stddev) float64 per image (n, N, N) of the pixels outside the circle of ROUND(radius_px) pixels about
    the image centre (pixel N/2), as RELION's calculateBackgroundAvgStddev; NaN for both when the circle leaves no
    pixel outside it. Arrays of the images' module."""
    xp = get_array_module(imgs)
    bg = background_mask(imgs.shape[-1], float(round_half_away(np.float64(radius_px))), xp)
    if not bool(bg.any()):
        return xp.full(imgs.shape[0], np.nan), xp.full(imgs.shape[0], np.nan)
    return _bg_stats(imgs, bg)


def remove_dust(imgs, bg, white: float = -1.0, black: float = -1.0, seed: int = 0):
    """Replace pixels with x - mu > white sigma (white dust) or x - mu < -black sigma (black dust) by N(mu,
    sigma) draws, mu and sigma from the background of each image; a threshold <= 0 disables that side."""
    if white <= 0 and black <= 0:
        return imgs
    xp = get_array_module(imgs)
    mu, sd = _bg_stats(imgs, bg)
    mu = mu.astype(np.float32)[:, None, None]
    sd = sd.astype(np.float32)[:, None, None]
    bad = xp.zeros(imgs.shape, dtype=bool)
    if white > 0:
        bad |= imgs - mu > white * sd
    if black > 0:
        bad |= imgs - mu < -black * sd
    noise = xp.random.default_rng(seed).standard_normal(imgs.shape, dtype=np.float32)
    return xp.where(bad, mu + sd * noise, imgs)


def subtract_ramp(imgs, bg):
    """Least-squares plane a j + b i + c through each image's background pixels, subtracted from the whole
    image. The design matrix is shared, so all fits are one matrix product with its pseudo-inverse."""
    xp = get_array_module(imgs)
    box = imgs.shape[-1]
    c = xp.arange(box, dtype=np.float64) - box // 2
    I, J = xp.meshgrid(c, c, indexing="ij")
    M = xp.stack([J[bg], I[bg], xp.ones(int(bg.sum()))], axis=1)  # (m, 3)
    pinv = xp.linalg.pinv(M)  # (3, m)
    coef = imgs[:, bg].astype(np.float64) @ pinv.T  # (n, 3)
    plane = coef[:, 0, None, None] * J + coef[:, 1, None, None] * I + coef[:, 2, None, None]
    return (imgs - plane).astype(np.float32)


def normalise_background(imgs, bg):
    """(x - mu) / sigma with mu, sigma (population) from each image's background; images with sigma < 1e-10
    are only shifted (RELION warns and skips the division)."""
    xp = get_array_module(imgs)
    mu, sd = _bg_stats(imgs, bg)
    sd = xp.where(sd < 1e-10, 1.0, sd)
    return ((imgs - mu[:, None, None]) / sd[:, None, None]).astype(np.float32)


def process_particles(boxes, out_size: int | None = None, norm: bool = False, bg_radius: float = -1.0,
                      white_dust: float = -1.0, black_dust: float = -1.0, ramp: bool = True,
                      invert: bool = False, seed: int = 0):
    """RELION's per-particle steps in order: rescale to ``out_size``, then (with ``norm``) dust removal, ramp
    subtraction and background normalisation with the ring r > ``bg_radius`` (pixels of the rescaled box),
    then contrast inversion."""
    xp = get_array_module(boxes)
    x = boxes.astype(np.float32)
    if out_size is not None and out_size != x.shape[-1]:
        x = rescale_boxes(x, out_size)
    if norm:
        bg = background_mask(x.shape[-1], bg_radius, xp)
        x = remove_dust(x, bg, white_dust, black_dust, seed)
        if ramp:
            x = subtract_ramp(x, bg)
        x = normalise_background(x, bg)
    elif white_dust > 0 or black_dust > 0:
        bg = background_mask(x.shape[-1], bg_radius if bg_radius > 0 else 0.375 * x.shape[-1], xp)
        x = remove_dust(x, bg, white_dust, black_dust, seed)
    if invert:
        x = -x
    return x.astype(np.float32)

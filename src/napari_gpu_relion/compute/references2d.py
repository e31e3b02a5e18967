"""2D class references: RELION's blob initialisation and class centring (relion_algorithm.md 7, 4.6)."""

from __future__ import annotations

import numpy as np

from .backend import get_array_module


def blob_references(averages: np.ndarray, diameter_px: float, rng: np.random.Generator, n_blobs: int = 40
                    ) -> np.ndarray:
    """(K, N, N) random-subset averages -> RELION's blob references: each class becomes blobs+ - blobs-/2, where
    each blob image holds ``n_blobs`` Gaussians exp(-|x - c|^2 / (D/10)^2) with centres drawn from N(box centre,
    (D/7)^2) and amplitudes |average| at the centre; the result is rescaled to the average's standard deviation.
    The random blobs make the K classes differ from the start."""
    K, N = averages.shape[0], averages.shape[-1]
    yy, xx = np.mgrid[0:N, 0:N].astype(np.float64) - N // 2
    width2 = (diameter_px / 10.0) ** 2
    out = np.empty_like(averages, dtype=np.float64)
    for k in range(K):  # K images, each a sum of Gaussians (tiny)
        amp = abs(float(averages[k, N // 2, N // 2]))
        pos = neg = 0.0
        for sign in (1, -1):
            c = rng.normal(0.0, diameter_px / 7.0, (n_blobs, 2))
            g = np.exp(-((xx[None] - c[:, 0, None, None]) ** 2 + (yy[None] - c[:, 1, None, None]) ** 2) / width2)
            img = amp * g.sum(0)
            if sign > 0:
                pos = img
            else:
                neg = img
        b = pos - 0.5 * neg
        s = float(b.std())
        out[k] = b * (float(averages[k].std()) / s if s > 0 else 1.0)
    return out


def center_of_mass(images, max_shift_px: float):
    """(K, 2) x, y centre of mass of the positive pixels of each image relative to the box centre (index N/2),
    clamped to a length of ``max_shift_px`` (RELION's --center_classes)."""
    xp = get_array_module(images)
    N = images.shape[-1]
    c = xp.arange(N, dtype=np.float64) - N // 2
    pos = xp.maximum(images.astype(np.float64), 0.0)
    tot = pos.sum(axis=(-2, -1))
    safe = xp.maximum(tot, 1e-300)
    cx = (pos.sum(axis=-2) * c[None, :]).sum(-1) / safe
    cy = (pos.sum(axis=-1) * c[None, :]).sum(-1) / safe
    com = xp.stack([cx, cy], axis=1) * (tot > 0)[:, None]
    length = xp.sqrt((com**2).sum(1, keepdims=True))
    return com * xp.minimum(1.0, max_shift_px / xp.maximum(length, 1e-300))


def shift_images(images, shifts_px):
    """Move the content of each image by ``shifts_px`` (K, 2) = (x, y) pixels, rounded to whole pixels, zero
    fill (RELION shifts class averages in real space)."""
    xp = get_array_module(images)
    out = xp.zeros_like(images)
    N = images.shape[-1]
    for k in range(images.shape[0]):  # K class images
        dx, dy = (int(np.round(float(v))) for v in shifts_px[k])
        src_y = slice(max(0, -dy), min(N, N - dy))
        dst_y = slice(max(0, dy), min(N, N + dy))
        src_x = slice(max(0, -dx), min(N, N - dx))
        dst_x = slice(max(0, dx), min(N, N + dx))
        out[k, dst_y, dst_x] = images[k, src_y, src_x]
    return out

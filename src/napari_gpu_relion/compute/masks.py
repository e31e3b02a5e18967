"""Soft masks (relion_algorithm.md section 8; relion_pick_extract_post.md section 3.1).

Radii and widths are in pixels; the centre is index N/2 in every axis.
"""

from __future__ import annotations

import numpy as np

from .backend import get_array_module, to_host
from .fourier import irfft_centered, lowpass_raised_cosine, real_radius_grid, rfft_centered


def soft_edge_weight(r, radius: float, width: float, xp=np):
    """RELION's outside weight c: 0 for r < R, 1 for r > R + w, 1/2 + 1/2 cos(pi (R + w - r)/w) between."""
    if width <= 0:
        return (r > radius).astype(np.float64)
    c = 0.5 + 0.5 * xp.cos(np.pi * (radius + width - r) / width)
    return xp.where(r < radius, 0.0, xp.where(r > radius + width, 1.0, c))


def soft_spherical_mask(size: int, radius: float, width: float = 5.0, ndim: int = 3, xp=np):
    """1 inside ``radius``, 0 beyond ``radius + width``, raised-cosine between (float32)."""
    r = real_radius_grid(size, ndim, xp)
    return (1.0 - soft_edge_weight(r, radius, width, xp)).astype(np.float32)


def soft_mask_outside(x, radius: float, width: float = 5.0, ndim: int = 2, background=None):
    """RELION's softMaskOutsideMap for a batch: v <- (1 - c) v + c b with b the c-weighted mean of each box
    outside ``radius`` (or ``background``: a scalar, per-box values, or a noise array of x's shape)."""
    xp = get_array_module(x)
    N = x.shape[-1]
    c = soft_edge_weight(real_radius_grid(N, ndim, xp), radius, width, xp).astype(x.dtype)
    axes = tuple(range(-ndim, 0))
    if background is None:
        wsum = c.sum()
        b = (x * c).sum(axis=axes, keepdims=True) / max(float(wsum), 1e-12)
    else:
        b = xp.asarray(background, dtype=x.dtype)
        if b.ndim == 1:
            b = b.reshape(b.shape + (1,) * ndim)
    return (1 - c) * x + c * b


def create_mask(vol, pixel_size: float, ini_threshold: float, extend_inimask: float = 0.0,
                width_soft_edge: float = 0.0, lowpass_A: float | None = None):
    """relion_mask_create: optional low-pass (raised cosine over ROUND(N p / lowpass) +- 1 shell),
    binarise at ``ini_threshold``, extend (or shrink, if negative) by a Euclidean distance in pixels (strict <),
    then a cosine soft edge of ``width_soft_edge`` pixels: 0.5 + 0.5 cos(pi d / w) for d < w.

    Runs on the host (scipy's exact Euclidean distance transform); returns float32 in [0, 1]."""
    from scipy import ndimage  # noqa: PLC0415 (0.2-0.5 s to import: only jobs that make a mask pay it)

    v = to_host(vol).astype(np.float64)
    N = v.shape[-1]
    if lowpass_A is not None and lowpass_A > 0:
        F = rfft_centered(v, 3)
        shell = np.floor(N * pixel_size / lowpass_A + 0.5)
        v = irfft_centered(F * lowpass_raised_cosine(N, shell, 2.0, 3), N, 3)
    binary = v >= ini_threshold
    if extend_inimask > 0:
        d = ndimage.distance_transform_edt(~binary)
        binary = binary | (d < extend_inimask)
    elif extend_inimask < 0:
        d = ndimage.distance_transform_edt(binary)
        binary = binary & (d >= -extend_inimask)
    mask = binary.astype(np.float64)
    if width_soft_edge > 0:
        d = ndimage.distance_transform_edt(~binary)
        edge = (~binary) & (d < width_soft_edge)
        mask[edge] = 0.5 + 0.5 * np.cos(np.pi * d[edge] / width_soft_edge)
    return mask.astype(np.float32)

"""2D class references: RELION's random-subset starting averages, blob initialisation and class centring
(relion_algorithm.md 7, 4.6)."""

from __future__ import annotations

import numpy as np

from .backend import get_array_module, to_host
from .backprojector import BackProjectorStack
from .ctf import ctf_half_grid
from .fourier import lowpass_map, phase_shift_2d, rfft_centered
from .geometry import euler_to_matrix
from .masks import soft_spherical_mask
from .projector import pixel_list


def blob_references(averages: np.ndarray, diameter_px: float, rng: np.random.Generator, n_blobs: int = 40
                    ) -> np.ndarray:
    """(K, N, N) random-subset averages -> RELION's blob references: each class becomes blobs+ - blobs-/2, where
    each blob image holds ``n_blobs`` Gaussians exp(-|x - c|^2 / (D/10)^2) with centres drawn from N(box centre,
    (D/7)^2) and amplitudes |average| at the centre; the result is rescaled to the average's standard deviation.
    The random blobs make the K classes differ from the start."""
    K, N = averages.shape[0], averages.shape[-1]
    axis = np.arange(N, dtype=np.float64) - N // 2  # x along rows' pixels (columns), y along rows
    width2 = (diameter_px / 10.0) ** 2
    out = np.empty_like(averages, dtype=np.float64)
    for k in range(K):  # K images, each a sum of Gaussians
        amp = abs(float(averages[k, N // 2, N // 2]))
        pos = neg = 0.0
        for sign in (1, -1):
            c = rng.normal(0.0, diameter_px / 7.0, (n_blobs, 2))
            # a Gaussian is the product of one in x and one in y, so the sum over blobs is one matrix product
            # ((N, blobs) @ (blobs, N)): 200 classes at box 360 took 22 s as whole-image exponentials
            gx = np.exp(-((axis[None, :] - c[:, 0, None]) ** 2) / width2)
            gy = np.exp(-((axis[None, :] - c[:, 1, None]) ** 2) / width2)
            img = amp * (gy.T @ gx)
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
    pos = xp.maximum(xp.asarray(images, dtype=np.float64), 0.0)  # (no copy of float64 images before it)
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
    shifts_px = to_host(shifts_px)  # one copy from the device, not one per class
    for k in range(images.shape[0]):  # K class images
        dx, dy = (int(np.round(float(v))) for v in shifts_px[k])
        src_y = slice(max(0, -dy), min(N, N - dy))
        dst_y = slice(max(0, dy), min(N, N + dy))
        src_x = slice(max(0, -dx), min(N, N - dx))
        dst_x = slice(max(0, dx), min(N, N + dx))
        out[k, dst_y, dst_x] = images[k, src_y, src_x]
    return out


def initial_class_averages(images, offsets_px: np.ndarray, ctf, K: int, pixel_size: float, diameter_px: float,
                           mask_radius_px: float, lowpass_A: float, rng: np.random.Generator, pad: int = 2,
                           mask_edge_px: float = 5.0) -> np.ndarray:
    """(K, N, N) starting classes of 2D classification (RELION's random-subset averages): each image (n, N, N,
    on the device; already a random subset in random order) gets a random psi and class (index mod K), is
    shifted by its offset (pixels), CTF-weighted (``ctf`` CtfParams or None) and averaged per class without
    regularisation; then RELION's blobs, the low-pass at ``lowpass_A`` and the soft mask."""
    xp = get_array_module(images)
    n, N = images.shape[0], images.shape[-1]
    psi = rng.uniform(0.0, 360.0, n)
    cls = np.arange(n) % K
    A = euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)
    F = phase_shift_2d(rfft_centered(images, 2), xp.asarray(offsets_px), N)
    c = xp.ones(F.shape, dtype=np.float32) if ctf is None else ctf_half_grid(ctf, N, pixel_size, xp=xp)
    stack = BackProjectorStack(K, N, pad, ndim=2, xp=xp, dtype=np.float64)
    ky, kx, flat = pixel_list(N, N / 2, xp, unique=True)
    stack.insert_pixels(cls, A, kx, ky, (F * c).reshape(n, -1)[:, flat], (c * c).reshape(n, -1)[:, flat])
    stack.enforce_hermitian()
    # the K unregularised reconstructions in batches (one per class took 7.7 s for K=200 at box 360 on an H200);
    # a class that got no image has no weight and reconstructs to zero
    avgs = to_host(stack.reconstruct(None)).astype(np.float64)
    refs = xp.asarray(blob_references(avgs, diameter_px, rng))
    refs = lowpass_map(refs, pixel_size, lowpass_A, ndim=2)
    return to_host(refs * xp.asarray(soft_spherical_mask(N, mask_radius_px, mask_edge_px, 2))[None])


def references_from_maps(maps, circle, offset_range_px: float, flatten: bool, center: bool):
    """The M-step's K class maps (float32 or float64, on the host or the device) as the next references: in
    float64, times the solvent ``circle`` (--flatten_solvent), shifted to their centre of mass within
    ``offset_range_px`` (--center_classes), then float32 (the maps as written), on the maps' device. Class2d runs
    it on the GPU before the maps come to the host: at K=200 and box 360 the same steps on the host took 0.39 s of
    every iteration (benchmarks/class2d_mstep_host.py, 2-core VM), an iteration on an H200 about 2 s."""
    xp = get_array_module(maps)
    refs = xp.array(maps, dtype=np.float64)  # a copy of its own (the in-place steps below)
    if flatten:
        refs *= xp.asarray(circle)[None]
    if center:
        refs = shift_images(refs, -center_of_mass(refs, offset_range_px))
    return refs.astype(np.float32)

"""The M-step's shell sums over the padded grid (compute/maximization.py), slab by slab, against direct float64
sums over the whole grid written out here: tau2 of a prepared reference (only the voxels it holds, as RELION's
computeFourierTransformMap counts them), sigma2_ref and the classification SSNR_MAP of an accumulator; and the
same values for any slab size."""

import numpy as np
import pytest

from napari_gpu_relion.compute import fourier
from napari_gpu_relion.compute.backprojector import BackProjector, BackProjectorStack
from napari_gpu_relion.compute.maximization import (
    reference_sigma2,
    reference_tau2,
    references_tau2,
    ssnr_map,
    ssnr_maps,
)
from napari_gpu_relion.compute.projector import prepare_reference

N, PAD = 24, 2


def _q2_and_shells(P: int, pad: int):
    i = np.arange(P)
    s = np.where(i <= P // 2, i, i - P).astype(float)  # integer frequencies, Nyquist +P/2
    q2 = s[:, None, None] ** 2 + s[None, :, None] ** 2 + np.arange(P // 2 + 1)[None, None, :] ** 2
    return q2, np.floor(np.sqrt(q2) / pad + 0.5).astype(int)


def _shell_mean(values, mask, shells, n):
    return np.array([values[mask & (shells == r)].mean() if (mask & (shells == r)).any() else np.nan
                     for r in range(n)])


@pytest.mark.parametrize("slab", [1 << 28, 1 << 12])
def test_shell_sums_equal_direct_sums(slab, monkeypatch):
    monkeypatch.setattr(fourier, "SLAB_BYTES", slab)
    rng = np.random.default_rng(0)
    n = N // 2 + 1
    q2, shells = _q2_and_shells(PAD * N, PAD)
    for r_max in (7.0, N / 2):
        ref = prepare_reference(rng.normal(size=(N,) * 3), PAD, r_max)
        power = np.abs(ref.data.astype(np.complex128)) ** 2 / 2
        want = np.nan_to_num(_shell_mean(power, q2 <= (PAD * r_max) ** 2, shells, n))
        np.testing.assert_allclose(reference_tau2(ref), want, rtol=1e-12, atol=0)
        assert want[int(r_max)] > 0.5 * want[int(r_max) - 1]  # the half-outside edge shell is not halved
    bp = BackProjector(N, PAD, 9.0)
    bp.weight[:] = rng.random(bp.weight.shape)
    inside = (q2 < (PAD * 9.0) ** 2) & (shells < n)
    mean_w = _shell_mean(bp.weight * PAD**3, inside, shells, n)
    np.testing.assert_allclose(reference_sigma2(bp), np.nan_to_num(1.0 / mean_w), rtol=1e-12)
    tau2 = rng.random(n) + 0.1
    want = np.where(np.isnan(mean_w), 999.0, PAD**3 * 4.0 * tau2 * _shell_mean(bp.weight, inside, shells, n))
    want[np.arange(n) > 9.0] = 0.0
    np.testing.assert_allclose(ssnr_map(bp, tau2, 4.0), want, rtol=1e-12)


@pytest.mark.parametrize("ndim,size,radius,slab", [(3, 20, 4.7, 1 << 28), (3, 21, 6.0, 1 << 10), (2, 20, 4.7, 1 << 8),
                                                   (3, 10, 5.0, 1 << 28)])
def test_box_slabs_visit_exactly_the_voxels_of_the_box_once_with_their_components(ndim, size, radius, slab,
                                                                                   monkeypatch):
    monkeypatch.setattr(fourier, "SLAB_BYTES", slab)
    shape = (size,) * (ndim - 1) + (size // 2 + 1,)
    grid = np.arange(np.prod(shape)).reshape(shape)  # each voxel's flat index as its value
    full = np.broadcast_arrays(*fourier.half_grid_indices(size, ndim))
    inside = np.all([np.abs(k) <= radius for k in full], axis=0)
    seen = []
    for index, ks in fourier.half_grid_box_slabs(size, radius, ndim):
        flat = grid[index]
        comps = np.broadcast_arrays(*ks)
        assert all(c.shape == flat.shape for c in comps)
        for c, k in zip(comps, full, strict=True):
            np.testing.assert_array_equal(c, k.reshape(-1)[flat])  # the components of the voxels it names
        seen.append(flat.reshape(-1))
    seen = np.concatenate(seen)
    assert seen.size == np.unique(seen).size  # each voxel once
    np.testing.assert_array_equal(np.sort(seen), np.flatnonzero(inside))


@pytest.mark.parametrize("ndim,slab", [(3, 1 << 28), (3, 1 << 12), (2, 1 << 28)])
def test_the_classes_in_one_pass_equal_each_class_alone_and_the_direct_sums(ndim, slab, monkeypatch):
    """references_tau2 and ssnr_maps (every class of an iteration in one pass over the grids, each slab's shells
    made once) give each class what the direct float64 sums over the whole grid give, for any slab size, in 2D
    (2D classification) and 3D."""
    monkeypatch.setattr(fourier, "SLAB_BYTES", slab)
    rng = np.random.default_rng(3)
    n, P, r_max = N // 2 + 1, PAD * N, 8.0
    k = [np.where(np.arange(P) <= P // 2, np.arange(P), np.arange(P) - P).astype(float)] * (ndim - 1)
    k.append(np.arange(P // 2 + 1).astype(float))
    q2 = sum(np.expand_dims(c, [a for a in range(ndim) if a != i]) ** 2 for i, c in enumerate(k))
    shells = np.floor(np.sqrt(q2) / PAD + 0.5).astype(int)
    refs = [prepare_reference(rng.normal(size=(N,) * ndim), PAD, r_max) for _ in range(3)]
    got = references_tau2(refs)
    for ref, g in zip(refs, got, strict=True):
        power = np.abs(ref.data.astype(np.complex128)) ** 2 / 2
        want = np.nan_to_num(_shell_mean(power, q2 <= (PAD * r_max) ** 2, shells, n))
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=0)
        np.testing.assert_allclose(g, reference_tau2(ref), rtol=1e-12, atol=0)
    assert len({g.tobytes() for g in got}) == 3  # three different maps, three different spectra
    stack = BackProjectorStack(3, N, PAD, 9.0, ndim)
    stack.arrays[2][:] = rng.random(stack.arrays[2].shape)
    stack.arrays[2][1] *= 5.0
    tau2 = rng.random((3, n)) + 0.1
    inside = (q2 < (PAD * 9.0) ** 2) & (shells < n)
    for k_, (g, bp) in enumerate(zip(ssnr_maps(stack, tau2, 4.0), stack.members, strict=True)):
        mean_w = _shell_mean(bp.weight, inside, shells, n)
        want = np.where(np.isnan(mean_w), 999.0, PAD**ndim * 4.0 * tau2[k_] * mean_w)
        want[np.arange(n) > 9.0] = 0.0
        np.testing.assert_allclose(g, want, rtol=1e-12)
        np.testing.assert_allclose(g, ssnr_map(bp, tau2[k_], 4.0), rtol=1e-12)

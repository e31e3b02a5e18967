"""Projector, back-projector, reconstruction and FSC against ground truth (analytic Gaussian-atom phantoms)."""

import numpy as np
import pytest

from napari_gpu_relion.compute import simulate as sim
from napari_gpu_relion.compute.backprojector import (
    BackProjector,
    BackProjectorStack,
    _soft_edge_and_gridding,
    insert_by_class,
)
from napari_gpu_relion.compute.fourier import irfft_centered, rfft_centered
from napari_gpu_relion.compute.fsc import fsc, fsc_to_full, resolution_shell
from napari_gpu_relion.compute.geometry import euler_to_matrix, symmetry_group
from napari_gpu_relion.compute.masks import soft_mask_outside
from napari_gpu_relion.compute.projector import (
    pixel_list,
    prepare_reference,
    prepare_references,
    project,
    project_pixels,
    sinc2_gridding,
    stack_references,
)


@pytest.fixture(scope="module")
def small_phantom():
    """Sharp atoms (sigma 1.3 px) inside a 24-px sphere: signal out to Nyquist in a 32-px box."""
    return sim.pseudo_atomic_phantom(diameter_A=24.0, n_atoms=40, n_domains=3, sigma_A=1.3, seed=1)


@pytest.fixture(scope="module")
def smooth_phantom():
    """Smooth, compact atoms (sigma 2.5 px) inside a 20-px sphere, for the interpolation-accuracy test."""
    return sim.pseudo_atomic_phantom(diameter_A=20.0, n_atoms=30, n_domains=3, sigma_A=2.5, seed=1)


def _analytic_projection(ph, A, N, apix=1.0):
    return sim.phantom_projections(ph, A, N, apix)


def test_projection_pins_euler_and_origin_conventions(smooth_phantom):
    """Fourier-projected slices of the sampled map equal the analytic z-projection of V(A^T r) at RELION Euler
    angles. Trilinear interpolation error falls as 1/pf^2; at pf = 8 it is ~1e-3 (a wrong convention gives O(1))."""
    N = 32
    small_phantom = smooth_phantom
    V = sim.phantom_volume(small_phantom, N, 1.0).astype(np.float64)
    rng = np.random.default_rng(1)
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (6, 3))
    A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
    truth = _analytic_projection(small_phantom, A, N)
    errs = {}
    for pad in (2, 4, 8):
        img = irfft_centered(project(prepare_reference(V, pad=pad), A), N, 2)
        errs[pad] = (np.linalg.norm((img - truth).reshape(6, -1), axis=1)
                     / np.linalg.norm(truth.reshape(6, -1), axis=1)).max()
    assert errs[8] < 2e-3
    assert errs[2] < 0.03
    assert errs[4] < errs[2] / 3 and errs[8] < errs[4] / 2  # interpolation error converges ~ 1/pf^2
    # the transposed convention (scipy's active ZYZ matrix) is far off: the test can tell conventions apart
    wrong = irfft_centered(project(prepare_reference(V, pad=2), A.transpose(0, 2, 1)), N, 2)
    assert np.linalg.norm(wrong - truth) / np.linalg.norm(truth) > 5 * errs[2]


def test_reconstruct_from_noiseless_projections_fsc_above_098(small_phantom):
    """Uniform orientations, no noise, no CTF: FSC against the sampled truth > 0.98 to 0.8 Nyquist."""
    N = 32
    V = sim.phantom_volume(small_phantom, N, 1.0)
    rng = np.random.default_rng(2)
    ang = sim.random_rotations(1500, rng)
    A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
    F = rfft_centered(_analytic_projection(small_phantom, A, N).astype(np.float64), 2)
    bp = BackProjector(N, 2)
    bp.insert_images(A, F, np.ones(F.shape))
    bp.enforce_hermitian()
    rec = bp.reconstruct()
    f = fsc(rec, V)
    assert f[: int(0.8 * N / 2) + 1].min() > 0.98
    assert (rec * V).sum() / (V * V).sum() == pytest.approx(1.0, abs=0.03)  # absolute scale preserved


def test_ctf_and_noise_half_maps_predict_full_map_fsc():
    """Simulated particles with CTF and noise, true angles: (a) the FSC of the full map vs truth follows the
    FSC' relation from the half-map FSC within one shell at FSC' = 0.5; (b) the half-map FSC matches its
    expected value from the SNR (the signal-variance ratio of independent half maps), within 0.1 per shell."""
    N, apix = 40, 3.0
    ph = sim.pseudo_atomic_phantom(diameter_A=90.0, n_atoms=200, seed=4)
    truth = sim.phantom_volume(ph, N, apix)
    parts = sim.simulate_particles(1200, N, apix, phantom=ph, snr=0.05, seed=5, max_shift_px=2.0)
    A = euler_to_matrix(*parts.angles.T)
    from napari_gpu_relion.compute.ctf import ctf_half_grid
    from napari_gpu_relion.compute.fourier import phase_shift_2d

    F = phase_shift_2d(rfft_centered(parts.images.astype(np.float64), 2), parts.origins_px, N)
    c = ctf_half_grid(parts.ctf, N, apix)
    halves = []
    for sel in (slice(0, None, 2), slice(1, None, 2)):
        bp = BackProjector(N, 2)
        bp.insert_images(A[sel], F[sel] * c[sel], c[sel] ** 2)
        bp.enforce_hermitian()
        halves.append(bp.reconstruct())
    full = BackProjector(N, 2)
    full.insert_images(A, F * c, c**2)
    full.enforce_hermitian()
    rec = full.reconstruct()
    f_half = fsc(*halves)
    f_full_truth = fsc(rec, truth)
    pred = fsc_to_full(f_half)
    assert abs(resolution_shell(f_full_truth, 0.5) - resolution_shell(pred, 0.5)) <= 1
    # the half maps' own FSC vs truth: sqrt of the half-map FSC (independent noise, same signal)
    f_h1_truth = fsc(halves[0], truth)
    ok = (f_half > 0.2)
    ok[0] = False
    np.testing.assert_allclose(f_h1_truth[ok], np.sqrt(f_half[ok]), atol=0.1)


@pytest.mark.parametrize("name", ["C4", "D2", "I"])
def test_symmetrised_reconstruction_equals_reconstruction_from_all_mates(name, small_phantom):
    """Inserting few images then symmetrising equals inserting every symmetry-related copy of them."""
    N = 24
    rng = np.random.default_rng(7)
    ang = sim.random_rotations(20, rng)
    A = euler_to_matrix(*ang.T)
    F = rfft_centered(_analytic_projection(small_phantom, A, N, 1.6).astype(np.float64), 2)
    ops = symmetry_group(name).matrices
    bp_sym = BackProjector(N, 2)
    bp_sym.insert_images(A, F, np.ones(F.shape))
    bp_sym.enforce_hermitian()
    bp_sym.symmetrise(ops)
    # the image at orientation A also views the map at A R for every operator R (V(R r) = V(r))
    A_all = np.einsum("nij,sjk->snik", A, ops).reshape(-1, 3, 3)
    F_all = np.broadcast_to(F, (len(ops),) + F.shape).reshape((-1,) + F.shape[1:])
    bp_all = BackProjector(N, 2)
    bp_all.insert_images(A_all, F_all, np.ones(F_all.shape))
    bp_all.enforce_hermitian()
    m_sym, m_all = bp_sym.reconstruct(), bp_all.reconstruct()
    rel = np.linalg.norm(m_sym - m_all) / np.linalg.norm(m_all)
    assert rel < 0.1, rel
    assert fsc(m_sym, m_all)[: N // 2 - 2].min() > 0.98


def test_fsc_analytic_cases():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(16, 16, 16))
    f = fsc(a, a)
    np.testing.assert_allclose(f, 1.0, atol=1e-12)
    np.testing.assert_allclose(fsc(a, -a)[1:], -1.0, atol=1e-12)
    # signal + independent noise of equal power: FSC ~ 0.5 in every shell (per-shell SNR 1)
    s = rng.normal(size=(48, 48, 48))
    f2 = fsc(s + rng.normal(size=s.shape), s + rng.normal(size=s.shape))
    assert np.abs(f2[4:] - 0.5).max() < 0.12
    assert fsc_to_full(np.array([0.143]))[0] == pytest.approx(np.sqrt(2 * 0.143 / 1.143))


def test_gold_standard_fsc_counts_only_elements_within_r_max_as_relion():
    """fsc_from_pooled (auto-refine's half-map FSC, RELION's calculateDownSampledFourierShellCorrelation): only
    half-grid elements with |k| <= r_max count. Against a direct float64 sum over those elements: the shell
    ROUND(r_max) keeps its correlated inner elements and drops the uncorrelated ones just beyond r_max (the
    insertion's interpolation leaves a little there), which took ours' edge-shell FSC from RELION's 0.18 to -0.02."""
    from napari_gpu_relion.compute.maximization import fsc_from_pooled  # noqa: PLC0415

    rng = np.random.default_rng(7)
    N, r_max = 32, 10.0
    shape = (N, N, N // 2 + 1)
    kz = np.fft.fftfreq(N, 1 / N)[:, None, None]
    ky = np.fft.fftfreq(N, 1 / N)[None, :, None]
    kx = np.arange(N // 2 + 1)[None, None, :]
    R = np.sqrt(kz ** 2 + ky ** 2 + kx ** 2) * np.ones(shape)
    signal = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    z1 = signal + 0.5 * (rng.normal(size=shape) + 1j * rng.normal(size=shape))
    z2 = signal + 0.5 * (rng.normal(size=shape) + 1j * rng.normal(size=shape))
    outer = (R > r_max) & (R < r_max + 0.5)  # shell 10's outer part: independent in each half
    z1[outer] = 3 * (rng.normal(size=outer.sum()) + 1j * rng.normal(size=outer.sum()))
    z2[outer] = 3 * (rng.normal(size=outer.sum()) + 1j * rng.normal(size=outer.sum()))
    z1[R >= r_max + 0.5], z2[R >= r_max + 0.5] = 0, 0
    got = fsc_from_pooled(z1, z2, r_max)
    shell = np.floor(R + 0.5).astype(int)
    for s in range(1, int(r_max) + 1):
        m = (shell == s) & (R <= r_max)
        num = np.sum(z1[m].real * z2[m].real + z1[m].imag * z2[m].imag)
        want = num / np.sqrt(np.sum(np.abs(z1[m]) ** 2) * np.sum(np.abs(z2[m]) ** 2))
        assert got[s] == pytest.approx(want, abs=1e-12), s
    assert got[int(r_max)] > 0.6  # the inner half of the edge shell is the signal's (0.8 expected)
    assert np.all(got[int(r_max) + 1:] == 0) and got[0] == 1.0


@pytest.mark.parametrize("ndim", [2, 3])
def test_stacked_classes_project_and_insert_as_one_class_at_a_time(ndim):
    """All classes in one stack (one projection / one scatter call for rows of any class) give exactly what
    the classes give one at a time: the 2D classification E-step relies on it."""
    rng = np.random.default_rng(3)
    N, K, R = 16, 3, 7
    maps = [rng.standard_normal((N,) * ndim) for _ in range(K)]
    refs = [prepare_reference(m, 2, r_max=6) for m in maps]
    alone = [prepare_reference(m, 2, r_max=6) for m in maps]
    stacked = stack_references(refs)
    assert stacked.ndim == ndim and stacked.n_stacked == K
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, R)) * np.array([[1], [0.5], [1]])))
    ky, kx, _ = pixel_list(N, 6, unique=True)
    index = rng.integers(0, K, R)
    got = project_pixels(stacked, A, kx, ky, index=index)
    for r in range(R):
        want = project_pixels(alone[index[r]], A[r:r + 1], kx, ky)[0]
        np.testing.assert_array_equal(got[r], want)
    # insertion: one stack call == per-class BackProjectors
    vals = got * (1 + 0.5j)
    w = np.abs(got).astype(np.float64) + 0.1
    stack = BackProjectorStack(K, N, 2, 6, ndim=ndim)
    insert_by_class(stack.members, index, A, kx, ky, vals, w)
    for k in range(K):
        one = BackProjector(N, 2, 6, ndim=ndim)
        sel = index == k
        one.insert_pixels(A[sel], kx, ky, vals[sel], w[sel])
        np.testing.assert_allclose(stack.members[k].data, one.data, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(stack.members[k].weight, one.weight, rtol=1e-12, atol=1e-12)
    assert sum(float(m.weight.sum()) for m in stack.members) > 0
    # Hermitian pairing and reconstruction of the whole stack == member by member
    copies = []
    for m in stack.members:
        c = BackProjector(N, 2, 6, ndim=ndim)
        c.add(m)
        c.enforce_hermitian()
        copies.append(c)
    stack.enforce_hermitian()
    tau2 = rng.uniform(0.5, 2.0, (K, N // 2 + 1))
    maps = stack.reconstruct(tau2, 2.0, max_bytes=2 * 8 * (2 * N) ** ndim)  # two members per chunk
    for k, c in enumerate(copies):
        np.testing.assert_array_equal(stack.members[k].weight, c.weight)
        np.testing.assert_allclose(maps[k], c.reconstruct(tau2[k], 2.0), rtol=1e-5, atol=1e-6 * np.abs(maps[k]).max())


@pytest.mark.parametrize("ndim,N,pad,r_max", [(3, 24, 2, 5.0), (3, 24, 1, 7.3), (2, 32, 2, 9.5), (3, 16, 2, 8.0)])
def test_insertion_stays_inside_the_block_that_mpi_sums(ndim, N, pad, r_max):
    """The sums over MPI ranks carry only support_index's block of the accumulators (jobs/distributed.sum_estep):
    slices in every direction, inserted up to r_max, leave every voxel outside it exactly zero, and the block
    holds all the inserted weight."""
    from napari_gpu_relion.compute.backprojector import insertion_reach, support_index

    rng = np.random.default_rng(5)
    R = 300
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, R)) * np.array([[1], [0.5], [1]])))
    ky, kx, _ = pixel_list(N, r_max, unique=True)
    bp = BackProjector(N, pad, r_max, ndim=ndim)
    vals = rng.standard_normal((R, kx.size)) + 1j * rng.standard_normal((R, kx.size))
    bp.insert_pixels(A, kx, ky, vals, np.ones((R, kx.size)))
    ix = support_index(bp.weight.shape, insertion_reach(pad, r_max))
    if 2 * r_max * pad + 3 >= pad * N:
        assert ix is None  # the block is the whole grid: nothing to crop
        return
    outside = np.ones(bp.weight.shape, bool)
    outside[ix] = False
    assert outside.sum() > 0.5 * outside.size  # a real saving at this r_max
    for g in (bp.data_re, bp.data_im, bp.weight):
        assert np.count_nonzero(g[outside]) == 0
    assert bp.weight[ix].sum() == pytest.approx(bp.weight.sum(), rel=1e-12)
    # the block reaches its own edge (insertion_reach is not larger than needed by more than a voxel)
    r = np.sqrt(sum(np.minimum(i, bp.padded_size - i).astype(float) ** 2 for i in np.nonzero(bp.weight)))
    assert r.max() > pad * r_max - 1


@pytest.mark.parametrize("weights", [(1.0, 2.0), (1.0, 0.0), (np.nan, 3.0)])
def test_reconstruct_classes_keeps_the_old_map_of_an_empty_class_to_the_bit(weights):
    """reconstruct_classes: the stack's float32 maps; a class without weight (0 or NaN) keeps its old map
    exactly, float64 values included (the first iteration's references need not be float32 values), the others
    are the stack's reconstruction."""
    from napari_gpu_relion.compute.maximization import reconstruct_classes

    rng = np.random.default_rng(2)
    N, K = 16, 2
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, 40)) * np.array([[1], [0.5], [1]])))
    ky, kx, _ = pixel_list(N, 6, unique=True)
    stack = BackProjectorStack(K, N, 2, 6)
    vals = rng.standard_normal((40, kx.size)) + 1j * rng.standard_normal((40, kx.size))
    insert_by_class(stack.members, rng.integers(0, K, 40), A, kx, ky, vals, np.ones((40, kx.size)))
    tau2 = [np.full(N // 2 + 1, 2.0)] * K
    old = rng.standard_normal((K, N, N, N))  # float64 values that float32 cannot hold
    want = BackProjectorStack(K, N, 2, 6)
    for a, b in zip(want.arrays, stack.arrays, strict=True):
        a[...] = b
    want.enforce_hermitian()
    fresh = want.reconstruct(np.stack(tau2), 1.0)
    maps, ssnr = reconstruct_classes(stack, tau2, 1.0, np.array(weights), old)
    assert len(ssnr) == K
    empty = [k for k in range(K) if not weights[k] > 0]
    assert maps.dtype == (np.float64 if empty else np.float32)
    for k in range(K):
        np.testing.assert_array_equal(maps[k], old[k] if k in empty else fresh[k])


@pytest.mark.parametrize("r_join", [2.0, 5.5, 40.0])
def test_joining_low_resolution_by_blocks_equals_the_whole_grid_join(r_join):
    """Auto-refine under MPI joins the halves' low resolution on their two owner ranks from a block of each grid
    (maximization.low_resolution_block, join_block), and join_low_resolution does so on both: bit for bit the
    average of every padded voxel with |q|^2 <= ROUND(pf r_join)^2 over the whole grids (computed here), for a
    join radius inside the grid and one past its edge (the whole grid as the block)."""
    from napari_gpu_relion.compute.fourier import half_grid_indices
    from napari_gpu_relion.compute.maximization import join_block, join_low_resolution, low_resolution_block

    rng = np.random.default_rng(5)
    bps = [BackProjector(12, 2, 6.0) for _ in range(2)]
    for bp in bps:
        for a in (bp.data_re, bp.data_im, bp.weight):
            a[...] = rng.standard_normal(a.shape)
    names = ("data_re", "data_im", "weight")
    ix, sel = low_resolution_block(bps[0].weight.shape, 2, r_join)
    blocks = [[getattr(bp, a)[ix] for a in names] for bp in bps]
    split = []
    for h in (0, 1):
        grids = [getattr(bps[h], a).copy() for a in names]
        for g, v in zip(grids, join_block(blocks[h], blocks[1 - h], sel), strict=True):
            g[ix] = v
        split.append(grids)
    before = [getattr(bps[0], a).copy() for a in names]
    q2 = sum(k.astype(np.float64) ** 2 for k in half_grid_indices(bps[0].padded_size, 3))
    inside = q2 <= np.floor(2 * r_join + 0.5) ** 2
    whole = [[np.where(inside, 0.5 * (getattr(bps[h], a) + getattr(bps[1 - h], a)), getattr(bps[h], a))
              for a in names] for h in (0, 1)]
    join_low_resolution(bps[0], bps[1], r_join)
    for h in (0, 1):
        for a, g, w in zip(names, split[h], whole[h], strict=True):
            assert np.array_equal(g, w)
            assert np.array_equal(getattr(bps[h], a), w)
    changed = sum(int((getattr(bps[0], a) != b).sum()) for a, b in zip(names, before, strict=True))
    assert changed >= 3 * int(sel.sum()) - 3  # the selected voxels did change (all but a chance tie)


def test_squared_radius_adds_in_the_fused_kernels_order_whatever_the_library():
    """The r_max test of the array code sums |q|^2 as ((q0^2 + q1^2) + q2^2) in the coordinates' float type, as
    the fused projection and insertion kernels do; another order (a library's reduction: CuPy without CUB adds
    q0^2 + q2^2 first) differs in the last bit for some points, which then fall on the other side of the sphere.
    NumPy's own sum over three numbers is in this order too, so only the GPU tests of the fused kernels against the
    array code (tests/test_gpu.py) would see CuPy's order come back."""
    from napari_gpu_relion.compute.projector import squared_radius

    rng = np.random.default_rng(3)
    q = rng.uniform(-40, 40, (20000, 3)).astype(np.float32)
    sq = q * q
    kernel_order = (sq[:, 0] + sq[:, 1]) + sq[:, 2]
    other_order = (sq[:, 0] + sq[:, 2]) + sq[:, 1]
    got = squared_radius(q)
    assert got.dtype == np.float32
    assert np.array_equal(got, kernel_order)
    assert np.count_nonzero(kernel_order != other_order) > 100  # the orders do differ: the test could fail
    assert np.array_equal(squared_radius(q[:, :2]), sq[:, 0] + sq[:, 1])


@pytest.mark.parametrize("ndim", [2, 3])
def test_soft_edge_and_gridding_in_slabs_equals_the_whole_box(ndim):
    """The M-step's soft edge at N/2 and sinc^2 division, in slabs of 3 planes with the edge means summed last axis
    first, equal masks.soft_mask_outside and projector.sinc2_gridding on the whole box (float64)."""
    rng = np.random.default_rng(3)
    N, pf, B = 20, 2, 3
    vol = rng.normal(size=(B,) + (N,) * ndim) + 5.0 * np.arange(1, B + 1).reshape((B,) + (1,) * ndim)
    want = soft_mask_outside(vol, N / 2, 3.0, ndim) / sinc2_gridding(N, pf, ndim)
    got = _soft_edge_and_gridding(vol.copy(), N, pf, ndim, True, max_bytes=B * N ** (ndim - 1) * 8 * 6 * 3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sym", ["C1", "D2"])
def test_pooled_average_over_the_insertion_box_equals_pooling_the_whole_grid(sym):
    """The half-map FSC's pooled averages go over insertion_reach's box only: after insertion up to r_max, the
    symmetrisation and the low-resolution join, they equal sum data / sum weight of every padded voxel pooled at
    ROUND(q / pf), counted here voxel by voxel over the whole grid (np.add.at, float64)."""
    from napari_gpu_relion.compute.backprojector import insertion_reach, support_index
    from napari_gpu_relion.compute.fourier import half_grid_indices
    from napari_gpu_relion.compute.maximization import join_low_resolution, pooled_average, round_half_away

    rng = np.random.default_rng(11)
    N, pad, r_max, R = 24, 2, 5.0, 200
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, R)) * np.array([[1], [0.5], [1]])))
    ky, kx, _ = pixel_list(N, r_max, unique=True)
    bps = []
    for _ in range(2):
        bp = BackProjector(N, pad, r_max, ndim=3)
        bp.insert_pixels(A, kx, ky, rng.standard_normal((R, kx.size)) + 1j * rng.standard_normal((R, kx.size)),
                         rng.uniform(0.5, 1.5, (R, kx.size)))
        bp.enforce_hermitian()
        bp.symmetrise(symmetry_group(sym).matrices)
        bps.append(bp)
    join_low_resolution(bps[0], bps[1], 2.0)
    assert support_index(bps[0].weight.shape, insertion_reach(pad, r_max)) is not None  # a box smaller than the grid
    kz_, ky_, kx_ = np.broadcast_arrays(*half_grid_indices(bps[0].padded_size, 3))
    r = [round_half_away(k / pad).astype(int) for k in (kz_, ky_, kx_)]
    ok = (r[2] <= N // 2) & (np.abs(r[1]) <= N // 2) & (np.abs(r[0]) <= N // 2)
    for bp in bps:
        num = np.zeros((N, N, N // 2 + 1), complex)
        den = np.zeros((N, N, N // 2 + 1))
        where = (r[0][ok] % N, r[1][ok] % N, r[2][ok])
        np.add.at(num, where, (bp.data_re + 1j * bp.data_im)[ok])
        np.add.at(den, where, bp.weight[ok])
        want = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0)
        np.testing.assert_allclose(pooled_average(bp), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("ndim", [2, 3])
def test_references_prepared_in_batches_equal_one_at_a_time(ndim):
    """projector.prepare_references (2D images in batches of a few per FFT, here 3 per batch, each batch moved to
    the device in one go; 3D maps one by one) gives each reference exactly what prepare_reference gives it alone,
    from float32 and float64 maps."""
    rng = np.random.default_rng(8)
    N, pad, r_max = 16, 2, 5.5
    vols = [rng.normal(size=(N,) * ndim).astype(dt) for dt in (np.float32, np.float64, np.float32, np.float64,
                                                                np.float32, np.float32, np.float64)]
    moved = []  # what to_device was given: one batch of 3 images at a time in 2D, one map at a time in 3D

    def to_device(a):
        moved.append(a.shape)
        return a

    got = prepare_references(vols, pad, r_max, max_bytes=3 * (pad * N) ** 2 * 48, to_device=to_device)
    assert len(got) == len(vols)
    assert moved == ([(3, N, N), (3, N, N), (1, N, N)] if ndim == 2 else [(N,) * 3] * len(vols)), moved
    for v, g in zip(vols, got, strict=True):
        want = prepare_reference(v, pad, r_max)
        assert g.data.shape == want.data.shape and g.data.dtype == want.data.dtype
        np.testing.assert_array_equal(g.data, want.data)
        assert (g.size, g.pad, g.r_max) == (want.size, want.pad, want.r_max)


@pytest.mark.parametrize("ndim", [2, 3])
def test_projection_and_insertion_in_threads_equal_one_thread_to_the_bit(ndim):
    """The NumPy path's chunks of orientations in 3 threads (host_threads.using) give the same projections and the
    same accumulators, bit for bit, as one thread: chunks are the same and are added in their order."""
    from napari_gpu_relion.compute import host_threads

    rng = np.random.default_rng(5)
    N, R = 24, 301
    ref = prepare_reference(rng.standard_normal((N,) * ndim), 2, r_max=9)
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, R)) * np.array([[1], [0.5], [1]])))
    ky, kx, _ = pixel_list(N, 9, unique=True)
    chunk = 7 * kx.size  # 7 orientations a chunk: 43 chunks, many more than threads
    one = project_pixels(ref, A, kx, ky, chunk_points=chunk)
    with host_threads.using(3):
        assert host_threads.host_threads() == 3
        three = project_pixels(ref, A, kx, ky, chunk_points=chunk)
    assert host_threads.host_threads() == 1
    np.testing.assert_array_equal(three, one)
    w = np.abs(one).astype(np.float64) + 0.1
    grids = []
    for threads in (1, 3):
        bp = BackProjector(N, 2, 9, ndim=ndim)
        with host_threads.using(threads):
            bp.insert_pixels(A, kx, ky, one * (1 - 0.5j), w, chunk_points=chunk)
        grids.append((bp.data_re, bp.data_im, bp.weight))
    for a, b in zip(*grids, strict=True):
        assert np.abs(a).sum() > 0
        np.testing.assert_array_equal(a, b)


def test_threaded_chunks_come_back_in_order_and_raise_in_turn():
    """map_ordered yields results in the items' order whatever order the threads finish in, and an error of one
    item is raised when that item's turn comes, after the results before it."""
    import time

    from napari_gpu_relion.compute import host_threads

    def slow_first(i):
        time.sleep(0.02 * (5 - i) if i < 5 else 0)
        if i == 7:
            raise ValueError("item 7")
        return i * i

    with host_threads.using(4):
        got = []
        with pytest.raises(ValueError, match="item 7"):
            for v in host_threads.map_ordered(slow_first, range(10)):
                got.append(v)
    assert got == [i * i for i in range(7)]


def test_thread_counts_belong_to_their_thread_and_nested_loops_run_alone():
    """A count set by one thread (a job) is not another thread's; inside a chunk run in the pool the count is 1, so
    a loop nested in a chunk runs in that chunk's thread (and cannot wait on busy workers)."""
    import threading

    from napari_gpu_relion.compute import host_threads

    seen = {}
    with host_threads.using(3):
        t = threading.Thread(target=lambda: seen.setdefault("other", host_threads.host_threads()))
        t.start()
        t.join()
        inner = list(host_threads.map_ordered(lambda i: (host_threads.host_threads(), list(
            host_threads.map_ordered(lambda k: k + i, range(3)))), range(5)))
    assert seen["other"] == 1
    assert inner == [(1, [i, i + 1, i + 2]) for i in range(5)]


def test_insertion_in_threads_retries_out_of_memory_with_smaller_chunks_and_adds_each_chunk_once(monkeypatch):
    """An out-of-memory error while a chunk's contributions are made (in a thread) halves the chunk from where it
    stopped: the accumulators equal one clean insertion (to rounding: the chunks differ), none added twice."""
    from napari_gpu_relion.compute import backprojector, host_threads

    rng = np.random.default_rng(8)
    N, R = 20, 200
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, R)) * np.array([[1], [0.5], [1]])))
    ky, kx, _ = pixel_list(N, 8, unique=True)
    vals = (rng.normal(size=(R, kx.size)) + 1j * rng.normal(size=(R, kx.size))).astype(np.complex64)
    w = rng.uniform(0.1, 1, (R, kx.size)).astype(np.float32)
    clean = BackProjector(N, 2, 8)
    clean.insert_pixels(A, kx, ky, vals, w, chunk_points=16 * kx.size)
    calls = {"n": 0}
    real = backprojector._chunk_contributions

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise MemoryError("out of memory")
        return real(*a, **k)

    monkeypatch.setattr(backprojector, "_chunk_contributions", flaky)
    retried = BackProjector(N, 2, 8)
    with host_threads.using(3):
        retried.insert_pixels(A, kx, ky, vals, w, chunk_points=16 * kx.size)
    assert calls["n"] > 13  # the failed chunk and those after it made again in halves
    for x, y in ((clean.data_re, retried.data_re), (clean.data_im, retried.data_im), (clean.weight, retried.weight)):
        np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-9 * np.abs(x).max())

"""The E-step's GEMM formulation against direct float64 evaluation of RELION's formulas (relion_algorithm.md 3)."""

import numpy as np
import pytest

from napari_gpu_relion.compute.expectation import (
    GEMM_ALIGN,
    add_to_rows,
    as_slices,
    fine_sums,
    gemm_width,
    grouped_sum,
    particle_terms,
    pixel_set,
    posterior_weights,
    scores_gathered,
    scores_shared,
    segment_sum,
    segments_of,
    translation_ramps,
)
from napari_gpu_relion.compute.fourier import rfft_centered


def _random_case(rng, I=5, T=7, R=11, N=16, with_ctf=True):
    pix = pixel_set(N, 12)
    K = pix.npix
    X = (rng.normal(size=(I, K)) + 1j * rng.normal(size=(I, K))).astype(np.complex64)
    P = (rng.normal(size=(R, K)) + 1j * rng.normal(size=(R, K))).astype(np.complex64)
    ctf = rng.uniform(-1, 1, (I, K)).astype(np.float32) if with_ctf else None
    sigma2 = rng.uniform(0.5, 2.0, (I, K))
    w = np.where(pix.shell[None, :] >= 1, 0.5 / sigma2, 0.0).astype(np.float32)
    shifts = rng.uniform(-3, 3, (T, 2))
    return pix, X, P, ctf, w, shifts


def _direct_diff2(X, P, ctf, w, shifts, pix):
    """RELION's diff2(i, t, r) = sum_k w |C P_r - X e_t|^2 in float64, one sample at a time."""
    X, P, w = X.astype(np.complex128), P.astype(np.complex128), w.astype(np.float64)
    I, R = X.shape[0], P.shape[0]
    C = np.ones(X.shape) if ctf is None else ctf.astype(np.float64)
    out = np.zeros((I, len(shifts), R))
    for i in range(I):
        for t, (sx, sy) in enumerate(shifts):
            e = np.exp(-2j * np.pi * (sx * pix.kx + sy * pix.ky) / pix.box)
            for r in range(R):
                out[i, t, r] = np.sum(w[i] * np.abs(C[i] * P[r] - X[i] * e) ** 2)
    return out


def _terms(X, ctf, w, pix, shifts, padded: bool):
    """The particle terms, with the GEMM width padded to gemm_width (the coarse pass's form) or not."""
    terms = particle_terms(X, ctf, w, translation_ramps(pix, shifts), width=gemm_width(pix.npix) if padded else None)
    K = pix.npix
    if padded:
        assert terms.Yt.shape[-1] % GEMM_ALIGN == 0 and terms.Yt.shape[-1] > 2 * K  # (2K = 138 here)
        assert (terms.Yt[..., 2 * K:] == 0).all()
    else:
        assert terms.Yt.shape[-1] == 2 * K
    return terms


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_ctf", [False, True])
def test_shared_scores_equal_direct_float64(with_ctf, padded):
    """Scores of slices shared by every particle (the global coarse pass), with the GEMM width padded or not."""
    rng = np.random.default_rng(3)
    pix, X, P, ctf, w, shifts = _random_case(rng, with_ctf=with_ctf)
    terms = _terms(X, ctf, w, pix, shifts, padded)
    if padded:
        with pytest.raises(ValueError, match="width"):
            scores_shared(as_slices(P), terms)  # slices stacked without the padding
    got = scores_shared(P, terms).astype(np.float64) + terms.x2[:, None, None]
    want = _direct_diff2(X, P, ctf, w, shifts, pix)
    spread = want.max() - want.min()
    assert np.abs(got - want).max() < 1e-5 * spread


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_ctf", [False, True])
def test_gathered_scores_equal_direct_float64(with_ctf, padded):
    """The fine pass / local-search form: each particle has its own slices (I, n, K); padded or not."""
    rng = np.random.default_rng(4)
    pix, X, P, ctf, w, shifts = _random_case(rng, R=13, with_ctf=with_ctf)
    idx = rng.integers(0, P.shape[0], (X.shape[0], 6))
    terms = _terms(X, ctf, w, pix, shifts, padded)
    got = scores_gathered(as_slices(P, terms.Yt.shape[-1]).take(idx), terms).astype(np.float64) \
        + terms.x2[:, None, None]
    full = _direct_diff2(X, P, ctf, w, shifts, pix)
    want = np.take_along_axis(full, idx[:, None, :].repeat(len(shifts), 1), axis=2)
    spread = want.max() - want.min()
    assert np.abs(got - want).max() < 1e-5 * spread


def test_cc_scores_are_normalised_cross_correlation():
    rng = np.random.default_rng(5)
    pix, X, P, ctf, w, shifts = _random_case(rng, with_ctf=True)
    terms = particle_terms(X, ctf, w, translation_ramps(pix, shifts), cc=True)
    got = scores_shared(P, terms)
    on = (w > 0).astype(np.float64)
    for i in range(X.shape[0]):
        for t, (sx, sy) in enumerate(shifts):
            e = np.exp(-2j * np.pi * (sx * pix.kx + sy * pix.ky) / pix.box)
            for r in range(P.shape[0]):
                cp = ctf[i] * P[r] * on[i]
                xe = X[i] * e * on[i]
                cc = np.real(np.vdot(cp, xe)) / (np.linalg.norm(cp) * np.linalg.norm(xe))
                assert got[i, t, r] == pytest.approx(-cc, abs=1e-5)


def test_translation_ramp_moves_content_by_plus_t():
    """Pins the origin sign: X e_t is the FT of the image rolled by +t (x right, y down the rows)."""
    rng = np.random.default_rng(6)
    N = 16
    img = rng.normal(size=(1, N, N)).astype(np.float32)
    tx, ty = 3, -2
    rolled = np.roll(img, (ty, tx), axis=(1, 2))
    pix = pixel_set(N, N)
    F = rfft_centered(img, 2).reshape(1, -1)[:, pix.flat]
    Fr = rfft_centered(rolled, 2).reshape(1, -1)[:, pix.flat]
    e = translation_ramps(pix, np.array([[tx, ty]]))
    np.testing.assert_allclose(F * e, Fr, atol=1e-5 * np.abs(Fr).max())


def _direct_significance(lw, fraction):
    p = np.exp(lw - lw.max())
    p /= p.sum()
    order = np.argsort(-p)
    csum = 0.0
    keep = np.zeros(p.shape, bool)
    for j in order:  # RELION: add samples until the running sum exceeds the fraction
        keep[j] = True
        csum += p[j]
        if csum >= fraction:
            break
    return p, keep


def test_posterior_weights_match_direct_softmax_and_significance():
    rng = np.random.default_rng(7)
    I, M = 6, 400
    diff2 = rng.normal(0, 3, (I, M)) + 1e4  # large constant: the log domain must not overflow
    log_prior = rng.normal(0, 1, (I, M))
    log_prior[:, ::7] = -np.inf  # masked samples
    W = posterior_weights(diff2.astype(np.float32), log_prior, 0.999)
    lw = log_prior - diff2.astype(np.float32).astype(np.float64)
    for i in range(I):
        p, keep = _direct_significance(lw[i], 0.999)
        np.testing.assert_array_equal(W.significant[i], keep)
        np.testing.assert_allclose(W.w[i], np.where(keep, p, 0.0), rtol=1e-5, atol=1e-9)
        assert W.pmax[i] == pytest.approx(p.max(), rel=1e-6)
        assert W.nr_significant[i] == keep.sum()
        finite = np.isfinite(lw[i])
        assert W.log_evidence[i] == pytest.approx(np.log(np.exp(lw[i][finite] - lw[i].max()).sum()) + lw[i].max())
        assert W.best[i] == np.argmax(lw[i])


def test_posterior_weights_cc_is_hard_assignment_to_best_score():
    rng = np.random.default_rng(8)
    diff2 = rng.normal(size=(4, 50)).astype(np.float32)
    lp = np.zeros((4, 50))
    lp[:, 0] = -np.inf
    W = posterior_weights(diff2, lp, cc=True)
    best = np.argmin(np.where(np.isfinite(lp), diff2, np.inf), axis=1)
    np.testing.assert_array_equal(W.best, best)
    assert np.all(W.w.sum(1) == 1.0) and np.all(W.w[np.arange(4), best] == 1.0)


@pytest.mark.parametrize("shared", [True, False])
def test_fine_sums_equal_direct_loops(shared):
    """Weighted back-projection slices, their weights, and per-pixel noise power against explicit sums
    over (row, translation) in float64."""
    rng = np.random.default_rng(9)
    pix, X, P, ctf, w, shifts = _random_case(rng, I=3, T=5, R=6)
    I, T, R = X.shape[0], len(shifts), P.shape[0]
    Xu = (X + 0.3 * rng.normal(size=X.shape)).astype(np.complex64)
    m = (2 * w + 0.1).astype(np.float32)
    ramps = translation_ramps(pix, shifts)
    if shared:
        Pin = P
        Pi = np.broadcast_to(P, (I,) + P.shape)
    else:
        idx = rng.integers(0, R, (I, 4))
        Pin = P[idx]
        Pi = Pin
    n = Pi.shape[1]
    wts = rng.uniform(0, 1, (I, T, n)) * (rng.uniform(size=(I, T, n)) > 0.3)
    wts /= wts.sum(axis=(1, 2), keepdims=True)
    fs = fine_sums(wts.astype(np.float32), Pin, X, Xu, ctf, m, ramps)
    C = ctf.astype(np.float64)
    e = ramps.astype(np.complex128)
    sl = np.zeros((I, n, X.shape[1]), np.complex128)
    sw = np.zeros((I, n, X.shape[1]))
    noise = np.zeros(X.shape)
    for i in range(I):
        for t in range(T):
            for r in range(n):
                wt = wts[i, t, r]
                sl[i, r] += wt * C[i] * Xu[i] * e[t] * m[i]
                sw[i, r] += wt * C[i] ** 2 * m[i]
                noise[i] += wt * np.abs(C[i] * Pi[i, r] - X[i] * e[t]) ** 2
    K = X.shape[1]
    got = fs.slices[..., :K] + 1j * fs.slices[..., K:]
    if shared:
        sl, sw = sl.sum(0), sw.sum(0)
    np.testing.assert_allclose(got, sl, atol=1e-5 * np.abs(sl).max())
    np.testing.assert_allclose(fs.slice_weights, sw, atol=1e-5 * sw.max())
    np.testing.assert_allclose(fs.noise, noise, atol=1e-5 * noise.max())
    np.testing.assert_allclose(fs.row_weight, wts.sum(1), atol=1e-6)
    np.testing.assert_allclose(fs.trans_weight, wts.sum(2), atol=1e-6)


@pytest.mark.parametrize("rows", [[3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23, 24, 25, 26, 27],  # two runs: slices
                                  [0, 2, 4, 6, 9], [5]])  # scattered rows, one row: fancy indexing
def test_add_to_rows_equals_an_element_by_element_float64_loop(rows):
    """add_to_rows (run by run through slices when the rows make few runs) against a direct float64 loop; the
    rows that are not named keep their values, to the bit."""
    rng = np.random.default_rng(3)
    target = rng.standard_normal((32, 5)).astype(np.float32)
    values = rng.standard_normal((len(rows), 5)).astype(np.float32)
    expected = target.astype(np.float64)
    for j, r in enumerate(rows):
        for c in range(5):
            expected[r, c] = np.float32(np.float64(target[r, c]) + np.float64(values[j, c]))
    add_to_rows(target, np.asarray(rows), values)
    np.testing.assert_array_equal(target, expected.astype(np.float32))


def test_segment_sum_adds_repeated_rows():
    rows = np.array([2, 0, 2, 2, 1])
    vals = np.arange(10, dtype=np.float32).reshape(5, 2)
    out = segment_sum(rows, vals, 4)
    np.testing.assert_array_equal(out, [[2, 3], [8, 9], [0 + 4 + 6, 1 + 5 + 7], [0, 0]])


@pytest.mark.parametrize("padded", [False, True])
def test_segments_group_like_unique_and_grouped_sums_equal_direct_sums(padded):
    """segments_of: np.unique's distinct keys and inverse; grouped_sum: a float64 sum per group. Negative keys
    (a gathered chunk's padding) are in no group: inverse -1, left out of the sums."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 50, (40, 7)) * 3 + 1000  # gaps between the keys, not 0..n-1
    if padded:
        keys[:, 4:] = -1
    vals = rng.normal(size=(keys.size, 5)).astype(np.float32)
    g = segments_of(keys)
    flat = keys.reshape(-1)
    valid = flat >= 0
    d, inv = np.unique(flat[valid], return_inverse=True)
    np.testing.assert_array_equal(g.distinct, d)
    np.testing.assert_array_equal(g.inverse[valid], inv.reshape(-1))
    assert (g.inverse[~valid] == -1).all() and g.n == d.size
    want = np.zeros((d.size, 5))
    np.add.at(want, inv.reshape(-1), vals[valid].astype(np.float64))
    np.testing.assert_allclose(grouped_sum(g, vals), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(segment_sum(g.inverse, vals, g.n), want, rtol=1e-5, atol=1e-5)
    empty = segments_of(np.zeros(0, dtype=np.int64))
    assert empty.n == 0 and grouped_sum(empty, np.zeros((0, 5), np.float32)).shape == (0, 5)


def test_pixel_set_is_unique_half_grid_within_radius():
    N, s = 16, 10
    pix = pixel_set(N, s)
    assert np.all(pix.shell <= s // 2)
    # no Friedel pair twice: (0, ky) and (0, -ky) are never both present
    pairs = {(int(x), int(y)) for x, y in zip(pix.kx, pix.ky, strict=True)}
    assert not any((0, -y) in pairs for (x, y) in pairs if x == 0 and y != 0)
    # every half-grid pixel of the disc is present once: count the full disc / 2 (+ DC)
    full = sum(1 for y in range(-N // 2, N // 2) for x in range(-N // 2, N // 2)
               if np.floor(np.hypot(x, y) + 0.5) <= s // 2)
    assert pix.npix == (full - 1) // 2 + 1


def test_project_pixels_float32_coordinates_match_float64_slices():
    """The E-step's slices (float32 coordinates) equal the float64 projector's half-grid slices at the same
    pixels to < 1e-4 relative (the trilinear interpolation error itself is ~1e-2)."""
    from napari_gpu_relion.compute.geometry import euler_to_matrix
    from napari_gpu_relion.compute.projector import prepare_reference, project, project_pixels

    rng = np.random.default_rng(10)
    N = 32
    ref = prepare_reference(rng.normal(size=(N, N, N)), 2, N / 2)
    A = euler_to_matrix(*rng.uniform([-180, 0, -180], [180, 180, 180], (7, 3)).T)
    pix = pixel_set(N, N)
    got = project_pixels(ref, A, pix.kx, pix.ky)
    want = project(ref, A).reshape(7, -1)[:, pix.flat]
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_class_offset_priors_split_identical_classes_as_the_priors_say():
    """Two identical 2D classes whose translation priors are centred at mu_0 = (0, 0) and mu_1 = (3, 0) Å; the
    data are the reference shifted by +2 px (4 Å) in x. The likelihood cannot tell the classes apart, so the
    class posterior is the prior ratio exp(-(|o - mu_1|^2 - |o - mu_0|^2) / (2 sigma^2)) evaluated at the coarse
    translation (relion_algorithm 2.8) with o = -4 Å (RELION's offset is the shift that brings the particle
    back to the centre), not at the fine child that wins; each class's mean offset is that child (the posterior
    is sharp) and the offset-variance sum is sum_c p_c |child - mu_c|^2. With the prior in Å throughout
    (--angstrom_offset_prior); RELION's arithmetic with class priors is in the brute-force cases."""
    from napari_gpu_relion.compute.backprojector import BackProjectorStack
    from napari_gpu_relion.compute.estep import EStepSetup, EStepSums, InPlaneSampling, expectation_batch, prepare_batch
    from napari_gpu_relion.compute.expectation import pixel_set
    from napari_gpu_relion.compute.projector import prepare_reference

    N, apix, sigma_A, I = 32, 2.0, 3.0, 3
    yy, xx = np.mgrid[:N, :N] - N // 2
    img = sum(a * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s * s))
              for a, cx, cy, s in ((1.0, -4, 2, 2.5), (0.7, 5, -3, 2.0), (0.5, 1, 7, 1.5)))
    data = np.repeat(np.roll(img, 2, axis=1)[None], I, axis=0).astype(np.float32)  # +2 px in x
    refs = [prepare_reference(img, 2, r_max=N / 2) for _ in range(2)]
    smp = InPlaneSampling(psi_step=12.0, offset_range=4.0, offset_step=2.0)
    pix = pixel_set(N, N, np)
    power = float((np.abs(np.fft.rfft2(img) / img.size) ** 2).mean())
    mu = np.array([[0.0, 0.0], [3.0, 0.0]])
    setup = EStepSetup(refs, smp, pix, pix, apix, np.full((1, N // 2 + 1), 1e-3 * power),
                       sigma_offset_A=sigma_A, class_offset_prior_A=mu, relion_offset_prior=False)
    sums = EStepSums(BackProjectorStack(2, N, 2, N / 2, ndim=2).members, N // 2 + 1, 1, 1)
    prep = prepare_batch(data, np.ones(I), np.zeros((I, 2)), mask_radius_px=N / 2 - 1)
    res = expectation_batch(setup, prep, None, np.zeros(I, int), np.ones(I), sums)
    o = np.array([-4.0, 0.0])
    lw = -((o - mu) ** 2).sum(1) / (2 * sigma_A**2)
    p_want = np.exp(lw - lw.max()) / np.exp(lw - lw.max()).sum()
    np.testing.assert_allclose(sums.pdf_class / I, p_want, atol=1e-3)
    child = res.offsets_px[0] * apix  # the best fine translation: a child of (-2, 0) px, 0.5 px off in x and y
    np.testing.assert_allclose(np.abs(child - o), [1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(res.offsets_px, res.offsets_px[:1].repeat(I, 0))
    np.testing.assert_allclose(sums.offset_sum / sums.pdf_class[:, None], np.tile(child, (2, 1)), atol=0.01)
    want = I * float((p_want * ((child - mu) ** 2).sum(1)).sum())
    np.testing.assert_allclose(sums.sigma_offset, want, rtol=2e-3)


def test_sample_log_prior_is_the_direct_float64_sum_and_gives_the_same_weights():
    """A SampleLogPrior (table per particle, row group and column group, plus a per-column term) against a float64
    loop over the samples, and posterior_weights with it against the same prior given as a full array."""
    from napari_gpu_relion.compute.expectation import SampleLogPrior, posterior_weights

    rng = np.random.default_rng(5)
    I, A, rg, B, cg = 3, 4, 3, 5, 2
    R, C = A * rg, B * cg
    table = rng.normal(0.0, 2.0, (I, A, B))
    table[0, 1, 2] = -np.inf
    column = rng.normal(0.0, 1.0, (I, C))
    lp = SampleLogPrior(table, row_group=rg, col_group=cg, column=column)
    want = np.empty((I, R, C))
    for i in range(I):
        for r in range(R):
            for c in range(C):
                want[i, r, c] = table[i, r // rg, c // cg] + column[i, c]
    assert np.array_equal(lp.full((I, R, C)), want)
    shared = SampleLogPrior(table, row_group=rg, col_group=cg, column=column[:1])
    assert np.array_equal(shared.full((I, R, C)), table.repeat(rg, 1).repeat(cg, 2) + column[:1, None, :])
    assert np.array_equal(SampleLogPrior(table, rg, cg).full((I, R, C)), table.repeat(rg, 1).repeat(cg, 2))
    d2 = rng.normal(50.0, 3.0, (I, R, C)).astype(np.float32)
    w = posterior_weights(d2, lp, 0.99)
    w0 = posterior_weights(d2, want, 0.99)
    assert np.array_equal(w.w, w0.w) and np.array_equal(w.best, w0.best)
    assert np.array_equal(w.log_evidence, w0.log_evidence) and (w.w[0].reshape(R, C)[rg:2 * rg, 4:6] == 0).all()


@pytest.mark.parametrize("sharpness", [0.0, 0.05, 1.0, 5.0, 40.0])
def test_significance_threshold_equals_the_full_sort(sharpness):
    """The candidate-only threshold gives exactly the k and w_sig of sorting every sample (flat to sharp
    posteriors, invalid samples, rows with one dominant sample)."""
    from napari_gpu_relion.compute.expectation import _threshold_by_sort, significance_threshold

    rng = np.random.default_rng()
    I, n = 30, 20000
    lw = -sharpness * rng.gamma(2.0, 1.0, (I, n)) * rng.uniform(0.2, 3.0, (I, 1))
    lw[rng.random((I, n)) < 0.1] = -np.inf
    lw[0, 5] = 1e3  # one sample takes all
    e = np.exp(lw - lw.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    for f in (0.999, 0.5, 0.9999):
        k, w = significance_threshold(p, f)
        k_ref, w_ref = _threshold_by_sort(p, f)
        assert np.array_equal(k, k_ref)
        assert np.array_equal(w, w_ref)


def test_flat_rows_are_sorted_alone_and_sharp_rows_by_their_candidates(monkeypatch):
    """A batch with a few flat posteriors (a junk particle, iteration 1's particles) and many sharp ones: only
    the flat rows take the full sort, and every row's k and w_sig are still exactly the full sort's."""
    from napari_gpu_relion.compute import expectation

    rng = np.random.default_rng(3)
    I, n = 40, 20000
    sharp = np.ones(I, dtype=bool)
    sharp[[3, 17, 30]] = False
    lw = -np.where(sharp, 40.0, 0.0)[:, None] * rng.gamma(2.0, 1.0, (I, n))
    e = np.exp(lw - lw.max(axis=1, keepdims=True))
    p = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    full = expectation._threshold_by_sort
    sorted_rows = []

    def recording_sort(q, f, maxsig=-1):
        sorted_rows.append(q.shape[0])
        return full(q, f, maxsig)

    monkeypatch.setattr(expectation, "_threshold_by_sort", recording_sort)
    k, w = expectation.significance_threshold(p, 0.999)
    assert sorted_rows == [3]  # the three flat rows, in one full sort
    k_ref, w_ref = full(p, 0.999)
    assert np.array_equal(k, k_ref) and np.array_equal(w, w_ref)
    assert (k_ref[~sharp] > n // 2).all() and (k_ref[sharp] < n // 20).all()  # the two kinds of row are real


@pytest.mark.parametrize("pixel_size", [1.0, 2.54, 5.08])
def test_translation_prior_in_angstrom_and_in_relions_arithmetic(pixel_size):
    """--angstrom_offset_prior: exp(-|o + t|^2 / (2 sigma^2)) with o + t converted to Å once: its width in pixels is
    sigma / pixel size at every pixel size. The default, RELION 5.0.1's arithmetic (ml_optimiser.cpp: the
    translation in Å added to the old offset in pixels, then scaled by pixel_size): exp(-|(o + t p) p|^2 / (2
    sigma^2)), a width of sigma / pixel_size^2 pixels for the translation. Float64 direct evaluations are the
    references."""
    from napari_gpu_relion.compute.estep import _log_trans_prior

    sigma_A = 10.0
    old = np.array([[3.0, -2.0], [0.0, 0.0]])  # rounded offsets, pixels
    t = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, -4.0], [1.5, 2.5]])  # translations, pixels
    got = _log_trans_prior(old, t, pixel_size, sigma_A, np, np.zeros((1, 2)), relion_units=False)[..., 0]
    want = np.array([[-(((o + tt) * pixel_size) ** 2).sum() / (2 * sigma_A**2) for tt in t] for o in old])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # one pixel of translation costs (pixel_size / sigma)^2 / 2 in log prior from a centred start, not more
    step = got[1, 1] - got[1, 0]
    assert step == pytest.approx(-(2.0 * pixel_size) ** 2 / (2 * sigma_A**2), rel=1e-12)
    relion = _log_trans_prior(old, t, pixel_size, sigma_A, np, np.zeros((1, 2)))[..., 0]
    want = np.array([[-(((o + tt * pixel_size) * pixel_size) ** 2).sum() / (2 * sigma_A**2) for tt in t]
                     for o in old])
    np.testing.assert_allclose(relion, want, rtol=1e-12)
    step = relion[1, 1] - relion[1, 0]
    assert step == pytest.approx(-(2.0 * pixel_size**2) ** 2 / (2 * sigma_A**2), rel=1e-12)


def test_the_pre_shift_moves_by_whole_pixels_with_zeros_where_nothing_comes_in():
    """RELION's selfTranslate with DONT_WRAP (ml_optimiser.cpp, getFourierTransformsAndCtfs): a circular shift
    (np.roll) where the source lies inside the image, 0 where it would wrap."""
    from napari_gpu_relion.compute.estep import shift_zero_filled

    rng = np.random.default_rng(4)
    N = 12
    x = rng.standard_normal((4, N, N)).astype(np.float32)
    shifts = np.array([[2.0, -3.0], [0.0, 0.0], [-5.0, 1.0], [11.0, 0.0]])
    out = shift_zero_filled(x, shifts)
    for i, (sx, sy) in enumerate(shifts.astype(int)):
        want = np.roll(x[i], (sy, sx), axis=(0, 1))
        rows, cols = np.arange(N) - sy, np.arange(N) - sx
        inside = ((rows >= 0) & (rows < N))[:, None] & ((cols >= 0) & (cols < N))[None, :]
        np.testing.assert_array_equal(out[i], np.where(inside, want, 0.0))
        assert (out[i] == 0).sum() >= N * N - (N - abs(sy)) * (N - abs(sx))


@pytest.mark.parametrize("stacked", [False, True])
def test_rows_projected_straight_into_the_score_layout_equal_the_gathered_slices(stacked):
    """project_as_slices (the NumPy coarse pass of a local search, chunked, in threads) gives, bit for bit, the
    array code it replaces: every orientation's complex slice, the zeroed corners, as_slices and a take of the
    rows of each particle."""
    from napari_gpu_relion.compute import host_threads
    from napari_gpu_relion.compute.expectation import as_slices, gemm_width, project_as_slices
    from napari_gpu_relion.compute.geometry import euler_to_matrix
    from napari_gpu_relion.compute.projector import pixel_list, prepare_reference, project_pixels, stack_references

    rng = np.random.default_rng(11)
    N, U = 20, 90
    refs = [prepare_reference(rng.standard_normal((N, N, N)), 2, r_max=8) for _ in range(2 if stacked else 1)]
    ref = stack_references(refs) if stacked else refs[0]
    A = euler_to_matrix(*(rng.uniform(-180, 180, (3, U)) * np.array([[1], [0.5], [1]]))).astype(np.float32)
    index = rng.integers(0, 2, U) if stacked else None
    ky, kx, _ = pixel_list(N, 8)
    zero = np.zeros(kx.size, bool)
    zero[::13] = True
    source = rng.integers(0, U, (7, 100))  # 7 particles x 100 rows, some shared: several chunks of 2^15 points
    width = gemm_width(kx.size) + 16  # padded beyond the GEMM width: the zeros too
    P = project_pixels(ref, A, kx, ky, index=index)
    P[:, zero] = 0
    want = as_slices(P, width).take(source)
    for threads in (1, 3):
        with host_threads.using(threads):
            got = project_as_slices(ref, A, kx, ky, source, width, index=index, zero=zero)
        np.testing.assert_array_equal(got.stacked, want.stacked)
        np.testing.assert_array_equal(got.power, want.power)
    assert got.stacked.shape == (7, 100, width) and np.abs(got.stacked).sum() > 0

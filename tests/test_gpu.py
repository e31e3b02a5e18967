"""CuPy vs NumPy agreement on fresh random data (run on a GPU machine: pytest -m gpu)."""

import numpy as np
import pytest

from napari_gpu_relion.compute.backend import gpu_available

pytestmark = pytest.mark.gpu

if not gpu_available():
    pytest.skip("no usable CUDA GPU with CuPy", allow_module_level=True)

import cupy as cp  # noqa: E402

from napari_gpu_relion.compute.backprojector import BackProjector  # noqa: E402
from napari_gpu_relion.compute.ctf import CtfParams, ctf_half_grid  # noqa: E402
from napari_gpu_relion.compute.fourier import rfft_centered  # noqa: E402
from napari_gpu_relion.compute.geometry import euler_to_matrix  # noqa: E402
from napari_gpu_relion.compute.projector import prepare_reference, project  # noqa: E402


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_projector_cupy_matches_numpy():
    rng = np.random.default_rng()
    vol = rng.normal(size=(48, 48, 48))
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (64, 3))
    A = euler_to_matrix(*ang.T)
    cpu = project(prepare_reference(vol), A)
    gpu = project(prepare_reference(cp.asarray(vol)), cp.asarray(A)).get()
    assert _rel(gpu, cpu) < 1e-5


def test_backprojection_and_reconstruction_cupy_matches_numpy():
    rng = np.random.default_rng()
    N = 32
    imgs = rng.normal(size=(200, N, N)).astype(np.float32)
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (200, 3))
    A = euler_to_matrix(*ang.T)
    ctf = CtfParams(rng.uniform(1e4, 2e4, 200), rng.uniform(1e4, 2e4, 200), rng.uniform(-180, 180, 200))
    maps = []
    for xp in (np, cp):
        F = rfft_centered(xp.asarray(imgs), 2)
        c = ctf_half_grid(ctf, N, 2.0, xp=xp)
        bp = BackProjector(N, 2, xp=xp)
        bp.insert_images(xp.asarray(A), F * c, c * c)
        bp.enforce_hermitian()
        bp.symmetrise(np.array([np.eye(3), np.diag([-1.0, -1.0, 1.0])]))
        m = bp.reconstruct(tau2=xp.full(N // 2 + 1, 0.01))
        maps.append(m if xp is np else m.get())
    assert _rel(maps[1], maps[0]) < 1e-4


def test_estep_scores_and_weights_cupy_match_numpy():
    from napari_gpu_relion.compute.expectation import (  # noqa: PLC0415
        particle_terms,
        pixel_set,
        posterior_weights,
        scores_shared,
        translation_ramps,
    )

    rng = np.random.default_rng()
    N, I, R = 64, 16, 500
    out = {}
    for xp in (np, cp):
        pix = pixel_set(N, N, xp)
        K = pix.npix
        g = np.random.default_rng(5)
        X = xp.asarray((g.normal(size=(I, K)) + 1j * g.normal(size=(I, K))).astype(np.complex64))
        P = xp.asarray((g.normal(size=(R, K)) + 1j * g.normal(size=(R, K))).astype(np.complex64))
        c = xp.asarray(g.uniform(-1, 1, (I, K)).astype(np.float32))
        w = xp.asarray(np.full((I, K), 0.01, np.float32))
        terms = particle_terms(X, c, w, translation_ramps(pix, g.uniform(-3, 3, (21, 2))))
        d2 = scores_shared(P, terms)
        W = posterior_weights(d2, xp.zeros((1, 1, 1)), 0.999)
        out[xp.__name__] = (np.asarray(cp.asnumpy(d2) if xp is cp else d2), cp.asnumpy(W.best) if xp is cp else W.best)
    d_np, b_np = out["numpy"]
    d_cp, b_cp = out["cupy"]
    assert _rel(d_cp, d_np) < 1e-5
    assert (b_cp == b_np).mean() > 0.99
    del rng


@pytest.mark.parametrize("zero_mask", [True, False])
def test_refine3d_cupy_and_numpy_give_the_same_angles(tmp_path, zero_mask):
    """The same small refinement on both backends, with zero-filled masks and with noise-filled ones (the noise is
    counter-based, compute/noise.py: the same numbers on NumPy and CuPy)."""
    import starfile  # noqa: PLC0415

    from napari_gpu_relion.compute.geometry import angular_distance_deg  # noqa: PLC0415
    from napari_gpu_relion.jobs import refine3d  # noqa: PLC0415
    from napari_gpu_relion.jobs.simulate import make_sample_data  # noqa: PLC0415

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=200, snr=0.1, diameter=140.0,
                            ini_high=60.0, n_micrographs=0)
    angles = {}
    for cpu in (True, False):
        o = tmp_path / ("cpu" if cpu else "gpu")
        for _ in refine3d.run(refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=o / "run",
                                              ctf=True,
                                              particle_diameter=160.0, healpix_order=1, zero_mask=zero_mask,
                                              auto_iter_max=3, cpu=cpu, gpu=None if cpu else 0)):
            pass
        d = starfile.read(o / "run_data.star")["particles"]
        angles[cpu] = euler_to_matrix(*(d[c].to_numpy() for c in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")))
    diff = angular_distance_deg(angles[True], angles[False])
    assert (diff < 0.1).mean() > 0.99, f"{(diff < 0.1).mean():.3f} of the angles agree"


def test_class3d_global_then_local_searches_separate_two_states(tmp_path):
    """3D classification of a 50/50 two-state mixture (2000 particles, box 64, 3 Å/px, SNR 0.05, K=2) the way
    RELION users do it: 20 iterations of global searches (HEALPix order 2) from the state-1 map low-passed to
    60 Å, then 8 iterations of local searches (order 3, sigma 3°) from that run's classes (--ref its
    _model.star, its _data.star as input): >= 95 % of the particles in the class of their own state. (Global
    searches alone plateau at 93-94 %, and the same path on 1500 particles at box 32, 6 Å/px, SNR 0.2 gave
    only 90 %: benchmarks/README.md.)"""
    import starfile

    from napari_gpu_relion.compute.ground_truth import class_assignment_report
    from napari_gpu_relion.jobs import class3d
    from napari_gpu_relion.jobs.simulate import make_sample_data

    data = make_sample_data(tmp_path / "data", box=64, angpix=3.0, n_particles=2000, snr=0.05, diameter=150.0,
                            ini_high=60.0, n_micrographs=0, conformations=2)
    common = dict(K=2, ctf=True, particle_diameter=160.0, flatten_solvent=True, zero_mask=True)
    for _ in class3d.run(class3d.Params(i=data / "particles.star", ref=data / "truth.mrc", o=data / "Class3D" / "run",
                                        iter=20, healpix_order=2, **common)):
        pass
    for _ in class3d.run(class3d.Params(i=data / "Class3D" / "run_it020_data.star",
                                        ref=data / "Class3D" / "run_it020_model.star", o=data / "Local" / "run", iter=8,
                                        healpix_order=3, sigma_ang=3.0, ini_high=-1.0, **common)):
        pass
    truth = starfile.read(data / "particles_truth.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    got = starfile.read(data / "Local" / "run_it008_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    rep = class_assignment_report(got, truth, 2)
    assert rep.accuracy >= 0.95, rep


def test_local_candidates_on_the_gpu_equal_numpy():
    """The local-search candidate rows and priors made on the device (jobs pass xp=cupy) are those of NumPy."""
    from napari_gpu_relion.compute.sampling import Sampling, local_candidates

    rng = np.random.default_rng()
    angles = rng.uniform([-180, 0, -180], [180, 180, 180], (300, 3))
    for order, sym, sigma in ((4, "C1", 1.5), (3, "D7", 3.0)):
        smp = Sampling(order, sym)
        c_cpu, l_cpu = local_candidates(angles, smp, sigma, sym, n_classes=2)
        c_gpu, l_gpu = local_candidates(angles, smp, sigma, sym, n_classes=2, xp=cp)
        assert np.array_equal(c_gpu.get(), c_cpu)
        ok = c_cpu >= 0
        assert np.all(np.isneginf(l_gpu.get()[~ok]))
        assert np.allclose(l_gpu.get()[ok], l_cpu[ok], atol=1e-9)


def test_fine_pass_particle_terms_on_the_gpu_equal_the_complex_forms():
    """The fine pass's particle terms on CuPy (expectation.stacked_shifted, sum_conj_shifted: the fused kernels
    gpu_kernels.stacked_shifted and sum_conj_shifted) against the complex products in float64."""
    from napari_gpu_relion.compute import expectation

    rng = np.random.default_rng(2)
    g = (rng.normal(size=(4, 300)) + 1j * rng.normal(size=(4, 300))).astype(np.complex64)
    ramps = np.exp(1j * rng.uniform(0, 2 * np.pi, size=(9, 300))).astype(np.complex64)
    ref = expectation.stack_complex(g.astype(np.complex128)[:, None, :] * ramps[None])
    got = cp.asnumpy(expectation.stacked_shifted(cp.asarray(g), cp.asarray(ramps)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    U = rng.normal(size=(4, 9, 600)).astype(np.float32)
    direct = ((U[..., :300].astype(np.complex128) - 1j * U[..., 300:]) * ramps[None]).sum(axis=1)
    got = cp.asnumpy(expectation.sum_conj_shifted(cp.asarray(U), cp.asarray(ramps)))
    np.testing.assert_allclose(got, direct, rtol=0, atol=1e-4)


def test_tf32_switch_rounds_both_product_paths_and_switches_back():
    """--tf32's switch: with it on, CuPy's 2-D product (cublasGemmEx) and batched product
    (cublasGemmStridedBatchedEx) differ from float64 by TF32's rounding (inputs to 10 bits: ~1e-4 relative),
    with it off by float32's (~1e-7); switching off restores float32 exactly."""
    from napari_gpu_relion.runtime.device import select_backend, set_matmul_tf32

    be = select_backend(gpu=0)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 512, 256)).astype(np.float32)
    b = rng.standard_normal((64, 256, 128)).astype(np.float32)
    exact2 = a[0].astype(np.float64) @ b[0].astype(np.float64)
    exact3 = a.astype(np.float64) @ b.astype(np.float64)
    ga, gb = cp.asarray(a), cp.asarray(b)
    errors = {}
    try:
        for on in (False, True, False):
            assert set_matmul_tf32(be, on) is on
            errors.setdefault(on, []).append((_rel(cp.asnumpy(ga[0] @ gb[0]), exact2),
                                              _rel(cp.asnumpy(ga @ gb), exact3)))
    finally:
        set_matmul_tf32(be, False)
    (off2, off3), (again2, again3) = errors[False]
    (on2, on3), = errors[True]
    assert off2 < 1e-6 and off3 < 1e-6, errors
    assert 1e-5 < on2 < 2e-3 and 1e-5 < on3 < 2e-3, errors
    assert again2 == off2 and again3 == off3, errors


def test_class3d_and_class2d_give_the_same_classes_and_angles_on_cupy_and_numpy(tmp_path):
    """Issue 16: the same seed gives the same classes and angles on the CPU and the GPU (>= 99.5 % of the
    particles): class3d K=2 (2 iterations) and class2d K=4 (2 iterations), noise-filled masks."""
    import starfile  # noqa: PLC0415

    from napari_gpu_relion.compute.geometry import angular_distance_deg  # noqa: PLC0415
    from napari_gpu_relion.jobs import class2d, class3d  # noqa: PLC0415
    from napari_gpu_relion.jobs.simulate import make_sample_data  # noqa: PLC0415

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=200, snr=0.2, diameter=134.4,
                            ini_high=60.0, n_micrographs=0)
    ang = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
    out = {}
    for cpu in (True, False):
        dev = {"cpu": cpu, "gpu": None if cpu else "0"}
        o3, o2 = tmp_path / f"c3_{cpu}" / "run", tmp_path / f"c2_{cpu}" / "run"
        list(class3d.run(class3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=o3, K=2, iter=2,
                                        healpix_order=1, ctf=True, particle_diameter=150.0, **dev)))
        list(class2d.run(class2d.Params(i=data / "particles.star", o=o2, K=4, iter=2, ctf=True,
                                        particle_diameter=150.0, **dev)))
        out[cpu] = [starfile.read(f"{o}_it002_data.star")["particles"] for o in (o3, o2)]
    for job, a, b in zip(("class3d", "class2d"), out[True], out[False], strict=True):
        same_class = float((a["rlnClassNumber"].to_numpy() == b["rlnClassNumber"].to_numpy()).mean())
        diff = angular_distance_deg(euler_to_matrix(*(a[c].to_numpy() for c in ang)),
                                    euler_to_matrix(*(b[c].to_numpy() for c in ang)))
        same_angle = float((diff < 0.01).mean())
        assert same_class >= 0.995 and same_angle >= 0.995, (job, same_class, same_angle)


def test_a_tf32_job_says_so_and_leaves_its_thread_in_float32(tmp_path):
    """--tf32 on the GPU: the job says its products run in TF32, gives the classes of the float32 job for
    >= 98 % of the particles (4 of 200; at iteration 1 of class3d K=4 on 10,000 particles TF32 moved 0.43 %,
    benchmarks/README.md "TF32"), and its thread's products are float32 again once it has ended."""
    from napari_gpu_relion.events import Message  # noqa: PLC0415
    from napari_gpu_relion.jobs import class2d  # noqa: PLC0415
    from napari_gpu_relion.jobs.simulate import make_sample_data  # noqa: PLC0415

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=200, snr=0.2, diameter=134.4,
                            ini_high=60.0, n_micrographs=0)
    classes = {}
    for tf32 in (False, True):
        o = tmp_path / f"t{tf32}" / "run"
        events = list(class2d.run(class2d.Params(i=data / "particles.star", o=o, K=4, iter=1, ctf=True,
                                                 particle_diameter=150.0, gpu="0", tf32=tf32,
                                                 coarse_float32=True)))
        said = [e.text for e in events if isinstance(e, Message) and "--tf32" in e.text]
        assert said == (["--tf32: the E-step's float32 matrix products run in TF32 on tensor cores"] if tf32 else [])
        import starfile  # noqa: PLC0415

        classes[tf32] = starfile.read(f"{o}_it001_data.star")["particles"]["rlnClassNumber"].to_numpy()
    assert (classes[False] == classes[True]).mean() >= 0.98
    rng = np.random.default_rng(5)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 128)).astype(np.float32)
    err = _rel(cp.asnumpy(cp.asarray(a) @ cp.asarray(b)), a.astype(np.float64) @ b.astype(np.float64))
    assert err < 1e-6, err


def test_coarse_tf32_is_tf32_in_its_block_only_and_keeps_the_float32_classes_and_angles(tmp_path):
    """The coarse pass in TF32 (the default; --coarse_float32 turns it off): matmul_tf32 rounds the block's
    products to TF32 and leaves float32 after it (TF32 after it when the thread was in TF32: a --tf32 job);
    class3d K=2 gives the float32 run's classes and angles (within 0.01 degrees) for >= 99.5 % of the
    particles: the coarse pass only selects what the fine pass scores in float32."""
    import starfile  # noqa: PLC0415

    from napari_gpu_relion.compute.backend import matmul_tf32
    from napari_gpu_relion.compute.geometry import angular_distance_deg  # noqa: PLC0415
    from napari_gpu_relion.jobs import class3d  # noqa: PLC0415
    from napari_gpu_relion.jobs.simulate import make_sample_data  # noqa: PLC0415
    from napari_gpu_relion.runtime.device import select_backend, set_matmul_tf32

    rng = np.random.default_rng(7)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 128)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    ga, gb = cp.asarray(a), cp.asarray(b)

    def err():
        return _rel(cp.asnumpy(ga @ gb), exact)

    with matmul_tf32(cp, True):
        inside = err()
    after = err()
    with matmul_tf32(cp, False):
        off_block = err()
    be = select_backend(gpu=0)
    try:
        set_matmul_tf32(be, True)
        with matmul_tf32(cp, True):
            pass
        still = err()
    finally:
        set_matmul_tf32(be, False)
    assert 1e-5 < inside < 2e-3 and after < 1e-6 and off_block < 1e-6 and 1e-5 < still < 2e-3, \
        (inside, after, off_block, still)

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=200, snr=0.2, diameter=134.4,
                            ini_high=60.0, n_micrographs=0)
    ang = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
    out = {}
    for coarse in (False, True):
        o = tmp_path / f"c3_{coarse}" / "run"
        list(class3d.run(class3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=o, K=2, iter=2,
                                        healpix_order=1, ctf=True, particle_diameter=150.0, gpu="0",
                                        coarse_float32=not coarse)))
        out[coarse] = starfile.read(f"{o}_it002_data.star")["particles"]
    a32, t32 = out[False], out[True]
    same_class = float((a32["rlnClassNumber"].to_numpy() == t32["rlnClassNumber"].to_numpy()).mean())
    diff = angular_distance_deg(euler_to_matrix(*(a32[c].to_numpy() for c in ang)),
                                euler_to_matrix(*(t32[c].to_numpy() for c in ang)))
    assert same_class >= 0.995 and float((diff < 0.01).mean()) >= 0.995, (same_class, float((diff < 0.01).mean()))
    assert err() < 1e-6


def _fused_and_array(monkeypatch, fn):
    """fn() with the fused kernels, then with the array code (gpu_kernels.ENABLED off), both on the GPU."""
    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415

    fused = fn()
    monkeypatch.setattr(gpu_kernels, "ENABLED", False)
    array = fn()
    monkeypatch.setattr(gpu_kernels, "ENABLED", True)
    return fused, array


@pytest.mark.parametrize("ndim", [3, 2])
def test_fused_projection_gives_the_array_codes_values(monkeypatch, ndim):
    """The fused gather kernel against the chain of CuPy operations it replaces (same float32 coordinates, same
    operation order): a stack of three references read at an index per row, at every pixel of the box out to
    Nyquist, so the r_max edge, the Hermitian mate and the wrap of y and z are all crossed."""
    from napari_gpu_relion.compute.projector import project_pixels, stack_references  # noqa: PLC0415

    rng = np.random.default_rng(7)
    N = 40
    refs = stack_references([prepare_reference(cp.asarray(rng.normal(size=(N,) * ndim))) for _ in range(3)])
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (257, 3))
    A = cp.asarray(euler_to_matrix(*ang.T), dtype=cp.float32)
    ky, kx = (a.ravel() for a in np.meshgrid(np.arange(-N // 2, N // 2), np.arange(N // 2 + 1), indexing="ij"))
    kx, ky = cp.asarray(kx, cp.float32), cp.asarray(ky, cp.float32)
    index = cp.asarray(rng.integers(0, 3, A.shape[0]))
    fused, array = _fused_and_array(monkeypatch, lambda: project_pixels(refs, A, kx, ky, index=index).get())
    assert fused.shape == (257, kx.size) and fused.dtype == np.complex64
    assert np.count_nonzero(array) > 0.5 * array.size
    scale = np.abs(array).max()
    assert np.abs(fused - array).max() <= 1e-6 * scale
    assert np.mean(fused == array) > 0.999  # the same operations in the same order: nearly all bit for bit


@pytest.mark.parametrize("ndim", [3, 2])
def test_fused_insertion_gives_the_array_codes_sums(monkeypatch, ndim):
    """The fused splat kernel against cupyx.scatter_add of the array code's corner contributions: the same
    float32 corner weights and products, float64 sums that differ only in the atomic adds' order."""
    from napari_gpu_relion.compute.backprojector import BackProjectorStack  # noqa: PLC0415

    rng = np.random.default_rng(8)
    N, R = 32, 300
    ky, kx = (a.ravel() for a in np.meshgrid(np.arange(-N // 2, N // 2), np.arange(N // 2 + 1), indexing="ij"))
    kx, ky = cp.asarray(kx, cp.float64), cp.asarray(ky, cp.float64)
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (R, 3))
    A = cp.asarray(euler_to_matrix(*ang.T))
    vals = cp.asarray(rng.normal(size=(R, kx.size)) + 1j * rng.normal(size=(R, kx.size)), dtype=cp.complex64)
    wts = cp.asarray(rng.uniform(0, 2, (R, kx.size)) * (rng.uniform(size=(R, kx.size)) > 0.1))
    index = cp.asarray(rng.integers(0, 2, R))

    def insert():
        st = BackProjectorStack(2, N, 2, r_max=N / 2 - 3, ndim=ndim, xp=cp)
        st.insert_pixels(index, A, kx, ky, vals, wts)
        return [a.get() for a in st.arrays]

    fused, array = _fused_and_array(monkeypatch, insert)
    for f, a in zip(fused, array, strict=True):
        assert np.count_nonzero(a) > 0.1 * a.size
        assert np.array_equal(f != 0, a != 0)
        assert np.abs(f - a).max() <= 1e-12 * np.abs(a).max()


def test_images_kept_on_the_gpu_give_the_same_refinement_as_images_read_from_the_disk(tmp_path, monkeypatch):
    """Issue 15: a one-process GPU run keeps the images on the device (said in its log); its refinement is the one
    that reads them from the disk in every iteration, to float rounding (two GPU runs are not bit for bit alike:
    the insertion adds in float64 atomics, in no fixed order): the same angles (< 0.01 degrees) and offsets
    (< 0.01 px) for >= 99.5 % of the particles."""
    import starfile  # noqa: PLC0415

    from napari_gpu_relion.compute.geometry import angular_distance_deg  # noqa: PLC0415
    from napari_gpu_relion.events import Message  # noqa: PLC0415
    from napari_gpu_relion.jobs import refine3d  # noqa: PLC0415
    from napari_gpu_relion.jobs.simulate import make_sample_data  # noqa: PLC0415
    from napari_gpu_relion.runtime import memory  # noqa: PLC0415

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=200, snr=0.1, diameter=140.0,
                            ini_high=60.0, n_micrographs=0)
    out = {}
    for where in ("device", "disk"):
        if where == "disk":
            monkeypatch.setattr(memory, "DEVICE_IMAGES_FRACTION", 10**15)  # no room on the device: host or disk
        o = tmp_path / where / "run"
        msgs = [ev.text for ev in refine3d.run(refine3d.Params(
            i=data / "particles.star", ref=data / "reference.mrc", o=o, ctf=True, particle_diameter=160.0,
            healpix_order=1, auto_iter_max=3, gpu=0, preread_images=False)) if isinstance(ev, Message)]
        on_gpu = any("kept on the GPU" in m for m in msgs)
        assert on_gpu == (where == "device"), msgs[:6]
        out[where] = starfile.read(o.parent / "run_data.star")["particles"]
    a, b = out["device"], out["disk"]
    ang = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
    diff = angular_distance_deg(euler_to_matrix(*(a[c].to_numpy() for c in ang)),
                                euler_to_matrix(*(b[c].to_numpy() for c in ang)))
    shift = np.hypot(*(a[c].to_numpy() - b[c].to_numpy() for c in ("rlnOriginXAngst", "rlnOriginYAngst"))) / 6.0
    assert (diff < 0.01).mean() >= 0.995 and (shift < 0.01).mean() >= 0.995, ((diff < 0.01).mean(),
                                                                              (shift < 0.01).mean())


@pytest.mark.parametrize("shape", [(7, 3, 70001), (64, 45, 2000), (5, 1, 13), (6, 8, 96)])
def test_fused_posterior_weights_give_the_array_codes_values(monkeypatch, shape):
    """gpu_posterior's passes against the array code on the same CuPy inputs, with a factored prior (a table per
    particle, row group and column group plus a per-column term: the coarse and fine passes' form) and with a
    full-array prior: the same best sample and top (bit for bit), p to float32 rounding, S to float64 rounding;
    with -inf priors (invalid samples), an exact tie (the first index wins, as argmax) and rows spanning several
    segments. The threshold's candidates (counted and packed by the kernel) are exactly the samples with p >= eps,
    and the whole posterior_weights (sharp rows by their candidates, flat rows by the full sort, a maxsig cap, the
    mask and the zeroed weights) is the array code's."""
    from napari_gpu_relion.compute import expectation, gpu_posterior
    from napari_gpu_relion.compute.expectation import SampleLogPrior

    rng = np.random.default_rng(3)
    I, R, C = shape
    rg, cg = (3 if R % 3 == 0 else R), (8 if C % 8 == 0 else C)
    A, B = R // rg, C // cg
    width = np.where(np.arange(I) % 3 == 1, 0.01, 30.0)[:, None, None]  # every third row flat, the others sharp
    d2 = (1.0e4 + width * rng.normal(0.0, 1.0, shape)).astype(np.float32)
    table = rng.normal(0.0, 2.0, (I, A, B))
    table[:, :, 1::7] = -np.inf
    column = rng.normal(0.0, 1.0, (1, C))
    column[:, 2::7] = -np.inf
    lp = SampleLogPrior(cp.asarray(table), rg, cg, cp.asarray(column))
    full = lp.full(shape).get()
    lw0 = full[0] - d2[0].astype(np.float64)
    rb, cb = np.unravel_index(int(np.argmax(lw0)), (R, C))
    twins = [r for r in (rb - 1, rb + 1) if 0 <= r < R and r // rg == rb // rg]  # rows of the same prior
    tie = None
    if twins:  # an exact tie of row 0's best with a sample of the same prior: the first index must win
        d2[0, twins[0], cb] = d2[0, rb, cb]
        tie = min(rb, twins[0]) * C + cb
    d2 = cp.asarray(d2)
    for prior in (lp, cp.asarray(full), SampleLogPrior(cp.asarray(table), rg, cg, cp.asarray(column).repeat(I, 0))):
        assert gpu_posterior.applies(*expectation.as_sample_log_prior(d2, prior))
        fused = expectation.normalised_weights(d2, prior)
        monkeypatch.setattr(gpu_posterior, "ENABLED", False)
        ref = expectation.normalised_weights(d2, prior)
        monkeypatch.setattr(gpu_posterior, "ENABLED", True)
        p, best, top, S = (x.get() for x in fused)
        p0, best0, top0, S0 = (x.get() for x in ref)
        assert (best == best0).all() and (top == top0).all()
        assert tie is None or best[0] == tie
        np.testing.assert_allclose(S, S0, rtol=1e-12)
        np.testing.assert_allclose(p, p0, rtol=2e-7, atol=1e-12)
        assert int((p0 == 0).sum()) >= I * R * (C // 8) and ((p == 0) == (p0 == 0)).all()
    eps = expectation.candidate_floor(0.999, R * C)
    p, _, _, _, counts, packed = gpu_posterior.fused_weights(d2, lp, eps, R * C // 4)
    p, counts, packed = p.get(), counts.get(), packed.get()
    for i in range(I):
        want = np.sort(p[i][p[i] >= np.float32(eps)])
        assert counts[i] == want.size
        if want.size <= R * C // 4:
            assert np.array_equal(np.sort(packed[i, :want.size]), want)
    if R * C > 100:
        assert (counts > R * C // 4).any() and (counts <= R * C // 4).any()  # both kinds of row are there
    for maxsig, weights in ((-1, True), (-1, False), (5, True)):
        monkeypatch.setattr(gpu_posterior, "ENABLED", False)
        w0 = expectation.posterior_weights(d2, lp, 0.999, maxsig=maxsig, weights=weights)
        monkeypatch.setattr(gpu_posterior, "ENABLED", True)
        w = expectation.posterior_weights(d2, lp, 0.999, maxsig=maxsig, weights=weights)
        assert (w.nr_significant == w0.nr_significant).all().item()
        assert (w.significant == w0.significant).all().item() and (w.best == w0.best).all().item()
        np.testing.assert_allclose(w.log_evidence.get(), w0.log_evidence.get(), rtol=1e-12)
        np.testing.assert_allclose(w.pmax.get(), w0.pmax.get(), rtol=2e-7)
        if weights:
            np.testing.assert_allclose(w.w.get(), w0.w.get(), rtol=2e-7, atol=1e-12)
            assert ((w.w > 0) == w.significant).all().item()
        else:
            assert w.w is None and w0.w is None


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 6000), (9, 70001)])
def test_rows_sorted_by_one_radix_sort_of_keys_equal_numpys_sort_and_keep_the_threshold(shape):
    """gpu_posterior.sort_rows_descending (one sort of (row, value) uint64 keys) gives NumPy's descending sort of
    each row bit for bit, values <= 0 as 0: ties, zeros, -0.0 and the packing's -1 included; and
    significance_threshold on CuPy gives the NumPy path's k and w_sig on the same weights (flat rows, sharp rows,
    packed candidates)."""
    from napari_gpu_relion.compute import expectation, gpu_posterior

    rng = np.random.default_rng(11)
    I, m = shape
    v = rng.random(shape).astype(np.float32)
    v[:, ::5] = v[:, :1]  # ties
    v[:, 1::7] = 0.0
    v[:, 2::11] = -0.0
    v[:, 3::13] = -1.0
    want = -np.sort(-np.maximum(v, np.float32(0.0)), axis=1)
    got = gpu_posterior.sort_rows_descending(cp.asarray(v)).get()
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got.view(np.uint32), (want + np.float32(0.0)).view(np.uint32))
    if m < 100:
        return
    width = np.where(np.arange(I) % 3 == 1, 0.01, 30.0)[:, None]  # flat and sharp rows
    lw = -width * rng.random(shape)
    p = np.exp(lw - lw.max(axis=1, keepdims=True))
    p = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    k0, w0 = expectation.significance_threshold(p, 0.999)
    k1, w1 = expectation.significance_threshold(cp.asarray(p), 0.999)
    assert np.array_equal(k1.get(), k0) and np.array_equal(w1.get(), w0)
    assert len(set((np.asarray(k0) + 1 > m // 4).tolist())) == 2  # both kinds of row are there


@pytest.mark.parametrize("rows,m,nbins", [(0, 3_000_001, 97), (300, 2001, 65), (2, 50_000, 2048), (70_000, 7, 4)])
def test_binned_sums_equal_float64_direct_sums(rows, m, nbins):
    """gpu_kernels.binned_sum (shell sums by block-local histograms) against a float64 NumPy sum per bin, with
    indices below 0 and at or beyond nbins dropped; rows 0 means one (m,) row; None counts."""
    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415

    rng = np.random.default_rng()
    idx = rng.integers(-3, nbins + 3, m)
    w = rng.normal(size=(max(rows, 1), m))
    ok = (idx >= 0) & (idx < nbins)
    want = np.stack([np.bincount(idx[ok], weights=r[ok], minlength=nbins) for r in w])
    got = gpu_kernels.binned_sum(cp.asarray(idx.astype(np.int32)), cp.asarray(w[0] if rows == 0 else w), nbins).get()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-9 * max(1.0, np.abs(w).sum(axis=1).max())
    counts = gpu_kernels.binned_sum(cp.asarray(idx), None, nbins).get()
    assert np.array_equal(counts[0], np.bincount(idx[ok], minlength=nbins).astype(np.float64))


def test_shell_sums_on_the_gpu_equal_numpy_for_batches_and_the_mstep():
    """fourier.shell_sum with batch axes, and the M-step's shell sums (reference_tau2, reference_sigma2) of one
    reference and one accumulator, on CuPy (binned_sum) and NumPy (bincount)."""
    from napari_gpu_relion.compute.fourier import shell_grid, shell_sum  # noqa: PLC0415
    from napari_gpu_relion.compute.maximization import reference_sigma2, reference_tau2  # noqa: PLC0415

    rng = np.random.default_rng()
    sh = shell_grid(40, 2, np)
    v = rng.normal(size=(3, 5) + sh.shape)
    assert np.allclose(shell_sum(cp.asarray(v), cp.asarray(sh), 21).get(), shell_sum(v, sh, 21), rtol=1e-12, atol=1e-9)
    vol = rng.normal(size=(32, 32, 32))
    assert np.allclose(reference_tau2(prepare_reference(cp.asarray(vol))), reference_tau2(prepare_reference(vol)),
                       rtol=1e-6)
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (50, 3))
    imgs = rng.normal(size=(50, 32, 32))
    bps = []
    for xp in (np, cp):
        bp = BackProjector(32, 2, xp=xp)
        F = rfft_centered(xp.asarray(imgs), 2)
        bp.insert_images(xp.asarray(euler_to_matrix(*ang.T)), F, xp.ones(F.shape))
        bps.append(reference_sigma2(bp))
    assert np.allclose(bps[1], bps[0], rtol=1e-6)
    # every class in one pass (references_tau2, ssnr_maps): the GPU gives NumPy's values, class by class
    from napari_gpu_relion.compute.backprojector import BackProjectorStack  # noqa: PLC0415
    from napari_gpu_relion.compute.maximization import references_tau2, ssnr_maps  # noqa: PLC0415

    vols = rng.normal(size=(3, 32, 32, 32))
    t_cpu = references_tau2([prepare_reference(v, 2, 11.0) for v in vols])
    t_gpu = references_tau2([prepare_reference(cp.asarray(v), 2, 11.0) for v in vols])
    assert all(np.allclose(g, c, rtol=1e-6) for g, c in zip(t_gpu, t_cpu, strict=True))
    w = rng.random((3,) + BackProjectorStack(3, 32, 2, 12.0).arrays[2].shape[1:])
    maps = []
    for xp in (np, cp):
        stack = BackProjectorStack(3, 32, 2, 12.0, xp=xp)
        stack.arrays[2][:] = xp.asarray(w)
        maps.append(ssnr_maps(stack, np.stack(t_cpu), 4.0))
    assert all(np.allclose(g, c, rtol=1e-9) for g, c in zip(maps[1], maps[0], strict=True))


@pytest.mark.parametrize("E,n,C", [(60_000, 37, 300), (5, 9, 1), (20_000, 4000, 64)])
def test_segment_rows_sum_equals_a_float64_direct_sum(E, n, C):
    """gpu_kernels.segment_rows_sum (the fine pass's per-row sums, sorted entries) against a float64 sum per
    row, entries outside 0..n-1 dropped, rows without entries zero; and segment_sum on the GPU and the CPU."""
    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415
    from napari_gpu_relion.compute.expectation import segment_sum  # noqa: PLC0415

    rng = np.random.default_rng()
    rows = rng.integers(-2, n + 2, E)
    rows[rows == n // 2] = n // 3  # one row with no entries
    vals = rng.normal(size=(E, C)).astype(np.float32)
    junk = cp.full((n, C), np.nan, dtype=np.float32)  # the pool hands this memory out again: an unwritten row shows
    del junk
    want = np.zeros((n, C))
    ok = (rows >= 0) & (rows < n)
    np.add.at(want, rows[ok], vals[ok].astype(np.float64))
    got = gpu_kernels.segment_rows_sum(cp.asarray(rows), cp.asarray(vals), n).get()
    scale = np.sqrt(np.maximum(np.bincount(rows[ok], minlength=n), 1))[:, None]
    assert np.abs(got - want).max() <= 1e-5 * scale.max() * np.abs(vals).max() * 10
    assert not got[n // 2].any()
    inside = np.where(ok)[0]
    gpu = segment_sum(cp.asarray(rows[inside]), cp.asarray(vals[inside]), n).get()
    cpu = segment_sum(rows[inside], vals[inside], n)
    assert np.allclose(gpu, cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())


@pytest.mark.parametrize("E,C,padded", [(200_000, 300, 0.0), (200_000, 300, 0.3), (7, 64, 0.0), (50_000, 1, 0.3),
                                        (0, 300, 0.0), (40, 64, 1.0)])
def test_segments_on_the_gpu_equal_unique_and_sum_as_without_them(E, C, padded):
    """segments_of on the GPU: np.unique's distinct keys and inverse; grouped_sum with its one sort gives the
    same float32 values, bit for bit, as segment_sum sorting the inverse itself (the same stable order), where
    the sorted-entry kernel sums (rows of SEGMENT_ROWS_MIN_COLUMNS values or more; narrower rows are summed by
    scatter_add's atomics, whose order is not fixed). A fraction ``padded`` of the keys is -1 (a gathered chunk's
    padding): in no group, inverse -1, left out of every sum."""
    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415
    from napari_gpu_relion.compute.expectation import grouped_sum, segment_sum, segments_of  # noqa: PLC0415

    rng = np.random.default_rng(E + C)
    keys = rng.integers(0, max(E // 40, 1), E) * 7 + 3
    keys[rng.random(E) < padded] = -1
    valid = keys >= 0
    vals = cp.asarray(rng.normal(size=(E, C)).astype(np.float32))
    g = segments_of(cp.asarray(keys))
    d, inv = np.unique(keys[valid], return_inverse=True)
    np.testing.assert_array_equal(g.distinct.get(), d)
    np.testing.assert_array_equal(g.inverse.get()[valid], inv.reshape(-1))
    assert (g.inverse.get()[~valid] == -1).all()
    assert g.start.size == d.size + 1 and int(g.start[-1]) == E
    got = grouped_sum(g, vals).get()
    if C >= gpu_kernels.SEGMENT_ROWS_MIN_COLUMNS:
        np.testing.assert_array_equal(got, segment_sum(g.inverse, vals, g.n).get())
    want = np.zeros((d.size, C))
    np.add.at(want, inv.reshape(-1), vals.get()[valid].astype(np.float64))
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * max(np.abs(want).max(initial=0), 1))


_OPS_SCRIPT = r"""
import json, os
import cupy as cp
from napari_gpu_relion.runtime import cupy_kernels
from napari_gpu_relion.compute.gpu_kernels import segment_rows_sum
cache = os.environ["CUPY_CACHE_DIR"]
before = cupy_kernels.cache_files(cache)
x = cp.arange(1000, dtype=cp.float32)
y = (x * 2.5 + 1.0).sum()  # elementwise and reduction kernels
z = cp.take(x.reshape(10, 100), cp.asarray([3, 1]), axis=0).max(axis=1)
vals = cp.arange(12, dtype=cp.float32).reshape(4, 3)
s = segment_rows_sum(cp.asarray([0, 1, 0, 1]), vals, 2)  # one of our raw modules
cp.cuda.Device().synchronize()
print(json.dumps({"compiled": cupy_kernels.cache_files(cache) - before, "y": float(y), "z": z.get().tolist(),
                  "s": s.get().tolist()}))
"""

_AHEAD_SCRIPT = r"""
import json, sys
from pathlib import Path
from napari_gpu_relion.runtime import cupy_kernels
rec = json.loads(Path(sys.argv[1]).read_text())
got = cupy_kernels.compile_ahead(rec["modules"], 0, Path(sys.argv[2]), workers=2)
print(json.dumps(got))
"""


def test_modules_recorded_and_compiled_ahead_through_public_calls_are_the_ones_cupy_then_finds(tmp_path):
    """The whole public path of issue 46: a process computes with an empty kernel cache (CuPy saving each module's
    source: CUPY_CACHE_SAVE_CUDA_SOURCE), benchmarks/record_kernels.py finds every module's options by compiling it
    again as a RawModule into that cache (nothing new written), the list is compiled ahead into another empty cache
    in worker processes, and a fresh process that computes the same then compiles nothing and gets the same
    numbers."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]

    def py(args, **env):
        e = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_SAVE_CUDA_SOURCE"}
        e.update(NAPARI_GPU_RELION_KERNEL_PRELOAD="0", **env)
        r = subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, timeout=600, cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip().splitlines()[-1]

    rec_cache, fresh = tmp_path / "recorded", tmp_path / "fresh"
    first = json.loads(py(["-c", _OPS_SCRIPT], CUPY_CACHE_DIR=str(rec_cache), CUPY_CACHE_SAVE_CUDA_SOURCE="1"))
    assert first["compiled"] >= 4
    py(["benchmarks/record_kernels.py", "--cache", str(rec_cache), "--out", str(tmp_path / "rec.json")])
    rec = json.loads((tmp_path / "rec.json").read_text())
    assert rec["missing"] == [] and len(rec["modules"]) == first["compiled"]
    ahead = json.loads(py(["-c", _AHEAD_SCRIPT, str(tmp_path / "rec.json"), str(fresh)],
                          CUPY_CACHE_DIR=str(fresh)))
    assert ahead["modules"] == ahead["of"] == first["compiled"]
    second = json.loads(py(["-c", _OPS_SCRIPT], CUPY_CACHE_DIR=str(fresh)))
    assert second["compiled"] == 0
    assert second["y"] == first["y"] == float(sum(2.5 * i + 1.0 for i in range(1000)))
    assert second["z"] == first["z"] == [399.0, 199.0]
    assert second["s"] == first["s"] == [[6.0, 8.0, 10.0], [12.0, 14.0, 16.0]]


_PCH_SCRIPT = r"""
import json, os
from napari_gpu_relion.runtime import cupy_kernels
import cupy
cupy.cuda.runtime.memGetInfo()
cache = os.environ["CUPY_CACHE_DIR"]
before = set(os.listdir(cache)) if os.path.isdir(cache) else set()
for e in cupy_kernels.shipped_entries("class3d")[:6]:
    cupy_kernels.compile_module(e["source"], e["options"])
print(json.dumps({"new": sorted(set(os.listdir(cache)) - before)}))
"""


def test_modules_compiled_with_precompiled_headers_are_the_files_cupy_finds_without_them(tmp_path):
    """The package turns on NVRTC's precompiled headers (CUPY_NVRTC_USE_PCH=1): CuPy adds ``--pch`` after it has
    made a module's cache key, so six shipped modules compiled with it are the same cache files (names) as without
    it, and a process without it finds them all (writes nothing)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from napari_gpu_relion.runtime import cupy_kernels  # noqa: PLC0415

    if not cupy_kernels.shipped_entries("class3d"):
        pytest.skip("the shipped list was recorded with another CuPy version")

    def py(cache, pch):
        e = dict(os.environ, CUPY_CACHE_DIR=str(cache), CUPY_NVRTC_USE_PCH=pch, NAPARI_GPU_RELION_KERNEL_PRELOAD="0")
        r = subprocess.run([sys.executable, "-c", _PCH_SCRIPT], env=e, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    with_pch = py(tmp_path / "a", "1")
    without = py(tmp_path / "b", "0")
    cubins = [n for n in with_pch["new"] if n.endswith(".cubin")]
    assert len(cubins) == 6 and cubins == [n for n in without["new"] if n.endswith(".cubin")]
    assert py(tmp_path / "a", "0")["new"] == []


def test_tf32_follows_the_cublas_handles_math_mode():
    """backend.matmul_tf32 switches CuPy's float32 products to TF32 through the cuBLAS handle's math mode alone (no
    private CuPy setting): inside the block the product's error against float64 is TF32's (10 mantissa bits, about
    1e-3 relative), outside it float32's (about 1e-6)."""
    from napari_gpu_relion.compute.backend import matmul_tf32  # noqa: PLC0415

    rng = np.random.default_rng(5)
    a = rng.standard_normal((512, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 512)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(want).max()
    ga, gb = cp.asarray(a), cp.asarray(b)
    before = np.abs(cp.matmul(ga, gb).get() - want).max() / scale
    with matmul_tf32(cp, True):
        tf32 = np.abs(cp.matmul(ga, gb).get() - want).max() / scale
        batched = np.abs(cp.matmul(ga[None], gb[None]).get()[0] - want).max() / scale
    after = np.abs(cp.matmul(ga, gb).get() - want).max() / scale
    assert before < 2e-5 and after < 2e-5
    assert tf32 > 1e-4 and batched > 1e-4


@pytest.mark.parametrize("shape", [(7, 5, 300), (1, 9, 1), (33, 4, 2049)])
def test_finish_scores_in_place_equals_the_array_codes_scores(shape):
    """gpu_kernels.finish_scores: pnorm - 2 cross in place, bit for bit the array code's float32 values, with the
    norms broadcast over the translations as both score paths give them."""
    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415

    rng = np.random.default_rng(sum(shape))
    cross = cp.asarray(rng.normal(size=shape).astype(np.float32) * 1e3)
    pnorm = cp.asarray(rng.random((shape[0], 1, shape[2])).astype(np.float32) * 1e4)
    want = (pnorm - 2.0 * cross).get()
    got = gpu_kernels.finish_scores(cross, pnorm)
    assert got is cross
    np.testing.assert_array_equal(got.get(), want)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        gpu_kernels.finish_scores(cross.astype(np.float64), pnorm)


@pytest.mark.parametrize("shape", [(5, 21, 3000), (1, 1, 7), (3, 4, 1), (0, 3, 5)])
def test_any_over_the_middle_axis_equals_cupys_reduction(shape):
    """gpu_kernels.any_over_middle: the coarse pass's significant rows, exactly CuPy's any(axis=1)."""
    from napari_gpu_relion.compute import gpu_kernels  # noqa: PLC0415

    a = cp.asarray(np.random.default_rng(sum(shape)).random(shape) < 0.02)
    np.testing.assert_array_equal(gpu_kernels.any_over_middle(a).get(), a.any(axis=1).get())
    with pytest.raises(ValueError, match="C-contiguous 3-D bool"):
        gpu_kernels.any_over_middle(cp.zeros((2, 3, 4), dtype=bool).transpose(0, 2, 1))


@pytest.mark.parametrize("n_classes", [1, 2])
def test_local_coarse_slices_projected_into_the_score_layout_equal_the_projected_and_gathered_ones(monkeypatch,
                                                                                                   n_classes):
    """A local search's coarse slices (estep._gathered_coarse_slices): the fused projection straight into each
    particle's rows gives the same float32 values as projecting the distinct rows, stacking them and gathering
    them per particle (the array path it replaces), and NumPy's within float rounding; the corners beyond the
    coarse radius are zero in both."""
    from types import SimpleNamespace

    from napari_gpu_relion.compute import estep
    from napari_gpu_relion.compute.expectation import pixel_set
    from napari_gpu_relion.compute.projector import stack_references
    from napari_gpu_relion.compute.sampling import Sampling, local_candidates

    rng = np.random.default_rng(4)
    N = 32
    vols = rng.normal(size=(n_classes, N, N, N))
    smp = Sampling(3, "C1")
    angles = rng.uniform([-180, 0, -180], [180, 180, 180], (9, 3))
    cand, _ = local_candidates(angles, smp, 4.0, "C1", n_classes=n_classes)
    got = {}
    for xp in (np, cp):
        refs = [prepare_reference(xp.asarray(v), pad=2) for v in vols]
        setup = SimpleNamespace(refs=refs, ref_stack=refs[0] if n_classes == 1 else stack_references(refs),
                                sampling=smp, mag=None)
        pix = pixel_set(N, 24, xp)
        c = xp.asarray(cand)
        urows, pos = xp.unique(xp.where(c >= 0, c, 0), return_inverse=True)
        pos = pos.reshape(c.shape)
        urows = urows.get() if xp is cp else urows
        for label, fraction in (("direct", 0.0), ("gathered", 2.0)):
            monkeypatch.setattr(estep, "DIRECT_PROJECTION_FRACTION", fraction)
            S = estep._gathered_coarse_slices(setup, urows, pos, pix)
            got[(xp.__name__, label)] = (cp.asnumpy(S.stacked), cp.asnumpy(S.power)) if xp is cp else \
                (S.stacked, S.power)
        assert pix.beyond_radius is not None
    for a, b in zip(got[("cupy", "direct")], got[("cupy", "gathered")], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got[("cupy", "direct")], got[("numpy", "gathered")], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())
    stacked, power = got[("cupy", "direct")]
    K = power.shape[-1]
    corner = cp.asnumpy(pixel_set(N, 24, cp).beyond_radius)
    assert np.all(stacked[..., :K][..., corner] == 0) and np.all(power[..., corner] == 0)
    assert np.all(stacked[..., 2 * K:] == 0) and np.abs(stacked[..., :K]).max() > 0


def test_maps_come_back_into_pinned_memory_that_is_used_again_once_free():
    """compute.backend.to_host(pinned=True): the same values as cp.asnumpy, in page-locked memory (the driver
    says so), and the pinned pool's block comes back for the next iteration's maps once the first are gone."""
    from napari_gpu_relion.compute.backend import to_host

    a = cp.random.default_rng(2).standard_normal((3, 32, 32, 32), dtype=np.float32)
    first = to_host(a, pinned=True)
    np.testing.assert_array_equal(first, cp.asnumpy(a))
    attrs = cp.cuda.runtime.pointerGetAttributes(first.ctypes.data)
    assert attrs.type == cp.cuda.runtime.memoryTypeHost, attrs.type
    address = first.ctypes.data
    del first
    second = to_host(a[:, ::-1] * 2, pinned=True)  # a strided view: copied contiguous first
    np.testing.assert_array_equal(second, cp.asnumpy(a[:, ::-1] * 2))
    assert second.ctypes.data == address


def test_warmed_pinned_blocks_are_the_ones_the_next_copies_of_that_shape_take():
    """compute.backend.warm_pinned: the blocks it made and let go are in the pinned pool, and two to_host(pinned)
    copies of that shape and dtype take them (their addresses), none made anew."""
    from napari_gpu_relion.compute.backend import to_host, warm_pinned

    pool = cp.get_default_pinned_memory_pool()
    pool.free_all_blocks()
    shape = (3, 40, 40, 40)
    before = pool.n_free_blocks()
    warm_pinned(shape, np.float32, 2, cp.cuda.Device().id)
    assert pool.n_free_blocks() == before + 2
    a = cp.ones(shape, dtype=np.float32)
    copies = [to_host(a, pinned=True), to_host(a * 2, pinned=True)]
    assert pool.n_free_blocks() == before  # both blocks taken, no new one made
    assert len({c.ctypes.data for c in copies}) == 2 and float(copies[1].sum()) == 2 * a.size


@pytest.mark.parametrize("capacity", [None, 7])
def test_images_uploaded_by_the_readers_threads_are_the_disks(tmp_path, capacity):
    """Issue 47: with the image store on the GPU, the reader's threads copy each block there (thread_upload, on the
    job's stream) and the job's thread only moves it into the store: every image the set returns is the disk's,
    bit for bit, in any order asked, for a store of every row and for an MPI rank's smaller store (7 places: the
    rest read each time); the threads did the copies."""
    import shutil  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from napari_gpu_relion.compute.backend import thread_upload  # noqa: PLC0415
    from napari_gpu_relion.io.particle_images import load_images  # noqa: PLC0415
    from napari_gpu_relion.jobs import particles  # noqa: PLC0415

    sample = Path(__file__).resolve().parents[1] / "sample_data"
    shutil.copytree(sample, tmp_path / "d")
    ps = particles.load_particle_set(tmp_path / "d" / "particles.star", ctf=True, halves=False)
    disk = load_images(ps.table)
    ps.keep_images_on(cp, capacity)
    up = thread_upload(0)
    uploads = []

    def counted(a):
        uploads.append(len(a))
        return up(a)
    n = len(ps)
    ps.read_ahead(np.arange(n), threads=3, upload=counted)
    got = []
    for i in range(0, n, 50):
        rows = np.arange(i, min(n, i + 50))
        got.append(cp.asnumpy(ps.images(rows)))
    ps.stop_reading()
    np.testing.assert_array_equal(np.concatenate(got), disk)
    assert sum(uploads) >= n // 2  # the threads copied (the job's thread may claim a few rows itself)
    back = np.arange(n)[::-1]
    np.testing.assert_array_equal(cp.asnumpy(ps.images(back)), disk[back])

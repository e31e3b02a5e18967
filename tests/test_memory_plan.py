"""The whole-run memory plan (runtime/memory.py, issue 21): its bytes per voxel are the real peaks of the
code (measured with tracemalloc on NumPy), its arithmetic matches hand sums for large boxes, a padding that does
not fit falls back to --pad 1 and says so, and a job that cannot fit is refused before it writes anything."""

import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from napari_gpu_relion import cli
from napari_gpu_relion.compute import estep, expectation, fourier, memory_model
from napari_gpu_relion.compute.backprojector import BackProjector, reconstruct_grids
from napari_gpu_relion.compute.expectation import pixel_set
from napari_gpu_relion.compute.maximization import fsc_from_backprojectors, reference_sigma2, ssnr_map
from napari_gpu_relion.compute.memory_model import (
    FINE_BYTES_PER_TRANSLATION_PIXEL,
    LOCAL_SLICE_BYTES_PER_PIXEL,
    LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE,
    PROJECT_BYTES_PER_POINT,
    UNION_BYTES_PER_FINE_PIXEL,
    union_bytes_per_orientation,
)
from napari_gpu_relion.compute.projector import prepare_reference
from napari_gpu_relion.compute.sampling import Sampling, local_candidates
from napari_gpu_relion.events import Message
from napari_gpu_relion.jobs import em, refine3d
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime.memory import (
    BATCH_FRACTION,
    GIB,
    SearchSpace,
    choose_padding,
    job_memory,
    mstep_bytes,
    plan_memory,
    prepare_bytes,
    refusal,
    union_budget,
)


def _peak(fn) -> int:
    """Peak bytes NumPy allocated while ``fn`` ran (tracemalloc sees NumPy's data buffers)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("pad", [1, 2])
def test_transient_bytes_are_the_measured_peaks(pad, monkeypatch):
    """The plan's transients bound the real peaks of the code, and not loosely (measured >= half the plan)."""
    box, slab = 64, 1 << 20
    monkeypatch.setattr(fourier, "SLAB_BYTES", slab)
    rng = np.random.default_rng(0)
    vol = rng.normal(size=(box,) * 3)
    prep = _peak(lambda: prepare_reference(vol, pad, r_max=box / 2, max_bytes=slab))
    bp = BackProjector(box, pad, box / 2)
    for a in (bp.data_re, bp.data_im, bp.weight):
        a[:] = rng.random(a.shape)
    tau2 = np.ones((1, box // 2 + 1))
    rec = _peak(lambda: reconstruct_grids(bp.data_re[None], bp.data_im[None], bp.weight[None], box, pad, 3,
                                          box / 2, tau2, 4.0, max_bytes=slab))
    fsc = _peak(lambda: fsc_from_backprojectors(bp, bp))
    shells = _peak(lambda: (reference_sigma2(bp), ssnr_map(bp, tau2[0], 4.0)))
    assert 0.5 * prepare_bytes(box, pad, slab_bytes=slab) <= prep <= prepare_bytes(box, pad, slab_bytes=slab)
    assert 0.5 * mstep_bytes(box, pad, slab_bytes=slab) <= rec <= mstep_bytes(box, pad, slab_bytes=slab)
    gold = mstep_bytes(box, pad, slab_bytes=slab, n_halves=2)
    assert 0.5 * gold <= max(rec, fsc) <= gold
    assert shells <= 2 * slab  # the shell sums are slab-wise: bounded by the slab budget, not the grid


def test_slab_wise_reconstruction_equals_the_whole_grid_one():
    """backprojector.reconstruct_grids in slabs of a few rows gives the map of one slab (to float32 rounding):
    independent of its slab budget, as results must be of batch and chunk sizes. A small r_max (an early
    iteration's) leaves most slabs wholly outside the sphere: they are skipped, with the same map."""
    rng = np.random.default_rng(2)
    for ndim, box, pad, r_max in ((3, 32, 2, 13), (3, 24, 1, 9), (2, 48, 2, 21), (3, 32, 2, 5), (2, 48, 2, 7)):
        bp = BackProjector(box, pad, r_max, ndim=ndim)
        for a in (bp.data_re, bp.data_im, bp.weight):
            a[:] = rng.normal(size=a.shape)
        bp.weight[:] = np.abs(bp.weight) * (rng.random(bp.weight.shape) > 0.2)
        tau2 = rng.random((1, box // 2 + 1)) + 0.1
        args = (bp.data_re[None], bp.data_im[None], bp.weight[None], box, pad, ndim, bp.r_max, tau2, 4.0)
        whole = reconstruct_grids(*args, max_bytes=1 << 40)
        slabs = reconstruct_grids(*args, max_bytes=1)
        np.testing.assert_allclose(slabs, whole, rtol=0, atol=1e-6 * np.abs(whole).max())


def test_skipped_slabs_give_the_same_map_bit_for_bit(monkeypatch):
    """The slabs reconstruct_grids skips (wholly outside the sphere) change nothing: the same float64 map, bit for
    bit, as the same slabs all computed, at an early iteration's small radius, in 3D and 2D."""
    from napari_gpu_relion.compute import backprojector  # noqa: PLC0415

    rng = np.random.default_rng(5)
    for ndim, box, pad, r_max in ((3, 32, 2, 5), (2, 48, 2, 7)):
        bp = BackProjector(box, pad, r_max, ndim=ndim)
        for a in (bp.data_re, bp.data_im, bp.weight):
            a[:] = rng.normal(size=a.shape)
        bp.weight[:] = np.abs(bp.weight)
        tau2 = rng.random((1, box // 2 + 1)) + 0.1
        args = (bp.data_re[None], bp.data_im[None], bp.weight[None], box, pad, ndim, bp.r_max, tau2, 4.0)
        P = pad * box
        lim2 = float(round(pad * r_max)) ** 2
        assert sum(backprojector.slab_outside_sphere(P, ndim, a, a + 1, lim2) for a in range(P)) > P // 2
        skipped = reconstruct_grids(*args, max_bytes=1, out_dtype=np.float64)
        with monkeypatch.context() as m:
            m.setattr(backprojector, "slab_outside_sphere", lambda *a: False)
            computed = reconstruct_grids(*args, max_bytes=1, out_dtype=np.float64)
        np.testing.assert_array_equal(skipped, computed)


def test_union_budget_by_hand():
    """runtime.memory.union_budget: the run's largest planned transient less the batch, one fine chunk and the
    projection's temporaries (2^24 points x 176 bytes = 2.75 GiB), at least BATCH_FRACTION (0.15) of what is left
    after the references and accumulators, at most what is left after the batch and the chunk."""
    g = int(GIB)
    proj = (1 << 24) * 176
    assert proj == int(2.75 * GIB)
    # box 800, pad 1 on an 80 GB GPU: 15.3 GiB held, the FSC pooling 18.7 GiB, batch 2 GiB, chunk 1.8 GiB:
    # 18.7 - 2 - 1.8 - 2.75 = 12.15 GiB, above 0.15 x 64.7 = 9.705 GiB
    held, transient, batch, chunk = int(15.3 * g), int(18.7 * g), 2 * g, int(1.8 * g)
    assert union_budget(80 * g, held, transient, batch, chunk) == transient - batch - chunk - proj
    assert union_budget(80 * g, held, transient, batch, chunk) / GIB == pytest.approx(12.15, abs=1e-6)
    # a small box: the plan's transient (0.55 GiB) is below the floor: 0.15 x (80 - 0.2) GiB
    assert union_budget(80 * g, int(0.2 * g), int(0.55 * g), int(0.7 * g), 2 * g) == \
        int(BATCH_FRACTION * (80 * g - int(0.2 * g)))
    # little free memory: what is left after the batch and the chunk, 4 - 3 - 0.5 - 0.25 GiB
    assert union_budget(4 * g, 3 * g, 10 * g, g // 2, g // 4) == g // 4
    assert union_budget(2 * g, 3 * g, 10 * g, g // 2, g // 4) == 0  # nothing left: one particle per group
    # the memory plan of an iteration carries it and says it
    kw = dict(box=800, ndim=3, pad=1, n_references=2, rows_per_particle=4608, translations=21, coarse_pixels=5000)
    plan = plan_memory(80 * g, largest_transient=transient, **kw)
    assert plan.union_bytes == union_budget(80 * g, plan.reference_bytes + plan.accumulator_bytes, transient,
                                            plan.batch * plan.bytes_per_particle, plan.fine_chunk_bytes)
    assert f"union of significant orientations at most {plan.union_bytes / GIB:.2f} GiB" in plan.describe()
    assert UNION_BYTES_PER_FINE_PIXEL == 24 and union_bytes_per_orientation(503_000) == 24 * 503_000
    # the run's largest transient is what JobMemory plans beside what it holds
    jm = job_memory(box=800, ndim=3, pad=1, n_classes=1, n_halves=2, budget_bytes=80 * g)
    assert jm.largest_transient == jm.peak - jm.held == max(jm.prepare, jm.reconstruct, jm.estep_minimum)


def test_union_bytes_per_fine_pixel_are_the_measured_peak(monkeypatch):
    """The E-step's union of significant orientations (estep._with_union_slices, then the zeroed sums of
    _FineSums.new_union) peaks at UNION_BYTES_PER_FINE_PIXEL per fine pixel per fine orientation, plus the
    projection's temporaries of one chunk (PROJECT_BYTES_PER_POINT per point); measured with tracemalloc on NumPy,
    with a small projection chunk so that the union's own bytes dominate."""
    chunk = 1 << 14
    monkeypatch.setattr(memory_model, "PROJECT_CHUNK_POINTS", chunk)
    box = 48
    vol = np.random.default_rng(0).normal(size=(box,) * 3)
    ref = prepare_reference(vol, 2, r_max=box / 2)
    pix_f = pixel_set(box, box)
    setup = estep.EStepSetup([ref], Sampling(order=1, offset_range=2, offset_step=2), pixel_set(box, 16), pix_f,
                             2.0, np.ones((1, box // 2 + 1)))
    b = SimpleNamespace(xp=np, setup=setup, n_orient=setup.sampling.n_orient)
    union = np.arange(0, setup.sampling.n_orient, 3)  # 192 coarse rows: 1536 fine orientations
    fine = estep._FineData(*[None] * 10)
    acc = estep._FineSums(*[None] * 14)
    held = []

    def make():
        g = estep._with_union_slices(b, fine, union)
        acc.new_union(b, union.size * g.n_children, union.size, pix_f.npix)
        held.append(g)

    peak = _peak(make)
    points = union.size * setup.sampling.n_children * pix_f.npix
    assert held[0].n_children == 8
    union_bytes = UNION_BYTES_PER_FINE_PIXEL * points  # measured: 24.1 bytes per point in all
    assert 0.95 * union_bytes <= peak <= 1.02 * union_bytes + PROJECT_BYTES_PER_POINT * chunk, peak / points


def test_local_search_slices_on_the_cpu_are_within_their_measured_bytes(monkeypatch):
    """A local search's coarse slices made by the array code (estep._gathered_coarse_slices on NumPy: the distinct
    rows projected, stacked, then gathered per particle) peak between the gathered result's own 12 bytes and
    LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE per (particle, candidate, pixel), plus one projection chunk's
    temporaries; measured with tracemalloc, with each particle at its own orientations."""
    chunk = 1 << 14
    monkeypatch.setattr(memory_model, "PROJECT_CHUNK_POINTS", chunk)
    box = 48
    ref = prepare_reference(np.random.default_rng(0).normal(size=(box,) * 3), 2, r_max=box / 2)
    smp = Sampling(order=3)
    angles = np.random.default_rng(1).uniform([-180, 0, -180], [180, 180, 180], (12, 3))
    cand, _ = local_candidates(angles, smp, 3.0, "C1")
    urows, pos = np.unique(np.where(cand >= 0, cand, 0), return_inverse=True)
    pos = pos.reshape(cand.shape)
    setup = SimpleNamespace(refs=[ref], ref_stack=ref, sampling=smp, mag=None)
    pix = pixel_set(box, 40)
    held = []
    peak = _peak(lambda: held.append(estep._gathered_coarse_slices(setup, urows, pos, pix)))
    points = pos.size * pix.npix
    assert urows.size > 0.5 * pos.size and held[0].stacked.shape[:2] == cand.shape
    assert 12 * points <= peak <= LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE * points + PROJECT_BYTES_PER_POINT * chunk, \
        peak / points


def test_local_searches_count_their_gathered_slices_in_the_batch():
    """The plan of a local search adds each particle's gathered coarse slices: 12 bytes per (row, pixel) on a GPU
    (the fused projection), the array code's 24 on the CPU; the batch shrinks by the same rule, and the budget of
    the union of significant orientations (after the slices are freed) does not count them."""
    kw = dict(box=192, ndim=3, pad=2, n_references=2, rows_per_particle=203, translations=49, coarse_pixels=14616)
    free = 100 * GIB
    for gpu, per_pixel in ((True, LOCAL_SLICE_BYTES_PER_PIXEL), (False, LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE)):
        plain = plan_memory(free, adaptive_chunks=gpu, **kw)
        local = plan_memory(free, adaptive_chunks=gpu, gathered_slices=True, **kw)
        assert local.bytes_per_particle - plain.bytes_per_particle == per_pixel * 203 * 14616
        left = free - local.reference_bytes - local.accumulator_bytes
        assert local.batch == min(plain.batch, int(BATCH_FRACTION * left // local.bytes_per_particle))
        assert local.batch < plain.batch
        # the slices are freed before the fine passes: the union's budget sees the batch without them
        assert local.union_bytes == union_budget(free, local.reference_bytes + local.accumulator_bytes, 0,
                                                 local.batch * plain.bytes_per_particle, local.fine_chunk_bytes)


def test_the_whole_run_plan_counts_a_local_searchs_slices():
    """The one-particle E-step of a run that searches locally (SearchSpace.particle_bytes) adds its rows' gathered
    slices at the full image size, at the array code's bytes; a global search's coarse bytes do not."""
    kw = dict(ndim=3, n_classes=1, offset_range=2, offset_step=1, order=5)
    glob, loc = SearchSpace(**kw), SearchSpace(local_sigma=1.88, **kw)
    box = 64
    pixels = box * (box // 2 + 1)
    assert glob.particle_bytes(box)[0] == memory_model.estep_bytes_per_particle(glob.rows, glob.translations, box,
                                                                                pixels)
    assert loc.particle_bytes(box)[0] == (memory_model.estep_bytes_per_particle(loc.rows, loc.translations, box,
                                                                                pixels)
                                          + LOCAL_SLICE_BYTES_PER_PIXEL_ARRAY_CODE * loc.rows * pixels)
    assert loc.particle_bytes(box)[1] == glob.particle_bytes(box)[1]


def test_plan_of_large_boxes_by_hand():
    """Box 1024, pad 2, auto-refine (2 halves, 1 class): the half grid is 2048 x 2048 x 1025 voxels; a complex64
    reference is 8 bytes per voxel = 32.03 GiB per half, the accumulators 3 x 8 bytes = 96.09 GiB per half.
    Pad 1: 1024 x 1024 x 513 voxels, 4.01 and 12.02 GiB per half."""
    two = job_memory(box=1024, ndim=3, pad=2, n_classes=1, n_halves=2, budget_bytes=int(80 * GIB))
    assert two.references / GIB == pytest.approx(2 * 32.031, abs=0.01)
    assert two.accumulators / GIB == pytest.approx(2 * 96.094, abs=0.01)
    assert not two.fits
    one = job_memory(box=1024, ndim=3, pad=1, n_classes=1, n_halves=2, budget_bytes=int(80 * GIB))
    assert one.references / GIB == pytest.approx(2 * 4.008, abs=0.01)
    assert one.accumulators / GIB == pytest.approx(2 * 12.023, abs=0.01)


def test_padding_falls_back_to_one_and_says_so():
    kw = dict(box=512, ndim=3, n_classes=1, n_halves=2)
    one = job_memory(pad=1, budget_bytes=0, **kw)
    plan, note = choose_padding(2, budget_bytes=one.peak + 1, **kw)
    assert plan.pad == 1 and plan.fits and "running with --pad 1" in note
    plan, note = choose_padding(2, budget_bytes=int(1e15), **kw)
    assert plan.pad == 2 and note is None
    plan, note = choose_padding(2, budget_bytes=one.peak - 1, **kw)  # neither fits: the pad-2 plan, refused
    assert plan.pad == 2 and not plan.fits and note is None
    line = refusal(job_memory(pad=2, box=256, ndim=3, n_classes=4, n_halves=1, budget_bytes=int(2 * GIB)),
                   "class3d")
    assert "\n" not in line and "--pad 1 needs" in line and "--K " in line and "2.0 GiB are available" in line


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_sample_data(tmp_path_factory.mktemp("mem"), box=64, angpix=4.0, n_particles=8, snr=0.2,
                            diameter=200.0, ini_high=60.0, n_micrographs=0)


def test_a_job_that_cannot_fit_is_refused_before_it_writes(data, tmp_path, capsys):
    out = tmp_path / "Refine3D" / "run"
    code = cli.main(["refine3d", "--i", str(data / "particles.star"), "--ref", str(data / "reference.mrc"),
                     "--o", str(out), "--cpu", "--memory_limit", "0.05"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "cannot fit" in err[0] and "0.1 GiB are available" not in err[0] and "0.0 GiB are available" in err[0]
    assert "--pad 1 needs" in err[0]
    assert not out.parent.exists()  # nothing written


def test_a_budget_for_pad_one_only_runs_with_pad_one(data, tmp_path):
    """The job-level fallback: with a budget that holds the pad-1 plan but not pad 2, the job says so and runs
    its grids with pad 1 (checked on the job object before iteration 1: no EM work needed)."""
    one = job_memory(box=64, ndim=3, pad=1, n_classes=1, n_halves=2, budget_bytes=0, rows_per_particle=1)
    two = job_memory(box=64, ndim=3, pad=2, n_classes=1, n_halves=2, budget_bytes=0, rows_per_particle=1)
    assert two.peak > one.peak
    p = refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=tmp_path / "r" / "run", cpu=True,
                        memory_limit=(one.peak + 1) / GIB)
    job = refine3d.Refine3D(p)
    job.model = job.initial_model()
    msgs = list(job.plan_job_memory())
    assert job.p.pad == 1 and job.job_memory.pad == 1
    assert len(msgs) == 1 and isinstance(msgs[0], Message) and "--pad 1" in msgs[0].text
    assert isinstance(job, em.EMJob)


def test_fine_chunk_bytes_per_translation_pixel_are_the_measured_peak():
    """A fine-pass chunk's per-particle part (the image at every fine translation: particle_terms for the scores,
    then fine_sums' back-projection terms and sums over orientations, as estep._fine_chunk calls them) peaks at
    FINE_BYTES_PER_TRANSLATION_PIXEL per (particle, fine translation, fine pixel); measured with tracemalloc, with
    few orientations so that the translation-expanded arrays dominate (before this was bounded: 40.5 bytes)."""
    rng = np.random.default_rng(0)

    def c64(*s):
        return (rng.normal(size=s) + 1j * rng.normal(size=s)).astype(np.complex64)

    I, T, K, n = 4, 200, 8000, 4
    X, Xu, ramps, P = c64(I, K), c64(I, K), c64(T, K), c64(n, K)
    ctf = rng.random((I, K)).astype(np.float32)
    w = rng.random((I, K)).astype(np.float32)
    W = rng.random((I, T, n)).astype(np.float32)

    def chunk():
        terms = expectation.particle_terms(X, ctf, w, ramps)
        expectation.scores_shared(P, terms)
        del terms
        expectation.fine_sums(W, P, X, Xu, ctf, w, ramps)

    per = _peak(chunk) / (I * T * K)
    assert 0.95 * FINE_BYTES_PER_TRANSLATION_PIXEL <= per <= 1.08 * FINE_BYTES_PER_TRANSLATION_PIXEL, per


def test_fine_chunks_count_each_particles_translations_by_hand():
    """plan_fine_chunks: a chunk grows while particles x (largest count x children x bytes per sample + bytes
    per particle) fits the budget: with 10 fine translations and 100 pixels, a sample is 10 x 40 + 100 x 24 =
    2,800 bytes and a particle's image at every translation 10 x 100 x 12 = 12,000 bytes."""
    per_sample, per_particle = 10 * 40 + 100 * 24, 10 * 100 * FINE_BYTES_PER_TRANSLATION_PIXEL
    assert memory_model.fine_bytes_per_sample(10, 100) == per_sample
    assert memory_model.fine_bytes_per_particle(10, 100) == per_particle
    counts = np.array([1, 1, 1, 2, 2, 5])
    one = 1 * 8 * per_sample + per_particle  # 34,400 bytes for a particle with one significant row
    chunks = estep.plan_fine_chunks(counts, 8, 10, 100, max_bytes=3 * one)
    # ranks 0-2 (3 x 34,400); ranks 3-4 (2 x (2 x 22,400 + 12,000) = 113,600 > 103,200? no: 2 x 56,800 = 113,600
    # does not fit, so rank 3 alone, then rank 4 alone); rank 5 alone
    assert chunks == [(0, 3), (3, 4), (4, 5), (5, 6)]
    without = estep.plan_fine_chunks(counts, 8, 10, 100, max_bytes=3 * 1 * 8 * per_sample)  # the old rule's budget
    assert without[0] == (0, 1)  # a particle's translations alone now exceed a third of it


def test_fine_chunks_share_the_slices_of_a_union_most_of_which_each_particle_scores():
    """When a chunk's largest count is at least half its group's union (iteration 1: flat posteriors), the chunk
    is certain to share its rows (estep._chunk_layout), so plan_fine_chunks counts the union's slices once and
    every particle's scores over the whole union: with 10 fine translations, 100 pixels and 8 children, a
    union of 12 rows costs 12 x 8 x 2,400 = 230,400 bytes of slices once and 12 x 8 x 400 + 12,000 = 50,400
    bytes per particle, so a 1,000,000-byte budget holds 15 particles (4 when each had its own slices:
    10 x 8 x 2,800 + 12,000 = 236,000 each). With counts below half the union the gathered rule stays."""
    assert memory_model.fine_bytes_per_score(10) == 400 and memory_model.fine_bytes_per_slice(100) == 2400
    flat = np.full(40, 10)
    assert estep.plan_fine_chunks(flat, 8, 10, 100, 1_000_000, n_union=12) == [(0, 15), (15, 30), (30, 40)]
    assert estep.plan_fine_chunks(flat, 8, 10, 100, 1_000_000) == [(a, min(a + 4, 40)) for a in range(0, 40, 4)]
    assert estep.fine_chunk_bytes(15, 10, 12, 8, 400, 2400, 12_000) == 230_400 + 15 * 50_400
    sharp = np.full(8, 5)  # 2 x 5 < 12: the layout is not certain, each particle is counted with its own slices
    assert estep.plan_fine_chunks(sharp, 8, 10, 100, 1_000_000, n_union=12) == \
        estep.plan_fine_chunks(sharp, 8, 10, 100, 1_000_000) == [(0, 8)]
    assert estep.fine_chunk_bytes(8, 5, 12, 8, 400, 2400, 12_000) == 8 * (5 * 8 * 2800 + 12_000)


def test_stacked_shifted_images_are_the_complex_products(monkeypatch):
    """Against float64 complex products to float32 rounding; with NumPy exactly NumPy's complex64 products,
    whatever the block of particles each is made in (blocks of 1 and of 2 particles: the same bits)."""
    rng = np.random.default_rng(1)
    g = (rng.normal(size=(3, 50)) + 1j * rng.normal(size=(3, 50))).astype(np.complex64)
    ramps = np.exp(1j * rng.uniform(0, 2 * np.pi, size=(7, 50))).astype(np.complex64)
    exact = g[:, None, :].astype(np.complex128) * ramps[None].astype(np.complex128)
    got = expectation.stacked_shifted(g, ramps)
    np.testing.assert_allclose(got, expectation.stack_complex(exact).astype(np.float64), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got, expectation.stack_complex(g[:, None, :] * ramps[None]))
    for per_block in (1, 2):
        monkeypatch.setattr(expectation, "CPU_SHIFT_BLOCK_BYTES", per_block * 7 * 50 * 8)
        np.testing.assert_array_equal(expectation.stacked_shifted(g, ramps, width=112), np.concatenate(
            [got, np.zeros((3, 7, 12), np.float32)], axis=-1))
    U = rng.normal(size=(3, 7, 100)).astype(np.float32)
    direct = ((U[..., :50].astype(np.complex128) - 1j * U[..., 50:]) * ramps[None]).sum(axis=1)
    np.testing.assert_allclose(expectation.sum_conj_shifted(U, ramps), direct, rtol=0, atol=1e-5)


def test_a_reader_holds_a_share_of_the_host_memory_within_its_bounds():
    """runtime.memory.read_ahead_bytes: 5 % of the available host memory shared by the host's ranks, never below
    256 MiB (below 5 GiB available: what the reader always had) nor above 2 GiB; a GPU node of 128 GB reads more
    than one box-256 batch (1,749 images of 256 KiB) ahead."""
    from napari_gpu_relion.runtime.memory import read_ahead_bytes

    GiB = 1 << 30
    assert read_ahead_bytes(4 * GiB) == 256 << 20
    assert read_ahead_bytes(8 * GiB) == int(0.05 * 8 * GiB)
    assert read_ahead_bytes(0) == 256 << 20
    assert read_ahead_bytes(20 * GiB) == GiB
    assert read_ahead_bytes(20 * GiB, ranks_on_host=2) == GiB // 2
    assert read_ahead_bytes(120 * GiB) == 2 * GiB
    assert read_ahead_bytes(120 * GiB, ranks_on_host=8) == int(0.05 * 120 * GiB / 8)
    assert read_ahead_bytes(120 * GiB) > 1749 * 256 * 256 * 4


def test_a_reader_that_uploads_holds_what_the_gpu_has_room_for():
    """runtime.memory.device_read_ahead_bytes: the host's bound, at most a quarter of what the plan leaves free on
    the GPU once the image store is made, and no uploads by the reader (0) where that is under the bound a reader
    started before the store keeps (READ_AHEAD_MIN_BYTES: bounds are never lowered)."""
    from napari_gpu_relion.runtime.memory import device_read_ahead_bytes

    GiB = 1 << 30
    assert device_read_ahead_bytes(2 * GiB, 100 * GiB) == 2 * GiB
    assert device_read_ahead_bytes(2 * GiB, 4 * GiB) == GiB
    assert device_read_ahead_bytes(2 * GiB, 200 << 20) == 0
    assert device_read_ahead_bytes(2 * GiB, 800 << 20) == 0  # 200 MiB: less than the first reader's 256 MiB
    assert device_read_ahead_bytes(2 * GiB, 1 << 30) == 256 << 20
    assert device_read_ahead_bytes(2 * GiB, -GiB) == 0


def test_maps_come_back_pinned_only_within_their_share_of_the_host_memory():
    """runtime.memory.pinned_maps_ok: three sets of an M-step's maps within 2 % of the host's available memory
    shared by its ranks: six box-256 float32 maps (403 MB) on a 256 GB GPU host, not on a 16 GB laptop, nor with
    eight ranks on a 128 GB host; never an empty set."""
    from napari_gpu_relion.runtime.memory import pinned_maps_ok

    GiB = 1 << 30
    six_256 = 6 * 256**3 * 4
    assert pinned_maps_ok(six_256, 240 * GiB)
    assert not pinned_maps_ok(six_256, 16 * GiB)
    assert not pinned_maps_ok(six_256, 120 * GiB, ranks_on_host=8)
    assert pinned_maps_ok(200 * 360 * 360 * 4, 16 * GiB)  # class2d K=200 at box 360: 104 MB
    assert not pinned_maps_ok(0, 240 * GiB)


def test_host_memory_is_the_nodes_available_or_less_under_a_memory_cgroup(tmp_path):
    """runtime.device.host_available_bytes: MemAvailable from meminfo, or the room a memory cgroup (a SLURM job's,
    a container's) leaves, limit minus use less the inactive page cache, where that is less (cgroup v2 and v1); no
    limit ("max", v1's huge number) leaves MemAvailable; 4 GiB when nothing can be read."""
    from napari_gpu_relion.runtime.device import host_available_bytes

    GiB = 1 << 30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {256 * GiB // 1024} kB\nMemAvailable: {200 * GiB // 1024} kB\n")
    v2, v1, none = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{32 * GiB}\n")
    (v2 / "memory.current").write_text(f"{12 * GiB}\n")
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{16 * GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{4 * GiB}\n")
    (v2 / "memory.stat").write_text(f"anon {10 * GiB}\ninactive_file {2 * GiB}\nactive_file 0\n")
    none.mkdir()
    (none / "memory.max").write_text("max\n")
    (none / "memory.current").write_text(f"{4 * GiB}\n")
    assert host_available_bytes(meminfo, v2) == 22 * GiB  # 32 - (12 - 2 of page cache it may reclaim)
    assert host_available_bytes(meminfo, v1) == 12 * GiB
    assert host_available_bytes(meminfo, none) == 200 * GiB
    assert host_available_bytes(meminfo, tmp_path / "absent") == 200 * GiB
    assert host_available_bytes(tmp_path / "absent", v2) == 22 * GiB
    assert host_available_bytes(tmp_path / "absent", tmp_path / "absent") == 4 * GiB


def test_host_memory_follows_the_processs_own_cgroup_and_the_ones_above_it(tmp_path):
    """A SLURM job's limit sits on the job's cgroup, above the step and task the process runs in: the cgroup path
    of /proc/self/cgroup is walked up to the root, and the least room of any limit counts (v2 here; v1's memory
    controller likewise under memory/)."""
    from napari_gpu_relion.runtime import device

    GiB = 1 << 30
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    job = root / "system.slice" / "slurmstepd.scope" / "job_7"
    task = job / "step_0" / "user" / "task_0"
    task.mkdir(parents=True)
    (task / "memory.max").write_text("max\n")
    (task / "memory.current").write_text(f"{GiB}\n")
    (job / "memory.max").write_text(f"{16 * GiB}\n")
    (job / "memory.current").write_text(f"{6 * GiB}\n")
    proc.write_text("0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n")
    folders = device._own_cgroups(root, proc)
    assert (task, "v2") in folders and (job, "v2") in folders and (root, "v2") in folders
    rooms = [r for r in (device._cgroup_room(f, k) for f, k in folders) if r is not None]
    assert rooms == [10 * GiB]

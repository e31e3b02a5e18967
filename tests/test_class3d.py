"""3D classification on a simulated two-state mixture with ground truth (CI-sized), its report, and its input
checks. The full-size global-search check is benchmarks/science_class3d.py (GPU, results/ JSON) and
tests/test_gpu.py::test_class3d_global_search_separates_two_states."""

import re
from pathlib import Path

import numpy as np
import pytest
import starfile

from napari_gpu_relion.compute.estep import prepare_batch
from napari_gpu_relion.compute.fourier import irfft_centered, phase_shift_2d, rfft_centered
from napari_gpu_relion.compute.ground_truth import class_assignment_report
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.events import Finished
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import class3d, em
from napari_gpu_relion.jobs.simulate import make_sample_data


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """600 particles, 50/50 from two conformations (the phantom, and the phantom without the quarter of its
    atoms around its outermost atom), box 32 at 6 Å/px, CTF, offsets, one noise level, SNR 0.2. Per Fourier
    component below 12 Å this is the information of SNR 0.05 at box 64 and 3 Å/px (4x the pixels)."""
    return make_sample_data(tmp_path_factory.mktemp("mixture"), box=32, angpix=6.0, n_particles=600, snr=0.2,
                            diameter=134.4, ini_high=60.0, n_micrographs=0, conformations=2)


def _classify(data: Path, out: Path, K: int) -> tuple[Finished, object, object]:
    p = class3d.Params(i=data / "particles.star", ref=data / "truth.mrc", o=out / "run", K=K, iter=20, ctf=True,
                       skip_align=True, particle_diameter=150.0, flatten_solvent=True, zero_mask=True, cpu=True)
    fin = [e for e in class3d.run(p) if isinstance(e, Finished)][0]
    truth = starfile.read(data / "particles_truth.star")["particles"]
    got = starfile.read(out / "run_it020_data.star")["particles"]
    # same particles in the same order (the output lies elsewhere, so its stack paths are absolute)
    assert (got["rlnImageName"].str.split("@").str[0] == truth["rlnImageName"].str.split("@").str[0]).all()
    assert got["rlnImageName"].iloc[0].endswith("particles/particles.mrcs")
    rep = class_assignment_report(got["rlnClassNumber"].to_numpy() - 1, truth["rlnClassNumber"].to_numpy() - 1, K)
    return fin, rep, (truth, got)


@pytest.mark.slow
def test_class3d_two_classes_separate_two_states(mixture, tmp_path):
    """K=2 with --skip_align: >= 95 % of the particles in the class of their own state; the input angles and
    offsets are kept exactly; the model STAR's class distribution matches the particle counts."""
    fin, rep, (truth, got) = _classify(mixture, tmp_path / "k2", 2)
    assert rep.accuracy >= 0.95, rep
    assert sorted(rep.label.tolist()) == [0, 1]  # one class per state
    for c in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst"):
        np.testing.assert_allclose(got[c].to_numpy(), truth[c].to_numpy(), atol=1e-4)
    model = starfile.read(tmp_path / "k2" / "run_it020_model.star")
    dist = model["model_classes"]["rlnClassDistribution"].to_numpy()
    assert abs(dist.sum() - 1) < 1e-6
    np.testing.assert_allclose(dist, rep.sizes / rep.sizes.sum(), atol=0.03)
    assert "no empty class" in fin.summary
    # go on from this run's classes: --ref its model STAR (one map per class, K from the list, no seeding)
    p = class3d.Params(i=mixture / "particles.star", ref=tmp_path / "k2" / "run_it020_model.star",
                       o=tmp_path / "again" / "run", K=1, iter=2, ctf=True, skip_align=True, particle_diameter=150.0,
                       ini_high=-1.0, flatten_solvent=True, zero_mask=True, cpu=True)
    events = list(class3d.run(p))
    assert not any("seeding" in getattr(e, "text", "") for e in events)
    # the fixed cost before iteration 1 (benchmarks/scaling.py reads it): its steps within it, itself within the job
    line = next(e.text for e in events if "start-up:" in getattr(e, "text", ""))
    steps = [float(v) for v in re.findall(r"([\d.]+) s", line)]
    assert line.startswith("  start-up: ") and sum(steps[1:]) <= steps[0] + 0.02, line
    assert steps[0] < float(re.search(r"in (\d+) s", events[-1].summary)[1]) + 1, (line, events[-1].summary)
    again = starfile.read(tmp_path / "again" / "run_it002_data.star")["particles"]
    assert (again["rlnClassNumber"].to_numpy() == got["rlnClassNumber"].to_numpy()).mean() >= 0.98


@pytest.mark.slow
def test_class3d_three_classes_report_the_split_or_empty_class(mixture, tmp_path):
    """K=3 on two states: >= 95 % accuracy (each class labelled by its majority state); one class empties or
    a state splits over two classes, and the job's report names that pair as the most alike."""
    fin, rep, _ = _classify(mixture, tmp_path / "k3", 3)
    assert rep.accuracy >= 0.95, rep
    assert rep.empty_classes or rep.split_states, rep
    if rep.split_states:
        s = rep.split_states[0]
        pair = sorted(k + 1 for k in range(3) if rep.label[k] == s and k not in rep.empty_classes)
        assert f"most alike: classes {pair[0]} and {pair[1]}" in fin.summary, fin.summary
    else:
        assert f"empty class(es): {rep.empty_classes[0] + 1}" in fin.summary, fin.summary


def test_subpixel_preparation_moves_the_particle_to_its_exact_offset():
    """--skip_align pre-shifts each image by its full (fractional) offset: a band-limited image whose content
    sits at -t comes back to the centre (the origin sign convention: rlnOrigin = t re-centres it). The particle is
    compact and smooth (Gaussian blobs of 2 px within 6 px of the centre: band-limited to float precision, so
    Fourier shifts are exact, and zero at the box edges, so the zero-filled whole-pixel shift loses nothing)."""
    rng = np.random.default_rng(3)
    N = 32
    yy, xx = np.mgrid[:N, :N] - N // 2
    centred = np.zeros((4, N, N))
    for i in range(4):
        for cx, cy, a in zip(rng.uniform(-6, 6, 5), rng.uniform(-6, 6, 5), rng.normal(size=5), strict=True):
            centred[i] += a * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * 2.0**2))
    F = rfft_centered(centred, 2)
    t = np.array([[0.3, -1.7], [2.5, 0.25], [-0.6, 0.6], [1.0, 0.0]])
    moved = irfft_centered(phase_shift_2d(F, -t, N), N, 2)  # the particle sits at -t
    prep = prepare_batch(moved.astype(np.float32), np.ones(4), t, mask_radius_px=N, subpixel=True)
    back = irfft_centered(prep.F_unmasked, N, 2)
    assert np.abs(back - centred).max() < 1e-4 * np.abs(centred).max()
    np.testing.assert_array_equal(prep.rounded_offsets, t)


def test_class3d_rejects_bad_input_before_work(mixture, tmp_path):
    """K < 1, K larger than the number of particles, and particles of different image sizes."""
    kw = dict(i=mixture / "particles.star", ref=mixture / "reference.mrc", o=tmp_path / "c" / "run", cpu=True)
    with pytest.raises(InputError, match="--K must be at least 1"):
        class3d.Params(K=0, **kw)
    with pytest.raises(InputError, match="larger than the number of particles"):
        list(class3d.run(class3d.Params(K=601, **kw)))
    star = starfile.read(mixture / "particles.star")
    optics = star["optics"]
    two = pd_concat_optics(optics)
    parts = star["particles"].copy()
    parts.loc[parts.index[:10], "rlnOpticsGroup"] = 2
    bad = tmp_path / "mixed.star"
    starfile.write({"optics": two, "particles": parts}, bad)
    with pytest.raises(InputError, match="rlnImageSize"):
        list(class3d.run(class3d.Params(i=bad, ref=mixture / "reference.mrc", o=tmp_path / "d" / "run", cpu=True)))
    assert not (tmp_path / "c" / "run_it001_data.star").exists()
    assert not (tmp_path / "d" / "run_it001_data.star").exists()


def pd_concat_optics(optics):
    import pandas as pd

    g2 = optics.copy()
    g2["rlnOpticsGroup"] = 2
    g2["rlnOpticsGroupName"] = "opticsGroup2"
    g2["rlnImageSize"] = 48
    return pd.concat([optics, g2], ignore_index=True)


@pytest.mark.slow
def test_class3d_continue_repeats_the_uninterrupted_run(mixture, tmp_path):
    """--continue run_it002_optimiser.star (to --iter 4) gives the classes and maps of 4 uninterrupted iterations."""
    kw = dict(i=mixture / "particles.star", ref=mixture / "truth.mrc", K=2, ctf=True, skip_align=True,
              particle_diameter=150.0, flatten_solvent=True, zero_mask=True, cpu=True)
    list(class3d.run(class3d.Params(o=tmp_path / "full" / "run", iter=4, **kw)))
    list(class3d.run(class3d.Params(o=tmp_path / "part" / "run", iter=2, **kw)))
    events = list(class3d.run(class3d.Params(continue_from=tmp_path / "part" / "run_it002_optimiser.star", iter=4,
                                             cpu=True)))
    assert "continuing after iteration 2" in events[0].message
    assert not (tmp_path / "part" / "run_it005_data.star").exists()
    a = starfile.read(tmp_path / "full" / "run_it004_data.star")["particles"]["rlnClassNumber"].to_numpy()
    b = starfile.read(tmp_path / "part" / "run_it004_data.star")["particles"]["rlnClassNumber"].to_numpy()
    np.testing.assert_array_equal(a, b)
    for k in (1, 2):
        ma = read_mrc(tmp_path / "full" / f"run_it004_class00{k}.mrc").data
        mb = read_mrc(tmp_path / "part" / f"run_it004_class00{k}.mrc").data
        np.testing.assert_allclose(mb, ma, atol=1e-5 * np.abs(ma).max())


@pytest.mark.slow
def test_class3d_firstiter_cc_copies_class_one_then_seeds(mixture, tmp_path):
    """--firstiter_cc: iteration 1 puts every particle in class 1 (CC, no noise/offset-sigma update), writes class 1
    to both classes with 50/50 distribution; iteration 2 seeds each particle into one random class; the run then
    separates the states as without CC."""
    p = class3d.Params(i=mixture / "particles.star", ref=mixture / "truth.mrc", o=tmp_path / "cc" / "run", K=2, iter=12,
                       ctf=True, skip_align=True, firstiter_cc=True, particle_diameter=150.0, flatten_solvent=True,
                       zero_mask=True, cpu=True)
    list(class3d.run(p))
    d1 = starfile.read(tmp_path / "cc" / "run_it001_data.star")["particles"]["rlnClassNumber"].to_numpy()
    assert (d1 == 1).all()
    m1 = starfile.read(tmp_path / "cc" / "run_it001_model.star")
    np.testing.assert_allclose(m1["model_classes"]["rlnClassDistribution"].to_numpy(), [0.5, 0.5])
    assert float(m1["model_general"]["rlnSigmaOffsetsAngst"]) == p.offset  # not updated by a CC iteration
    a, b = (read_mrc(tmp_path / "cc" / f"run_it001_class00{k}.mrc").data for k in (1, 2))
    np.testing.assert_array_equal(a, b)
    d2 = starfile.read(tmp_path / "cc" / "run_it002_data.star")["particles"]["rlnClassNumber"].to_numpy()
    assert 0.4 <= (d2 == 1).mean() <= 0.6
    truth = starfile.read(mixture / "particles_truth.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    got = starfile.read(tmp_path / "cc" / "run_it012_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    rep = class_assignment_report(got, truth, 2)
    assert rep.accuracy >= 0.95, rep


@pytest.mark.slow
def test_class3d_orientation_distributions_follow_relions_convention(mixture, tmp_path):
    """A global search (HEALPix order 0): each class's rlnOrientationDistribution in the model STAR sums to its
    rlnClassDistribution, as in RELION's files (its E-step takes pdf_direction as the prior of class and direction
    together; RELION 5.0.1's run_it001_model.star of a K=2 class3d sums to 0.506664 and 0.493328 for
    distributions 0.506667 and 0.493333), and a --continue that reads them back repeats the uninterrupted run."""
    kw = dict(i=mixture / "particles.star", ref=mixture / "truth.mrc", K=2, ctf=True, healpix_order=0,
              offset_range=2.0, offset_step=2.0, particle_diameter=150.0, flatten_solvent=True, zero_mask=True,
              cpu=True)
    list(class3d.run(class3d.Params(o=tmp_path / "full" / "run", iter=2, **kw)))
    list(class3d.run(class3d.Params(o=tmp_path / "part" / "run", iter=1, **kw)))
    model = starfile.read(tmp_path / "part" / "run_it001_model.star")
    dist = model["model_classes"]["rlnClassDistribution"].to_numpy()
    sums = [model[f"model_pdf_orient_class_{k}"]["rlnOrientationDistribution"].sum() for k in (1, 2)]
    assert min(dist) > 0.05  # both classes alive, so the test tells the conventions apart
    np.testing.assert_allclose(sums, dist, rtol=1e-5)
    opt = tmp_path / "part" / "run_it001_optimiser.star"
    # --iter on a --continue: as given, the default value (25) included, for this run started with --iter 1
    for given in (2, 25):
        assert em.continued_params(class3d.Params, class3d.Params(continue_from=opt, iter=given))[0].iter == given
    list(class3d.run(class3d.Params(continue_from=opt, iter=2, cpu=True)))
    a = starfile.read(tmp_path / "full" / "run_it002_data.star")["particles"]
    b = starfile.read(tmp_path / "part" / "run_it002_data.star")["particles"]
    np.testing.assert_array_equal(a["rlnClassNumber"].to_numpy(), b["rlnClassNumber"].to_numpy())
    np.testing.assert_allclose(b["rlnAngleTilt"].to_numpy(), a["rlnAngleTilt"].to_numpy(), atol=1e-3)


def test_a_new_job_starts_from_relions_setup_draw_of_the_perturbation(mixture, tmp_path):
    """A new job's state holds the perturbation RELION draws when it sets up its sampling (iteration 0), so that
    iteration 1's is the second draw; RELION draws it before it seeds the C library, so it is the same for every
    seed (0.460047 in RELION 5.0.1's run_it000_sampling.star with --random_seed 1-4)."""
    for seed in (1, 2):
        p = class3d.Params(i=mixture / "particles.star", ref=mixture / "reference.mrc", o=tmp_path / f"s{seed}" / "run",
                           K=2, iter=1, cpu=True, random_seed=seed)
        job = class3d.Class3D(p)
        assert job.state.iteration == 0 and job.state.perturb == pytest.approx(0.460047, abs=6e-7)

"""Absurd values (issue 50): searches far beyond the machine, translation ranges beyond the box, HEALPix orders
beyond RELION's, particle images with absurd finite values or not normalised. Each must end in ONE line on stderr
naming what is wrong and what to change, exit code 2, no traceback, before any work (no output folder, no map);
with --dont_check_norm the normalisation check becomes a warning and the job finishes.

The thresholds and where they come from: runtime/memory.py (SearchSpace, refusal), compute/sampling.py
(RELION_MAX_HEALPIX_ORDER, check_offset_search) and io/particle_images.py (MAX_ABS_PIXEL, RELION's normalisation
check: NORM_MAX_MEAN_IN_STDDEV, NORM_STDDEV_BAND).
"""

from __future__ import annotations

import re
from pathlib import Path

import mrcfile
import numpy as np
import pytest
from cli_cases import fails, run_cli

from napari_gpu_relion.compute import expectation
from napari_gpu_relion.compute.sampling import InPlaneSampling, Sampling, translation_grid
from napari_gpu_relion.io.particle_images import check_normalisation, norm_check_rows
from napari_gpu_relion.io.star import read_particles
from napari_gpu_relion.jobs import simulate
from napari_gpu_relion.jobs.simulate import sample_data_dir
from napari_gpu_relion.runtime.memory import GIB, SearchSpace, job_memory, refusal, translation_count

APIX = 6.0
SIM = dict(n_particles=8, box=16, angpix=APIX, diameter=60.0, n_micrographs=0)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return simulate.make_sample_data(tmp_path_factory.mktemp("values") / "d", **SIM)


def _em(job: str, data: Path, out: Path, *extra) -> list:
    argv = [job, "--i", data / "particles.star", "--o", out / "run", "--cpu", "--iter", "1"]
    if job != "class2d":
        argv += ["--ref", data / "reference.mrc"]
    if job == "refine3d":
        argv.remove("--iter")
        argv.remove("1")
        argv += ["--auto_iter_max", "1"]
    return argv + (["--K", "2"] if job != "refine3d" else []) + list(extra)


def _edit_stack(data: Path, edit) -> None:
    with mrcfile.open(data / "particles" / "particles.mrcs", mode="r+") as m:
        d = np.array(m.data)
        edit(d)
        m.data[:] = d


def _mean_in(line: str) -> float:
    """The background mean a normalisation message gives."""
    return float(re.search(r"has mean (\S+) and stddev", line).group(1))


def _nothing_written(out: Path) -> None:
    assert not out.exists() or not [q for q in out.rglob("*") if q.is_file()], list(out.rglob("*"))


# ------------------------------------------------------------------------------------------------------------
# searches beyond the machine, ranges beyond the box, orders beyond RELION's


def test_healpix_order_8_is_refused_before_work_with_the_numbers(sample, tmp_path, capsys):
    """Box 16, 2 classes at HEALPix order 8: 1.2e9 orientations x 21 translations, 567 GiB per particle for the
    coarse scores alone (and terabytes of coarse slices): refused before iteration 1 (no folder) with the GiB and
    the finest order that would fit."""
    out = tmp_path / "c3"
    line = fails(capsys, _em("class3d", sample, out, "--healpix_order", "8"), "class3d cannot fit even one "
                  "particle per E-step batch", "HEALPix order 8", "1,207,959,552 orientations", "21 translations",
                  "567.0 GiB per particle", "GiB are available", "--healpix_order ")
    assert "coarse slices" in line and "needs" in line
    _nothing_written(out)


def test_a_search_too_large_for_the_memory_limit_names_what_would_fit(sample, tmp_path, capsys):
    """2D: 8 classes x 3600 psi x 20,081 translations is 6.5 GiB per particle; with --memory_limit 2 the job is
    refused and told the in-plane step that fits; the plan's arithmetic is the refusal's."""
    out = tmp_path / "c2"
    line = fails(capsys, _em("class2d", sample, out, "--K", "8", "--psi_step", "0.1", "--offset_range", "8",
                              "--offset_step", "0.1", "--memory_limit", "2"),
                  "class2d cannot fit even one particle", "3,600 orientations", "2.0 GiB are available",
                  "--psi_step ")
    s = SearchSpace(2, 8, 8.0, 0.1, psi_step=0.1)
    assert s.translations == translation_grid(8.0, 0.1).shape[0] == 20_081
    assert f"{s.particle_bytes(16)[0] / GIB:.1f} GiB per particle" in line
    _nothing_written(out)


def test_refusal_suggests_an_order_whose_plan_fits():
    plan = job_memory(box=64, ndim=3, pad=2, n_classes=4, n_halves=1, budget_bytes=int(8 * GIB),
                      search=SearchSpace(3, 4, 5.0, 2.0, order=7, first_size=32, pixel_size=2.0, diameter_A=100.0))
    assert not plan.fits and plan.held + max(plan.prepare, plan.reconstruct) <= plan.budget_bytes
    line = refusal(plan, "class3d")
    k = int(line.split("--healpix_order ")[1].split()[0])
    assert k < 7
    better = job_memory(box=64, ndim=3, pad=2, n_classes=4, n_halves=1, budget_bytes=int(8 * GIB),
                        search=SearchSpace(3, 4, 5.0, 2.0, order=k, first_size=32, pixel_size=2.0, diameter_A=100.0))
    worse = job_memory(box=64, ndim=3, pad=2, n_classes=4, n_halves=1, budget_bytes=int(8 * GIB),
                       search=SearchSpace(3, 4, 5.0, 2.0, order=k + 1, first_size=32, pixel_size=2.0,
                                          diameter_A=100.0))
    assert better.fits and not worse.fits
    assert f"--healpix_order {k} needs {better.peak / GIB:.1f} GiB" in line


@pytest.mark.parametrize("order", ["10", "13"])
def test_healpix_order_beyond_relion_is_refused_with_its_limit(order, sample, tmp_path, capsys):
    fails(capsys, _em("class3d", sample, tmp_path / "o", "--healpix_order", order), "--healpix_order",
           "0..9", "0.1°", f"got {order}")
    _nothing_written(tmp_path / "o")


@pytest.mark.parametrize("job", ["class2d", "class3d", "refine3d"])
def test_offset_range_larger_than_half_the_box_is_refused(job, sample, tmp_path, capsys):
    """Box 16: at most 8 px. 1000 px would be 785,349 translations (all wrapped round the box)."""
    fails(capsys, _em(job, sample, tmp_path / "o", "--offset_range", "1000"), "--offset_range 1000",
           "half the box", "16 px", "at most 8 px", "RELION does not limit it")
    _nothing_written(tmp_path / "o")


@pytest.mark.parametrize("step", ["0", "-2", "nan"])
def test_offset_step_not_positive_is_refused(step, sample, tmp_path, capsys):
    fails(capsys, _em("class2d", sample, tmp_path / "o", "--offset_step", step), "--offset_step", "> 0",
           f"got {step}")
    _nothing_written(tmp_path / "o")


def test_the_plan_counts_what_the_sampling_makes():
    """SearchSpace counts rows and translations without making them: the same as Sampling / InPlaneSampling (and
    the 785,349 translations of --offset_range 1000 that the E-step would have made)."""
    assert translation_count(1000, 2) == 785_349
    for r, step in [(0, 2), (5, 2), (6, 2), (8, 2), (10, 2), (7.3, 0.3), (24, 1.5), (3, 7)]:
        assert translation_count(r, step) == translation_grid(r, step).shape[0], (r, step)
    for order, sym in [(0, "C1"), (2, "C1"), (3, "D2"), (2, "I")]:
        s, smp = SearchSpace(3, 3, 6.0, 2.0, order=order, sym=sym), Sampling(order, sym, None, 6.0, 2.0)
        assert s.rows == 3 * smp.n_orient and s.translations == smp.translations.shape[0]
        assert s.n_children == smp.n_children
    s, smp = SearchSpace(2, 5, 5.0, 2.0, psi_step=12.0), InPlaneSampling(12.0, 5.0, 2.0)
    assert s.rows == 5 * smp.n_orient and s.n_children == smp.n_children


# ------------------------------------------------------------------------------------------------------------
# absurd pixel values; particles not normalised


def _scale_one(d, k=4, factor=1e30):
    d[k] = d[k] * np.float32(factor)


def test_reconstruct_refuses_an_image_scaled_1e30_and_names_it(data, tmp_path, capsys):
    _edit_stack(data, _scale_one)
    out = tmp_path / "r" / "map.mrc"
    fails(capsys, ["reconstruct", "--i", data / "particles.star", "--o", out, "--cpu"], "image 5 of stack",
           "000005@particles/particles.mrcs", "beyond +-1e+16", data / "particles.star", "rlnImageName")
    assert not out.exists() and not out.parent.exists()


@pytest.mark.parametrize("job", ["class2d", "class3d"])
def test_em_jobs_refuse_an_image_scaled_1e30_and_name_it(job, data, tmp_path, capsys):
    """class2d once ended in a ZeroDivisionError traceback (candidate_floor of a row of no samples)."""
    _edit_stack(data, _scale_one)
    fails(capsys, _em(job, data, tmp_path / "o"), "image 5 of stack", "000005@particles/particles.mrcs",
           "beyond +-1e+16")
    _nothing_written(tmp_path / "o")


def test_one_image_scaled_apart_from_the_others_is_refused_as_not_normalised(data, tmp_path, capsys):
    """A finite factor (x1000): its background stddev is 1000 x the others' median, outside RELION's 0.5-2 band."""
    _edit_stack(data, lambda d: _scale_one(d, 2, 1000.0))
    out = tmp_path / "r" / "map.mrc"
    fails(capsys, ["reconstruct", "--i", data / "particles.star", "--o", out, "--cpu"],
           "000003@particles/particles.mrcs", "not normalised", "stddev", "x the median", "--dont_check_norm")
    assert not out.parent.exists()


@pytest.mark.parametrize("job", ["class2d", "class3d", "refine3d", "reconstruct"])
def test_particles_with_background_mean_1000_are_refused_naming_dont_check_norm(job, data, tmp_path, capsys):
    """Not normalised (every image + 1000): 2 of 4 classes came out empty without a word; now refused, as
    RELION's check (its flag named), with the first image, its background mean and stddev."""
    _edit_stack(data, lambda d: d.__iadd__(np.float32(1000.0)))
    out = tmp_path / "o"
    argv = (["reconstruct", "--i", data / "particles.star", "--o", out / "map.mrc", "--cpu"] if job == "reconstruct"
            else _em(job, data, out))
    line = fails(capsys, argv, "000001@particles/particles.mrcs", "not normalised", "background", "stddev",
                  "--dont_check_norm", "8 of 8 images checked", data / "particles.star")
    assert "beyond +-0.5 x the stddev" in line and abs(_mean_in(line) - 1000) < 5
    _nothing_written(out)


@pytest.mark.parametrize("job", ["class2d", "reconstruct"])
def test_dont_check_norm_runs_with_a_warning(job, data, tmp_path, capsys):
    _edit_stack(data, lambda d: d.__iadd__(np.float32(1000.0)))
    out = tmp_path / "o"
    argv = (["reconstruct", "--i", data / "particles.star", "--o", out / "map.mrc", "--cpu"] if job == "reconstruct"
            else _em(job, data, out))
    code, stdout, err = run_cli(capsys, [*argv, "--dont_check_norm"])
    assert code == 0, err
    text = stdout + err
    assert "WARNING: --dont_check_norm" in text and "not normalised" in text, text
    assert abs(_mean_in(text) - 1000) < 5
    assert (out / "map.mrc").is_file() if job == "reconstruct" else (out / "run_it001_classes.mrcs").is_file()


def test_the_sample_data_and_simulated_particles_pass_the_normalisation_check(sample):
    """The plugin's sample data and the tests' simulated particles are in other units than RELION's (background
    stddev ~9 here) but normalised (mean ~0, one noise level): they pass, at the EM jobs' radius and reconstruct's."""
    from napari_gpu_relion.compute.extraction import background_stats  # noqa: PLC0415
    from napari_gpu_relion.io.particle_images import load_images  # noqa: PLC0415

    for star in (sample / "particles.star", sample_data_dir() / "particles.star"):
        table = read_particles(star)
        rows = norm_check_rows(table.particles["rlnOpticsGroup"].to_numpy())
        N = table.box_size
        for radius in ((N - 5) / 2, N / 4):
            mean, std = background_stats(load_images(table, rows=rows), radius)
            assert check_normalisation(table, rows, mean, std, radius) is None


# ------------------------------------------------------------------------------------------------------------
# candidate_floor's edge case


def test_candidate_floor_is_the_direct_formula_and_zero_where_nothing_can_be_cut():
    for f in (0.5, 0.9, 0.999, 0.99999):
        for n in (1, 2, 7, 1000, 2**20):
            assert expectation.candidate_floor(f, n) == 0.5 * (1.0 - f) / n
    assert expectation.candidate_floor(0.999, 0) == 0.0  # a row of no samples: was ZeroDivisionError
    assert expectation.candidate_floor(1.0, 10) == 0.0 and expectation.candidate_floor(1.5, 10) == 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64])
def test_candidate_floor_keeps_every_sample_up_to_the_crossing(n):
    """The floor's promise, checked by the direct calculation (a full sort of each row): every sample at or before
    the significance crossing weighs at least eps, so the threshold found among the candidates is the full
    sort's, also for rows of one or a few samples."""
    rng = np.random.default_rng(n)
    for sharp in (0.1, 3.0, 30.0):
        lw = rng.normal(scale=sharp, size=(50, n))
        p = np.exp(lw - lw.max(axis=1, keepdims=True))
        p = (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
        f = 0.999
        eps = np.float32(expectation.candidate_floor(f, n))
        k_ref, w_ref = expectation._threshold_by_sort(p, f)
        srt = -np.sort(-p, axis=1)
        for i in range(p.shape[0]):
            assert (srt[i, :k_ref[i] + 1] >= eps).all()
        k, w = expectation.significance_threshold(p, f)
        np.testing.assert_array_equal(k, k_ref)
        np.testing.assert_array_equal(w, w_ref)


def test_background_stats_are_the_mean_and_stddev_outside_relions_rounded_circle():
    """compute.extraction.background_stats against a loop over the pixels in float64: outside the circle of
    ROUND(radius) pixels (half away from zero: 6.5 -> 7) about pixel N/2; NaN when no pixel is outside."""
    from napari_gpu_relion.compute.extraction import background_stats  # noqa: PLC0415

    imgs = np.random.default_rng(4).normal(3.0, 2.0, (3, 16, 16)).astype(np.float32)
    mean, std = background_stats(imgs, 6.5)
    for i in range(3):
        vals = [float(imgs[i, y, x]) for y in range(16) for x in range(16) if (y - 8) ** 2 + (x - 8) ** 2 > 49]
        assert mean[i] == pytest.approx(np.mean(vals), rel=1e-12) and std[i] == pytest.approx(np.std(vals), rel=1e-12)
    assert np.isnan(background_stats(imgs, 12.0)).all()

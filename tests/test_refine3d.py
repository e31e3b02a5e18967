"""3D auto-refine on simulated data with ground truth (CI-sized), and its input checks."""

import shlex
from pathlib import Path

import numpy as np
import pytest
import starfile

from napari_gpu_relion.compute.fsc import fsc, resolution_A
from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.jobs import reconstruct, refine3d
from napari_gpu_relion.jobs.em import read_optimiser_star
from napari_gpu_relion.jobs.simulate import make_sample_data

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """300 particles, box 32 at 6 Å/px (192 Å box, 140 Å phantom), CTF, offsets, SNR 0.3: about the
    information of 3000 particles at SNR 0.05, at a tenth of the cost."""
    return make_sample_data(tmp_path_factory.mktemp("refine_data"), box=32, angpix=6.0, n_particles=300, snr=0.3,
                            diameter=134.4, ini_high=60.0, n_micrographs=0)


def _half_resolution(h1, h2):
    a = read_mrc(h1)
    m1, m2 = np.asarray(a.data, np.float64), np.asarray(read_mrc(h2).data, np.float64)
    return resolution_A(fsc(m1, m2), m1.shape[0], float(a.pixel_size), 0.143)


def _matrices(df):
    return euler_to_matrix(*(df[c].to_numpy() for c in ANG))


@pytest.mark.slow
def test_refine3d_reaches_true_angle_resolution_and_angles(small_data, tmp_path):
    """From the truth low-passed to 60 Å: gold-standard resolution within 10% of the reconstruction from the
    true angles, and median angular error under 2x the final fine angular step (about 130 s on 2 cores)."""
    star = small_data / "particles.star"
    for k in (1, 2):
        for _ in reconstruct.run(reconstruct.Params(i=star, o=tmp_path / f"t{k}.mrc", ctf=True, subset=k, cpu=True)):
            pass
    res_truth = _half_resolution(tmp_path / "t1.mrc", tmp_path / "t2.mrc")
    out = tmp_path / "Refine3D"
    events = list(refine3d.run(refine3d.Params(i=star, ref=small_data / "reference.mrc", o=out / "run", ctf=True,
                                               particle_diameter=160.0, healpix_order=1,
                                               auto_local_healpix_order=3, flatten_solvent=True, cpu=True)))
    res = _half_resolution(out / "run_half1_class001_unfil.mrc", out / "run_half2_class001_unfil.mrc")
    assert res <= 1.1 * res_truth, f"refined {res:.1f} Å vs true angles {res_truth:.1f} Å"
    order = int(read_optimiser_star(out / "run_optimiser.star")["rlnGpuRelion_order"])
    fine_step = 60.0 / 2**order / 2
    d = starfile.read(out / "run_data.star")["particles"]
    truth = starfile.read(star)["particles"]
    err = angular_distance_deg(_matrices(d), _matrices(truth))
    assert np.median(err) < 2 * fine_step, f"median angular error {np.median(err):.2f}° (step {fine_step}°)"
    off = np.hypot(d["rlnOriginXAngst"] - truth["rlnOriginXAngst"], d["rlnOriginYAngst"] - truth["rlnOriginYAngst"])
    assert np.median(off) < 6.0 / 2  # under half a pixel
    # RELION's layout and the event stream
    for name in ("run_class001.mrc", "run_model.star", "run_it001_half1_class001.mrc", "run_it001_half2_model.star",
                 "run_it001_data.star", "run_it001_optimiser.star"):
        assert (out / name).is_file(), name
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "Started" and kinds[-1] == "Finished"
    assert kinds.count("IterationFinished") >= 3 and "FscUpdated" in kinds and "MapUpdated" in kinds
    model = starfile.read(out / "run_model.star")
    assert "model_class_1" in model and "rlnGoldStandardFsc" in model["model_class_1"].columns
    # rlnCurrentResolution of an iteration is RELION's (updateCurrentResolution): the shell before the SSNR first
    # drops below 1 (or a shell > that + 3 still above 1, scanning down), not the FSC-0.143 estimate; that estimate
    # (a dip skipped the same way) is what each iteration and the end report and rlnEstimatedResolution holds
    reported = [e.resolution_A for e in events if type(e).__name__ == "FscUpdated"]
    for it in (1, 2):
        m = starfile.read(out / f"run_it{it:03d}_half1_model.star")
        ssnr, gen = m["model_class_1"]["rlnSsnrMap"].to_numpy(), m["model_general"]
        n = len(ssnr)
        r = next((i for i in range(1, n) if ssnr[i] < 1.0), n) - 1
        r = next((i for i in range(n - 2, r + 3, -1) if ssnr[i] > 1.0), r)
        box, apix = int(gen["rlnOriginalImageSize"]), float(gen["rlnPixelSize"])
        assert float(gen["rlnCurrentResolution"]) == pytest.approx(box * apix / max(r, 5), rel=1e-6)
        f = m["model_class_1"]["rlnGoldStandardFsc"].to_numpy()
        r143 = next((i for i in range(1, n) if f[i] < 0.143), n) - 1
        r143 = next((i for i in range(n - 2, r143 + 3, -1) if f[i] > 0.143), r143)
        assert reported[it - 1] == pytest.approx(box * apix / max(r143, 1), rel=1e-6)
        assert float(m["model_classes"]["rlnEstimatedResolution"].iloc[0]) == pytest.approx(reported[it - 1])
    final = float(starfile.read(out / "run_model.star")["model_classes"]["rlnEstimatedResolution"].iloc[0])
    assert reported[-1] == pytest.approx(final, rel=1e-6)
    assert f"final resolution {final:.2f} Å" in events[-1].summary


def _params(data, tmp_path, **kw):
    base = dict(i=data / "particles.star", ref=data / "reference.mrc", o=tmp_path / "r" / "run", ctf=True, cpu=True)
    base.update(kw)
    return refine3d.Params(**base)


def test_reference_of_another_size_is_an_error_unless_trusted(small_data, tmp_path):
    big = np.zeros((40, 40, 40), np.float32)
    big[20, 20, 20] = 1
    ref = write_mrc(tmp_path / "ref40.mrc", big, 6.0)
    with pytest.raises(InputError, match="--trust_ref_size"):
        list(refine3d.run(_params(small_data, tmp_path, ref=ref)))
    assert not (tmp_path / "r" / "run_it001_data.star").exists()
    ref2 = write_mrc(tmp_path / "ref32_4A.mrc", np.zeros((32, 32, 32), np.float32), 4.0)
    with pytest.raises(InputError, match="Å/px"):
        list(refine3d.run(_params(small_data, tmp_path, ref=ref2)))


def test_bad_inputs_are_clear_errors_before_work(small_data, tmp_path):
    with pytest.raises(InputError, match="larger than the box"):
        list(refine3d.run(_params(small_data, tmp_path, particle_diameter=400.0)))
    # no CTF columns with --ctf
    blocks = starfile.read(small_data / "particles.star")
    parts = blocks["particles"].drop(columns=["rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle"])
    (tmp_path / "particles").symlink_to(small_data / "particles")
    starfile.write({"optics": blocks["optics"], "particles": parts}, tmp_path / "noctf.star")
    with pytest.raises(InputError, match="rlnDefocusU"):
        list(refine3d.run(_params(small_data, tmp_path, i=tmp_path / "noctf.star")))
    # too few particles for two halves
    one = blocks["particles"].iloc[:1]
    starfile.write({"optics": blocks["optics"], "particles": one}, tmp_path / "one.star")
    with pytest.raises(InputError, match="half"):
        list(refine3d.run(_params(small_data, tmp_path, i=tmp_path / "one.star")))
    assert not (tmp_path / "r" / "run_it001_data.star").exists()



def test_first_iteration_counts_particles_not_in_class_1_as_changed(small_data, tmp_path):
    """RELION's refinement moves every particle into class 1: its change monitor counts the particles whose
    rlnClassNumber was not 1 (all of them when the column is missing) as changed in iteration 1
    (docs/relion_schedule.md)."""
    blocks = starfile.read(small_data / "particles.star")
    (tmp_path / "particles").symlink_to(small_data / "particles")
    parts = blocks["particles"]
    cases = {"all1": (parts.assign(rlnClassNumber=1), 0.0),
             "missing": (parts.drop(columns=["rlnClassNumber"]), 1.0),
             "mixed": (parts.assign(rlnClassNumber=np.where(np.arange(len(parts)) % 4 == 0, 3, 1)), 0.25)}
    for name, (table, want) in cases.items():
        starfile.write({"optics": blocks["optics"], "particles": table}, tmp_path / f"{name}.star")
        job = refine3d.Refine3D(_params(small_data, tmp_path, i=tmp_path / f"{name}.star"))
        assert job.input_class_change == pytest.approx(want, abs=1 / len(parts)), name
        assert job.monitor_steps is None  # set from the first iteration's fine steps, then kept

def test_local_candidates_are_the_prior_window_of_each_particle():
    """Candidates = every (direction, psi) inside RELION's 3-sigma window around the particle's angles, with
    the Gaussian log prior of direction and psi, in row order (row = direction x n_psi + psi)."""
    from napari_gpu_relion.compute.sampling import Sampling, local_candidates, local_search

    rng = np.random.default_rng(2)
    angles = rng.uniform([-180, 0, -180], [180, 180, 180], (5, 3))
    smp = Sampling(order=3)
    cand, lpc = local_candidates(angles, smp, 7.5, "C1")
    ls = local_search(angles[:, 0], angles[:, 1], angles[:, 2], 7.5, 3, "C1", None)
    for i in range(5):
        keep = ls.dir_mask[i][:, None] & ls.psi_mask[i][None, :]
        want = np.flatnonzero(keep.reshape(-1))
        got = cand[i][cand[i] >= 0]
        np.testing.assert_array_equal(got, want)
        lp = (ls.dir_log_prior[i][:, None] + ls.psi_log_prior[i][None, :]).reshape(-1)
        np.testing.assert_allclose(lpc[i][cand[i] >= 0], lp[want])
        assert np.all(np.isneginf(lpc[i][cand[i] < 0]))
        # a 3-sigma window at 7.5° holds several orientations
        assert want.size > 1


@pytest.mark.slow
def test_continue_from_an_optimiser_star_repeats_the_same_iterations(small_data, tmp_path):
    """A run continued from run_it001_optimiser.star (same folder, files of iteration 1 only) gives the same
    iteration 2 and final angles as the uninterrupted run: references, noise spectra, particle states and the
    sampling schedule all come back from the files."""
    import shutil

    star = small_data / "particles.star"
    kw = dict(ctf=True, particle_diameter=160.0, healpix_order=0, auto_iter_max=2, cpu=True)  # order 0: seconds
    proj = tmp_path / "project"  # a RELION project: image paths in the STAR files are relative to it
    (proj / "Refine3D").mkdir(parents=True)
    (proj / "particles").symlink_to(small_data / "particles")
    full = proj / "Refine3D" / "full"
    list(refine3d.run(refine3d.Params(i=star, ref=small_data / "reference.mrc", o=full / "run", **kw)))
    part = proj / "Refine3D" / "part"
    part.mkdir()
    for f in full.glob("run_it001_*"):
        shutil.copy(f, part / f.name)
    shutil.copy(full / "note.txt", part / "note.txt")
    list(refine3d.run(refine3d.Params(continue_from=part / "run_it001_optimiser.star", cpu=True)))
    for name in ("run_it002_data.star", "run_data.star"):
        a = starfile.read(full / name)["particles"]
        b = starfile.read(part / name)["particles"]
        same = angular_distance_deg(_matrices(a), _matrices(b)) < 0.01
        assert same.mean() > 0.99, f"{name}: {same.mean():.3f} of the angles agree"
    assert (part / "run_class001.mrc").is_file()


@pytest.mark.slow
def test_out_of_memory_halves_the_batch_and_gives_the_same_result(small_data, tmp_path, monkeypatch):
    """An E-step batch that does not fit is retried at half the size: the job goes on, says so, and its angles
    are those of a run that used the small batch from the start."""
    from napari_gpu_relion.events import Message
    from napari_gpu_relion.jobs import em

    real = em.expectation_batch

    def limited(setup, prep, *a, **k):
        if prep.F_masked.shape[0] > 40:
            raise MemoryError("out of memory (simulated)")
        return real(setup, prep, *a, **k)

    blocks = starfile.read(small_data / "particles.star")  # 120 particles are enough here
    (tmp_path / "particles").symlink_to(small_data / "particles")
    starfile.write({"optics": blocks["optics"], "particles": blocks["particles"].iloc[:120]}, tmp_path / "sub.star")
    kw = dict(i=tmp_path / "sub.star", ref=small_data / "reference.mrc", ctf=True, particle_diameter=160.0,
              healpix_order=0, auto_iter_max=1, zero_mask=True, cpu=True)  # order 0: the same paths, seconds
    list(refine3d.run(refine3d.Params(o=tmp_path / "small" / "run", batch=40, **kw)))
    monkeypatch.setattr(em, "expectation_batch", limited)
    events = list(refine3d.run(refine3d.Params(o=tmp_path / "big" / "run", batch=100, **kw)))
    assert any(isinstance(e, Message) and "out of memory" in e.text for e in events)
    a = starfile.read(tmp_path / "small" / "run_data.star")["particles"]
    b = starfile.read(tmp_path / "big" / "run_data.star")["particles"]
    same = angular_distance_deg(_matrices(a), _matrices(b)) < 0.01
    assert same.mean() > 0.99


def test_subpixel_offsets_are_on_in_auto_refine_and_their_no_flag_turns_them_off(small_data, tmp_path):
    """Auto-refine searches around exact offsets by default (classification keeps RELION's rounding); the
    command line written for a run with them off says --no-subpixel_offsets and parses back to the same options,
    and a --continue of a run written before the option existed keeps RELION's rounding."""
    from dataclasses import replace  # noqa: PLC0415

    from napari_gpu_relion import cli  # noqa: PLC0415
    from napari_gpu_relion.jobs import class3d, em  # noqa: PLC0415
    from napari_gpu_relion.jobs.common import command_line  # noqa: PLC0415

    p = refine3d.Params(i=small_data / "particles.star", ref=small_data / "reference.mrc", o=tmp_path / "r" / "run",
                        cpu=True)
    assert p.subpixel_offsets is True
    assert class3d.Params(i=small_data / "particles.star", ref=small_data / "reference.mrc",
                          o=tmp_path / "c" / "run").subpixel_offsets is False
    for value in (True, False):
        line = command_line("refine3d", replace(p, subpixel_offsets=value))
        assert ("--no-subpixel_offsets" in line) is (not value)
        args = cli.build_parser("refine3d").parse_args(shlex.split(line)[1:])
        assert args.subpixel_offsets is value
    assert refine3d.Params.NEWER_OPTIONS == {"subpixel_offsets": False} == em.EMParams.NEWER_OPTIONS


def test_subpixel_offsets_search_around_the_exact_offsets_and_relion_around_whole_pixels(small_data, tmp_path):
    """RELION searches each particle's translations around its offset rounded to whole pixels (the image is shifted
    by that, ml_optimiser.cpp getFourierTransformsAndCtfs); --subpixel_offsets around the exact offset. After one
    iteration every particle's new offset is then its base (rounded or exact) plus one of the few sampled
    translations: few distinct steps from the base, many from the other."""
    blocks = starfile.read(small_data / "particles.star")
    (tmp_path / "particles").symlink_to(small_data / "particles")
    starfile.write({"optics": blocks["optics"], "particles": blocks["particles"].iloc[:120]}, tmp_path / "sub.star")
    old = blocks["particles"].iloc[:120][["rlnOriginXAngst", "rlnOriginYAngst"]].to_numpy(float) / 6.0
    assert np.abs(old - np.round(old)).max() > 0.3  # offsets well off whole pixels
    kw = dict(i=tmp_path / "sub.star", ref=small_data / "reference.mrc", ctf=True, particle_diameter=160.0,
              healpix_order=0, auto_iter_max=1, zero_mask=True, cpu=True, offset_range=1.0, offset_step=1.0)
    steps = {}
    for name, sub in (("rounded", False), ("subpixel", True)):
        list(refine3d.run(refine3d.Params(o=tmp_path / name / "run", subpixel_offsets=sub, **kw)))
        new = starfile.read(tmp_path / name / "run_it001_data.star")["particles"][
            ["rlnOriginXAngst", "rlnOriginYAngst"]].to_numpy(float) / 6.0

        def distinct(d):
            return len({tuple(v) for v in np.round(d, 3)})

        steps[name] = (distinct(new - np.round(old)), distinct(new - old))
    n_translations = 4 * 9  # the fine translations of a 3 x 3 coarse grid
    assert steps["rounded"][0] <= n_translations < steps["rounded"][1], steps
    assert steps["subpixel"][1] <= n_translations < steps["subpixel"][0], steps

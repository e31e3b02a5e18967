"""RELION's image corrections --norm and --scale (jobs/em.EMCorrections, EMJob.update_corrections) in 3D and 2D
classification and auto-refine, on particles whose intensities were multiplied by known factors: the per-particle
norm correction follows the factors, a --continue resumes with the same norms, and the options are saved with the
run. Box 32, 200 particles, 2-3 iterations: a few seconds each."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import starfile

from napari_gpu_relion.compute import simulate as sim
from napari_gpu_relion.compute.masks import soft_spherical_mask
from napari_gpu_relion.io.mrc import write_mrc
from napari_gpu_relion.io.star import write_particles
from napari_gpu_relion.jobs import class2d, class3d, refine3d
from napari_gpu_relion.jobs.simulate import _optics

N, APIX, N_PARTICLES = 32, 6.0, 200
DIAMETER = 150.0  # Å: the particle mask of every run here
GROUP_FACTOR = 1.5  # the images of scale group 2 are this much brighter than those of group 1


def _write_set(out: Path, sp: sim.SimulatedParticles, factor: np.ndarray, group: np.ndarray) -> Path:
    """particles.star + particles/p.mrcs of the simulated images times ``factor`` (per particle), in scale groups
    ``group`` (rlnGroupNumber, one optics group), with their true angles, offsets and CTF."""
    n = len(factor)
    (out / "particles").mkdir(parents=True, exist_ok=True)
    write_mrc(out / "particles" / "p.mrcs", (sp.images * factor[:, None, None]).astype(np.float32), APIX)
    df = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@particles/p.mrcs" for i in range(n)],
                       "rlnOpticsGroup": np.ones(n, int), "rlnGroupNumber": group,
                       "rlnDefocusU": sp.ctf.defocus_u, "rlnDefocusV": sp.ctf.defocus_v,
                       "rlnDefocusAngle": sp.ctf.defocus_angle, "rlnAngleRot": sp.angles[:, 0],
                       "rlnAngleTilt": sp.angles[:, 1], "rlnAnglePsi": sp.angles[:, 2],
                       "rlnOriginXAngst": sp.origins_px[:, 0] * APIX, "rlnOriginYAngst": sp.origins_px[:, 1] * APIX})
    write_particles(out / "particles.star", df, _optics(N, APIX, "particles"))
    return out / "particles.star"


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> dict:
    """200 particles of the pseudo-atomic phantom (SNR 0.2, CTF, offsets, white noise of std ``sigma``) written
    twice: "norm": each image times its own factor (uniform 0.6-1.6, ``factors``), one scale group; "groups":
    the images of scale group 2 (every other particle) times GROUP_FACTOR. truth.mrc is the phantom."""
    out = tmp_path_factory.mktemp("scaled")
    ph = sim.pseudo_atomic_phantom(134.4, seed=0)
    sp = sim.simulate_particles(N_PARTICLES, N, APIX, phantom=ph, snr=0.2, seed=1)
    write_mrc(out / "truth.mrc", sim.phantom_volume(ph, N, APIX), APIX)
    factors = np.random.default_rng(5).uniform(0.6, 1.6, N_PARTICLES)
    group = np.arange(N_PARTICLES) % 2 + 1
    return {"truth": out / "truth.mrc", "factors": factors, "sigma": sp.noise_sigma, "group": group,
            "norm": _write_set(out / "norm", sp, factors, np.ones(N_PARTICLES, int)),
            "groups": _write_set(out / "groups", sp, np.where(group == 2, GROUP_FACTOR, 1.0), group)}


def _class3d(data: dict, star: str, out: Path, **kw) -> list:
    """class3d K=2 --skip_align (each particle at its true pose) from the true map; the events."""
    opts = dict(K=2, iter=3, ctf=True, skip_align=True, particle_diameter=DIAMETER, zero_mask=True,
                flatten_solvent=True, cpu=True) | kw
    return list(class3d.run(class3d.Params(i=data[star], ref=data["truth"], o=out / "run", **opts)))


def _norms(data_star: Path) -> np.ndarray:
    return starfile.read(data_star)["particles"]["rlnNormCorrection"].to_numpy(float)


def _expected_norm(data: dict) -> np.ndarray:
    """RELION's norm correction of each particle, sqrt(2 x its residual power) with the 1/N^2 forward transform:
    the real-space std of the noise inside the particle mask, sigma x factor x sqrt(sum(mask^2) / N^2) for the
    white noise here (the residual of the signal at SNR 0.2 is small beside it)."""
    mask = soft_spherical_mask(N, DIAMETER / (2 * APIX), 5.0, 2)
    return data["sigma"] * data["factors"] * np.sqrt((mask.astype(np.float64) ** 2).sum() / N**2)


def _check_norms_follow_factors(norms: np.ndarray, data: dict) -> None:
    """rlnNormCorrection is proportional to the true intensity factor (correlation > 0.97, ratio within 8 % rms)
    and at RELION's scale (the noise std in the mask) within 12 %. Measured: correlation 0.99, ratio spread 3 %,
    scale 0.95-0.99 of the expectation."""
    factors = data["factors"]
    assert norms.std() > 0, "the norm corrections did not change (--norm ignored?)"
    assert np.corrcoef(norms, factors)[0, 1] > 0.97
    ratio = norms / factors
    assert ratio.std() / ratio.mean() < 0.08
    assert np.median(norms / _expected_norm(data)) == pytest.approx(1.0, abs=0.12)


def test_class3d_norm_follows_the_particles_intensity_factors(scaled, tmp_path):
    """--norm: after 3 iterations each particle's rlnNormCorrection follows the factor its image was multiplied by;
    the model STAR's rlnNormCorrectionAverage is their mean and the optimiser STAR saves the option. Without --norm
    every rlnNormCorrection stays 1."""
    _class3d(scaled, "norm", tmp_path / "on", norm=True)
    norms = _norms(tmp_path / "on" / "run_it003_data.star")
    _check_norms_follow_factors(norms, scaled)
    general = starfile.read(tmp_path / "on" / "run_it003_model.star")["model_general"]
    assert float(general["rlnNormCorrectionAverage"]) == pytest.approx(norms.mean(), rel=1e-12)
    opt = starfile.read(tmp_path / "on" / "run_it003_optimiser.star")
    assert int(opt["rlnGpuRelionParam_norm"]) == 1 and int(opt["rlnGpuRelionParam_scale"]) == 0
    _class3d(scaled, "norm", tmp_path / "off", iter=1)
    np.testing.assert_array_equal(_norms(tmp_path / "off" / "run_it001_data.star"), 1.0)


def test_class3d_norm_continue_resumes_with_the_same_norms(scaled, tmp_path):
    """--continue run_it002_optimiser.star of a --norm run (the option not given again) gives the norms and classes
    of 3 uninterrupted iterations exactly: the option, the norms (data STAR) and their average come back."""
    _class3d(scaled, "norm", tmp_path / "full", norm=True)
    _class3d(scaled, "norm", tmp_path / "part", norm=True, iter=2)
    list(class3d.run(class3d.Params(continue_from=tmp_path / "part" / "run_it002_optimiser.star", iter=3, cpu=True)))
    full, part = (starfile.read(tmp_path / d / "run_it003_data.star")["particles"] for d in ("full", "part"))
    assert not np.allclose(part["rlnNormCorrection"], _norms(tmp_path / "part" / "run_it002_data.star"))
    np.testing.assert_array_equal(part["rlnNormCorrection"].to_numpy(), full["rlnNormCorrection"].to_numpy())
    np.testing.assert_array_equal(part["rlnClassNumber"].to_numpy(), full["rlnClassNumber"].to_numpy())


def test_class3d_continues_a_run_saved_before_it_took_norm_and_scale(scaled, tmp_path):
    """An optimiser STAR without rlnGpuRelionParam_norm / _scale (a class3d run written before the options
    existed) continues with both off, not as a damaged file; the continued run saves them."""
    _class3d(scaled, "norm", tmp_path / "old", iter=1)
    opt = tmp_path / "old" / "run_it001_optimiser.star"
    lines = opt.read_text().splitlines(keepends=True)
    kept = [q for q in lines if not q.startswith(("_rlnGpuRelionParam_norm ", "_rlnGpuRelionParam_scale "))]
    assert len(kept) == len(lines) - 2
    opt.write_text("".join(kept))
    list(class3d.run(class3d.Params(continue_from=opt, iter=2, cpu=True)))
    again = starfile.read(tmp_path / "old" / "run_it002_optimiser.star")
    assert int(again["rlnGpuRelionParam_norm"]) == 0 and int(again["rlnGpuRelionParam_scale"]) == 0
    np.testing.assert_array_equal(_norms(tmp_path / "old" / "run_it002_data.star"), 1.0)


def test_class2d_norm_follows_the_particles_intensity_factors(scaled, tmp_path):
    """2D classification with --norm (K=2, 3 iterations, alignment on): the same norm corrections as in 3D."""
    list(class2d.run(class2d.Params(i=scaled["norm"], o=tmp_path / "c2" / "run", K=2, iter=3, ctf=True, norm=True,
                                    particle_diameter=DIAMETER, zero_mask=True, flatten_solvent=True, cpu=True)))
    _check_norms_follow_factors(_norms(tmp_path / "c2" / "run_it003_data.star"), scaled)


def test_refine3d_norm_follows_the_particles_intensity_factors(scaled, tmp_path):
    """Auto-refine with --norm (the M-step shared with classification): iteration 1 and the final one, local
    searches at HEALPix order 0 from the start (seconds on a CPU)."""
    list(refine3d.run(refine3d.Params(i=scaled["norm"], ref=scaled["truth"], o=tmp_path / "r" / "run", ctf=True,
                                      norm=True, auto_iter_max=1, healpix_order=0, auto_local_healpix_order=0,
                                      offset_range=2.0, offset_step=2.0, particle_diameter=DIAMETER, zero_mask=True,
                                      flatten_solvent=True, cpu=True)))
    _check_norms_follow_factors(_norms(tmp_path / "r" / "run_data.star"), scaled)


def _group_ratio(model: Path) -> float:
    s = starfile.read(model)["model_groups"]["rlnGroupScaleCorrection"].to_numpy(float)
    return s[1] / s[0]


@pytest.mark.parametrize("K", [1, 2])
def test_class3d_scale_recovers_the_groups_intensity_ratio(scaled, tmp_path, K):
    """--scale: group 2's rlnGroupScaleCorrection over group 1's is GROUP_FACTOR within 10 % (RELION's meaning:
    the sums of image x CTF-multiplied reference and of its power, over the shells with the class's SSNR > 3, the
    old scale divided out). K=2 takes the per-class path (each class's shells for its own samples). Without
    --scale both stay 1."""
    _class3d(scaled, "groups", tmp_path / "on", K=K, scale=True)
    assert _group_ratio(tmp_path / "on" / "run_it003_model.star") == pytest.approx(GROUP_FACTOR, rel=0.1)
    _class3d(scaled, "groups", tmp_path / "off", K=K, iter=1)
    assert _group_ratio(tmp_path / "off" / "run_it001_model.star") == 1.0


def test_refine3d_scale_recovers_the_groups_intensity_ratio(scaled, tmp_path):
    """Auto-refine with --scale (FSC-based SSNR for the shells after iteration 1): the same ratio, in the final
    model STAR."""
    list(refine3d.run(refine3d.Params(i=scaled["groups"], ref=scaled["truth"], o=tmp_path / "r" / "run", ctf=True,
                                      scale=True, auto_iter_max=2, healpix_order=0, auto_local_healpix_order=0,
                                      offset_range=2.0, offset_step=2.0, particle_diameter=DIAMETER, zero_mask=True,
                                      flatten_solvent=True, cpu=True)))
    assert _group_ratio(tmp_path / "r" / "run_model.star") == pytest.approx(GROUP_FACTOR, rel=0.1)


def test_class3d_scale_continue_repeats_the_uninterrupted_run(scaled, tmp_path):
    """--continue run_it002_optimiser.star of a --scale run: the shells of iteration 3's scale sums come from the
    saved SSNR (rlnSsnrMap), so the group scales and classes equal those of 3 uninterrupted iterations."""
    _class3d(scaled, "groups", tmp_path / "full", K=2, scale=True)
    _class3d(scaled, "groups", tmp_path / "part", K=2, scale=True, iter=2)
    list(class3d.run(class3d.Params(continue_from=tmp_path / "part" / "run_it002_optimiser.star", iter=3, cpu=True)))
    scales = [starfile.read(tmp_path / d / "run_it003_model.star")["model_groups"]["rlnGroupScaleCorrection"]
              .to_numpy(float) for d in ("full", "part")]
    np.testing.assert_allclose(scales[1], scales[0], rtol=1e-9)
    full, part = (starfile.read(tmp_path / d / "run_it003_data.star")["particles"] for d in ("full", "part"))
    np.testing.assert_array_equal(part["rlnClassNumber"].to_numpy(), full["rlnClassNumber"].to_numpy())

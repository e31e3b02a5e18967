"""Anisotropic magnification (rlnMagMat00/01/10/11 of an optics group, what relion_ctf_refine --fit_aniso writes):
the EM jobs and reconstruct apply it as RELION's ObservationModel does (projections and insertions at
A^T (M k, 0), CTFs at M k); docs/ctf_refinement.md.

1. The convention against a float64 evaluation written out here: the projection coordinate of image pixel k is the
   rotation's transpose applied to (M k, 0) (RELION: its projector's A^-1 becomes A^-1 M for A' = M^-1 A).
2. Simulation from the real map EMD-11007 (box 96, 1.668 Å/px), images made at a 2 % anisotropic magnification
   (projection and CTF at M k) by a finer projector than the jobs': reconstructed from the true poses, the map
   agrees with the true map at 4-3.3 Å far better with the matrix in the optics table than without, and about as
   well as a set made without magnification; classification at the true poses (--skip_align: the E-step's
   projection, CTF and insertion) gives every particle a better log-likelihood with the matrix.
3. ctf_refine --fit_aniso (RELION's linearised per-pixel least squares) recovers the matrix from those images
   with the true map as both halves; its astigmatism translation keeps the CTF's defocus term the same function
   of the image pixels (float64, here); and with the matrix in the optics table ctf_refine fits the defocus of a
   magnified set (the CTF at M k) as it does without magnification.
"""

from __future__ import annotations

from pathlib import Path

import mrcfile
import numpy as np
import pandas as pd
import pytest
import starfile

from napari_gpu_relion.cli import main
from napari_gpu_relion.compute.ctf import CtfParams
from napari_gpu_relion.compute.fourier import fourier_resize
from napari_gpu_relion.compute.fsc import fsc
from napari_gpu_relion.compute.geometry import euler_to_matrix, magnified, magnified_frequencies
from napari_gpu_relion.compute.projector import prepare_reference, rotated_frequencies
from napari_gpu_relion.compute.simulate import ctf_images, random_rotations
from napari_gpu_relion.io.star import read_particles, write_particles
from napari_gpu_relion.jobs.particles import applied_magnifications, optics_magnifications

MAP = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real" / "emd_11007_centred192.mrc"
BOX = 96
ANGPIX = 0.834 * 192 / BOX  # 1.668 Å/px
MAG = np.array([[1.02, 0.006], [0.006, 0.985]])


def test_magnified_projection_coordinates_are_relions():
    rng = np.random.default_rng(0)
    A = euler_to_matrix(*rng.uniform(-180, 180, (3, 4)))
    kx, ky = rng.uniform(-20, 20, 7), rng.uniform(-20, 20, 7)
    q = rotated_frequencies(magnified(A, MAG), kx, ky, 1)
    for r in range(4):
        for i in range(7):
            k = np.array([MAG[0, 0] * kx[i] + MAG[0, 1] * ky[i], MAG[1, 0] * kx[i] + MAG[1, 1] * ky[i], 0.0])
            relion = np.linalg.inv(np.linalg.inv(np.pad(MAG, ((0, 1), (0, 1))) + np.diag([0, 0, 1])) @ A[r]) @ (
                np.array([kx[i], ky[i], 0.0]))  # RELION: A' = M^-1 A, coordinate A'^-1 (x, y, 0)
            np.testing.assert_allclose(q[r, i], A[r].T @ k, atol=1e-12)
            np.testing.assert_allclose(q[r, i], relion, atol=1e-12)
    fx, fy = magnified_frequencies(MAG, 0.1, -0.2)
    assert (fx, fy) == pytest.approx((1.02 * 0.1 - 0.006 * 0.2, 0.006 * 0.1 - 0.985 * 0.2))
    assert magnified(A, None) is A and magnified_frequencies(None, 0.1, 0.2) == (0.1, 0.2)


def _optics(mag) -> pd.DataFrame:
    o = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"], "rlnVoltage": [300.0],
                      "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1], "rlnImagePixelSize": [ANGPIX],
                      "rlnImageSize": [BOX], "rlnImageDimensionality": [2], "rlnCtfDataAreCtfPremultiplied": [0]})
    if mag is not None:
        for (i, j) in ((0, 0), (0, 1), (1, 0), (1, 1)):
            o[f"rlnMagMat{i}{j}"] = [float(mag[i, j])]
    return o


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """Two stacks of the same 240 poses, CTFs and noise: one at MAG, one without magnification."""
    if not MAP.exists():
        pytest.skip(f"the real map {MAP} is not there")
    d = tmp_path_factory.mktemp("mag")
    v = fourier_resize(mrcfile.read(MAP).astype(np.float64), BOX, 3)
    rng = np.random.default_rng(4)
    n = 240
    ang = random_rotations(n, rng)
    A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
    dmean = rng.uniform(8000, 20000, n)
    ctf = CtfParams(dmean + 100, dmean - 100, rng.uniform(-180, 180, n))
    origins = rng.uniform(-3, 3, (n, 2))
    noise = rng.normal(0, 1, (n, BOX, BOX))
    ref = prepare_reference(v, pad=3)  # a finer projector than the jobs' (padding 2)
    sigma = None
    for name, mag in (("mag", MAG), ("plain", None)):
        clean = ctf_images(ref, A, ctf, ANGPIX, origins, mag=mag)
        sigma = np.sqrt(clean.reshape(n, -1).var(axis=1).mean() / 2.0) if sigma is None else sigma  # SNR 2
        with mrcfile.new(d / f"{name}.mrcs") as m:
            m.set_data((clean + sigma * noise).astype(np.float32))
            m.voxel_size = ANGPIX
        df = pd.DataFrame({
            "rlnImageName": [f"{i + 1:06d}@{name}.mrcs" for i in range(n)], "rlnOpticsGroup": np.ones(n, int),
            "rlnDefocusU": ctf.defocus_u, "rlnDefocusV": ctf.defocus_v, "rlnDefocusAngle": ctf.defocus_angle,
            "rlnAngleRot": ang[:, 0], "rlnAngleTilt": ang[:, 1], "rlnAnglePsi": ang[:, 2],
            "rlnOriginXAngst": origins[:, 0] * ANGPIX, "rlnOriginYAngst": origins[:, 1] * ANGPIX,
            "rlnClassNumber": np.ones(n, int), "rlnRandomSubset": 1 + np.arange(n) % 2,
            "rlnMicrographName": [f"mic{i // 20:03d}.mrc" for i in range(n)]})
        for label, o in (("with", mag), ("without", None)):
            write_particles(d / f"{name}_{label}.star", df, _optics(o))
    with mrcfile.new(d / "truth.mrc") as m:
        m.set_data(v.astype(np.float32))
        m.voxel_size = ANGPIX
    errors = rng.normal(0, 300, n)  # a defocus error per particle, for the defocus fit at a known matrix
    t = read_particles(d / "mag_with.star")
    df = t.particles.drop(columns=[c for c in t.optics.columns if c != "rlnOpticsGroup" and c in t.particles])
    df["rlnDefocusU"] += errors
    df["rlnDefocusV"] += errors
    write_particles(d / "mag_with_errors.star", df, t.optics)
    # what CTFFIND gives for the magnified images, without a matrix: the defocus term of the CTF at M k as a
    # function of k (astigmatism carried to the image's coordinates)
    from napari_gpu_relion.compute.ctf_refine import adapt_astigmatism, array_to_columns, params_to_array

    cols = array_to_columns(adapt_astigmatism(params_to_array(ctf), MAG, None), 0.1)
    df = read_particles(d / "mag_without.star").particles
    df = df.drop(columns=[c for c in t.optics.columns if c != "rlnOpticsGroup" and c in df])
    for c in ("rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle"):
        df[c] = cols[c]
    write_particles(d / "mag_ctffind.star", df, _optics(None))
    return d, v, dmean


def _fsc_high(d: Path, star: str, truth: np.ndarray) -> float:
    out = d / f"{star}.mrc"
    assert main(["reconstruct", "--i", str(d / f"{star}.star"), "--o", str(out), "--ctf", "--cpu"]) == 0
    return float(np.mean(fsc(mrcfile.read(out).astype(np.float64), truth)[40:48]))  # 4.0-3.3 Å


def test_the_matrix_is_read_and_said(simulated):
    d = simulated[0]
    t = read_particles(d / "mag_with.star")
    mags = optics_magnifications(t)
    np.testing.assert_allclose(mags[0], MAG)
    assert "opticsGroup1 (1.0200 0.0060 0.0060 0.9850)" in applied_magnifications(t, mags)
    assert optics_magnifications(read_particles(d / "mag_without.star")) is None


@pytest.mark.slow
def test_reconstruction_applies_the_magnification(simulated):
    d, truth = simulated[:2]
    applied, ignored, plain = (_fsc_high(d, s, truth) for s in ("mag_with", "mag_without", "plain_without"))
    assert applied > ignored + 0.15, (applied, ignored)  # measured: 0.637 against 0.068
    assert abs(applied - plain) < 0.03, (applied, plain)  # measured: 0.647 without magnification


@pytest.mark.slow
def test_the_estep_applies_the_magnification(simulated, tmp_path):
    """class3d K=1 --skip_align at the true poses, one iteration from the true map: with the matrix every
    particle's log-likelihood is higher (the E-step's projection and CTF) and the class map closer to the truth
    at high resolution (its insertion)."""
    d, truth = simulated[:2]
    ll, high = {}, {}
    for label in ("with", "without"):
        out = tmp_path / label / "run"
        assert main(["class3d", "--i", str(d / f"mag_{label}.star"), "--ref", str(d / "truth.mrc"), "--K", "1",
                     "--iter", "1", "--skip_align", "--ctf", "--particle_diameter", "150", "--ini_high", "0",
                     "--tau2_fudge", "4", "--cpu", "--o", str(out)]) == 0
        ll[label] = starfile.read(f"{out}_it001_data.star")["particles"]["rlnLogLikeliContribution"].to_numpy()
        high[label] = float(np.mean(fsc(mrcfile.read(f"{out}_it001_class001.mrc").astype(np.float64),
                                        truth)[30:40]))
    assert (ll["with"] > ll["without"]).mean() > 0.95, (ll["with"] - ll["without"])  # measured: all 240
    assert high["with"] > high["without"] + 0.05, high  # measured: 0.900 against 0.573 (5.5-4.1 Å)


def test_astigmatism_translation_keeps_the_defocus_term():
    """adapt_astigmatism: the defocus term z u^2 + z1 (x^2 - y^2) + z2 2xy of the CTF at new k, with the new
    parameters, equals the old one at old k for every pixel (float64)."""
    from napari_gpu_relion.compute.ctf_refine import adapt_astigmatism

    rng = np.random.default_rng(1)
    theta = np.zeros((5, 7))
    theta[:, 1:4] = np.column_stack([rng.uniform(8e3, 2e4, 5), rng.uniform(-500, 500, 5), rng.uniform(-500, 500, 5)])
    old = np.array([[1.004, -0.002], [0.001, 0.997]])
    new = MAG
    out = adapt_astigmatism(theta, old, new)
    k = rng.normal(size=(2, 50))

    def term(t, m):
        x, y = m @ k
        return t[:, 1:2] * (x * x + y * y) + t[:, 2:3] * (x * x - y * y) + t[:, 3:4] * 2 * x * y

    np.testing.assert_allclose(term(out, new), term(theta, old), rtol=1e-12)
    np.testing.assert_allclose(adapt_astigmatism(theta, None, None), theta)


def _ctf_refine(d: Path, star: str, out: Path, *extra: str) -> pd.DataFrame:
    assert main(["ctf_refine", "--i", str(d / star), "--m1", str(d / "truth.mrc"), "--m2", str(d / "truth.mrc"),
                 *extra, "--cpu", "--o", str(out) + "/"]) == 0
    return read_particles(out / "particles_ctf_refine.star")


@pytest.mark.slow
def test_ctf_refine_fits_the_magnification_matrix(simulated, tmp_path):
    """One pass is RELION's linearised estimate: the right matrix in direction, short of a 2 % distortion (the
    slices change over a pixel when the particle fills the box: measured 0.0138/0.0043/0.0042/-0.0114 of
    0.02/0.006/0.006/-0.015); a second pass on its own output (predictions and CTFs at the first matrix) is a
    Gauss-Newton step: measured within 1e-4 of the truth. The astigmatism translated with the matrix comes back
    to the true defocus at the true matrix."""
    d = simulated[0]

    def matrix(t):
        o = t.optics.iloc[0]
        return np.array([[o["rlnMagMat00"], o["rlnMagMat01"]], [o["rlnMagMat10"], o["rlnMagMat11"]]])

    first = _ctf_refine(d, "mag_ctffind.star", tmp_path / "aniso1", "--fit_aniso")
    D, D_true = matrix(first) - np.eye(2), MAG - np.eye(2)
    assert np.all(np.sign(D) == np.sign(D_true)) and np.abs(D - D_true).max() < 0.4 * np.abs(D_true).max(), D
    (d / "aniso1.star").write_bytes((tmp_path / "aniso1" / "particles_ctf_refine.star").read_bytes())
    second = _ctf_refine(d, "aniso1.star", tmp_path / "aniso2", "--fit_aniso")
    assert np.abs(matrix(second) - MAG).max() < 5e-4, matrix(second)
    t0 = read_particles(d / "mag_with.star")  # the true defocus, at the true matrix
    for c in ("rlnDefocusU", "rlnDefocusV"):
        np.testing.assert_allclose(second.particles[c], t0.particles[c], atol=20)


def test_ctf_refine_fits_the_defocus_of_a_magnified_set(simulated, tmp_path):
    d, _, dmean = simulated
    t = _ctf_refine(d, "mag_with_errors.star", tmp_path / "defocus", "--fit_defocus", "--fit_mode", "fpfff")
    got = 0.5 * (t.particles["rlnDefocusU"].to_numpy(float) + t.particles["rlnDefocusV"].to_numpy(float))
    rms = float(np.sqrt(np.mean((got - dmean) ** 2)))
    assert rms < 50, rms
    np.testing.assert_allclose(t.optics.iloc[0]["rlnMagMat00"], MAG[0, 0])  # the matrix kept


@pytest.mark.gpu
def test_the_estep_with_a_matrix_on_the_gpu_equals_the_cpu(simulated, tmp_path):
    """class3d --skip_align at the true poses with the matrix: the same log-likelihoods and class map on the GPU."""
    pytest.importorskip("cupy")
    d = simulated[0]
    out = {}
    for where in ("--cpu", "--gpu"):
        o = tmp_path / where.strip("-") / "run"
        args = ["class3d", "--i", str(d / "mag_with.star"), "--ref", str(d / "truth.mrc"), "--K", "1", "--iter", "1",
                "--skip_align", "--ctf", "--particle_diameter", "150", "--ini_high", "0", "--o", str(o)]
        assert main(args + ([where] if where == "--cpu" else ["--gpu", "0"])) == 0
        out[where] = (starfile.read(f"{o}_it001_data.star")["particles"]["rlnLogLikeliContribution"].to_numpy(),
                      mrcfile.read(f"{o}_it001_class001.mrc").astype(np.float64))
    np.testing.assert_allclose(out["--gpu"][0], out["--cpu"][0], rtol=1e-5)
    a, b = out["--gpu"][1], out["--cpu"][1]
    assert np.abs(a - b).max() <= 1e-3 * b.std()

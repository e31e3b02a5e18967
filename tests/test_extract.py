"""Particle extraction: boxes against plain NumPy slicing, normalisation against float64 least squares,
rescaling against an explicit Fourier crop, RELION's edge handling, dust removal, output files, bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from napari_gpu_relion.compute import extraction as ex
from napari_gpu_relion.compute import simulate as sim
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.events import Finished
from napari_gpu_relion.io.micrographs import write_coordinate_list
from napari_gpu_relion.io.mrc import write_mrc
from napari_gpu_relion.io.particle_images import load_images
from napari_gpu_relion.io.star import read_particles, write_coordinates, write_particles
from napari_gpu_relion.jobs import extract

APIX, BOX = 3.0, 64


def _expected(mic: np.ndarray, xy: np.ndarray, box: int, radius: float, invert: bool) -> np.ndarray:
    """Boxes by slicing, then plane fit (lstsq, float64) on r > radius, background mean/std, inversion."""
    h = box // 2
    c = np.arange(box) - h
    I, J = np.meshgrid(c, c, indexing="ij")
    bg = I**2 + J**2 > radius**2
    out = []
    for x, y in xy:
        b = mic[y - h:y + h, x - h:x + h].astype(np.float64)
        M = np.stack([J[bg], I[bg], np.ones(bg.sum())], 1)
        coef = np.linalg.lstsq(M, b[bg], rcond=None)[0]
        b = b - (coef[0] * J + coef[1] * I + coef[2])
        b = (b - b[bg].mean()) / b[bg].std()
        out.append(-b if invert else b)
    return np.array(out)


def _write_set(tmp: Path, seed: int = 0, size: int = 512, n: int = 15):
    ph = sim.pseudo_atomic_phantom(150.0, seed=0)
    m = sim.simulate_micrograph(ph, (size, size), APIX, n, BOX, snr=0.1, seed=seed)
    (tmp / "MotionCorr/job002/Movies").mkdir(parents=True)
    name = "MotionCorr/job002/Movies/mic001.mrc"
    write_mrc(tmp / name, m.image, APIX)
    optics = pd.DataFrame({"rlnOpticsGroupName": ["opticsGroup1"], "rlnOpticsGroup": [1], "rlnVoltage": [300.0],
                           "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1],
                           "rlnMicrographPixelSize": [APIX]})
    mics = pd.DataFrame({"rlnMicrographName": [name], "rlnOpticsGroup": [1], "rlnDefocusU": [15150.0],
                         "rlnDefocusV": [14850.0], "rlnDefocusAngle": [12.0], "rlnCtfMaxResolution": [4.5]})
    write_particles(tmp / "micrographs.star", mics, optics, block="micrographs")
    return m, name


def _coords(tmp: Path, name: str, x, y, fom=None) -> Path:
    f = tmp / "AutoPick/job003/Movies/mic001_autopick.star"
    write_coordinates(f, x, y, fom=np.ones(len(x)) if fom is None else fom, class_number=np.zeros(len(x), int),
                      psi=np.zeros(len(x)))
    return write_coordinate_list(tmp / "AutoPick/job003/autopick.star", [name],
                                 ["AutoPick/job003/Movies/mic001_autopick.star"])


def test_extracted_boxes_equal_slices_after_the_same_normalisation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, name = _write_set(tmp_path)
    # fractional coordinates: RELION truncates (x.7 -> x)
    _coords(tmp_path, name, m.coords[:, 0] + 0.7, m.coords[:, 1] + 0.2)
    p = extract.Params(i=Path("micrographs.star"), o=Path("Extract/job004"),
                       coord_list=Path("AutoPick/job003/autopick.star"), extract_size=BOX, norm=True,
                       bg_radius=24, invert_contrast=True, cpu=True)
    ev = list(extract.run(p))
    assert isinstance(ev[-1], Finished)
    t = read_particles("Extract/job004/particles.star")
    imgs = load_images(t)
    exp = _expected(m.image, m.coords, BOX, 24, True)
    assert imgs.shape == exp.shape
    assert np.abs(imgs - exp).max() < 2e-4  # float32 rounding of values of order 4
    df = t.particles
    assert df["rlnImageName"].iloc[0] == "000001@Extract/job004/Particles/Movies/mic001.mrcs"
    assert np.allclose(df["rlnCoordinateX"], m.coords[:, 0] + 0.7)
    assert (df["rlnMicrographName"] == name).all() and (df["rlnDefocusU"] == 15150.0).all()
    assert t.pixel_size == APIX and t.box_size == BOX
    assert "rlnMicrographPixelSize" not in t.optics.columns
    assert int(t.optics["rlnImageDimensionality"].iloc[0]) == 2


def _fourier_crop(x: np.ndarray, b: int) -> np.ndarray:
    """Explicit crop: keep rows/cols of signed frequency -b/2..b/2 (the +b/2 row/col from +b/2), float64."""
    B = x.shape[-1]
    F = np.fft.rfft2(np.fft.ifftshift(x, axes=(-2, -1))) / B**2
    k = np.fft.fftfreq(b, 1 / b).astype(int)
    k[b // 2] = b // 2
    Fc = F[:, k % B][:, :, : b // 2 + 1]
    return np.fft.fftshift(np.fft.irfft2(Fc * b**2, s=(b, b)), axes=(-2, -1))


def test_rescaled_extraction_matches_fourier_crop_of_full_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, name = _write_set(tmp_path, seed=3)
    _coords(tmp_path, name, m.coords[:, 0], m.coords[:, 1])
    common = dict(i=Path("micrographs.star"), coord_list=Path("AutoPick/job003/autopick.star"), extract_size=BOX,
                  cpu=True)
    list(extract.run(extract.Params(o=Path("full"), **common)))
    list(extract.run(extract.Params(o=Path("small"), scale=32, **common)))
    full = load_images(read_particles("full/particles.star"))
    small_t = read_particles("small/particles.star")
    small = load_images(small_t)
    assert np.allclose(full, np.array([m.image[y - 32:y + 32, x - 32:x + 32] for x, y in m.coords]))
    exp = _fourier_crop(full.astype(np.float64), 32)
    assert np.abs(small - exp).max() < 1e-5 * np.abs(exp).max() + 1e-6
    assert small_t.pixel_size == pytest.approx(APIX * 2) and small_t.box_size == 32


def test_edge_boxes_are_edge_replicated_or_skipped():
    rng = np.random.default_rng(0)
    mic = rng.normal(size=(100, 120)).astype(np.float32)
    x, y = np.array([3, 60, 119]), np.array([50, 98, 0])
    boxes = ex.cut_boxes(mic, x, y, 16)
    pad = np.pad(mic, 8, mode="edge")
    for b, xi, yi in zip(boxes, x, y, strict=True):
        assert np.array_equal(b, pad[yi:yi + 16, xi:xi + 16])
    assert ex.box_inside(x, y, 16, 100, 120).tolist() == [False, False, False]
    assert ex.box_inside(np.array([8]), np.array([92]), 16, 100, 120).tolist() == [True]
    assert ex.box_touches(np.array([-8, -7]), np.array([50, 50]), 16, 100, 120).tolist() == [False, True]


def test_dust_removal_replaces_only_outliers():
    rng = np.random.default_rng(1)
    imgs = rng.normal(size=(4, 32, 32)).astype(np.float32)
    imgs[1, 5, 7] = 40.0
    imgs[2, 20, 20] = -40.0
    bg = ex.background_mask(32, 12)
    out = ex.remove_dust(imgs, bg, white=5.0, black=5.0, seed=2)
    changed = out != imgs
    assert changed.sum() == 2 and changed[1, 5, 7] and changed[2, 20, 20]
    assert abs(out[1, 5, 7]) < 6 and abs(out[2, 20, 20]) < 6


def test_skip_edge_and_outside_coordinates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, name = _write_set(tmp_path, size=256, n=3)
    _coords(tmp_path, name, np.array([5.0, 128.0]), np.array([128.0, 128.0]))
    common = dict(i=Path("micrographs.star"), coord_list=Path("AutoPick/job003/autopick.star"), extract_size=BOX,
                  cpu=True)
    list(extract.run(extract.Params(o=Path("keep"), **common)))
    assert len(read_particles("keep/particles.star")) == 2
    fin = list(extract.run(extract.Params(o=Path("skip"), skip_edge=True, **common)))[-1]
    assert len(read_particles("skip/particles.star")) == 1 and "1 boxes left" in fin.summary
    _coords(tmp_path, name, np.array([128.0, 400.0]), np.array([128.0, 128.0]))
    with pytest.raises(InputError, match=r"rlnCoordinateX.*400") as exc:
        list(extract.run(extract.Params(o=Path("bad"), **common)))
    assert "mic001_autopick.star" in str(exc.value)
    assert not Path("bad/particles.star").exists()


def test_bad_parameters(tmp_path):
    f = tmp_path / "x.star"
    f.write_text("data_\n")
    with pytest.raises(InputError, match="even"):
        extract.Params(i=f, o=tmp_path, coord_list=f, extract_size=63)
    with pytest.raises(InputError, match="bg_radius"):
        extract.Params(i=f, o=tmp_path, coord_list=f, extract_size=64, norm=True, bg_radius=40)


def test_micrograph_driver_rounds_events_and_failures():
    """The per-micrograph driver shared by autopick and extract (one process): work's events first, then the
    round's skip warnings, collect's events and Progress; a round with done=0 is retried; progress=False rounds
    yield no Progress; the unreadable micrographs come back in order; read_or_skip skips or raises."""
    from types import SimpleNamespace

    from napari_gpu_relion.events import Message, Progress
    from napari_gpu_relion.jobs.micrograph_driver import Round, failure_report, over_micrographs, read_or_skip
    from napari_gpu_relion.runtime.distributed import SingleProcess

    calls = []
    retried = []

    def work(i, stop):
        calls.append((i, stop))
        yield f"work {i}"
        if i == 1 and not retried:
            retried.append(i)
            return Round(done=0)  # e.g. out of memory: the same micrograph again
        if i == 2:
            return Round([], [f"m{i}: unreadable"], done=1, progress=False)
        return Round([i * 10], done=1)

    def collect(results):
        for r in results:
            yield f"collect {r}"

    def drive():
        failures = yield from over_micrographs(SingleProcess(), 4, work, collect, "testing")
        yield ("failures", failures)

    ev = list(drive())
    assert calls == [(0, 4), (1, 4), (1, 4), (2, 4), (3, 4)]
    assert [(e.done, e.total, e.stage) for e in ev if isinstance(e, Progress)] == [
        (1, 4, "testing"), (1, 4, "testing"), (2, 4, "testing"), (4, 4, "testing")]
    strs = [e for e in ev if isinstance(e, str)]
    assert strs == ["work 0", "collect 0", "work 1", "work 1", "collect 10", "work 2", "work 3", "collect 30"]
    i_skip = next(j for j, e in enumerate(ev) if isinstance(e, Message))
    assert ev[i_skip].text == "skipping micrograph m2: unreadable" and ev[i_skip].level == "warning"
    assert ev[i_skip - 1] == "work 2" and ev[i_skip + 1] == "work 3"  # no Progress after the skipped one
    assert ev[-1] == ("failures", ["m2: unreadable"])
    rep = failure_report(["a: x", "b: y"])
    assert rep.text == "2 micrograph(s) could not be read:\n  a: x\n  b: y" and rep.level == "warning"

    e = SimpleNamespace(path="missing.mrc", name="mic.mrc")

    def bad(path):
        raise OSError("no such file")

    assert read_or_skip(e, True, bad) == (None, "mic.mrc: no such file")
    with pytest.raises(OSError):
        read_or_skip(e, False, bad)
    assert read_or_skip(e, False, lambda path: path.upper()) == ("MISSING.MRC", None)

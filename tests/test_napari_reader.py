"""napari reader, writer and sample data of napari-gpu-relion, in a real (Xvfb) viewer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("napari")

from napari_gpu_relion import _reader, _writer  # noqa: E402
from napari_gpu_relion.io.mrc import read_mrc, write_mrc  # noqa: E402
from napari_gpu_relion.io.star import read_coordinates, write_coordinates  # noqa: E402

PLUGIN = "napari-gpu-relion"
SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "real"


@pytest.fixture(scope="session")
def sample_dir() -> Path:
    from napari_gpu_relion.jobs.simulate import sample_data_dir

    return Path(sample_data_dir())


def _particles_star(root: Path) -> Path:
    nested = root / "particles" / "particles.star"
    return nested if nested.is_file() else root / "particles.star"


def _units(layer) -> tuple[str, ...]:
    return tuple(str(u) for u in layer.units)


def _shared(name: str) -> Path:
    p = SHARED / name
    if not p.is_file():
        pytest.skip(f"shared test data {p} not present")
    return p


# ----------------------------------------------------------------------------------------------------------
# get_reader


def test_get_reader_accepts_and_refuses(sample_dir, tmp_path):
    assert _reader.get_reader(str(sample_dir / "truth.mrc")) is not None
    assert _reader.get_reader(str(sample_dir / "particles" / "particles.mrcs")) is not None
    assert _reader.get_reader(str(sample_dir / "coords" / "mic001_truth.star")) is not None
    assert _reader.get_reader(str(sample_dir / "micrographs.star")) is not None
    assert _reader.get_reader([str(sample_dir / "truth.mrc"), str(sample_dir / "reference.mrc")]) is not None
    assert _reader.get_reader(str(tmp_path / "image.tif")) is None
    assert _reader.get_reader([str(sample_dir / "truth.mrc"), str(tmp_path / "x.tif")]) is None
    other = tmp_path / "model.star"
    other.write_text("data_general\n\n_rlnFinalResolution 3.2\n")
    assert _reader.get_reader(str(other)) is None  # leaves model/optimiser STARs to other plugins


def test_postprocess_star_opens_its_fsc_plot(make_napari_viewer):
    """RELION's postprocess.star (and ours, same labels) opens as the FSC plot a RELION user expects, no layer."""
    from napari_gpu_relion.widgets.display import LiveDisplay

    path = _shared("relion_postprocess.star")
    assert _reader.star_kind(path) == "postprocess"
    event = _reader.postprocess_fsc(path)
    assert event.resolution_A == pytest.approx(16.363636)
    assert set(event.curves) == {"corrected", "unmasked", "masked", "phase randomised"}
    assert all(len(c) == len(event.resolution_inv_A) for c in event.curves.values())
    viewer = make_napari_viewer()
    layers = viewer.open(str(path), plugin=PLUGIN)
    assert layers == [] and len(viewer.layers) == 0
    plot = LiveDisplay.for_viewer(viewer).fsc
    assert plot is not None and "16.36 Å" in plot.axes.get_title()
    assert {ln.get_label() for ln in plot.axes.get_lines()} >= {"corrected", "unmasked", "masked"}


# ----------------------------------------------------------------------------------------------------------
# MRC


def test_open_micrograph(make_napari_viewer, sample_dir):
    viewer = make_napari_viewer()
    path = sample_dir / "micrographs" / "mic001.mrc"
    mrc = read_mrc(path)
    layers = viewer.open(str(path), plugin=PLUGIN)
    assert len(layers) == 1
    layer = layers[0]
    assert type(layer).__name__ == "Image"
    assert layer.data.shape == mrc.data.shape
    np.testing.assert_allclose(layer.scale, [mrc.pixel_size] * 2)
    assert _units(layer) == ("angstrom", "angstrom")
    assert tuple(layer.axis_labels) == ("y", "x")
    lo, hi = layer.contrast_limits
    assert float(mrc.data.min()) <= lo < hi <= float(mrc.data.max())


def test_open_stack_in_memory_and_lazy(make_napari_viewer, sample_dir, monkeypatch):
    viewer = make_napari_viewer()
    path = sample_dir / "particles" / "particles.mrcs"
    ref = read_mrc(path)
    layer = viewer.open(str(path), plugin=PLUGIN)[0]
    assert isinstance(layer.data, np.ndarray)
    assert layer.data.shape == ref.data.shape
    np.testing.assert_allclose(layer.scale, [1.0, ref.pixel_size, ref.pixel_size])
    assert _units(layer)[1:] == ("angstrom", "angstrom")

    monkeypatch.setattr(_reader, "LAZY_STACK_BYTES", 0)  # force the per-section dask reader
    data, kwargs, kind = _reader.read_mrc_layers(path)[0]
    assert kind == "image" and kwargs["metadata"]["lazy"]
    assert type(data).__module__.startswith("dask")
    for i in (0, 17, len(ref.data) - 1):
        np.testing.assert_array_equal(np.asarray(data[i]), ref.data[i].astype(np.float32))
    lazy_layer = viewer.add_image(data, **kwargs)
    viewer.dims.set_point(0, 5)
    np.testing.assert_array_equal(np.asarray(lazy_layer.data[5]), ref.data[5].astype(np.float32))


def test_open_map_iso_defaults(make_napari_viewer, sample_dir):
    viewer = make_napari_viewer()
    path = sample_dir / "truth.mrc"
    ref = read_mrc(path)
    layer = viewer.open(str(path), plugin=PLUGIN)[0]
    assert layer.data.shape == ref.data.shape and layer.data.ndim == 3
    np.testing.assert_allclose(layer.scale, [ref.pixel_size] * 3)
    assert _units(layer) == ("angstrom",) * 3
    assert str(layer.rendering) == "iso"
    assert float(ref.data.min()) < layer.iso_threshold < float(ref.data.max())
    inside = (ref.data > layer.iso_threshold).mean()
    assert 0.001 < inside < 0.5  # the surface encloses the particle, not the box or nothing
    viewer.dims.ndisplay = 3  # renders in 3D with Mesa under Xvfb


def test_uint16_4096_micrograph_is_memory_mapped(make_napari_viewer):
    path = _shared("real_micrograph_epu_4096.mrc")
    data, kwargs, kind = _reader.read_mrc_layers(path)[0]
    assert kind == "image"
    assert isinstance(data, np.memmap) and data.dtype == np.uint16 and data.shape == (4096, 4096)
    assert kwargs["scale"] == pytest.approx((0.667, 0.667), abs=1e-3)
    lo, hi = kwargs["contrast_limits"]
    sample = np.asarray(data[::64, ::64], dtype=np.float32)
    assert np.percentile(sample, 0.1) <= lo < hi <= np.percentile(sample, 99.9)
    viewer = make_napari_viewer()
    layer = viewer.open(str(path), plugin=PLUGIN)[0]
    assert layer.data.shape == (4096, 4096)


# ----------------------------------------------------------------------------------------------------------
# STAR


def test_open_coordinates_as_points(make_napari_viewer, sample_dir):
    viewer = make_napari_viewer()
    path = sample_dir / "coords" / "mic001_truth.star"
    truth = read_coordinates(path)
    layer = viewer.open(str(path), plugin=PLUGIN)[0]
    assert type(layer).__name__ == "Points"
    assert len(layer.data) == len(truth)
    np.testing.assert_array_equal(layer.data[:, 0], truth["rlnCoordinateY"].to_numpy())  # row = Y
    np.testing.assert_array_equal(layer.data[:, 1], truth["rlnCoordinateX"].to_numpy())  # col = X
    for name in ("fom", "class", "psi"):
        assert name in layer.features.columns
    np.testing.assert_array_equal(layer.features["fom"], truth["rlnAutopickFigureOfMerit"])
    mic_pixel = read_mrc(sample_dir / "micrographs" / "mic001.mrc").pixel_size
    np.testing.assert_allclose(layer.scale, [mic_pixel] * 2)
    assert _units(layer) == ("angstrom", "angstrom")
    assert str(layer.symbol[0]) == "disc" if np.ndim(layer.symbol) else str(layer.symbol) == "disc"
    assert np.all(layer.face_color[:, 3] == 0)  # transparent discs


def test_open_particle_star(make_napari_viewer, sample_dir):
    from napari_gpu_relion.io.star import read_particles

    viewer = make_napari_viewer()
    path = _particles_star(sample_dir)
    table = read_particles(path)
    layer = viewer.open(str(path), plugin=PLUGIN)[0]
    assert type(layer).__name__ == "Image"
    assert layer.data.shape == (min(len(table), _reader.MAX_PARTICLES), table.box_size, table.box_size)
    np.testing.assert_allclose(layer.scale, [1.0, table.pixel_size, table.pixel_size])
    stack = read_mrc(sample_dir / "particles" / "particles.mrcs").data
    np.testing.assert_array_equal(layer.data[3], stack[3].astype(np.float32))


def test_open_real_relion31_particles(make_napari_viewer):
    viewer = make_napari_viewer()
    layer = viewer.open(str(_shared("relion31.star")), plugin=PLUGIN)[0]
    assert layer.data.shape == (5, 256, 256)
    np.testing.assert_allclose(layer.scale[1:], [2.806, 2.806], rtol=1e-4)


def test_open_micrographs_star(make_napari_viewer, sample_dir):
    viewer = make_napari_viewer()
    layer = viewer.open(str(sample_dir / "micrographs.star"), plugin=PLUGIN)[0]
    mic = read_mrc(sample_dir / "micrographs" / "mic002.mrc")
    assert layer.data.shape == (2,) + mic.data.shape
    np.testing.assert_allclose(layer.scale, [1.0, mic.pixel_size, mic.pixel_size])
    assert tuple(layer.axis_labels) == ("mic", "y", "x")
    np.testing.assert_array_equal(np.asarray(layer.data[1]), mic.data.astype(np.float32))


# ----------------------------------------------------------------------------------------------------------
# Sample data


def test_sample_micrographs_with_true_picks(make_napari_viewer, sample_dir):
    viewer = make_napari_viewer()
    layers = viewer.open_sample(PLUGIN, "micrographs")
    image = next(la for la in layers if type(la).__name__ == "Image")
    points = next(la for la in layers if type(la).__name__ == "Points")
    truth_files = sorted((sample_dir / "coords").glob("*_truth.star"))
    truths = [read_coordinates(f) for f in truth_files]
    assert image.data.shape[0] == len(truth_files)
    assert len(points.data) == sum(len(t) for t in truths)
    pixel = read_mrc(sample_dir / "micrographs" / "mic001.mrc").pixel_size
    np.testing.assert_allclose(image.scale, [1.0, pixel, pixel])
    np.testing.assert_allclose(points.scale, image.scale)
    assert _units(image) == _units(points) == ("angstrom",) * 3
    assert {"fom", "class", "psi"} <= set(points.features.columns)
    for mic, truth in enumerate(truths):  # (mic, y, x) with y = rlnCoordinateY
        sel = points.data[:, 0] == mic
        np.testing.assert_array_equal(points.data[sel, 1], truth["rlnCoordinateY"].to_numpy())
        np.testing.assert_array_equal(points.data[sel, 2], truth["rlnCoordinateX"].to_numpy())


def test_sample_particles_and_reference(make_napari_viewer, sample_dir):
    viewer = make_napari_viewer()
    particles = viewer.open_sample(PLUGIN, "particles")[0]
    stack = read_mrc(sample_dir / "particles" / "particles.mrcs")
    assert particles.data.shape == (min(len(stack.data), _reader.MAX_PARTICLES),) + stack.data.shape[1:]
    np.testing.assert_allclose(particles.scale[1:], [stack.pixel_size] * 2)
    reference = viewer.open_sample(PLUGIN, "reference")[0]
    ref = read_mrc(sample_dir / "reference.mrc")
    assert reference.data.shape == ref.data.shape
    np.testing.assert_allclose(reference.scale, [ref.pixel_size] * 3)
    assert _units(reference) == ("angstrom",) * 3
    assert str(reference.rendering) == "iso"


# ----------------------------------------------------------------------------------------------------------
# Writer


def test_writer_round_trip_is_exact(make_napari_viewer, tmp_path):
    rng = np.random.default_rng(3)
    n = 37
    x, y = rng.uniform(0, 4096, n), rng.uniform(0, 4096, n)
    fom, cls, psi = rng.normal(size=n), rng.integers(0, 5, n), rng.uniform(-180, 180, n)
    src = tmp_path / "mic_autopick.star"
    write_coordinates(src, x, y, fom=fom, class_number=cls, psi=psi)
    viewer = make_napari_viewer()
    layer = viewer.open(str(src), plugin=PLUGIN)[0]
    out = tmp_path / "saved.star"
    written = layer.save(str(out), plugin=PLUGIN)
    assert [Path(p) for p in written] == [out]
    back = read_coordinates(out)
    np.testing.assert_array_equal(back["rlnCoordinateX"], x)
    np.testing.assert_array_equal(back["rlnCoordinateY"], y)
    np.testing.assert_array_equal(back["rlnAutopickFigureOfMerit"], fom)
    np.testing.assert_array_equal(back["rlnClassNumber"], cls)
    np.testing.assert_array_equal(back["rlnAnglePsi"], psi)
    again = viewer.open(str(out), plugin=PLUGIN)[0]
    np.testing.assert_array_equal(again.data, layer.data)
    for name in ("fom", "class", "psi"):
        np.testing.assert_array_equal(again.features[name], layer.features[name])


def test_writer_hidden_points_new_points_and_world_conversion(tmp_path):
    data = np.array([[10.0, 20.0], [30.5, 40.25], [50.0, 60.0]])
    meta = {"features": {"fom": np.array([0.1, 0.9, 0.5])}, "shown": np.array([True, True, False]),
            "scale": np.array([2.0, 2.0]), "translate": np.zeros(2), "metadata": {"pixel_size": 2.0}}
    (path,) = _writer.write_points(str(tmp_path / "picks.star"), data, meta)
    back = read_coordinates(path)
    np.testing.assert_array_equal(back["rlnCoordinateX"], [20.0, 40.25])  # hidden point not written
    np.testing.assert_array_equal(back["rlnCoordinateY"], [10.0, 30.5])
    np.testing.assert_array_equal(back["rlnClassNumber"], [-999, -999])  # RELION's "not given"
    # a layer of scale 1 drawn over a 2 Å/px micrograph: data are Å, written as pixels
    meta = {"scale": np.array([1.0, 1.0]), "translate": np.zeros(2), "metadata": {"pixel_size": 2.0}}
    (path,) = _writer.write_points(str(tmp_path / "world.star"), data, meta)
    np.testing.assert_array_equal(read_coordinates(path)["rlnCoordinateX"], data[:, 1] / 2.0)


def test_writer_splits_micrograph_stack(tmp_path):
    data = np.array([[0, 1.0, 2.0], [1, 3.0, 4.0], [1, 5.0, 6.0]])
    meta = {"features": {"fom": np.array([1.0, 2.0, 3.0])},
            "metadata": {"micrograph_names": ["Movies/a.mrc", "Movies/b.mrc"]}}
    written = _writer.write_points(str(tmp_path / "picks.star"), data, meta)
    assert [Path(p).name for p in written] == ["picks_a.star", "picks_b.star"]
    b = read_coordinates(written[1])
    np.testing.assert_array_equal(b["rlnCoordinateX"], [4.0, 6.0])
    np.testing.assert_array_equal(b["rlnAutopickFigureOfMerit"], [2.0, 3.0])


def test_stack_axis_points_and_map_share_units(make_napari_viewer, sample_dir, tmp_path):
    """Opening a map next to micrographs must not make napari drop units (one unit on every axis)."""
    viewer = make_napari_viewer()
    viewer.open_sample(PLUGIN, "micrographs")
    viewer.open_sample(PLUGIN, "reference")
    assert viewer.layers.extent.units is not None
    write_mrc(tmp_path / "x.mrc", np.zeros((4, 4), np.float32), 1.5)  # unrelated file, just opens
    assert viewer.open(str(tmp_path / "x.mrc"), plugin=PLUGIN)

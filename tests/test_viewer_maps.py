"""Maps are always visible (issue 18): a 3D map that arrives while micrographs and a class grid are shown is drawn
in 3D, on the rendered canvas; the 2D view gives the micrographs back with their own slider. Every layer is in
Å (no "Inconsistent units" warning) and the scale bar is on."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("napari")

from qtpy.QtWidgets import QApplication  # noqa: E402

from napari_gpu_relion.events import ClassAveragesUpdated, MapUpdated, MicrographPicked  # noqa: E402
from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: E402

PLUGIN = "napari-gpu-relion"
BOX, APIX = 48, 3.0

pytestmark = pytest.mark.usefixtures("config_dir")


def _blob_map() -> np.ndarray:
    """A bright ball of radius 12 voxels in a 48-voxel box (an iso-surface any threshold finds)."""
    z, y, x = np.mgrid[:BOX, :BOX, :BOX] - BOX / 2
    return np.exp(-(x * x + y * y + z * z) / (2 * 8.0**2)).astype(np.float32)


def _classes(n: int = 6, box: int = 32) -> ClassAveragesUpdated:
    rng = np.random.default_rng(1)
    return ClassAveragesUpdated("classes", rng.normal(size=(n, box, box)).astype(np.float32), np.full(n, 1 / n),
                                np.full(n, 12.0), APIX, None)


def _canvas(viewer, qtbot) -> np.ndarray:
    """The rendered canvas (RGB), once the window's layout has settled."""
    qtbot.wait(100)
    QApplication.processEvents()
    return np.asarray(viewer.screenshot(canvas_only=True, flash=False))[..., :3].astype(np.float32)


def _warnings_to(monkeypatch) -> list[str]:
    """napari's warnings (show_warning) of the canvas and the display, collected."""
    import napari._vispy.canvas as vcanvas

    seen: list[str] = []
    monkeypatch.setattr(vcanvas, "show_warning", lambda msg: seen.append(str(msg)))
    return seen


def test_map_arriving_over_micrographs_and_class_grid_is_drawn(make_napari_viewer, qtbot, monkeypatch):
    warnings = _warnings_to(monkeypatch)
    viewer = make_napari_viewer(show=True)
    viewer.window._qt_window.resize(1000, 700)
    viewer.open_sample(PLUGIN, "micrographs")
    display = LiveDisplay.for_viewer(viewer)
    display.handle(MicrographPicked("mic001.mrc", 0, np.array([[100.0, 120.0], [300.0, 200.0]]),
                                    np.array([0.2, 0.9])))
    display.handle(_classes())
    display.flush()
    grid = viewer.layers["classes"]
    mics = viewer.layers["micrographs"]
    # the class grid lies beside the micrographs (not over micrograph pixels), in Å like them
    assert grid.extent.world[0][-1] > mics.extent.world[1][-1]
    assert {str(u) for la in viewer.layers for u in la.units} == {"angstrom"}
    assert viewer.dims.ndisplay == 2
    assert viewer.canvas.overlays.scale_bar.visible

    display.handle(MapUpdated("half1", _blob_map(), APIX, None))
    display.flush()
    half1 = viewer.layers["half1"]
    assert viewer.dims.ndisplay == 3 and half1.visible
    assert not any(la.visible for la in viewer.layers if la is not half1)  # nothing 2D lies over the map
    _canvas(viewer, qtbot)  # the layer controls of the new active layer settle first
    with_map = _canvas(viewer, qtbot)
    half1.opacity = 0.0  # the same canvas (layout untouched) without the map
    without_map = _canvas(viewer, qtbot)
    half1.opacity = 1.0
    diff = np.abs(with_map - without_map).max(axis=-1)
    h, w = diff.shape
    centre = diff[h // 3: 2 * h // 3, w // 3: 2 * w // 3]
    assert (centre > 30).mean() > 0.2, "the map is not drawn in the middle of the canvas (camera framed on it)"
    corners = np.concatenate([diff[: h // 8, : w // 8].ravel(), diff[-h // 8:, -w // 8:].ravel()])
    assert (corners > 30).mean() < 0.02  # only where the map is

    # updates arrive in place and stay visible
    display.handle(MapUpdated("half1", 2.0 * _blob_map(), APIX, None))
    display.flush()
    assert viewer.layers["half1"] is half1 and half1.metadata["volume"].max() == pytest.approx(2.0, rel=1e-3)

    # the 2D view: micrographs, picks and grid back; the map kept aside (its z axis off the micrograph slider)
    viewer.dims.ndisplay = 2
    assert "half1" not in viewer.layers
    assert all(viewer.layers[n].visible for n in ("micrographs", "true picks", "picks", "classes"))
    assert viewer.dims.range[0].stop == pytest.approx(1.0)  # two micrographs: slider positions 0 and 1
    display.handle(MapUpdated("half1", 3.0 * _blob_map(), APIX, None))  # a map update meanwhile is kept
    display.flush()
    assert viewer.dims.ndisplay == 2 and "half1" not in viewer.layers
    viewer.dims.ndisplay = 3
    assert viewer.layers["half1"] is half1 and half1.metadata["volume"].max() == pytest.approx(3.0, rel=1e-3)
    assert not viewer.layers["micrographs"].visible
    assert not [w for w in warnings if "Inconsistent units" in w]


def test_large_map_is_binned_for_display_in_place(make_napari_viewer):
    """A 256-voxel map is drawn from 128 voxels of twice the size, at the same place in Å: its surface mesh (the
    faces of a cube) stays where the cube is."""
    from napari_gpu_relion.widgets.display_model import prepare_map

    vol = np.zeros((256, 256, 256), np.float32)
    vol[100:140, 100:140, 100:140] = 1.0
    prepared = prepare_map(MapUpdated("big", vol, 1.5, None))
    viewer = make_napari_viewer()
    display = LiveDisplay.for_viewer(viewer)
    display.handle(prepared)
    display.flush()
    layer = viewer.layers["big"]
    assert viewer.dims.ndisplay == 3
    assert type(layer).__name__ == "Surface" and layer.metadata["display_bin"] == 2
    assert layer.metadata["volume"].shape == (128, 128, 128)
    np.testing.assert_allclose(layer.scale, [3.0] * 3)
    # the cube's centre (voxel 119.5 of the original) lands at the same world position, from the volume ...
    shown = layer.metadata["volume"]
    centre = np.array(np.nonzero(shown > 0.5)).mean(axis=1)
    np.testing.assert_allclose(centre * layer.scale + layer.translate, [119.5 * 1.5] * 3, atol=1e-6)
    # ... and from the surface: its vertices span the cube, 40 voxels of 1.5 Å
    world = layer.data[0] * layer.scale + layer.translate
    np.testing.assert_allclose(world.mean(axis=0), [119.5 * 1.5] * 3, atol=1.5)
    np.testing.assert_allclose(np.ptp(world, axis=0), [40 * 1.5] * 3, atol=2 * 3.0)

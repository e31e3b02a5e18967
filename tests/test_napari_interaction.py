"""Interaction in a real (Xvfb) napari viewer: class grid selection and saving, the pick threshold slider, picks
edited by hand and saved, the angular distribution dock of 3D auto-refine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("napari")

import starfile  # noqa: E402
from napari.utils.interactions import (  # noqa: E402
    mouse_move_callbacks,
    mouse_press_callbacks,
    mouse_release_callbacks,
)

from napari_gpu_relion.events import ClassAveragesUpdated, Finished, MicrographPicked  # noqa: E402
from napari_gpu_relion.io.micrographs import read_coordinate_list  # noqa: E402
from napari_gpu_relion.io.star import read_coordinates, write_star_blocks  # noqa: E402
from napari_gpu_relion.widgets.display import (  # noqa: E402
    LiveDisplay,
    class_at,
    grid_shape,
    tile_at,
    tile_corners,
)

PLUGIN = "napari-gpu-relion"


pytestmark = pytest.mark.usefixtures("config_dir")  # own settings folder per test (tests/conftest.py)


# ----------------------------------------------------------------------------------------------------------
# Simulated mouse: napari's own dispatch of drag callbacks (press, moves, release) on a layer


class _Mouse:
    """What napari's drag callbacks read from a mouse event."""

    def __init__(self, type_: str, position, pos, button: int = 1):
        self.type, self.position, self.pos, self.button = type_, tuple(position), np.asarray(pos, float), button
        self.modifiers: list[str] = []
        self.is_dragging = type_ == "mouse_move"
        self.handled = False
        self.dims_displayed = [0, 1]
        self.view_direction = None
        self.up_direction = None


class _Proxy:
    """Stands in for napari's read-only event wrapper: the dispatcher swaps ``__wrapped__`` between calls."""

    def __init__(self, event: _Mouse):
        self.__wrapped__ = event

    def __getattr__(self, name):
        return getattr(self.__dict__["__wrapped__"], name)


def _click(layer, position, drag_px: float = 0.0) -> None:
    """Press, (move by ``drag_px`` canvas pixels,) release at world ``position`` on ``layer``."""
    start = np.array([200.0, 150.0])
    mouse_press_callbacks(layer, _Proxy(_Mouse("mouse_press", position, start)))
    end = start + [drag_px, 0.0]
    if drag_px:
        mouse_move_callbacks(layer, _Proxy(_Mouse("mouse_move", position, end)))
    mouse_release_callbacks(layer, _Proxy(_Mouse("mouse_release", position, end)))


# ----------------------------------------------------------------------------------------------------------
# (a) click -> tile -> class


@pytest.mark.parametrize("K, shape", [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (5, (2, 3)), (10, (3, 4)),
                                      (50, (7, 8))])
def test_grid_shape(K, shape):
    assert grid_shape(K) == shape


def test_click_position_to_tile_and_class():
    N, apix = 64, 2.0
    # K = 4: 2 x 2 tiles; pixel i is centred at i, so tile 0 covers [-0.5, 63.5) px = [-1, 127) Å
    assert tile_at(0.0, 0.0, 4, N, apix) == 0
    assert tile_at(-1.0, -1.0, 4, N, apix) == 0
    assert tile_at(-1.01, 10.0, 4, N, apix) is None
    assert tile_at(10.0, 126.99, 4, N, apix) == 0
    assert tile_at(10.0, 127.0, 4, N, apix) == 1
    assert tile_at(96 * apix, 96 * apix, 4, N, apix) == 3
    assert tile_at(10.0, 255.0, 4, N, apix) is None  # right of the grid
    assert tile_at(255.0, 10.0, 4, N, apix) is None  # below the grid
    # K = 5: 3 columns, 2 rows, the last row holds 2 tiles
    assert [tile_at((r + 0.5) * N, (c + 0.5) * N, 5, N) for r in range(2) for c in range(3)] == [0, 1, 2, 3, 4, None]
    # K = 10: 4 columns, 3 rows
    assert tile_at(2.5 * N, 1.5 * N, 10, N) == 9 and tile_at(2.5 * N, 2.5 * N, 10, N) is None
    assert tile_at(0.5 * N, 3.5 * N, 10, N) == 3 and tile_at(1.5 * N, 0.5 * N, 10, N) == 4
    # classes through the display order (tile i shows 0-based class order[i]); RELION numbers from 1
    order = np.array([2, 0, 3, 1])
    assert [class_at((r + 0.5) * N * apix, (c + 0.5) * N * apix, order, N, apix)
            for r in range(2) for c in range(2)] == [3, 1, 4, 2]
    assert class_at(-5.0, 0.0, order, N, apix) is None
    # outlines: tile 4 of a 3-column grid of 16-px tiles is row 1, column 1
    np.testing.assert_allclose(tile_corners(4, 3, 16), [[15.5, 15.5], [15.5, 31.5], [31.5, 31.5], [31.5, 15.5]])
    np.testing.assert_allclose(tile_corners(1, 2, 64, inset=2.0)[[0, 2]], [[1.5, 65.5], [61.5, 125.5]])


# ----------------------------------------------------------------------------------------------------------
# (b) class selection in the viewer, kept across redraws, saved as the Select job does


def _classes_event(folder: Path, it: int, distribution, N: int = 16, apix: float = 3.0) -> ClassAveragesUpdated:
    """K constant tiles: class k (0-based) has value k + 1 with a bright corner (so each tile has a std)."""
    K = len(distribution)
    imgs = np.zeros((K, N, N), np.float32)
    for k in range(K):
        imgs[k] = k + 1
        imgs[k, :2, :2] = 10 * (k + 1)
    return ClassAveragesUpdated("classes", imgs, np.asarray(distribution, float), np.full(K, 12.0), apix,
                                folder / f"run_it{it:03d}_classes.mrcs")


def _data_star(path: Path, classes: np.ndarray) -> Path:
    n = len(classes)
    optics = pd.DataFrame({"rlnOpticsGroupName": ["g1"], "rlnOpticsGroup": [1], "rlnVoltage": [300.0],
                           "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1],
                           "rlnImagePixelSize": [3.0], "rlnImageSize": [16], "rlnImageDimensionality": [2]})
    parts = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@Extract/particles.mrcs" for i in range(n)],
                          "rlnOpticsGroup": np.ones(n, int), "rlnClassNumber": classes,
                          "rlnAnglePsi": np.linspace(-180, 180, n)})
    write_star_blocks(path, {"optics": optics, "particles": parts})
    return path


def _tile_centre(grid, tile: int) -> tuple[float, float]:
    """World (y, x) in Å of the centre of tile ``tile`` of the grid layer."""
    N = grid.metadata["tile_size"]
    ncol = grid_shape(len(grid.metadata["order"]))[1]
    r, c = divmod(tile, ncol)
    return ((r + 0.5) * N * grid.scale[0] + grid.translate[0], (c + 0.5) * N * grid.scale[1] + grid.translate[1])


def _outlined_tiles(selection_layer, N: int = 16) -> list[tuple[int, int]]:
    """(row, column) of the tiles outlined by the selection layer (rectangles in pixels)."""
    out = []
    for rect in selection_layer.data:
        lo, hi = rect.min(0), rect.max(0)
        np.testing.assert_allclose(hi - lo, [N - 2, N - 2])  # 1 px inside the tile (N / 32 at least 1)
        out.append(tuple(int(v) for v in (lo + hi) // 2 // N))
    return sorted(out)


def test_class_grid_selection_by_clicks_survives_redraws_and_saves(make_napari_viewer, tmp_path, errors):
    viewer = make_napari_viewer()
    display = LiveDisplay.for_viewer(viewer)
    folder = tmp_path / "Class2D" / "job007"
    display.handle(_classes_event(folder, 2, [0.1, 0.3, 0.05, 0.35, 0.2]))
    display.flush()
    grid = viewer.layers["classes"]
    order = list(grid.metadata["order"])
    assert order == [3, 1, 4, 0, 2]
    for tile, k in enumerate(order):  # the click mapping agrees with what the grid shows
        y, x = grid.world_to_data(_tile_centre(grid, tile))
        assert grid.data[int(y), int(x)] == pytest.approx(grid.data[int(y), int(x) + 1])
        assert class_at(*_tile_centre(grid, tile), order, 16, 3.0) == k + 1
    assert tuple(str(u) for u in grid.units) == ("angstrom", "angstrom")  # like every other layer
    active = viewer.layers.selection.active
    assert active.name == "classes"  # the grid stays active (pan/zoom: clicks select, nothing is edited)
    _click(viewer.layers["classes labels"], _tile_centre(grid, 0))  # class 4, clicked with the labels active
    assert viewer.layers.selection.active is grid  # drawing the outline did not activate the Shapes layer
    _click(viewer.layers.selection.active, _tile_centre(grid, 4))  # class 3
    assert grid.metadata["selected"] == {4, 3}
    sel = viewer.layers["classes selection"]
    assert sel.nshapes == 2
    assert _outlined_tiles(sel) == [(0, 0), (1, 1)]  # tile 0 (class 4) and tile 4 (class 3) of 3 columns
    _click(viewer.layers.selection.active, _tile_centre(grid, 1), drag_px=40)  # a pan, not a click
    _click(viewer.layers.selection.active, (-30.0, -30.0))  # outside the tiles
    assert grid.metadata["selected"] == {4, 3}
    _click(viewer.layers.selection.active, _tile_centre(grid, 0))  # toggles class 4 off
    assert grid.metadata["selected"] == {3} and sel.nshapes == 1
    _click(viewer.layers.selection.active, _tile_centre(grid, 3))  # class 1
    assert display.selected_classes("classes") == [1, 3]

    # the next iteration re-orders the tiles: the selection (class numbers) stays, its outlines move
    display.handle(_classes_event(folder, 3, [0.4, 0.1, 0.2, 0.05, 0.25]))
    display.flush()
    assert viewer.layers["classes"] is grid
    assert list(grid.metadata["order"]) == [0, 4, 2, 1, 3]
    assert grid.metadata["selected"] == {1, 3} and sel.nshapes == 2
    assert _outlined_tiles(sel) == [(0, 0), (0, 2)]  # class 1 is tile 0, class 3 tile 2 now
    assert grid.metadata["path"] == folder / "run_it003_classes.mrcs"

    # Save selection writes the particles of classes 1 and 3 of iteration 3
    classes = np.arange(40) % 5 + 1
    _data_star(folder / "run_it002_data.star", classes[::-1].copy())  # another iteration: not used
    _data_star(folder / "run_it003_data.star", classes)
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "2D classification")
    w.save_selection_button.native.click()
    assert not errors, errors
    out = folder / "selected_particles.star"
    parts = starfile.read(out)["particles"]
    assert len(parts) == 16 and set(parts["rlnClassNumber"]) == {1, 3}
    keep = np.flatnonzero(np.isin(classes, [1, 3]))
    assert list(parts["rlnImageName"]) == [f"{i + 1:06d}@Extract/particles.mrcs" for i in keep]
    assert w.last_saved == (out, 16)
    assert "wrote 16 of 40 particles" in w.status_text and "2 class(es): 1, 3" in w.selection_info.value
    assert not list(folder.glob(".*tmp*"))  # written through a temporary file, nothing left behind

    # a chosen file; a new job (another folder) starts with no selection
    w.selection_file.line_edit.value = str(tmp_path / "Select" / "mine.star")
    w.save_selection_button.native.click()
    assert len(starfile.read(tmp_path / "Select" / "mine.star")["particles"]) == 16
    display.handle(_classes_event(tmp_path / "Class2D" / "job008", 1, [0.2] * 5))
    display.flush()
    assert grid.metadata["selected"] == set() and sel.nshapes == 0
    w.save_selection_button.native.click()
    assert errors and "no classes selected" in errors[-1]


# ----------------------------------------------------------------------------------------------------------
# (c), (d) picks: threshold slider, editing by hand, saving

FOMS = [np.array([0.1, 0.25, 0.45, 0.6, 0.15, 0.8]), np.array([0.2, 0.7, 0.9, 0.35])]
NAMES = ["MotionCorr/job002/Micrographs/mic001.mrc", "MotionCorr/job002/Micrographs/mic002.mrc",
         "MotionCorr/job002/Micrographs/mic003.mrc"]


def _picked(index: int, foms: np.ndarray) -> MicrographPicked:
    n = len(foms)
    xy = np.column_stack([np.arange(n) * 20.0 + 10 + index, np.arange(n) * 15.0 + 5])
    return MicrographPicked(NAMES[index], index, xy, foms)


def _autopick_widget(viewer, pixel_size: float = 2.0):
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    w.display.micrograph_pixel_size = pixel_size
    return w


def test_threshold_slider_hides_low_fom_picks(make_napari_viewer, errors):
    viewer = make_napari_viewer()
    w = _autopick_widget(viewer)
    assert not w.fom_slider.enabled  # no picks yet
    display = w.display
    for i in (0, 1):
        display.handle(_picked(i, FOMS[i]))
    display.flush()
    picks = viewer.layers["picks"]
    fom = picks.features["fom"].to_numpy()
    assert w.fom_slider.enabled
    assert w.fom_slider.min == pytest.approx(0.1) and w.fom_slider.max == pytest.approx(0.9)
    assert picks.shown.sum() == 10
    w.fom_slider.value = 0.4
    assert picks.shown.sum() == (fom >= w.fom_slider.value).sum() == 5
    np.testing.assert_array_equal(picks.shown, fom >= 0.4)
    assert w.picks_info.value == "5 of 10 picks shown (FOM ≥ 0.4)"
    w.fom_slider.value = 0.85
    assert picks.shown.sum() == 1
    w.fom_slider.value = w.fom_slider.min  # lowest position: everything
    assert picks.shown.sum() == 10
    w.fom_slider.value = 0.4
    display.handle(_picked(2, np.array([1.5, 0.3])))  # the range follows new picks, the threshold stays
    display.flush()
    assert w.fom_slider.max == pytest.approx(1.5) and w.fom_slider.value == pytest.approx(0.4)
    assert picks.shown.sum() == 6 and len(picks.data) == 12
    assert not errors


def test_pick_rings_are_coloured_by_fom_and_hand_picks_by_their_own_colour(make_napari_viewer, errors):
    """The picks layer's rings: the lowest FOM in the ramp's first colour, the highest in its last, and a point
    added by hand (with napari's add mode) in MANUAL_PICK_COLOR; before, every ring was one colour."""
    from napari_gpu_relion.widgets.style import MANUAL_PICK_COLOR, PICK_COLORS, hex_to_rgb

    viewer = make_napari_viewer()
    w = _autopick_widget(viewer)
    for i in (0, 1):
        w.display.handle(_picked(i, FOMS[i]))
    w.display.flush()
    picks = viewer.layers["picks"]
    fom = picks.features["fom"].to_numpy()
    rings = np.asarray(picks.border_color)[:, :3]
    assert len({tuple(np.round(r, 6)) for r in rings}) == len(set(fom)) > 2
    np.testing.assert_allclose(rings[int(np.argmin(fom))], hex_to_rgb(PICK_COLORS[0]), atol=1e-6)
    np.testing.assert_allclose(rings[int(np.argmax(fom))], hex_to_rgb(PICK_COLORS[-1]), atol=1e-6)
    viewer.dims.set_point(0, 1)
    viewer.layers.selection.active = picks
    picks.mode = "add"
    _click(picks, (1.0, 30.25 * 2.0, 40.5 * 2.0))
    picks.mode = "pan_zoom"
    assert bool(picks.features["manual"].iloc[-1])
    np.testing.assert_allclose(np.asarray(picks.border_color)[-1, :3], hex_to_rgb(MANUAL_PICK_COLOR), atol=1e-6)
    w.display.handle(_picked(2, np.array([0.5, 0.2, 0.95])))  # new picks widen the range; the hand pick stays
    w.display.flush()
    rings = np.asarray(picks.border_color)[:, :3]
    fom = picks.features["fom"].to_numpy()
    manual = picks.features["manual"].to_numpy()
    np.testing.assert_allclose(rings[manual], [hex_to_rgb(MANUAL_PICK_COLOR)], atol=1e-6)
    np.testing.assert_allclose(rings[int(np.argmax(np.where(manual, -np.inf, fom)))], hex_to_rgb(PICK_COLORS[-1]),
                               atol=1e-6)
    assert not errors


def test_picks_edited_by_hand_are_saved_per_micrograph(make_napari_viewer, tmp_path, errors):
    viewer = make_napari_viewer()
    w = _autopick_widget(viewer)
    display = w.display
    for i in (0, 1):
        display.handle(_picked(i, FOMS[i]))
    display.flush()
    picks = viewer.layers["picks"]
    np.testing.assert_allclose(picks.scale, [1.0, 2.0, 2.0])
    w.fom_slider.value = 0.4  # shown: 0.45, 0.6, 0.8 on micrograph 0; 0.7, 0.9 on micrograph 1

    # add a point by hand on micrograph 1 (napari's add mode at the current slice), delete the 0.6 pick
    viewer.dims.set_point(0, 1)
    viewer.layers.selection.active = picks
    picks.mode = "add"
    _click(picks, (1.0, 30.25 * 2.0, 40.5 * 2.0))  # world: micrograph, y and x in Å
    picks.mode = "pan_zoom"
    assert len(picks.data) == 11
    new = picks.features.iloc[-1]
    assert new["mic"] == 1 and bool(new["manual"]) and new["fom"] == -999
    np.testing.assert_allclose(picks.data[-1], [1.0, 30.25, 40.5])
    assert picks.shown[-1]  # below the threshold, but picked by hand
    w.fom_slider.value = 0.5
    assert picks.shown[-1] and picks.shown.sum() == 5  # 0.6, 0.8, 0.7, 0.9 and the hand-picked point
    w.fom_slider.value = 0.4
    gone = int(np.flatnonzero(picks.features["fom"].to_numpy() == 0.6)[0])
    picks.selected_data = {gone}
    picks.remove_selected()
    assert len(picks.data) == 10 and picks.shown.sum() == 5

    # the job's next micrograph must not undo the edits
    display.handle(_picked(2, np.array([0.5, 0.2, 0.95])))
    display.flush()
    assert len(picks.data) == 13 and picks.shown.sum() == 7
    assert (picks.features["manual"].to_numpy()).sum() == 1

    w.picks_folder.line_edit.value = str(tmp_path / "ManualPick")
    w.save_picks_button.native.click()
    assert not errors, errors
    out = tmp_path / "ManualPick" / "Micrographs"
    m1, m2, m3 = (read_coordinates(out / f"mic00{k}_autopick.star") for k in (1, 2, 3))
    assert len(m1) == 2 and len(m2) == 3 and len(m3) == 2 and w.last_saved[1] == 7
    np.testing.assert_allclose(sorted(m1["rlnAutopickFigureOfMerit"]), [0.45, 0.8])  # 0.6 deleted, < 0.4 hidden
    hand = m2[m2["rlnAutopickFigureOfMerit"] == -999]
    assert len(hand) == 1
    assert hand["rlnCoordinateX"].iloc[0] == pytest.approx(40.5) and hand["rlnCoordinateY"].iloc[0] == \
        pytest.approx(30.25)
    x_auto = _picked(1, FOMS[1]).coords[[1, 2], 0]
    np.testing.assert_allclose(np.sort(m2["rlnCoordinateX"][m2["rlnAutopickFigureOfMerit"] != -999]),
                               np.sort(x_auto))  # pixels, not Å
    listed = read_coordinate_list(tmp_path / "ManualPick" / "autopick.star")
    assert list(listed) == NAMES and listed[NAMES[1]] == out / "mic002_autopick.star"
    assert "wrote 7 picks of 3 micrograph(s)" in w.status_text


# ----------------------------------------------------------------------------------------------------------
# (e) angular distribution of a refinement


def test_refine3d_finished_shows_the_angular_distribution(make_napari_viewer, qtbot, tmp_path, errors):
    rng = np.random.default_rng(3)
    n = 500
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    folder = tmp_path / "Refine3D" / "job010"
    optics = pd.DataFrame({"rlnOpticsGroupName": ["g1"], "rlnOpticsGroup": [1], "rlnVoltage": [300.0],
                           "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1],
                           "rlnImagePixelSize": [6.0], "rlnImageSize": [32], "rlnImageDimensionality": [2]})
    parts = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@p.mrcs" for i in range(n)], "rlnOpticsGroup": 1,
                          "rlnAngleRot": np.degrees(np.arctan2(v[:, 1], v[:, 0])),
                          "rlnAngleTilt": np.degrees(np.arccos(v[:, 2])), "rlnAnglePsi": rng.uniform(-180, 180, n)})
    data = write_star_blocks(folder / "run_data.star", {"optics": optics, "particles": parts})
    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "3D auto-refine")
    w._on_finished(Finished({"map": folder / "run_class001.mrc", "data": data}, "final resolution 12 Å"))
    # read, binned and drawn in a background thread; the dock shows the picture when it is ready
    qtbot.waitUntil(lambda: w.display.angdist is not None and w.display.angdist.draw_count == 1, timeout=20_000)
    assert not errors, errors
    plot = w.display.angdist
    assert plot is not None and "Angular distribution" in viewer.window.dock_widgets
    assert plot.histogram.counts.sum() == n and plot.source == data
    assert plot.axes.get_xlabel() == "rot (°)" and plot.axes.get_ylabel() == "tilt (°)"
    assert plot.colorbar.ax.get_ylabel() == "particles"
    # the button redraws from the job folder, in the same dock
    w.folder.value = str(folder)
    w.angdist_button.native.click()
    qtbot.waitUntil(lambda: plot.draw_count == 2, timeout=20_000)
    assert w.display.angdist is plot


# ----------------------------------------------------------------------------------------------------------
# Layers made when the dock opens, filled in place by the job's results (issue 18: no layer creation, no first
# draw of a new layer among the arriving results)


def _micrographs(viewer, apix: float = 2.0):
    return viewer.add_image(np.zeros((2, 64, 80), np.float32), name="micrographs", scale=(1, apix, apix),
                            units=("angstrom",) * 3,
                            metadata={"kind": "micrographs", "pixel_size": apix})


def test_picking_dock_makes_the_picks_layer_before_the_first_picks(make_napari_viewer, qtbot, errors):
    viewer = make_napari_viewer()
    _micrographs(viewer)
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    qtbot.waitUntil(lambda: "picks" in viewer.layers, timeout=5_000)  # made at the display's next turn
    picks = viewer.layers["picks"]
    assert len(picks.data) == 0 and picks.ndim == 3
    np.testing.assert_allclose(picks.scale, [1.0, 2.0, 2.0])
    assert tuple(str(u) for u in picks.units) == ("angstrom",) * 3  # like the micrographs: the scale bar in Å
    assert w.picks_info.value == "no picks yet" and not w.fom_slider.enabled
    assert w.save_picks() is None and "no picks yet" in w.status_text  # nothing to save in the empty layer
    assert len(errors) == 1 and "no picks yet" in errors[0]
    errors.clear()
    other = viewer.add_image(np.zeros((64, 80), np.float32), name="opened later", scale=(2.0, 2.0),
                             units=("angstrom",) * 2)
    inserted = []
    viewer.layers.events.inserted.connect(lambda e: inserted.append(e.value.name))
    display = w.display
    for i in (0, 1):
        display.handle(_picked(i, FOMS[i]))
    display.flush()
    assert inserted == [] and viewer.layers["picks"] is picks  # filled in place, no new layer
    assert len(picks.data) == 10 and set(picks.data[:, 0].astype(int)) == {0, 1}
    np.testing.assert_allclose(picks.data[0, 1:], [5.0, 10.0])  # (y, x) in micrograph pixels ...
    np.testing.assert_allclose(picks.data_to_world(picks.data[0])[1:], [10.0, 20.0])  # ... drawn in Å
    assert viewer.layers.index(picks) > viewer.layers.index(other)  # above the image opened after it
    assert viewer.layers.selection.active is picks
    assert w.fom_slider.enabled and w.picks_info.value == "10 of 10 picks shown"
    assert not errors


def test_picks_layer_made_ahead_takes_the_pixel_size_known_at_the_first_picks(make_napari_viewer, qtbot, errors):
    viewer = make_napari_viewer()
    _micrographs(viewer, apix=2.0)
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    qtbot.waitUntil(lambda: "picks" in viewer.layers, timeout=5_000)
    picks = viewer.layers["picks"]
    w.display.micrograph_pixel_size = 1.5  # e.g. --angpix of the job
    w.display.handle(_picked(0, FOMS[0]))
    w.display.flush()
    assert viewer.layers["picks"] is picks
    np.testing.assert_allclose(picks.scale, [1.0, 1.5, 1.5])
    assert picks.metadata["pixel_size"] == 1.5
    assert not errors


def test_class2d_dock_makes_the_grid_labels_ahead_and_fills_them_in_place(make_napari_viewer, qtbot, tmp_path,
                                                                          errors):
    viewer = make_napari_viewer()
    _micrographs(viewer)
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "2D classification")
    qtbot.waitUntil(lambda: "classes labels" in viewer.layers, timeout=5_000)
    labels = viewer.layers["classes labels"]
    assert tuple(str(u) for u in labels.units) == ("angstrom",) * 2  # no "Inconsistent units" with the micrographs
    assert viewer.layers.selection.active is not labels  # made ahead: not the layer one works on
    inserted = []
    viewer.layers.events.inserted.connect(lambda e: inserted.append(e.value.name))
    display = w.display
    display.handle(_classes_event(tmp_path, 1, [0.4, 0.3, 0.2, 0.1]))
    display.flush()
    grid = viewer.layers["classes"]
    assert inserted == ["classes"] and viewer.layers["classes labels"] is labels  # only the grid is new
    assert len(labels.data) == 4 and all("%" in t and "Å" in t for t in labels.features["label"])
    assert viewer.layers.index(labels) == viewer.layers.index(grid) + 1  # right above its grid
    np.testing.assert_allclose(labels.translate, grid.translate)
    np.testing.assert_allclose(labels.scale, grid.scale)
    assert grid.translate[1] > 0  # beside the micrographs
    assert labels.text.color.constant[3] > 0  # the text shows (made ahead, it was transparent)
    assert viewer.layers.selection.active is grid
    assert w.selection_info.value.startswith("no classes") or "click" in w.selection_info.value
    assert not errors


def _canvas_point(viewer, world_yx) -> tuple[int, int]:
    """The canvas pixel (x, y) of a world (y, x) point in the 2D view: napari's camera maps world to canvas as
    (world - centre) * zoom + half the canvas; checked against napari's own inverse map."""
    canvas = viewer.window._qt_viewer.canvas
    w, h = canvas.native.width(), canvas.native.height()
    cy, cx = viewer.camera.center[-2:]
    z = viewer.camera.zoom
    px = (world_yx[1] - cx) * z + w / 2.0, (world_yx[0] - cy) * z + h / 2.0
    back = canvas._map_canvas2world(px, canvas.view)
    np.testing.assert_allclose(back[-2:], world_yx, atol=1.0 / z)
    return int(round(px[0])), int(round(px[1]))


def test_picks_edited_with_real_clicks(make_napari_viewer, qtbot, errors):
    """Pick editing with the mouse as a user does it (Qt mouse and key events on the canvas, no scripted layer
    calls): a click in add mode adds a hand pick where it lands, a click in select mode selects the pick under it,
    Delete removes it; the dock's count follows each edit. The picks lie a ring's width apart, as real picks do
    (napari gives a click inside two overlapping rings to the later point)."""
    from qtpy.QtCore import QPoint, Qt

    viewer = make_napari_viewer(show=True)
    viewer.window._qt_window.resize(1366, 768)
    w = _autopick_widget(viewer)
    xy = np.array([[40.0, 40.0], [140.0, 40.0], [40.0, 140.0], [140.0, 140.0]])  # pixels, 100 apart
    w.display.handle(MicrographPicked(NAMES[0], 0, xy, np.array([0.3, 0.45, 0.6, 0.9])))
    w.display.flush()
    picks = viewer.layers["picks"]
    assert float(np.max(picks.size)) < 100  # the rings do not overlap
    viewer.dims.set_point(0, 0)
    viewer.reset_view()
    qtbot.wait(100)
    canvas = viewer.window._qt_viewer.canvas.native
    viewer.layers.selection.active = picks
    assert w.picks_info.value.startswith("4 of 4 picks shown")

    picks.mode = "add"
    target = (180.0, 180.0)  # world (Å): y, x on micrograph 0, between the four picks
    qtbot.mouseClick(canvas, Qt.MouseButton.LeftButton, pos=QPoint(*_canvas_point(viewer, target)))
    qtbot.wait(50)
    assert len(picks.data) == 5, "a click in add mode added nothing"
    np.testing.assert_allclose(picks.data[-1][1:] * 2.0, target, atol=2.0 / viewer.camera.zoom + 1e-6)
    assert picks.data[-1][0] == 0 and bool(picks.features["manual"].iloc[-1])
    assert w.picks_info.value.startswith("5 of 5 picks shown")

    picks.mode = "select"
    victim = 1  # the 0.45 pick at (x, y) = (140, 40) px
    at = QPoint(*_canvas_point(viewer, xy[victim][::-1] * 2.0))
    qtbot.mouseClick(canvas, Qt.MouseButton.LeftButton, pos=at)
    qtbot.wait(50)
    assert picks.selected_data == {victim}, f"a click in select mode selected {picks.selected_data}"
    qtbot.keyClick(canvas, Qt.Key.Key_Delete)
    qtbot.wait(50)
    assert len(picks.data) == 4 and 0.45 not in set(picks.features["fom"])
    assert w.picks_info.value.startswith("4 of 4 picks shown")
    assert not errors, errors

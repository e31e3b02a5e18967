"""The widgets' plain models, without Qt or napari: picks (threshold, hand edits, what Save writes) and the 2D
class grid (layout, click -> class, selection)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from napari_gpu_relion.widgets.class_grid_model import ClassGrid
from napari_gpu_relion.widgets.pick_model import MANUAL_PICK_VALUE, PickModel

MIC = ["MotionCorr/job002/Micrographs/mic001.mrc", "MotionCorr/job002/Micrographs/mic002.mrc",
       "MotionCorr/job002/Micrographs/mic003.mrc"]


def _xy(n: int, index: int) -> np.ndarray:
    """(n, 2) x, y pixels: x = 10 * (i + 1) + index, y = 100 + i."""
    return np.column_stack([10.0 * (np.arange(n) + 1) + index, 100.0 + np.arange(n)])


def _two_micrographs() -> PickModel:
    model = PickModel()
    model.set_micrograph(1, MIC[1], _xy(3, 1), [0.2, 0.7, 0.9])
    model.set_micrograph(0, MIC[0], _xy(4, 0), [0.1, 0.45, 0.6, 0.8])
    return model


# ----------------------------------------------------------------------------------------------------------
# Picks


def test_picks_are_grouped_by_micrograph_and_filtered_by_threshold():
    model = _two_micrographs()
    assert len(model) == 7
    np.testing.assert_array_equal(model.mic, [0, 0, 0, 0, 1, 1, 1])  # ascending, whatever the arrival order
    np.testing.assert_allclose(model.fom, [0.1, 0.45, 0.6, 0.8, 0.2, 0.7, 0.9])
    np.testing.assert_allclose(model.xy[4], [11.0, 100.0])
    assert model.shown.all() and model.threshold == -np.inf
    assert model.fom_range() == (0.1, 0.9)
    model.threshold = 0.5
    np.testing.assert_array_equal(model.shown, [False, False, True, True, False, True, True])
    assert model.n_shown == 4
    model.threshold = 0.6  # at least the threshold is shown
    assert model.n_shown == 4
    model.threshold = 0.85
    assert model.n_shown == 1
    assert model.micrograph_names() == MIC[:2]


def test_hand_edits_survive_threshold_and_later_picks():
    model = _two_micrographs()
    model.threshold = 0.5
    row = model.add(1, 40.5, 30.25)  # below any threshold, but picked by hand
    assert row == 7 and model.mic[row] == 1 and model.fom[row] == MANUAL_PICK_VALUE and model.manual[row]
    assert model.shown[row] and model.n_shown == 5
    assert model.fom_range() == (0.1, 0.9)  # manual picks have no FOM
    model.remove([2])  # the 0.6 pick of micrograph 0
    assert len(model) == 7 and model.n_shown == 4
    np.testing.assert_allclose(model.fom[:3], [0.1, 0.45, 0.8])

    model.set_micrograph(2, MIC[2], _xy(3, 2), [0.5, 0.2, 0.95])  # the job's next micrograph
    assert len(model) == 10 and model.n_shown == 6
    assert model.manual.sum() == 1
    np.testing.assert_allclose(model.xy[model.manual][0], [40.5, 30.25])
    np.testing.assert_array_equal(model.mic, [0, 0, 0, 1, 1, 1, 1, 2, 2, 2])

    model.set_micrograph(1, MIC[1], _xy(1, 1), [0.3])  # new picks of micrograph 1 replace all of its rows
    np.testing.assert_array_equal(model.mic, [0, 0, 0, 1, 2, 2, 2])
    assert model.manual.sum() == 0 and model.n_shown == 3


def test_replace_takes_the_edited_layer_rows_in_their_order():
    model = _two_micrographs()
    mic = np.array([1, 0, 3])
    xy = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    model.replace(mic, xy, [0.9, 0.2, MANUAL_PICK_VALUE], [False, False, True],
                  names=["ignored: micrograph 0 is known", "", "", "from the layer"])
    np.testing.assert_array_equal(model.mic, mic)
    np.testing.assert_allclose(model.xy, xy)
    assert model.names == {0: MIC[0], 1: MIC[1], 3: "from the layer"}
    assert model.micrograph_names() == [MIC[0], MIC[1], "", "from the layer"]
    with pytest.raises(ValueError):
        model.replace([0, 1], xy, [0.1, 0.2, 0.3], [False] * 3)


def test_what_save_picks_writes():
    model = _two_micrographs()
    model.set_micrograph(2, MIC[2], np.empty((0, 2)), [])  # a micrograph without picks: an empty file
    model.threshold = 0.5
    model.add(1, 40.5, 30.25)
    model.remove([3])  # the 0.8 pick of micrograph 0
    model.add(4, 7.0, 8.0)  # a micrograph the job did not name
    tables = model.coordinate_tables()
    assert [(t.index, t.name, len(t)) for t in tables] == [(0, MIC[0], 1), (1, MIC[1], 3), (2, MIC[2], 0),
                                                          (4, "", 1)]
    t0, t1 = tables[0], tables[1]
    np.testing.assert_allclose([t0.x[0], t0.y[0], t0.fom[0]], [30.0, 102.0, 0.6])
    np.testing.assert_allclose(t1.x, [21.0, 31.0, 40.5])  # pixels, in row order
    np.testing.assert_allclose(t1.y, [101.0, 102.0, 30.25])
    np.testing.assert_allclose(t1.fom, [0.7, 0.9, -999.0])
    np.testing.assert_array_equal(t1.class_number, [-999] * 3)
    assert t1.class_number.dtype == np.int64
    np.testing.assert_allclose(t1.psi, [-999.0] * 3)
    assert sum(len(t) for t in tables) == model.n_shown == 5
    model.clear()
    assert len(model) == 0 and model.coordinate_tables() == [] and model.fom_range() is None


# ----------------------------------------------------------------------------------------------------------
# Class grid


def test_class_grid_layout_labels_and_image():
    dist = [0.1, 0.3, 0.05, 0.35, 0.2]
    grid = ClassGrid(dist, [12.0, 8.4, 20.0, 7.6, 9.5], 16, "Class2D/job007/run_it002_classes.mrcs")
    assert grid.K == 5 and grid.shape == (2, 3) and grid.image_shape == (32, 48)
    np.testing.assert_array_equal(grid.order, [3, 1, 4, 0, 2])  # largest class first
    assert grid.labels() == ["4: 35.0% 8 Å", "2: 30.0% 8 Å", "5: 20.0% 10 Å", "1: 10.0% 12 Å", "3: 5.0% 20 Å"]
    np.testing.assert_allclose(grid.label_positions(), [[1, 1], [1, 17], [1, 33], [17, 1], [17, 17]])
    assert [grid.tile_of(k) for k in (1, 2, 3, 4, 5)] == [3, 1, 4, 0, 2]
    assert grid.tile_origin(4) == (16, 16)
    imgs = np.arange(5 * 16 * 16, dtype=np.float32).reshape(5, 16, 16)
    imgs[2] = 7.0  # a flat class: std 0, shown as zeros
    image = grid.compose(imgs)
    assert image.shape == (32, 48) and image.dtype == np.float32
    t = imgs[3]
    np.testing.assert_allclose(image[:16, :16], (t - t.mean()) / t.std(), rtol=1e-5)  # tile 0 = class 4
    np.testing.assert_allclose(image[16:, 16:32], 0.0)  # tile 4 = class 3
    np.testing.assert_allclose(image[16:, 32:], 0.0)  # no tile 5
    with pytest.raises(ValueError):
        grid.compose(imgs[:4])


def test_click_position_to_class():
    grid = ClassGrid([0.1, 0.3, 0.05, 0.35, 0.2], np.full(5, 10.0), 64)
    # pixel i is centred at i: tile 0 covers [-0.5, 63.5) in y and x
    assert grid.class_at(-0.5, -0.5) == 4 and grid.class_at(63.49, 63.49) == 4
    assert grid.class_at(-0.51, 10.0) is None
    assert grid.class_at(10.0, 63.5) == 2  # tile 1
    assert grid.class_at(10.0, 3 * 64 - 0.5) is None  # right of the 3 columns
    assert [grid.class_at(64 + 32, 32 + 64 * c) for c in range(3)] == [1, 3, None]  # row 1 has 2 tiles
    assert grid.class_at(2 * 64, 10.0) is None  # below the 2 rows


def test_toggle_selection_and_outlines():
    grid = ClassGrid([0.1, 0.3, 0.05, 0.35, 0.2], np.full(5, 10.0), 16)
    assert grid.toggle_at(8.0, 8.0) == 4 and grid.selected == {4}
    assert grid.toggle_at(24.0, 24.0) == 3 and grid.selected_classes() == [3, 4]
    assert grid.toggle_at(-5.0, -5.0) is None and grid.selected == {3, 4}
    assert grid.toggle(4) is False and grid.selected == {3}
    assert grid.toggle(1) is True and grid.selected_classes() == [1, 3]
    with pytest.raises(ValueError):
        grid.toggle(6)
    assert grid.outline_width == 1.0
    outlines = grid.selection_outlines()  # class 1 is tile 3 (row 1, column 0), class 3 tile 4
    np.testing.assert_allclose(outlines[0], [[16.5, 0.5], [16.5, 14.5], [30.5, 14.5], [30.5, 0.5]])
    np.testing.assert_allclose(outlines[1][0], [16.5, 16.5])
    assert ClassGrid(np.ones(4), np.ones(4), 64).outline_width == 2.0


def test_selection_is_kept_across_iterations_of_one_job():
    folder = Path("Class2D/job007")
    it2 = ClassGrid([0.1, 0.3, 0.05, 0.35, 0.2], np.full(5, 10.0), 16, folder / "run_it002_classes.mrcs",
                    selected=[1, 5])
    it3 = ClassGrid([0.4, 0.1, 0.2, 0.05], np.full(4, 10.0), 16, folder / "run_it003_classes.mrcs")
    it3.keep_selection_of(it2)
    assert it3.selected == {1}  # class 5 no longer exists
    assert it3.tile_of(1) == 0
    other = ClassGrid(np.full(5, 0.2), np.full(5, 10.0), 16, "Class2D/job008/run_it001_classes.mrcs")
    other.keep_selection_of(it2)
    assert other.selected == set()  # another job
    fresh = ClassGrid(np.full(5, 0.2), np.full(5, 10.0), 16)
    fresh.keep_selection_of(None)
    assert fresh.selected == set()


# ----------------------------------------------------------------------------------------------------------
# No GUI toolkit


def test_models_import_without_qt_or_napari():
    code = textwrap.dedent("""
        import sys
        from napari_gpu_relion.widgets.class_grid_model import ClassGrid
        from napari_gpu_relion.widgets.pick_model import PickModel

        grid = ClassGrid([0.5, 0.5], [10.0, 10.0], 8)
        grid.toggle_at(1.0, 1.0)
        grid.compose([[[0.0] * 8] * 8] * 2)
        grid.selection_outlines()
        model = PickModel()
        model.set_micrograph(0, "a.mrc", [[1.0, 2.0]], [0.5])
        model.add(0, 3.0, 4.0)
        model.coordinate_tables()
        gui = ("qtpy", "PyQt5", "PyQt6", "PySide2", "PySide6", "napari", "magicgui", "vispy", "superqt")
        print(sorted(m for m in sys.modules if m.split(".")[0] in gui))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

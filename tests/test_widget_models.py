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


def test_fom_histogram_bins_and_threshold_line():
    """The picking dock's FOM histogram: equal bins from the lowest to the highest automatic FOM, hand picks
    left out, the shown part of each bin and the threshold line's place along the axis."""
    model = _two_micrographs()  # FOMs 0.1 0.2 0.45 0.6 0.7 0.8 0.9
    model.add(0, 5.0, 5.0)  # FOM -999: not in the histogram
    h = model.fom_histogram(bins=5)
    np.testing.assert_allclose(h.edges, [0.1, 0.26, 0.42, 0.58, 0.74, 0.9])
    np.testing.assert_array_equal(h.counts, [2, 0, 1, 2, 2])  # 0.9 (the top edge) in the last bin
    np.testing.assert_array_equal(h.shown, h.counts)
    assert h.threshold_position is None  # threshold -inf: no line
    model.threshold = 0.6
    h = model.fom_histogram(bins=5)
    np.testing.assert_array_equal(h.shown, [0, 0, 0, 2, 2])  # 0.45 hidden, 0.6 shown
    assert h.threshold_position == pytest.approx(0.625)  # (0.6 - 0.1) / (0.9 - 0.1)
    assert int(h.shown.sum()) == int((~model.manual & model.shown).sum())
    model.threshold = 5.0  # above every pick: the line at the right edge, nothing shown
    h = model.fom_histogram(bins=5)
    assert h.threshold_position == 1.0 and h.shown.sum() == 0
    assert PickModel().fom_histogram() is None


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
    """The models, the forms, the colours and the display preparation (run in job threads) load no GUI."""
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
        import numpy as np
        from napari_gpu_relion.events import MapUpdated
        from napari_gpu_relion.widgets.display_model import prepare_map
        from napari_gpu_relion.widgets.form_model import form_layout
        from napari_gpu_relion.widgets.locres_model import legend_ticks
        from napari_gpu_relion.widgets.style import PICK_COLORS
        z = np.mgrid[:16, :16, :16][0].astype(np.float32)
        assert len(prepare_map(MapUpdated("m", z, 1.0)).faces) > 10  # marching cubes in the worker: no GUI
        coloured = prepare_map(MapUpdated("m", z, 1.0, surface_values=z + 3))  # the local-resolution surface
        assert len(coloured.vertex_values) == len(coloured.vertices)
        legend_ticks(3.0, 5.0)
        form_layout("refine3d", [("i", "--i")])
        gui = ("qtpy", "PyQt5", "PyQt6", "PySide2", "PySide6", "napari", "magicgui", "vispy", "superqt")
        print(sorted(m for m in sys.modules if m.split(".")[0] in gui))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_slider_range_ignores_one_outlier_but_not_a_spread():
    model = PickModel()
    foms = np.array([0.15, 0.2, 0.22, 0.25, 0.3, 0.31, 0.35, 0.4, 0.42, 0.5, 0.55, 0.6])
    model.set_micrograph(0, MIC[0], _xy(13, 0), np.append(foms, 5.0))  # one pick on contamination, FOM 5
    lo, hi = model.slider_range()
    assert lo == pytest.approx(0.15) and hi == pytest.approx(0.6)  # the outlier does not stretch the slider
    model.threshold = hi
    assert model.shown[-1]  # ... and stays shown at the slider's top
    model.set_micrograph(0, MIC[0], _xy(13, 0), np.append(foms, 0.9))  # a high FOM within the spread counts
    assert model.slider_range() == (pytest.approx(0.15), pytest.approx(0.9))
    few = PickModel()
    few.set_micrograph(0, MIC[0], _xy(3, 0), [0.1, 0.2, 5.0])  # too few picks to call anything an outlier
    assert few.slider_range() == (pytest.approx(0.1), pytest.approx(5.0))
    assert PickModel().slider_range() is None


# ----------------------------------------------------------------------------------------------------------
# The option forms (tabs, labels in words, basic / advanced)


def _all_jobs():
    from napari_gpu_relion.jobs import (
        autopick,
        class2d,
        class3d,
        ctf_refine,
        extract,
        initial_model,
        local_resolution,
        mask_create,
        postprocess,
        reconstruct,
        refine3d,
        select,
    )

    return (autopick, extract, class2d, initial_model, class3d, refine3d, select, reconstruct, postprocess,
            mask_create, ctf_refine, local_resolution)


def _flags(module) -> list[tuple[str, str, str]]:
    """(name, flag, help) of every Params field of a job module."""
    import dataclasses

    return [(f.name, f.metadata.get("flag") or f"--{f.name}", f.metadata.get("help", ""))
            for f in dataclasses.fields(module.Params) if f.init]


def test_every_option_of_every_job_has_a_label_in_words_and_a_tab():
    from napari_gpu_relion.widgets.form_model import TAB_ORDER, form_of, known

    for module in _all_jobs():
        for _name, flag, help_text in _flags(module):
            assert known(module.JOB_NAME, flag), f"{module.JOB_NAME} {flag}: add it to widgets/form_model.py"
            form = form_of(module.JOB_NAME, flag)
            assert form.tab in TAB_ORDER and form.tab != "Other"
            assert not form.label.startswith("-") and form.label[0].isupper(), (flag, form.label)
            # a unit the help text gives (Å, px, degrees, %) is in the label too
            for unit, spelled in (("(Å)", "Å"), ("(pixels", "px"), ("(degrees)", "°")):
                if unit in help_text and flag not in ("--lowpass",):
                    assert spelled in form.label, (module.JOB_NAME, flag, form.label, help_text)


def test_form_layout_groups_options_in_relion_like_tabs_basic_first():
    from napari_gpu_relion.jobs import autopick, refine3d
    from napari_gpu_relion.widgets.form_model import form_layout

    tabs = {t.name: t for t in form_layout("refine3d", [(n, f) for n, f, _ in _flags(refine3d)])}
    assert list(tabs) == ["I/O", "Reference", "CTF", "Optimisation", "Sampling", "Compute"]  # RELION's order
    assert tabs["I/O"].basic == ("i", "o") and tabs["I/O"].advanced == ("continue_from",)
    assert "ref" in tabs["Reference"].basic and "ctf" in tabs["CTF"].basic
    assert "healpix_order" in tabs["Sampling"].basic and "batch" in tabs["Compute"].advanced
    pick = {t.name: t for t in form_layout("autopick", [(n, f) for n, f, _ in _flags(autopick)])}
    assert {"LoG", "Templates"} <= set(pick)  # LoG and template options no longer mixed
    assert "LoG_diam_min" in pick["LoG"].basic and "ref" in pick["Templates"].basic
    assert not set(pick["LoG"].basic + pick["LoG"].advanced) & set(pick["Templates"].basic + pick["Templates"].advanced)
    # every field lands in exactly one tab
    names = [n for n, _, _ in _flags(autopick)]
    placed = [n for t in pick.values() for n in t.basic + t.advanced]
    assert sorted(placed) == sorted(names)
    # an unknown flag is kept, folded, under its own name
    other = form_layout("toy", [("x", "--new_option")])
    assert [(t.name, t.basic, t.advanced) for t in other] == [("Other", (), ("x",))]


# ----------------------------------------------------------------------------------------------------------
# Display preparation (done in the worker thread) and colours


def test_bin_volume_averages_blocks_and_prepare_map_keeps_the_map_in_place():
    from napari_gpu_relion.events import MapUpdated
    from napari_gpu_relion.widgets.display_model import bin_volume, prepare_map

    vol = np.arange(6 * 6 * 6, dtype=np.float32).reshape(6, 6, 6)
    binned = bin_volume(vol, 2)
    assert binned.shape == (3, 3, 3)
    assert binned[1, 2, 0] == pytest.approx(vol[2:4, 4:6, 0:2].mean())
    ev = prepare_map(MapUpdated("m", np.zeros((200, 200, 200), np.float32), 1.0), max_box=100)
    assert ev.bin_factor == 2 and ev.display_volume.shape == (100, 100, 100)
    assert ev.display_scale == (2.0, 2.0, 2.0) and ev.display_translate == (0.5, 0.5, 0.5)
    # a flat map has no surface: one degenerate triangle, nothing drawn
    assert len(ev.faces) == 1 and not np.ptp(ev.vertices)


def test_iso_mesh_is_the_surface_at_the_level():
    from napari_gpu_relion.widgets.display_model import iso_mesh

    z, y, x = np.mgrid[:40, :40, :40] - 19.5
    r = np.sqrt(x * x + y * y + z * z)
    vol = (r < 10).astype(np.float32) * 0 + np.clip(15 - r, 0, None).astype(np.float32)  # 5 at radius 10
    verts, faces = iso_mesh(vol, 5.0)
    assert verts.dtype == np.float32 and faces.dtype == np.int32 and faces.max() < len(verts)
    radius = np.linalg.norm(verts - 19.5, axis=1)
    np.testing.assert_allclose(radius, 10.0, atol=0.3)  # a sphere of radius 10 voxels
    assert len(faces) > 500


def test_prepare_classes_composes_the_grid_off_the_gui_thread():
    from napari_gpu_relion.events import ClassAveragesUpdated
    from napari_gpu_relion.widgets.display_model import prepare_classes, prepare_event

    imgs = np.stack([np.full((8, 8), k, np.float32) + np.eye(8, dtype=np.float32) for k in range(3)])
    ev = ClassAveragesUpdated("classes", imgs, np.array([0.2, 0.5, 0.3]), np.full(3, 10.0), 2.0)
    prepared = prepare_event(ev)
    assert prepared == prepare_classes(prepared) or prepared is prepare_classes(prepared)
    assert isinstance(prepared, ClassAveragesUpdated)  # handlers of the job event still receive it
    assert list(prepared.grid.order) == [1, 2, 0] and prepared.grid_image.shape == (16, 16)
    np.testing.assert_allclose(prepared.grid_image, prepared.grid.compose(imgs))


# Machado et al. (2009) colour-vision-deficiency matrices (severity 1) in linear RGB
_CVD = {
    "normal": np.eye(3),
    "protanopia": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                            [-0.003882, -0.048116, 1.051998]]),
    "deuteranopia": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                              [-0.011820, 0.042940, 0.968881]]),
    "tritanopia": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                            [0.004733, 0.691367, 0.303900]]),
}


def _lab(rgb: np.ndarray, vision: str) -> np.ndarray:
    """CIELAB of an sRGB colour as seen with ``vision``."""
    c = np.asarray(rgb, dtype=np.float64)
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    lin = np.clip(_CVD[vision] @ lin, 0, 1)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ lin
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > 0.008856, np.cbrt(t), 7.787 * t + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_pick_colours_stand_out_for_colour_blind_viewers():
    """Low and high FOM are told apart, no pick colour is near the true picks' yellow, and every pick colour is
    bright and saturated enough to be seen on a grey micrograph, with normal vision and under simulated
    protanopia, deuteranopia and tritanopia (the former 'plasma' ramp ended in near-black purple and yellow)."""
    from napari_gpu_relion.widgets.style import PICK_COLORS, TRUE_PICK_COLOR, hex_to_rgb

    ramp = [np.array(hex_to_rgb(c)) for c in PICK_COLORS]
    samples = [ramp[0] + t * (ramp[1] - ramp[0]) for t in np.linspace(0, 1, 5)] + \
              [ramp[1] + t * (ramp[2] - ramp[1]) for t in np.linspace(0, 1, 5)]
    true = np.array(hex_to_rgb(TRUE_PICK_COLOR))
    for vision in _CVD:
        low, high = _lab(ramp[0], vision), _lab(ramp[-1], vision)
        assert np.linalg.norm(low - high) > 40, vision
        for c in samples:
            lab = _lab(c, vision)
            assert np.linalg.norm(lab - _lab(true, vision)) > 25, (vision, c)
            if vision == "normal":
                assert 45 < lab[0] < 80 and np.hypot(lab[1], lab[2]) > 50, c  # mid lightness, saturated


def test_extraction_boxes_cover_exactly_the_pixels_extraction_cut():
    """A square of side B at the drawn centre holds the centres of exactly the pixels cut_boxes takes."""
    from napari_gpu_relion.compute.extraction import cut_boxes
    from napari_gpu_relion.widgets.display_model import extraction_boxes

    ny, nx, B = 40, 50, 8
    rows, cols = np.mgrid[0:ny, 0:nx]
    xy = np.array([[20, 15], [31, 9]])
    centres = extraction_boxes(3, xy)
    assert np.all(centres[:, 0] == 3)
    for k, (x, y) in enumerate(xy):
        cut_cols = cut_boxes(cols.astype(np.float32), [x], [y], B)[0]
        cut_rows = cut_boxes(rows.astype(np.float32), [x], [y], B)[0]
        cy, cx = centres[k, 1:]
        inside = (np.abs(rows - cy) < B / 2) & (np.abs(cols - cx) < B / 2)
        assert set(zip(rows[inside], cols[inside], strict=True)) == \
            set(zip(cut_rows.ravel().astype(int), cut_cols.ravel().astype(int), strict=True))


def test_extraction_gallery_is_composed_like_the_class_grid():
    from napari_gpu_relion.events import ParticlesExtracted
    from napari_gpu_relion.widgets.class_grid_model import ClassGrid
    from napari_gpu_relion.widgets.display_model import prepare_extraction

    imgs = np.random.default_rng(0).standard_normal((5, 8, 8)).astype(np.float32)
    ev = prepare_extraction(ParticlesExtracted("m.mrc", 0, np.zeros((5, 2)), 16, 1.0, imgs, 2.0))
    assert ev.gallery_image.shape == (16, 24)  # 5 tiles in 3 columns, 2 rows
    same_order = ClassGrid(np.full(5, 0.2), np.zeros(5), 8).compose(imgs)  # equal classes keep their order
    np.testing.assert_array_equal(ev.gallery_image, same_order)


def test_extraction_boxes_colour_differs_from_picks_and_true_picks_for_colour_blind_viewers():
    from napari_gpu_relion.widgets.style import EXTRACTION_BOX_COLOR, PICK_COLORS, TRUE_PICK_COLOR, hex_to_rgb

    ramp = [np.array(hex_to_rgb(c)) for c in PICK_COLORS]
    others = [ramp[0] + t * (ramp[1] - ramp[0]) for t in np.linspace(0, 1, 5)] + \
             [ramp[1] + t * (ramp[2] - ramp[1]) for t in np.linspace(0, 1, 5)] + [np.array(hex_to_rgb(TRUE_PICK_COLOR))]
    box = np.array(hex_to_rgb(EXTRACTION_BOX_COLOR))
    for vision in _CVD:
        assert min(np.linalg.norm(_lab(box, vision) - _lab(c, vision)) for c in others) > 20, vision


def _direct_display(img: np.ndarray, apix: float, f: int, res: float) -> np.ndarray:
    """Binning by explicit block means and a raised-cosine low-pass (none for res 0) through the full complex FFT,
    in float64."""
    img = np.asarray(img, np.float64)
    ny, nx = img.shape[0] // f, img.shape[1] // f
    binned = np.zeros((ny, nx))
    for j in range(ny):
        for i in range(nx):
            binned[j, i] = img[j * f:(j + 1) * f, i * f:(i + 1) * f].mean()
    if res <= 0:
        return binned
    a = apix * f
    ky = np.array([min(k, ny - k) for k in range(ny)], float) / (ny * a)
    kx = np.array([min(k, nx - k) for k in range(nx)], float) / (nx * a)
    s = np.hypot(ky[:, None], kx[None, :])
    width = 2.0 / (max(ny, nx) * a)
    lo = 1.0 / res - width / 2
    w = np.clip((s - lo) / width, 0.0, 1.0)
    filt = 0.5 + 0.5 * np.cos(np.pi * w)
    return np.real(np.fft.ifft2(np.fft.fft2(binned) * filt))


@pytest.mark.parametrize(("f", "res"), [(1, 9.0), (2, 0.0), (3, 25.0), (2, 14.0)])
def test_display_micrograph_equals_a_direct_float64_computation(f, res):
    from napari_gpu_relion.widgets.display_model import display_micrograph

    img = np.random.default_rng(1).standard_normal((62, 90)).astype(np.float32) * 5 + 100
    shown, apix, shift = display_micrograph(img, 2.0, f, res)
    direct = _direct_display(img, 2.0, f, res)
    assert shown.dtype == np.float32 and shown.shape == (62 // f, 90 // f)
    np.testing.assert_allclose(shown, direct, rtol=0, atol=1e-4)
    assert apix == 2.0 * f and shift == 2.0 * (f - 1) / 2


def test_binned_micrograph_keeps_a_particle_at_its_place_in_angstrom():
    """A bright 3 x 3 block whose binned pixel is fully inside: its centroid in Å is unchanged by binning."""
    from napari_gpu_relion.widgets.display_model import display_micrograph

    img = np.zeros((30, 33), np.float32)
    img[9:12, 15:18] = 1.0  # centre pixel (10, 16): at (20, 32) Å with 2 Å pixels
    shown, apix, shift = display_micrograph(img, 2.0, 3)
    j, i = np.unravel_index(np.argmax(shown), shown.shape)
    assert (j * apix + shift, i * apix + shift) == (20.0, 32.0)


def test_pick_rings_take_the_fom_ramp_over_the_automatic_picks_and_hand_picks_their_own_colour():
    """PickModel.border_colours: the lowest automatic FOM gets the ramp's first colour and the highest its last,
    one halfway its middle colour; a pick added by hand (FOM -999) is MANUAL_PICK_COLOR and does not stretch the
    range (the picks layer had its colour limits at (-999, -999) and every ring was one colour)."""
    from napari_gpu_relion.widgets.style import MANUAL_PICK_COLOR, PICK_COLORS, TRUE_PICK_COLOR, hex_to_rgb

    model = PickModel()
    model.set_micrograph(0, "a.mrc", [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [0.2, 0.5, 0.8])
    model.add(0, 7.0, 8.0)
    rgba = model.border_colours()
    assert rgba.shape == (4, 4)
    manual = model.manual
    want = {0.2: PICK_COLORS[0], 0.5: PICK_COLORS[1], 0.8: PICK_COLORS[2]}
    for fom, colour in want.items():
        row = int(np.flatnonzero((model.fom == fom) & ~manual)[0])
        np.testing.assert_allclose(rgba[row, :3], hex_to_rgb(colour), atol=1e-12)
    np.testing.assert_allclose(rgba[manual, :3], [hex_to_rgb(MANUAL_PICK_COLOR)])
    assert len({tuple(r) for r in rgba[~manual]}) == 3  # three FOMs, three colours
    black = np.array(hex_to_rgb(MANUAL_PICK_COLOR))
    for vision in _CVD:
        for c in (*PICK_COLORS, TRUE_PICK_COLOR, "#FFFFFF"):
            assert np.linalg.norm(_lab(black, vision) - _lab(np.array(hex_to_rgb(c)), vision)) > 20, (vision, c)


def test_the_progress_bar_is_busy_only_while_a_job_is_cancelling():
    """Issue 49: after a cancel the bar kept its busy animation (maximum 0) for good."""
    from napari_gpu_relion.widgets.progress_model import bar_in_state

    assert bar_in_state("cancelling", (40, 200)) == (0, 0)  # busy until the job has stopped
    assert bar_in_state("cancelled", (0, 0), before_cancel=(40, 200)) == (40, 200)  # as it stood, not busy
    assert bar_in_state("cancelled", (0, 0)) == (0, 1)  # never busy, even without a bar to go back to
    assert bar_in_state("failed", (0, 0), before_cancel=(3, 10)) == (3, 10)
    assert bar_in_state("failed", (7, 10)) == (7, 10)
    assert bar_in_state("finished", (0, 0)) == (1, 1) and bar_in_state("finished", (5, 10)) == (10, 10)
    assert bar_in_state("running", (5, 10)) == (5, 10) and bar_in_state("queued", (0, 1)) == (0, 1)


# ----------------------------------------------------------------------------------------------------------
# The local-resolution view (widgets/locres_model.py; the geometry: tests/test_display_surface.py)


def test_prepare_map_colours_the_surface_of_a_map_by_its_values():
    from napari_gpu_relion.events import MapUpdated
    from napari_gpu_relion.widgets.display_model import prepare_map

    n = 48
    z, y, x = np.mgrid[:n, :n, :n].astype(np.float64) - (n - 1) / 2
    r = np.sqrt(x * x + y * y + z * z)
    vol = np.clip(1.0 - r / 30.0, 0.0, None).astype(np.float32)
    locres = (3.0 + 0.05 * (z + (n - 1) / 2)).astype(np.float32)
    mask = (r < 15).astype(np.float32)
    ev = prepare_map(MapUpdated("lr", vol, 2.0, surface_values=locres, values_mask=mask, values_label="Å"),
                     max_box=24, level=0.5)
    assert ev.bin_factor == 2 and ev.iso_threshold == 0.5 and ev.value_colormap == "turbo"
    full_z = ev.vertices[:, 0].astype(np.float64) * 2 + 0.5  # a binned voxel's centre on the full grid
    np.testing.assert_allclose(ev.vertex_values, 3.0 + 0.05 * full_z, atol=1e-4)
    inside = locres[mask > 0.5]
    assert ev.value_limits == pytest.approx(tuple(np.percentile(inside, [5, 95])), rel=1e-5)
    plain = prepare_map(MapUpdated("m", vol, 2.0))
    assert plain.vertex_values is None  # a map without values keeps its one colour


def test_locres_folder_files_and_legend(tmp_path):
    from napari_gpu_relion.errors import InputError
    from napari_gpu_relion.io.mrc import write_mrc
    from napari_gpu_relion.widgets.locres_model import legend_ticks, locres_files, surface_event, tick_label

    assert legend_ticks(3.0, 5.0, 5) == [3.0, 3.5, 4.0, 4.5, 5.0]
    assert legend_ticks(4.0, 4.0) == [4.0] and tick_label(3.456) == "3.5 Å"
    folder = tmp_path / "LocalRes" / "job012"
    folder.mkdir(parents=True)
    with pytest.raises(InputError, match="no local-resolution map"):
        locres_files(folder)
    vol = np.zeros((8, 8, 8), np.float32)
    write_mrc(folder / "relion_locres.mrc", vol + 4.0, 1.5)
    with pytest.raises(InputError, match="filtered"):
        locres_files(folder)
    write_mrc(folder / "relion_locres_filtered.mrc", vol, 1.5)
    write_mrc(folder / "other_locres.mrc", vol, 1.5)  # RELION's rootname "relion" first
    assert locres_files(folder) == (folder / "relion_locres.mrc", folder / "relion_locres_filtered.mrc")
    write_mrc(tmp_path / "mask.mrc", vol + 1.0, 1.5)
    ev = surface_event(folder, tmp_path / "mask.mrc")
    assert ev.path == folder / "relion_locres_filtered.mrc" and ev.values_path == folder / "relion_locres.mrc"
    assert ev.pixel_size == pytest.approx(1.5) and float(ev.surface_values.max()) == 4.0
    assert ev.values_mask.shape == (8, 8, 8) and "Å" in ev.values_label
    write_mrc(tmp_path / "small.mrc", np.zeros((4, 4, 4), np.float32), 1.5)
    with pytest.raises(InputError, match="mask's shape"):
        surface_event(folder, tmp_path / "small.mrc")

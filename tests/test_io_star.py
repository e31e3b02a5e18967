"""STAR reading/writing against real RELION files; expected values come from a tiny independent reader."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from napari_gpu_relion import _reader
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.micrographs import micrograph_list, read_coordinate_list, write_coordinate_list
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.io.particle_images import image_locations, image_names_for, load_images, parse_image_name
from napari_gpu_relion.io.star import (
    ParticleTable,
    read_coordinates,
    read_micrographs,
    read_particles,
    read_star,
    write_coordinates,
    write_particles,
)

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real"
needs_data = pytest.mark.skipif(not REAL.is_dir(), reason=f"shared real data not found at {REAL}")

# file -> read_particles keyword arguments (the 6-group file really has 1.24 and 1.25 Å groups)
PARTICLE_FILES = {
    "relion31.star": {},
    "relion31_6opticsgroups.star": {"uniform_optics": False},
    "relion5_particles.star": {},
    "empiar_10076_7_relion30.star": {},
}


# ---------------------------------------------------------------------------------------------------------
# A tiny, independent STAR text reader used only to compute expected values


def parse_loop(text: str, block: str) -> tuple[list[str], list[list[str]], list[int]]:
    """Labels, whitespace-split rows and 1-based line numbers of the rows of loop ``data_<block>``."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.strip() == f"data_{block}")
    labels, rows, numbers = [], [], []
    for i in range(start + 1, len(lines)):
        s = lines[i].strip()
        if s.startswith("data_"):
            break
        if not s or s.startswith("#") or s == "loop_":
            continue
        if s.startswith("_"):
            labels.append(s.split()[0][1:])
        else:
            rows.append(s.split())
            numbers.append(i + 1)
    return labels, rows, numbers


def cell(text: str, block: str, row: int, label: str) -> str:
    labels, rows, _ = parse_loop(text, block)
    return rows[row][labels.index(label)]


def edit_cell(text: str, block: str, row: int, label: str, value: str) -> str:
    """Copy of ``text`` with one table cell replaced (the row is re-joined with single spaces)."""
    labels, rows, numbers = parse_loop(text, block)
    tokens = list(rows[row])
    tokens[labels.index(label)] = value
    lines = text.split("\n")
    lines[numbers[row] - 1] = " ".join(tokens)
    return "\n".join(lines)


def copy_with(tmp_path: Path, name: str, text: str, *, with_stack: str | None = None) -> Path:
    out = tmp_path / name
    out.write_text(text)
    if with_stack:
        shutil.copy(REAL / with_stack, tmp_path / with_stack)
    return out


def real_text(name: str) -> str:
    return (REAL / name).read_text()


# ---------------------------------------------------------------------------------------------------------
# Reading real files


@needs_data
@pytest.mark.parametrize("name", list(PARTICLE_FILES))
def test_particle_values_match_text(name):
    text = real_text(name)
    table = read_particles(REAL / name, **PARTICLE_FILES[name])
    block = "" if name.endswith("relion30.star") else "particles"
    labels, rows, numbers = parse_loop(text, block)
    assert len(table) == len(rows)
    for row in (0, len(rows) - 1):
        assert table.particles["rlnDefocusU"].iloc[row] == float(cell(text, block, row, "rlnDefocusU"))
        assert table.particles["rlnImageName"].iloc[row] == cell(text, block, row, "rlnImageName")
    assert table.row_lines.tolist() == numbers
    # every particle carries the optics columns
    for col in ("rlnOpticsGroup", "rlnVoltage", "rlnImagePixelSize", "rlnAmplitudeContrast"):
        assert col in table.particles.columns
    if block == "particles":
        olabels, orows, _ = parse_loop(text, "optics")
        assert table.optics["rlnVoltage"].tolist() == [float(r[olabels.index("rlnVoltage")]) for r in orows]
        assert table.optics["rlnImagePixelSize"].tolist() == [
            float(r[olabels.index("rlnImagePixelSize")]) for r in orows]
        assert table.version == ("5" if "relion5" in name else "3.1")
    else:
        assert table.version == "3.0"


@needs_data
def test_six_optics_groups_merge_per_particle():
    name = "relion31_6opticsgroups.star"
    text = real_text(name)
    table = read_particles(REAL / name, uniform_optics=False)
    olabels, orows, _ = parse_loop(text, "optics")
    by_group = {int(r[olabels.index("rlnOpticsGroup")]): r for r in orows}
    assert sorted(by_group) == [1, 2, 3, 4, 5, 6]
    labels, rows, _ = parse_loop(text, "particles")
    seen = set()
    for i, r in enumerate(rows):
        g = int(r[labels.index("rlnOpticsGroup")])
        seen.add(g)
        orow = by_group[g]
        p = table.particles.iloc[i]
        assert p["rlnOpticsGroup"] == g
        for col in ("rlnImagePixelSize", "rlnSphericalAberration", "rlnBeamTiltX", "rlnMagMat00",
                    "rlnMicrographPixelSize"):
            assert p[col] == float(orow[olabels.index(col)]), (i, col)
        assert p["rlnOpticsGroupName"] == orow[olabels.index("rlnOpticsGroupName")]
    assert seen == {1, 2, 3, 4, 5, 6}
    # groups really differ, so the per-row check above could fail
    assert table.particles.groupby("rlnOpticsGroup")["rlnImagePixelSize"].first().nunique() == 2
    assert table.particles.groupby("rlnOpticsGroup")["rlnSphericalAberration"].first().nunique() == 2
    with pytest.raises(InputError, match="different pixel sizes"):
        _ = table.pixel_size


@needs_data
def test_relion5_extra_optics_columns_survive():
    text = real_text("relion5_particles.star")
    table = read_particles(REAL / "relion5_particles.star")
    assert table.version == "5"
    for col in ("rlnBeamTiltX", "rlnBeamTiltY", "rlnOddZernike", "rlnEvenZernike", "rlnMagMat00",
                "rlnMagMat01", "rlnMagMat10", "rlnMagMat11", "rlnCtfDataAreCtfPremultiplied"):
        assert col in table.optics.columns and col in table.particles.columns
        expected = cell(text, "optics", 0, col)
        got = table.particles[col].iloc[-1]
        assert (got == expected) if isinstance(got, str) else (got == float(expected)), col
    assert table.optics["rlnMagMat01"].iloc[0] == -7.04404e-04
    assert table.optics["rlnOddZernike"].iloc[0].startswith("[0.0680480107376,")
    assert table.pixel_size == 0.89 and table.box_size == 448


@needs_data
def test_relion30_pixel_size_from_magnification_and_images():
    name = "empiar_10076_7_relion30.star"
    text = real_text(name)
    detector = float(cell(text, "", 0, "rlnDetectorPixelSize"))  # µm
    mag = float(cell(text, "", 0, "rlnMagnification"))
    expected = detector * 1e4 / mag
    table = read_particles(REAL / name)
    assert table.version == "3.0"
    assert table.pixel_size == pytest.approx(expected, rel=1e-15)
    assert table.pixel_size == pytest.approx(1.30999790, abs=1e-8)
    assert table.optics["rlnOpticsGroup"].tolist() == [1]
    assert table.optics["rlnVoltage"].iloc[0] == 300
    assert table.optics["rlnSphericalAberration"].iloc[0] == 2.7
    assert table.box_size == 320  # from the stack header, since RELION 3.0 files do not store it
    assert table.particles["rlnMicrographName"].tolist() == [str(i) for i in range(1, 8)]  # text, not ints
    imgs = load_images(table)
    assert imgs.shape == (7, 320, 320) and imgs.dtype == np.float32
    stack = read_mrc(REAL / "empiar_10076_7.mrc").data
    np.testing.assert_array_equal(imgs, stack)
    paths, idx = image_locations(table)
    assert idx.tolist() == list(range(7)) and paths[0].resolve() == (REAL / "empiar_10076_7.mrc").resolve()


@needs_data
def test_relion31_images_and_pixel_size():
    table = read_particles(REAL / "relion31.star")
    assert table.pixel_size == 2.806
    assert table.box_size == 256
    imgs = load_images(table)
    assert imgs.shape == (5, 256, 256)
    stack = read_mrc(REAL / "relion31.mrcs").data
    np.testing.assert_array_equal(imgs, stack)
    sub = load_images(table, rows=[3, 1])
    np.testing.assert_array_equal(sub, stack[[3, 1]])
    # same result when the project folder is given explicitly
    np.testing.assert_array_equal(load_images(table, rows=[4], project_dir=REAL), stack[[4]])


@needs_data
def test_other_real_star_files():
    post = read_star(REAL / "relion_postprocess.star")
    assert list(post) == ["general", "fsc", "guinier"]
    assert post["general"]["rlnFinalResolution"] == 16.363636
    assert post["general"]["rlnMaskName"] == "mask.mrc"
    assert len(post["fsc"]) == 49
    assert post["fsc"]["rlnAngstromResolution"].iloc[1] == 720.0
    assert post["fsc"]["rlnFourierShellCorrelationCorrected"].iloc[2] == 0.999902
    opt = read_star(REAL / "relion_tutorial_run_it025_optimiser_3D.star")
    general = opt["optimiser_general"]
    assert general["rlnCurrentIteration"] == 25
    assert general["rlnOutputRootName"] == "Class3D/job020/run"
    assert general["rlnParticleDiameter"] == 200.0
    assert general["rlnSolventMaskName"] == "None"
    samp = read_star(REAL / "relion_tutorial_run_it025_sampling_3D.star")
    assert samp["sampling_general"]["rlnHealpixOrder"] == 2
    assert samp["sampling_general"]["rlnSymmetryGroup"] == "C1"
    assert samp["sampling_general"]["rlnPsiStep"] == 15.0
    text = real_text("relion_tutorial_run_it025_sampling_3D.star")
    _, rows, _ = parse_loop(text, "sampling_directions")
    assert len(samp["sampling_directions"]) == len(rows) == 192
    assert samp["sampling_directions"]["rlnAngleTilt"].iloc[-1] == float(rows[-1][1])
    style = read_star(REAL / "relion31_data_style.star")
    assert list(style) == ["block_1", "block_2", "block_3"]
    assert style["block_1"]["rlnImagePixelSize"].iloc[0] == 1.04
    pd.testing.assert_frame_equal(style["block_2"], style["block_3"])
    assert style["block_2"]["rlnCoordinateZ"].tolist() == [-51.5227, -51.5227]


# ---------------------------------------------------------------------------------------------------------
# Round trip


@needs_data
@pytest.mark.parametrize("name", list(PARTICLE_FILES))
def test_round_trip_is_exact(tmp_path, name):
    kwargs = PARTICLE_FILES[name]
    first = read_particles(REAL / name, **kwargs)
    out = write_particles(tmp_path / name, first)
    text = out.read_text()
    assert text.split("\n")[0] == "# version 30001"
    assert text.index("data_optics") < text.index("data_particles")
    plabels, prows, _ = parse_loop(text, "particles")
    olabels, _, _ = parse_loop(text, "optics")
    assert "rlnOpticsGroup" in plabels
    assert not (set(plabels) & set(olabels)) - {"rlnOpticsGroup"}, "optics columns repeated in particles"
    second = read_particles(out, **kwargs)
    pd.testing.assert_frame_equal(first.particles, second.particles, check_exact=True)
    pd.testing.assert_frame_equal(first.optics, second.optics, check_exact=True)
    # the written numbers are the original numbers (compare as values: formatting differs)
    block = "" if name.endswith("relion30.star") else "particles"
    orig = real_text(name)
    assert float(cell(text, "particles", len(prows) - 1, "rlnDefocusV")) == float(
        cell(orig, block, len(prows) - 1, "rlnDefocusV"))


@needs_data
def test_write_from_dataframes_and_refuse_lost_values(tmp_path):
    table = read_particles(REAL / "relion31.star")
    out = write_particles(tmp_path / "p.star", table.particles, table.optics)
    assert read_particles(out).particles["rlnDefocusU"].tolist() == table.particles["rlnDefocusU"].tolist()
    changed = table.particles.copy()
    changed.loc[2, "rlnVoltage"] = 200.0  # a per-particle voltage cannot be written in the 3.1 layout
    with pytest.raises(InputError) as err:
        write_particles(tmp_path / "bad.star", changed, table.optics)
    assert "rlnVoltage" in str(err.value) and "row 3" in str(err.value)
    assert not (tmp_path / "bad.star").exists()


@needs_data
def test_micrographs_table(tmp_path):
    six = read_particles(REAL / "relion31_6opticsgroups.star", uniform_optics=False)
    mics = six.particles[["rlnMicrographName", "rlnOpticsGroup"]].drop_duplicates("rlnMicrographName")
    optics = six.optics[["rlnOpticsGroup", "rlnOpticsGroupName", "rlnVoltage", "rlnSphericalAberration",
                         "rlnAmplitudeContrast", "rlnMicrographPixelSize"]]
    out = write_particles(tmp_path / "micrographs_ctf.star", mics.reset_index(drop=True), optics,
                          block="micrographs")
    assert "data_micrographs" in out.read_text()
    table = read_micrographs(out)
    assert table.block == "micrographs" and len(table) == len(mics)
    expected = dict(zip(optics["rlnOpticsGroup"], optics["rlnMicrographPixelSize"], strict=True))
    merged = table.particles
    for g, px in zip(merged["rlnOpticsGroup"], merged["rlnMicrographPixelSize"], strict=True):
        assert px == expected[g]
    assert sorted(set(expected.values())) == [1.035, 1.24, 1.25]
    with pytest.raises(InputError, match="rlnMicrographPixelSize"):
        _ = table.pixel_size  # 1.035 vs 1.25 Å: more than RELION's 0.01 Å
    same = read_micrographs(write_particles(tmp_path / "one.star", mics[mics.rlnOpticsGroup == 1], optics,
                                            block="micrographs"))
    assert same.pixel_size == 1.25


# ---------------------------------------------------------------------------------------------------------
# Coordinates


def test_coordinates_round_trip(tmp_path):
    x = np.array([100.5, 2000.25, 3.0])
    y = np.array([10.0, 20.0, 4095.75])
    out = write_coordinates(tmp_path / "mic_autopick.star", x, y, fom=[1.5, 0.25, -0.125], class_number=0,
                            psi=0.0)
    text = out.read_text()
    labels, rows, _ = parse_loop(text, "")
    assert labels == ["rlnCoordinateX", "rlnCoordinateY", "rlnAutopickFigureOfMerit", "rlnClassNumber",
                      "rlnAnglePsi"]
    assert len(rows) == 3 and rows[1][0] == "2000.25"
    df = read_coordinates(out)
    assert df["rlnCoordinateX"].tolist() == x.tolist()
    assert df["rlnCoordinateY"].tolist() == y.tolist()
    assert df["rlnAutopickFigureOfMerit"].tolist() == [1.5, 0.25, -0.125]
    assert df["rlnClassNumber"].tolist() == [0, 0, 0]
    plain = read_coordinates(write_coordinates(tmp_path / "plain.star", x, y))
    assert plain["rlnAutopickFigureOfMerit"].tolist() == [-999.0] * 3
    assert plain["rlnClassNumber"].tolist() == [-999] * 3 and plain["rlnAnglePsi"].tolist() == [-999.0] * 3
    empty = read_coordinates(write_coordinates(tmp_path / "none.star", [], []))
    assert len(empty) == 0 and "rlnCoordinateX" in empty.columns


def test_coordinates_any_order_and_missing_optional(tmp_path):
    template_style = ("\n# version 30001\n\ndata_\n\nloop_ \n_rlnCoordinateX #1 \n_rlnCoordinateY #2 \n"
                      "_rlnClassNumber #3 \n_rlnAutopickFigureOfMerit #4 \n_rlnAnglePsi #5 \n"
                      "  512.000000  1024.000000            2     0.731000   -35.000000 \n"
                      "   64.000000    32.000000            1     0.402000   120.000000 \n")
    p = tmp_path / "tpl.star"
    p.write_text(template_style)
    df = read_coordinates(p)
    assert df["rlnClassNumber"].tolist() == [2, 1]
    assert df["rlnAutopickFigureOfMerit"].tolist() == [0.731, 0.402]
    assert df["rlnAnglePsi"].tolist() == [-35.0, 120.0]
    manual = tmp_path / "manual.star"
    manual.write_text("data_\n\nloop_\n_rlnCoordinateY #1\n_rlnCoordinateX #2\n7 8\n9 10\n")
    df = read_coordinates(manual)
    assert df["rlnCoordinateX"].tolist() == [8.0, 10.0] and df["rlnCoordinateY"].tolist() == [7.0, 9.0]
    assert df["rlnAutopickFigureOfMerit"].tolist() == [-999.0, -999.0]
    assert df["rlnClassNumber"].tolist() == [-999, -999] and df["rlnAnglePsi"].tolist() == [-999.0, -999.0]
    assert list(df.columns) == ["rlnCoordinateX", "rlnCoordinateY", "rlnAutopickFigureOfMerit",
                                "rlnClassNumber", "rlnAnglePsi"]
    no_y = tmp_path / "no_y.star"
    no_y.write_text("data_\n\nloop_\n_rlnCoordinateX #1\n_rlnAnglePsi #2\n7 8\n")
    with pytest.raises(InputError) as err:
        read_coordinates(no_y)
    msg = str(err.value)
    assert "no_y.star" in msg and "rlnCoordinateY" in msg and "rlnAnglePsi" in msg


# ---------------------------------------------------------------------------------------------------------
# Bad input: each error names the file and the line/column/value


@needs_data
def test_missing_columns_all_named(tmp_path):
    text = real_text("relion31.star").replace("_rlnDefocusU #7", "_rlnDefocusUU #7")
    text = text.replace("_rlnImageName #22", "_rlnImageNameX #22")
    p = copy_with(tmp_path, "cols.star", text)
    with pytest.raises(InputError) as err:
        read_particles(p, require=("rlnImageName", "rlnDefocusU", "rlnAngleRot"))
    msg = str(err.value)
    assert str(p) in msg
    assert "rlnImageName, rlnDefocusU" in msg  # both missing names, not the present rlnAngleRot
    assert "rlnAngleRot" in msg.split("the file has:")[1]  # and what the file has
    assert err.value.column == "rlnImageName, rlnDefocusU"


@needs_data
@pytest.mark.parametrize("bad", ["nan", "inf", "NaN"])
def test_non_finite_defocus_gives_line(tmp_path, bad):
    name = "relion31_6opticsgroups.star"
    text = edit_cell(real_text(name), "particles", 9, "rlnDefocusU", bad)
    p = copy_with(tmp_path, name, text)
    # the expected line, found by searching the edited text for the row
    row_text = [line for line in text.split("\n") if f" {bad} " in line and "@Polish" in line]
    assert len(row_text) == 1
    expected_line = text.split("\n").index(row_text[0]) + 1
    with pytest.raises(InputError) as err:
        read_particles(p, uniform_optics=False)
    assert err.value.line == expected_line
    assert err.value.column == "rlnDefocusU"
    msg = str(err.value)
    assert str(p) in msg and f"line {expected_line}" in msg and "rlnDefocusU" in msg


@needs_data
def test_text_in_numeric_column(tmp_path):
    text = edit_cell(real_text("relion31.star"), "particles", 3, "rlnAngleTilt", "abc")
    p = copy_with(tmp_path, "txt.star", text)
    _, _, numbers = parse_loop(text, "particles")
    with pytest.raises(InputError) as err:
        read_particles(p)
    assert err.value.line == numbers[3] and err.value.column == "rlnAngleTilt" and "'abc'" in str(err.value)


@needs_data
def test_stack_index_beyond_stack(tmp_path):
    text = real_text("relion31.star").replace("000005@relion31.mrcs", "000009@relion31.mrcs")
    p = copy_with(tmp_path, "beyond.star", text, with_stack="relion31.mrcs")
    _, _, numbers = parse_loop(text, "particles")
    table = read_particles(p)
    np.testing.assert_array_equal(load_images(table, rows=[0])[0], read_mrc(REAL / "relion31.mrcs").data[0])
    with pytest.raises(InputError) as err:
        load_images(table)
    msg = str(err.value)
    assert str(p) in msg and f"line {numbers[4]}" in msg
    assert str(tmp_path / "relion31.mrcs") in msg
    assert "image 9" in msg and "only 5 images" in msg


@needs_data
def test_missing_stack_file(tmp_path):
    p = copy_with(tmp_path, "nostack.star", real_text("relion31.star"))
    table = read_particles(p)
    with pytest.raises(InputError) as err:
        load_images(table, project_dir=tmp_path)
    msg = str(err.value)
    assert "relion31.mrcs" in msg and "not found" in msg and str(p) in msg
    with pytest.raises(InputError, match="cannot find image stack"):
        image_locations(read_particles(REAL / "relion5_particles.star"))


@needs_data
def test_mismatched_optics_groups(tmp_path):
    name = "relion31_6opticsgroups.star"
    _, _, onumbers = parse_loop(real_text(name), "optics")
    with pytest.raises(InputError) as err:
        read_particles(REAL / name)
    msg = str(err.value)
    assert name in msg and err.value.column == "rlnImagePixelSize"
    assert err.value.line == onumbers[1]  # group 2 is the first that differs from group 1
    assert "group 1 (opticsGroup5) = 1.25" in msg and "group 2 (opticsGroup3) = 1.24" in msg
    # same pixel size everywhere but one box size different
    text = real_text(name)
    for row in range(6):
        text = edit_cell(text, "optics", row, "rlnImagePixelSize", "1.250000")
    text = edit_cell(text, "optics", 3, "rlnImageSize", "198")
    p = copy_with(tmp_path, "boxes.star", text)
    with pytest.raises(InputError) as err:
        read_particles(p)
    assert err.value.column == "rlnImageSize" and err.value.line == onumbers[3]
    assert "group 4 (opticsGroup1) = 198" in str(err.value) and "196" in str(err.value)
    sizes = read_particles(p, uniform_optics=False).optics["rlnImageSize"].tolist()
    assert sizes == [196] * 3 + [198] + [196] * 2


@needs_data
def test_odd_box(tmp_path):
    text = edit_cell(real_text("relion31.star"), "optics", 0, "rlnImageSize", "255")
    p = copy_with(tmp_path, "odd.star", text)
    _, _, onumbers = parse_loop(text, "optics")
    with pytest.raises(InputError) as err:
        read_particles(p)
    assert err.value.line == onumbers[0] and err.value.column == "rlnImageSize"
    assert "255" in str(err.value) and "odd" in str(err.value) and str(p) in str(err.value)
    assert read_particles(p, even_box=False).box_size == 255


@needs_data
def test_unknown_optics_group(tmp_path):
    text = edit_cell(real_text("relion31.star"), "particles", 2, "rlnOpticsGroup", "2")
    p = copy_with(tmp_path, "group.star", text)
    _, _, numbers = parse_loop(text, "particles")
    with pytest.raises(InputError) as err:
        read_particles(p)
    assert err.value.line == numbers[2] and "[2]" in str(err.value) and err.value.column == "rlnOpticsGroup"


@needs_data
def test_empty_inputs(tmp_path):
    empty = tmp_path / "empty.star"
    empty.write_text("")
    for reader in (read_star, read_particles, read_coordinates):
        with pytest.raises(InputError) as err:
            reader(empty)
        assert str(empty) in str(err.value) and "empty" in str(err.value)
    junk = tmp_path / "junk.star"
    junk.write_text("# only a comment\nhello\n")
    with pytest.raises(InputError, match="no data blocks"):
        read_star(junk)
    with pytest.raises(InputError, match="not found"):
        read_particles(tmp_path / "nope.star")
    # labels but no rows
    text = real_text("relion31.star")
    _, _, numbers = parse_loop(text, "particles")
    lines = text.split("\n")
    no_rows = "\n".join(line for i, line in enumerate(lines, start=1) if i not in numbers)
    p = copy_with(tmp_path, "norows.star", no_rows)
    with pytest.raises(InputError) as err:
        read_particles(p)
    assert "no rows" in str(err.value) and str(p) in str(err.value)


@needs_data
def test_malformed_image_name(tmp_path):
    text = real_text("relion31.star").replace("000003@relion31.mrcs", "000003relion31.mrcs")
    p = copy_with(tmp_path, "name.star", text, with_stack="relion31.mrcs")
    _, _, numbers = parse_loop(text, "particles")
    table = read_particles(p)
    with pytest.raises(InputError) as err:
        load_images(table)
    msg = str(err.value)
    assert str(p) in msg and f"line {numbers[2]}" in msg and "000003relion31.mrcs" in msg
    assert err.value.column == "rlnImageName"


def test_parse_image_name():
    assert parse_image_name("000012@Particles/mic1.mrcs") == (11, "Particles/mic1.mrcs")
    assert parse_image_name("00000012@Particles/mic1.mrcs") == (11, "Particles/mic1.mrcs")  # 8 digits
    assert parse_image_name("1@empiar_10076_7.mrc") == (0, "empiar_10076_7.mrc")
    assert parse_image_name(" 123456789@/abs/path/s.mrcs ") == (123456788, "/abs/path/s.mrcs")
    for bad in ("abc@x.mrcs", "0@x.mrcs", "@x.mrcs", "5@", "x.mrcs", "-1@x.mrcs", "1.5@x.mrcs"):
        with pytest.raises(InputError) as err:
            parse_image_name(bad)
        assert repr(bad.strip()) in str(err.value) or "0" in bad


def test_particle_table_in_memory():
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnImagePixelSize": [1.5], "rlnImageSize": [64]})
    parts = pd.DataFrame({"rlnImageName": ["1@a.mrcs"], "rlnOpticsGroup": [1]})
    table = ParticleTable(particles=parts, optics=optics)
    assert table.pixel_size == 1.5 and table.box_size == 64 and table.line_of(0) is None


@needs_data
def test_required_column_may_come_from_optics():
    table = read_particles(REAL / "relion31.star", require=("rlnImageName", "rlnVoltage", "rlnDefocusU"))
    assert table.particles["rlnVoltage"].tolist() == [300.0] * 5
    legacy = read_particles(REAL / "empiar_10076_7_relion30.star", require=("rlnImagePixelSize",))
    assert legacy.particles["rlnImagePixelSize"].nunique() == 1


@needs_data
def test_row_with_extra_field(tmp_path):
    text = real_text("relion31.star")
    _, _, numbers = parse_loop(text, "particles")
    lines = text.split("\n")
    lines[numbers[1] - 1] += " 99"
    p = copy_with(tmp_path, "ragged.star", "\n".join(lines))
    with pytest.raises(InputError) as err:
        read_particles(p)
    assert err.value.line == numbers[1] and "27 fields" in str(err.value) and "26 labels" in str(err.value)


@needs_data
def test_relion30_mixed_optics_and_pixel_origins(tmp_path):
    """A 3.0 file with two voltages gets two optics groups; pixel origins become Å origins."""
    text = real_text("empiar_10076_7_relion30.star")
    text = edit_cell(text, "", 3, "rlnVoltage", "200")
    labels, rows, numbers = parse_loop(text, "")
    lines = text.split("\n")
    header_end = lines.index("_rlnDetectorPixelSize #10")
    lines.insert(header_end + 1, "_rlnOriginX #11")
    lines.insert(header_end + 2, "_rlnOriginY #12")
    for k, n in enumerate(numbers):
        lines[n + 1] += f" {k}.5 -{k}"  # two header lines were inserted above the rows
    p = copy_with(tmp_path, "legacy.star", "\n".join(lines))
    table = read_particles(p, project_dir=REAL)
    assert table.optics["rlnVoltage"].tolist() == [300, 200]
    assert table.particles["rlnOpticsGroup"].tolist() == [1, 1, 1, 2, 1, 1, 1]
    assert table.particles["rlnVoltage"].tolist() == [300, 300, 300, 200, 300, 300, 300]
    apix = 5 * 1e4 / 38168
    assert "rlnOriginX" not in table.particles.columns
    assert table.particles["rlnOriginXAngst"].tolist() == [(k + 0.5) * apix for k in range(7)]
    assert table.particles["rlnOriginYAngst"].tolist() == [-k * apix for k in range(7)]
    assert table.box_size == 320
    assert table.row_lines.tolist() == [n + 2 for n in numbers]


def test_image_names_stay_relative_where_they_resolve_and_become_absolute_elsewhere(tmp_path):
    """A job writing a particles STAR into another folder keeps RELION's project-relative image names when the
    stacks are found from there, and writes absolute stack paths otherwise (so chained jobs find the images)."""
    proj = tmp_path / "project"
    (proj / "Particles").mkdir(parents=True)
    imgs = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    write_mrc(proj / "Particles" / "s.mrcs", imgs, 1.0)
    optics = pd.DataFrame({"rlnOpticsGroupName": ["g"], "rlnOpticsGroup": [1], "rlnImagePixelSize": [1.0],
                           "rlnImageSize": [4], "rlnImageDimensionality": [2]})
    parts = pd.DataFrame({"rlnImageName": ["000001@Particles/s.mrcs", "000002@Particles/s.mrcs"],
                          "rlnOpticsGroup": [1, 1]})
    write_particles(proj / "particles.star", parts, optics)
    t = read_particles(proj / "particles.star")
    inside = image_names_for(t, proj / "Class2D" / "job001" / "run_data.star")
    assert list(inside) == ["000001@Particles/s.mrcs", "000002@Particles/s.mrcs"]
    elsewhere = tmp_path / "other" / "deep" / "dir" / "er" / "run_data.star"
    names = image_names_for(t, elsewhere)
    assert list(names) == [f"00000{i}@{(proj / 'Particles' / 's.mrcs').resolve()}" for i in (1, 2)]
    write_particles(elsewhere, parts.assign(rlnImageName=names.to_numpy()), optics)
    np.testing.assert_array_equal(load_images(read_particles(elsewhere)), imgs)


def test_paths_in_star_files_resolve_by_one_rule_current_folder_first(tmp_path, monkeypatch):
    """Particle stacks, micrographs and coordinate files named in STAR files are all found by RELION's rule
    (jobdir.project_path): the current folder (the project) first, then the STAR's folder and its parents;
    what is found nowhere is an error that lists the folders tried."""
    optics = pd.DataFrame({"rlnOpticsGroupName": ["g"], "rlnOpticsGroup": [1], "rlnImagePixelSize": [1.0],
                           "rlnImageSize": [4], "rlnImageDimensionality": [2]})
    mic_optics = pd.DataFrame({"rlnOpticsGroupName": ["g"], "rlnOpticsGroup": [1], "rlnMicrographPixelSize": [1.0]})
    projects = {}
    for name in ("proj", "cwd"):
        root = tmp_path / name
        (root / "Particles").mkdir(parents=True)
        write_mrc(root / "Particles" / "s.mrcs", np.zeros((1, 4, 4), np.float32), 1.0)
        write_mrc(root / "m.mrc", np.zeros((8, 8), np.float32), 1.0)
        write_coordinates(root / "m_pick.star", [1.0], [2.0])
        projects[name] = root
    star = projects["proj"] / "Select" / "job002" / "particles.star"
    write_particles(star, pd.DataFrame({"rlnImageName": ["000001@Particles/s.mrcs"], "rlnOpticsGroup": [1]}), optics)
    mics = write_particles(projects["proj"] / "Select" / "job002" / "micrographs.star",
                           pd.DataFrame({"rlnMicrographName": ["m.mrc"], "rlnOpticsGroup": [1]}), mic_optics,
                           block="micrographs")
    picks = write_coordinate_list(projects["proj"] / "Select" / "job002" / "picks.star", ["m.mrc"], ["m_pick.star"])

    def found() -> set[Path]:
        stack = image_locations(read_particles(star))[0][0]
        mic = micrograph_list(mics).entries[0].path
        coords = read_coordinate_list(picks)["m.mrc"]
        files = _reader.micrographs_table(mics)[0][0]
        return {stack.parent.resolve(), mic.parent.resolve(), coords.parent.resolve(), files.parent.resolve()}

    monkeypatch.chdir(tmp_path)  # no project here: the STAR file's parents
    assert found() == {projects["proj"].resolve(), (projects["proj"] / "Particles").resolve()}
    monkeypatch.chdir(projects["cwd"])  # the current folder is the project
    assert found() == {projects["cwd"].resolve(), (projects["cwd"] / "Particles").resolve()}
    monkeypatch.chdir(tmp_path)
    lost = tmp_path / "lost" / "particles.star"
    write_particles(lost, pd.DataFrame({"rlnImageName": ["000001@Particles/s.mrcs"], "rlnOpticsGroup": [1]}), optics)
    with pytest.raises(InputError, match="cannot find image stack") as err:
        image_locations(read_particles(lost))
    assert str(tmp_path) in str(err.value) and str(lost.parent) in str(err.value)
    write_particles(lost.with_name("mics.star"), pd.DataFrame({"rlnMicrographName": ["m.mrc"], "rlnOpticsGroup": [1]}),
                    mic_optics, block="micrographs")
    with pytest.raises(InputError, match="not found; looked in") as err:
        _reader.micrographs_table(lost.with_name("mics.star"))
    assert str(lost.parent) in str(err.value)


@pytest.mark.parametrize("name", ["Movies/mic{}.mrc", "Movies/é{}.mrc"])
def test_loop_rows_are_each_column_right_justified_with_floats_that_read_back_exactly(tmp_path, name):
    """The writer's loop text against a direct Python layout: floats as repr (the shortest text that reads back
    to the same value; float32's own shortest text for float32), ints and bools as ints, every column
    right-justified to its longest value, one space between columns; the same for an ASCII table (laid out as
    one byte matrix) and a non-ASCII one."""
    from napari_gpu_relion.io.star import write_star_blocks

    rng = np.random.default_rng(3)
    n = 57
    df = pd.DataFrame({"rlnMicrographName": [name.format(i * 37) for i in range(n)],
                       "rlnAngleRot": rng.normal(size=n) * 10.0 ** rng.integers(-8, 9, n),
                       "rlnClassNumber": rng.integers(1, 300, n), "rlnIsFlipped": rng.random(n) < 0.5,
                       "rlnDefocusU": np.round(rng.random(n) * 30000, 1),
                       "rlnCtfFigureOfMerit": (rng.random(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)})
    df.loc[3, "rlnAngleRot"] = -0.0
    write_star_blocks(tmp_path / "t.star", {"particles": df})
    text = (tmp_path / "t.star").read_text(encoding="utf-8")
    rows = text.split("_rlnCtfFigureOfMerit #6\n", 1)[1].rstrip("\n").split("\n")
    cols = [[str(v) for v in df["rlnMicrographName"]], [repr(float(v)) for v in df["rlnAngleRot"]],
            [str(int(v)) for v in df["rlnClassNumber"]], [str(int(v)) for v in df["rlnIsFlipped"]],
            [repr(float(v)) for v in df["rlnDefocusU"]],
            [str(v) for v in df["rlnCtfFigureOfMerit"].to_numpy()]]  # float32's own shortest text
    widths = [max(len(x) for x in c) for c in cols]
    want = [" ".join(c[i].rjust(w) for c, w in zip(cols, widths, strict=True)) for i in range(n)]
    assert rows == want
    back = read_star(tmp_path / "t.star")["particles"]
    np.testing.assert_array_equal(back["rlnAngleRot"].to_numpy(float), df["rlnAngleRot"].to_numpy())


def test_a_long_loop_formatted_by_worker_processes_gives_the_same_file_and_errors(tmp_path, monkeypatch):
    """FORMAT_WORKERS_ENV (the file-writing helper's): a 30,000-row loop formatted in 2 processes gives the bytes
    of one process, and a bad value in the second part is reported with its own row."""
    from napari_gpu_relion.io import star  # noqa: PLC0415

    rng = np.random.default_rng(0)
    n = 30_000
    df = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@Extract/job012/Movies/mic{i // 500:03d}.mrcs" for i in range(n)],
                       "rlnAngleRot": rng.uniform(-180, 180, n), "rlnDefocusU": rng.uniform(8000, 25000, n),
                       "rlnClassNumber": rng.integers(1, 7, n), "rlnOpticsGroup": np.ones(n, int)})
    monkeypatch.delenv(star.FORMAT_WORKERS_ENV, raising=False)
    star.write_star_blocks(tmp_path / "one.star", {"particles": df})
    monkeypatch.setenv(star.FORMAT_WORKERS_ENV, "2")
    star.write_star_blocks(tmp_path / "two.star", {"particles": df})
    assert star._format_pool and star._format_pool[0] == 2  # the workers did the formatting
    assert (tmp_path / "two.star").read_bytes() == (tmp_path / "one.star").read_bytes()
    bad = df.copy()
    bad.loc[20_000, "rlnDefocusU"] = np.nan  # in the second worker's part
    with pytest.raises(InputError, match=r"rlnDefocusU \(data_particles row 20001\)"):
        star.write_star_blocks(tmp_path / "bad.star", {"particles": bad})
    assert not (tmp_path / "bad.star").exists()
    star._format_pool[1].shutdown()
    star._format_pool = None


def test_warm_writer_imports_the_writers_and_starts_every_formatting_process_only_for_long_loops(monkeypatch):
    """warm_writer (the helper's start, before a job's first iteration): the named modules imported; the
    FORMAT_WORKERS_ENV processes started, all of them, only when the job's loops will be long enough for them."""
    import multiprocessing  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from napari_gpu_relion.io import star  # noqa: PLC0415

    monkeypatch.setenv(star.FORMAT_WORKERS_ENV, "2")
    monkeypatch.setattr(star, "_format_pool", None)
    monkeypatch.delitem(sys.modules, "napari_gpu_relion.io.model_star", raising=False)
    star.warm_writer(("napari_gpu_relion.io.model_star",), star._PARALLEL_FROM_ROWS - 1)
    assert "napari_gpu_relion.io.model_star" in sys.modules
    assert star._format_pool is None and not multiprocessing.active_children()
    star.warm_writer((), star._PARALLEL_FROM_ROWS)
    try:
        assert star._format_pool[0] == 2 and len(multiprocessing.active_children()) == 2
    finally:
        star._format_pool[1].shutdown()


@needs_data
@pytest.mark.parametrize("name", sorted(p.name for p in REAL.glob("*.star")) if REAL.is_dir() else [])
def test_our_star_reader_gives_starfiles_blocks_on_relion_made_files(name):
    """io/star reads a loop's rows in one pass of pandas' C parser from the lines its layout found (starfile's reader
    walked the file line by line: read_particles of 100,000 rows 0.78-0.83 s, now 0.61-0.64 s). On every RELION-made
    STAR in the shared data, every block equals what starfile reads: the same names in order, labels in order, rows,
    number kinds (int / float) and values (numbers exactly, NaN where starfile has NaN; text as text); key-value
    blocks equal."""
    import starfile  # noqa: PLC0415 - the independent reader

    from napari_gpu_relion.io.star import _is_string_label  # noqa: PLC0415

    ours = read_star(REAL / name)
    text = sorted({c for b in ours.values() if isinstance(b, pd.DataFrame) for c in b.columns
                   if b[c].dtype.kind not in "fiu"} | {k for b in ours.values() if isinstance(b, dict)
                                                       for k, v in b.items() if isinstance(v, str)})
    theirs = starfile.read(REAL / name, always_dict=True, parse_as_string=text)  # ours keeps text labels as text
    plain = starfile.read(REAL / name, always_dict=True)
    for block, b in plain.items():  # a column ours holds as text is a text label (names), or text to starfile too
        for col in (b.columns if isinstance(b, pd.DataFrame) else ()):
            assert col not in text or _is_string_label(col) or b[col].dtype.kind not in "fiu", (block, col)
    assert list(ours) == list(theirs)
    for block, a in ours.items():
        b = theirs[block]
        if not isinstance(a, pd.DataFrame):
            assert a == b, block
            continue
        assert list(a.columns) == list(b.columns) and len(a) == len(b), block
        for col in a.columns:
            x, y = a[col].to_numpy(), b[col].to_numpy()
            if y.dtype.kind in "fiu":
                assert x.dtype.kind == y.dtype.kind, (block, col, x.dtype, y.dtype)
                np.testing.assert_array_equal(x, y, err_msg=f"{block} {col}")
            else:
                assert [str(v) for v in x] == [str(v) for v in y], (block, col)


def test_a_star_files_version_is_read_from_comment_lines_only():
    """io/star._detect_version: '# version 5xxxx' counts on a line whose first non-blank character is its '#' (RELION
    writes one before each block), anywhere in the file; a '# version' after a value (a row's trailing comment) does
    not; without one, an optics table means 3.1, else 3.0."""
    from napari_gpu_relion.io.star import _detect_version  # noqa: PLC0415

    assert _detect_version("\n# version 30001\ndata_optics\n\n  \t# version 50001\ndata_particles\n", {}) == "5"
    assert _detect_version("data_\nloop_\n_rlnA\n1 # version 50001\n", {}) == "3.0"
    assert _detect_version("#version 50001", {}) == "5"
    assert _detect_version("# version 30001\n", {"optics": None}) == "3.1"
    assert _detect_version("# versions 50001\n# version x50001\n", {}) == "3.0"


def test_short_rows_keys_with_more_values_and_blocks_without_labels_read_as_relion_users_expect(tmp_path):
    """Our STAR reader on what the starfile package read its own way (a helper's review): a loop row short of fields
    (the missing field NaN in a number column, '' in a text one) is an error naming its line, whichever column it
    misses, and a quoted field with spaces counts as one field when the line is found; an empty quoted field in a
    number column reads as NaN; a key with two values is an error naming its line and label, a trailing comment is
    not a value; a data block without labels is left out (the next block keeps its own table)."""
    def read(text):
        path = tmp_path / "t.star"
        path.write_text(text)
        return read_star(path)

    for text, line in (("data_a\nloop_\n_rlnX\n_rlnY\n1\n2 3.5\n", 5),
                       ("data_a\nloop_\n_rlnImageName\n_rlnY\n1\n2@x.mrcs 3.5\n", 5),
                       ("data_a\nloop_\n_rlnMicrographName\n_rlnY\n\"a b\" 1\nc 1 2\n", 6)):
        with pytest.raises(InputError) as err:
            read(text)
        assert err.value.line == line and "fields but the block has 2 labels" in str(err.value), text
    got = read('data_a\nloop_\n_rlnX\n_rlnY\n1 ""\n2 3.5\n# c\n')["a"]
    assert got["rlnY"].dtype.kind == "f" and np.isnan(got["rlnY"][0]) and got["rlnY"][1] == 3.5
    assert read("data_general\n_rlnFinalResolution 3.5 # c\n")["general"] == {"rlnFinalResolution": 3.5}
    with pytest.raises(InputError) as err:
        read("data_general\n_rlnFinalResolution 3.5\n_rlnX 1 2\n")
    assert err.value.line == 3 and err.value.column == "rlnX"
    blocks = read("data_\n\ndata_x\nloop_\n_rlnCoordinateX\n_rlnCoordinateY\n1 2\n")
    assert list(blocks) == ["x"] and blocks["x"]["rlnCoordinateX"].tolist() == [1]

"""Half-read and misread input files (issue 50): STAR files that used to lose rows or read as "no data blocks"
(a block name given twice, a Latin-1 byte, a byte-order mark, gzip compression, a last row cut short), and
micrographs whose pixels no job can use (NaN, infinite, blank).

Decisions tested here: a block name given twice is refused (RELION's MetaDataTable::read silently keeps only the
first block of a name); a Latin-1 or byte-order-marked file reads as RELION reads it; a gzip-compressed STAR is
read transparently (by its content, whatever its name). A micrograph with NaN/infinite pixels or one value
everywhere is skipped with a warning naming it and the count of bad pixels, with or without
--skip_bad_micrographs (its pixels are seen only after the job has started); never a NaN particle or an empty
pick list written for it.

Each job case runs the command line in-process on a tiny simulated data set (two 128 px micrographs).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import mrcfile
import numpy as np
import pytest
from cli_cases import fails, run_cli

from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.micrographs import (
    UnusableMicrograph,
    micrograph_list,
    read_micrograph,
    write_coordinate_list,
)
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.io.star import read_coordinates, read_micrographs, read_particles, read_star
from napari_gpu_relion.jobs import simulate
from napari_gpu_relion.jobs.micrograph_driver import read_or_skip

APIX = 6.0
SIM = dict(n_particles=8, box=16, angpix=APIX, diameter=60.0, n_micrographs=2, micrograph_size=128,
           particles_per_micrograph=3)
LOG = ["--LoG", "--LoG_diam_min", "40", "--LoG_diam_max", "60", "--cpu"]
MIC1, MIC2 = "micrographs/mic001.mrc", "micrographs/mic002.mrc"
N_PIXELS = 128 * 128


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return simulate.make_sample_data(tmp_path_factory.mktemp("sample") / "d", **SIM)


def _line_of(path: Path, start: str, nth: int = 0) -> int:
    """1-based line number of the ``nth`` line of ``path`` starting with ``start``."""
    hits = [i for i, ln in enumerate(path.read_text(encoding="latin-1").splitlines(), 1) if ln.startswith(start)]
    return hits[nth]


def _particle_block(star: Path) -> str:
    text = star.read_text()
    return text[text.index("data_particles"):]


# ------------------------------------------------------------------------------------------------------------
# STAR files: a block given twice


def test_two_particle_blocks_are_refused_naming_the_block_and_its_lines(data, tmp_path, capsys):
    star = data / "particles.star"
    star.write_text(star.read_text() + "\n" + _particle_block(star))
    first, second = _line_of(star, "data_particles"), _line_of(star, "data_particles", 1)
    with pytest.raises(InputError) as ei:
        read_particles(star)
    msg = str(ei.value)
    assert str(star) in msg and f"line {second}" in msg and "data_particles is given twice" in msg
    assert f"lines {first}-" in msg and f"again lines {second}-" in msg and "(8 rows)" in msg
    # on the command line: one line, nothing written
    out = tmp_path / "rec.mrc"
    fails(capsys, ["reconstruct", "--i", star, "--o", out, "--cpu"], star, "data_particles is given twice",
           f"line {second}")
    assert not out.exists()


def test_two_micrograph_blocks_stop_autopick_before_work(data, tmp_path, capsys):
    star = data / "micrographs.star"
    text = star.read_text()
    star.write_text(text + "\n" + text[text.index("data_micrographs"):])
    odir = tmp_path / "AutoPick"
    fails(capsys, ["autopick", "--i", star, "--odir", odir, *LOG], star, "data_micrographs is given twice",
           f"line {_line_of(star, 'data_micrographs', 1)}")
    assert not odir.exists()


def test_two_unnamed_blocks_in_a_coordinate_file_are_refused(data):
    coords = data / "coords" / "mic001_truth.star"
    text = coords.read_text()
    coords.write_text(text + "\n" + text[text.index("data_"):])
    with pytest.raises(InputError, match=r"block data_ is given twice: lines \d+-\d+ \(3 rows\), and again"):
        read_coordinates(coords)


# ------------------------------------------------------------------------------------------------------------
# STAR files: bytes that are not plain UTF-8


def test_latin1_comment_reads_with_every_row(data):
    star = data / "particles.star"
    plain = read_particles(star)
    raw = star.read_bytes().replace(b"# version 30001", b"# version 30001\n# pr\xe9par\xe9 \xe0 Gen\xe8ve", 1)
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")  # really not UTF-8
    star.write_bytes(raw)
    table = read_particles(star)
    assert len(table) == len(plain) == SIM["n_particles"]
    assert table.particles.equals(plain.particles)
    assert table.line_of(0) == plain.line_of(0) + 1  # line numbers still count the extra comment line


def test_latin1_micrograph_name_keeps_its_letter(data):
    star = data / "micrographs.star"
    star.write_bytes(star.read_bytes().replace(b"micrographs/mic002.mrc", b"micrographs/mic\xe9002.mrc"))
    table = read_micrographs(star)
    assert list(table.particles["rlnMicrographName"]) == [MIC1, "micrographs/mic\u00e9002.mrc"]


def test_utf8_byte_order_mark_before_the_first_block(data):
    star = data / "particles.star"
    text = star.read_text()
    text = text[text.index("data_optics"):]  # no version line: the mark sits right before data_optics
    star.write_bytes(b"\xef\xbb\xbf" + text.encode())
    table = read_particles(star)
    assert len(table) == SIM["n_particles"] and len(table.optics) == 1
    assert table.version == "3.1"  # data_optics was recognised
    blocks = read_star(star)
    assert list(blocks) == ["optics", "particles"]


# ------------------------------------------------------------------------------------------------------------
# STAR files: gzip


@pytest.mark.parametrize("name", ["particles.star.gz", "particles_gzipped.star"])
def test_gzip_star_reads_like_the_plain_file(name, data):
    star = data / "particles.star"
    plain = read_particles(star)
    gz = data / name
    gz.write_bytes(gzip.compress(star.read_bytes()))
    table = read_particles(gz)
    assert len(table) == len(plain)
    assert table.particles.equals(plain.particles) and table.optics.equals(plain.optics)
    assert table.line_of(3) == plain.line_of(3)


def test_gzip_micrographs_star_in_autopick(data, tmp_path, capsys):
    star = data / "micrographs.star"
    gz = data / "micrographs.star.gz"
    gz.write_bytes(gzip.compress(star.read_bytes()))
    assert [e.name for e in micrograph_list(gz).entries] == [MIC1, MIC2]
    odir = tmp_path / "AutoPick"
    code, out, err = run_cli(capsys, ["autopick", "--i", gz, "--odir", odir, *LOG])
    assert code == 0, err
    assert (odir / "micrographs" / "mic002_autopick.star").is_file()


def test_damaged_gzip_star_is_refused_clearly(data, capsys, tmp_path):
    star = data / "particles.star"
    packed = gzip.compress(star.read_bytes())
    gz = data / "cut.star"  # gzip data under a plain name (the jobs' --i checks want names ending in .star)
    gz.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(InputError, match="gzip-compressed but cannot be decompressed"):
        read_particles(gz)
    fails(capsys, ["reconstruct", "--i", gz, "--o", tmp_path / "rec.mrc", "--cpu"], gz, "gzip-compressed",
           "cut short")
    assert not (tmp_path / "rec.mrc").exists()


# ------------------------------------------------------------------------------------------------------------
# STAR files: cut short


@pytest.mark.parametrize("cut", ["between fields", "inside a field"])
def test_last_row_cut_short(cut, data):
    star = data / "particles.star"
    lines = star.read_text().rstrip("\n").split("\n")
    fields = lines[-1].split()
    lines[-1] = " ".join(fields[:5]) if cut == "between fields" else lines[-1][: len(lines[-1]) // 2]
    star.write_text("\n".join(lines))  # no final newline, as a copy that stopped
    with pytest.raises(InputError) as ei:
        read_particles(star)
    msg = str(ei.value)
    assert f"line {len(lines)}" in msg and "last row of data_particles" in msg and "cut short" in msg
    assert f"of its {len(fields)} fields" in msg


# ------------------------------------------------------------------------------------------------------------
# Micrographs whose pixels cannot be used


def _set_micrograph(path: Path, value: float, n: int = 0) -> None:
    """``n`` pixels of the micrograph set to ``value`` (all when n == 0)."""
    with mrcfile.open(path, mode="r+") as m:
        img = m.data.copy()
        if n:
            img.reshape(-1)[:n] = value
        else:
            img[...] = value
        m.data[...] = img


def _extract_argv(data: Path, tmp_path: Path) -> tuple[list, Path]:
    coords = write_coordinate_list(tmp_path / "autopick.star", [MIC1, MIC2],
                                   [str(data / "coords" / "mic001_truth.star"),
                                    str(data / "coords" / "mic002_truth.star")])
    out = tmp_path / "Extract"
    return ["extract", "--i", data / "micrographs.star", "--coord_list", coords, "--o", out, "--extract_size", "16",
            "--norm", "--cpu"], out


@pytest.mark.parametrize("skip_flag", [False, True])
def test_nan_micrograph_in_extract_is_skipped_and_no_nan_written(skip_flag, data, tmp_path, capsys):
    _set_micrograph(data / MIC1, np.nan, 100)
    argv, out = _extract_argv(data, tmp_path)
    code, stdout, err = run_cli(capsys, argv + (["--skip_bad_micrographs"] if skip_flag else []))
    assert code == 0, err
    assert f"skipping micrograph {MIC1}: 100 of {N_PIXELS} pixels are NaN" in stdout
    assert "1 failed" in stdout
    assert not (out / "Particles" / "micrographs" / "mic001.mrcs").exists()
    stack = read_mrc(out / "Particles" / "micrographs" / "mic002.mrcs").data
    assert np.isfinite(stack).all()
    parts = read_particles(out / "particles.star").particles
    assert set(parts["rlnMicrographName"]) == {MIC2}


def test_infinite_pixels_in_extract(data, tmp_path, capsys):
    _set_micrograph(data / MIC2, np.inf, 7)
    argv, out = _extract_argv(data, tmp_path)
    code, stdout, err = run_cli(capsys, argv)
    assert code == 0, err
    assert f"skipping micrograph {MIC2}: 7 of {N_PIXELS} pixels are infinite" in stdout
    for stack in (out / "Particles").rglob("*.mrcs"):
        assert np.isfinite(read_mrc(stack).data).all(), stack
    assert set(read_particles(out / "particles.star").particles["rlnMicrographName"]) == {MIC1}


def test_every_micrograph_nan_in_extract_fails_naming_them(data, tmp_path, capsys):
    _set_micrograph(data / MIC1, np.nan, 1)
    _set_micrograph(data / MIC2, np.nan, 2)
    argv, out = _extract_argv(data, tmp_path)
    fails(capsys, argv, "no particles were extracted", f"{MIC1}: 1 of {N_PIXELS} pixels are NaN",
           f"{MIC2}: 2 of {N_PIXELS} pixels are NaN")
    assert not (out / "particles.star").exists()


def test_nan_micrograph_in_autopick_is_skipped_with_a_warning(data, tmp_path, capsys):
    _set_micrograph(data / MIC1, np.nan, 5)
    odir = tmp_path / "AutoPick"
    code, out, err = run_cli(capsys, ["autopick", "--i", data / "micrographs.star", "--odir", odir, *LOG])
    assert code == 0, err
    assert f"skipping micrograph {MIC1}: 5 of {N_PIXELS} pixels are NaN" in out
    assert "from 1 of 2 micrographs" in out and f"1 failed: {MIC1}" in out
    assert not (odir / "micrographs" / "mic001_autopick.star").exists()  # no empty pick list for it
    listed = read_star(odir / "autopick.star")["coordinate_files"]
    assert list(listed["rlnMicrographName"]) == [MIC2]


def test_blank_micrograph_in_autopick(data, tmp_path, capsys):
    _set_micrograph(data / MIC2, 0.0)
    odir = tmp_path / "AutoPick"
    code, out, err = run_cli(capsys, ["autopick", "--i", data / "micrographs.star", "--odir", odir, *LOG])
    assert code == 0, err
    assert f"skipping micrograph {MIC2}: every pixel is 0 (blank)" in out
    assert list(read_star(odir / "autopick.star")["coordinate_files"]["rlnMicrographName"]) == [MIC1]


def test_read_micrograph_and_the_driver(data):
    _set_micrograph(data / MIC1, -np.inf, 3)
    with pytest.raises(UnusableMicrograph) as ei:
        read_micrograph(data / MIC1)
    assert str(data / MIC1) in str(ei.value) and ei.value.reason == f"3 of {N_PIXELS} pixels are infinite"
    entry = micrograph_list(data / "micrographs.star").entries[0]
    for skip_bad in (False, True):  # skipped either way: seen only once the job is under way
        assert read_or_skip(entry, skip_bad) == (None, f"{entry.name}: 3 of {N_PIXELS} pixels are infinite")
    good = micrograph_list(data / "micrographs.star").entries[1]
    img, failure = read_or_skip(good, False)
    assert failure is None and img.shape == (128, 128) and np.isfinite(img).all()


def test_a_gzip_compressed_particles_star_is_taken_where_a_star_file_is(tmp_path):
    """require_file takes name.star.gz where it takes .star (io/star.py reads it), and still names a wrong ending."""
    import gzip

    from napari_gpu_relion.errors import InputError
    from napari_gpu_relion.jobs.common import require_file

    gz = tmp_path / "particles.star.gz"
    gz.write_bytes(gzip.compress(b"data_\nloop_\n_rlnImageName #1\n1@a.mrcs\n"))
    require_file(gz, "--i particles STAR", (".star",))
    other = tmp_path / "particles.txt.gz"
    other.write_bytes(gz.read_bytes())
    with pytest.raises(InputError, match=r"should end in \.star, got '\.gz'"):
        require_file(other, "--i particles STAR", (".star",))

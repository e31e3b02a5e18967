"""MRC reading/writing against real files; header values are checked with an independent struct reader."""

from __future__ import annotations

import io
import shutil
import struct
import tracemalloc
from pathlib import Path

import mrcfile
import numpy as np
import pytest

from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.mrc import LazyStack, is_stack, read_mrc, write_mrc

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real"
needs_data = pytest.mark.skipif(not REAL.is_dir(), reason=f"shared real data not found at {REAL}")

MODE_DTYPE = {0: np.int8, 1: np.int16, 2: np.float32, 6: np.uint16, 12: np.float16}


def raw_header(path: Path) -> dict:
    """The few MRC header words we check, read with struct (little-endian files only)."""
    with open(path, "rb") as fh:
        head = fh.read(1024)
    nx, ny, nz, mode = struct.unpack("<4i", head[0:16])
    mx, my, mz = struct.unpack("<3i", head[28:40])
    cella = struct.unpack("<3f", head[40:52])
    ispg, nsymbt = struct.unpack("<2i", head[88:96])
    dmin, dmax, dmean = struct.unpack("<3f", head[76:88])
    return dict(nx=nx, ny=ny, nz=nz, mode=mode, mx=mx, cella=cella, ispg=ispg, nsymbt=nsymbt,
                dmin=dmin, dmax=dmax, dmean=dmean)


def raw_pixels(path: Path, h: dict, count: int, start: int = 0) -> np.ndarray:
    """``count`` pixels from flat position ``start`` of the data block, read with np.fromfile."""
    dtype = np.dtype(MODE_DTYPE[h["mode"]])
    return np.fromfile(path, dtype=dtype, count=count, offset=1024 + h["nsymbt"] + start * dtype.itemsize)


def expected_pixel_size(h: dict) -> float | None:
    if h["mx"] <= 0 or h["cella"][0] <= 0:
        return None
    return float(str(np.float32(h["cella"][0]) / np.float32(h["mx"])))


@needs_data
@pytest.mark.parametrize("name", sorted(p.name for p in REAL.glob("*.mrc*")) if REAL.is_dir() else [])
def test_read_every_real_mrc(name):
    path = REAL / name
    h = raw_header(path)
    d = read_mrc(path, mmap=True)
    assert isinstance(d.data, np.memmap)
    expected_shape = (h["ny"], h["nx"]) if h["nz"] == 1 else (h["nz"], h["ny"], h["nx"])
    assert d.data.shape == expected_shape
    assert d.data.dtype == MODE_DTYPE[h["mode"]]
    assert d.pixel_size == expected_pixel_size(h)
    flat = d.data.reshape(-1)
    np.testing.assert_array_equal(flat[:100], raw_pixels(path, h, 100))
    n = flat.size
    np.testing.assert_array_equal(flat[n - 50:], raw_pixels(path, h, 50, start=n - 50))


@needs_data
def test_epu_micrograph_lazy_uint16():
    path = REAL / "real_micrograph_epu_4096.mrc"
    h = raw_header(path)
    assert h["mode"] == 6 and h["nsymbt"] > 0  # FEI extended header must be skipped
    tracemalloc.start()
    try:
        d = read_mrc(path, mmap=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"mmap read allocated {peak} bytes; it should not load the 32 MiB image"
    assert isinstance(d.data, np.memmap)
    assert not d.data.flags.writeable
    assert d.data.shape == (4096, 4096)
    assert d.data.dtype == np.uint16
    assert d.pixel_size == pytest.approx(0.667, abs=5e-4)
    assert d.pixel_size == pytest.approx(2730.1943 / 4096, rel=1e-6)  # header: cella.x / mx
    full = read_mrc(path)
    assert not isinstance(full.data, np.memmap)
    assert full.data.dtype == np.uint16
    assert float(full.data.mean(dtype=np.float64)) == pytest.approx(h["dmean"], rel=1e-5)
    assert int(full.data.min()) == h["dmin"] and int(full.data.max()) == h["dmax"]


@needs_data
def test_stack_detection_and_lazy_stack():
    assert is_stack(REAL / "relion31.mrcs")  # suffix
    assert not is_stack(REAL / "ribosome70S_65px.mrc")  # volume, ispg 1
    assert not is_stack(REAL / "real_micrograph_epu_4096.mrc")  # single image
    # empiar_10076_7.mrc is a 7-image particle stack whose header says volume (ispg 1): not a stack by
    # header, but LazyStack still serves its sections as images.
    assert not is_stack(REAL / "empiar_10076_7.mrc")
    whole = read_mrc(REAL / "empiar_10076_7.mrc").data
    with LazyStack(REAL / "empiar_10076_7.mrc") as st:
        assert len(st) == 7 and st.shape == (7, 320, 320)
        got = st.read([6, 0, 3])
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, whole[[6, 0, 3]])
    with LazyStack(REAL / "relion31.mrcs") as st:
        assert st.shape == (5, 256, 256)
        assert st.pixel_size == 1.0  # old RELION header: cella = box, so 1 Å/px; the STAR file says 2.806
        with pytest.raises(InputError) as err:
            st.read([1, 5])
    msg = str(err.value)
    assert "relion31.mrcs" in msg and "index 5" in msg and "5 images" in msg
    with LazyStack(REAL / "real_micrograph_epu_4096.mrc") as st:
        assert st.shape == (1, 4096, 4096)


def test_write_map_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    vol = rng.standard_normal((16, 18, 20)).astype(np.float32)
    out = write_mrc(tmp_path / "map.mrc", vol, 1.23)
    assert out == tmp_path / "map.mrc"
    assert mrcfile.validate(out, print_file=io.StringIO())
    h = raw_header(out)
    assert h["ispg"] == 1 and h["mode"] == 2 and (h["nx"], h["ny"], h["nz"]) == (20, 18, 16)
    assert h["dmin"] == pytest.approx(vol.min()) and h["dmax"] == pytest.approx(vol.max())
    assert h["dmean"] == pytest.approx(vol.mean(), abs=1e-6)
    back = read_mrc(out)
    assert back.pixel_size == 1.23
    np.testing.assert_array_equal(back.data, vol)


def test_write_stack_and_dtypes(tmp_path):
    imgs = np.arange(3 * 8 * 8, dtype=np.float64).reshape(3, 8, 8)
    out = write_mrc(tmp_path / "parts.mrcs", imgs, 2.5)
    assert mrcfile.validate(out, print_file=io.StringIO())
    h = raw_header(out)
    assert h["ispg"] == 0 and h["nz"] == 3 and h["mode"] == 2  # float64 stored as float32
    assert is_stack(out)
    np.testing.assert_array_equal(read_mrc(out).data, imgs.astype(np.float32))
    # an explicit stack=True on a .mrc name also gives space group 0
    out2 = write_mrc(tmp_path / "parts_as_mrc.mrc", imgs, 2.5, stack=True)
    assert raw_header(out2)["ispg"] == 0 and is_stack(out2)
    u16 = (imgs * 10).astype(np.uint16)
    out3 = write_mrc(tmp_path / "mic.mrc", u16[0], 0.667)
    assert raw_header(out3)["mode"] == 6 and mrcfile.validate(out3, print_file=io.StringIO())
    back = read_mrc(out3)
    assert back.data.dtype == np.uint16 and back.pixel_size == 0.667
    np.testing.assert_array_equal(back.data, u16[0])
    out4 = write_mrc(tmp_path / "half.mrc", imgs.astype(np.float16), 1.0)
    assert raw_header(out4)["mode"] == 12
    single = write_mrc(tmp_path / "one.mrcs", imgs[0], None)
    assert read_mrc(single).pixel_size is None
    with LazyStack(single) as st:
        assert len(st) == 1


def test_write_rejects_bad_input(tmp_path):
    with pytest.raises(InputError, match="pixel size"):
        write_mrc(tmp_path / "x.mrc", np.zeros((4, 4), np.float32), -1.0)
    with pytest.raises(InputError, match="shape"):
        write_mrc(tmp_path / "x.mrc", np.zeros((2, 2, 2, 2), np.float32), 1.0)
    assert list(tmp_path.iterdir()) == []


@needs_data
def test_bad_mrc_files_name_the_file(tmp_path):
    empty = tmp_path / "empty.mrc"
    empty.write_bytes(b"")
    with pytest.raises(InputError) as err:
        read_mrc(empty)
    assert str(empty) in str(err.value) and "0 bytes" in str(err.value)
    text = tmp_path / "notes.mrc"
    text.write_text("this is not an image\n" * 100)
    with pytest.raises(InputError) as err:
        read_mrc(text)
    assert str(text) in str(err.value)
    cut = tmp_path / "cut.mrcs"
    cut.write_bytes((REAL / "relion31.mrcs").read_bytes()[: 1024 + 3 * 256 * 256 * 4])
    with pytest.raises(InputError) as err:
        LazyStack(cut)
    assert str(cut) in str(err.value) and "truncated" in str(err.value)
    with pytest.raises(InputError, match="not found"):
        read_mrc(tmp_path / "missing.mrc")
    copy = tmp_path / "copy.mrcs"
    shutil.copy(REAL / "relion31.mrcs", copy)
    assert read_mrc(copy).data.shape == (5, 256, 256)


def _stack_file(path: Path, n: int = 300, box: int = 8, dtype=np.float32, byteorder: str = "=") -> np.ndarray:
    """A stack of n distinct images (every pixel a function of its image's number) in ``path``."""
    data = (np.arange(n * box * box, dtype=np.float64).reshape(n, box, box) * 0.25).astype(dtype)
    with mrcfile.new(path, overwrite=True) as m:
        m.set_data(data.astype(np.dtype(dtype).newbyteorder(byteorder)) if byteorder != "=" else data)
    return data


@pytest.mark.parametrize("pattern", ["consecutive", "half", "shuffled", "two_windows", "scattered", "repeats", "one"])
def test_lazy_stack_reads_the_asked_images_by_any_path(tmp_path, monkeypatch, pattern):
    """Whatever the index pattern (the direct reads of windows, with gaps read into scratch, or the memory map),
    the images are the file's, in the order asked for, into ``out`` when given."""
    data = _stack_file(tmp_path / "s.mrcs")
    real_windows = LazyStack._read_windows
    rng = np.random.default_rng(1)
    idx = {"consecutive": np.arange(40, 200),
           "half": np.flatnonzero(rng.permutation(np.arange(300) % 2) == 1)[:128],  # gaps of 1-5 images
           "shuffled": rng.permutation(np.arange(10, 150)),
           "two_windows": np.r_[250:290:3, 0:20],  # gaps of 2 in one window, none in the other, 230 between them
           "scattered": np.sort(rng.choice(300, 12, replace=False)),  # memory map
           "repeats": np.array([5, 6, 7, 7, 8, 9, 10, 11, 12, 13, 14, 15]),  # memory map
           "one": np.array([299])}[pattern]
    direct = []
    monkeypatch.setattr(LazyStack, "_read_windows", lambda self, *a: direct.append(1) or real_windows(self, *a))
    with LazyStack(tmp_path / "s.mrcs") as st:
        np.testing.assert_array_equal(st.read(idx), data[idx])
        assert bool(direct) == (pattern in ("consecutive", "half", "shuffled", "two_windows"))
        out = np.full((idx.size, 8, 8), -1.0, np.float32)
        assert st.read(idx, out=out) is out
        np.testing.assert_array_equal(out, data[idx])
        with pytest.raises(ValueError, match="C-contiguous float32"):
            st.read(idx, out=np.empty((idx.size, 8, 8), np.float64))


def test_lazy_stack_direct_reads_survive_short_reads_and_no_preadv(tmp_path, monkeypatch):
    """A system that returns fewer bytes than asked per read (allowed by POSIX), or has no positioned scatter
    read, still gives every image."""
    import napari_gpu_relion.io.mrc as mrc_module

    data = _stack_file(tmp_path / "s.mrcs", box=32)  # 4 KiB per image: each 1000-byte read ends inside a buffer
    idx = np.flatnonzero(np.arange(300) % 3 != 0)[:150]  # runs of two with one-image gaps
    real = mrc_module.os.preadv
    calls = []

    def short(fd, buffers, offset):  # at most 1000 bytes per call
        calls.append(offset)
        first = memoryview(buffers[0]).cast("B")
        return real(fd, [first[:1000]], offset)

    monkeypatch.setattr(mrc_module.os, "preadv", short)
    with LazyStack(tmp_path / "s.mrcs") as st:
        np.testing.assert_array_equal(st.read(idx), data[idx])
    assert len(calls) > 100  # the loop went on after each short read
    monkeypatch.delattr(mrc_module.os, "preadv")
    with LazyStack(tmp_path / "s.mrcs") as st:
        np.testing.assert_array_equal(st.read(idx[::-1]), data[idx[::-1]])


@pytest.mark.parametrize("dtype,byteorder", [(np.float32, ">"), (np.int16, "="), (np.float16, "=")])
def test_lazy_stack_other_modes_and_byte_orders_go_through_the_map(tmp_path, dtype, byteorder):
    data = _stack_file(tmp_path / "s.mrcs", n=50, dtype=dtype, byteorder=byteorder)
    with LazyStack(tmp_path / "s.mrcs") as st:
        assert not st._direct
        got = st.read(np.arange(5, 45))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, data[5:45].astype(np.float32))


def test_unusable_image_names_the_first_bad_image_and_what_is_wrong():
    from napari_gpu_relion.io.mrc import unusable_image

    imgs = np.random.default_rng(0).standard_normal((6, 5, 5)).astype(np.float32)
    assert unusable_image(imgs) is None
    for value, kind in ((np.nan, "NaN"), (np.inf, "infinite"), (-np.inf, "infinite")):
        bad = imgs.copy()
        bad[4, 1, 2] = value
        bad[4, 3, 3] = value
        bad[5, 0, 0] = value
        assert unusable_image(bad) == (4, f"2 of 25 pixels are {kind}")
    mixed = imgs.copy()
    mixed[2, 0, 0], mixed[2, 0, 1] = np.inf, np.nan  # NaN named first
    assert unusable_image(mixed) == (2, "2 of 25 pixels are NaN")
    blank = imgs.copy()
    blank[3] = 1.5
    assert unusable_image(blank) == (3, "every pixel is 1.5 (blank)")
    assert unusable_image(np.full((2, 3, 3), 7, np.int16)) == (0, "every pixel is 7 (blank)")


def test_load_images_from_several_stacks_with_kept_headers(tmp_path):
    """Rows of three stacks in any order, read with the headers kept between calls: the same images as each
    stack's own, and each header parsed once."""
    import pandas as pd
    import starfile

    import napari_gpu_relion.io.mrc as mrc_module
    from napari_gpu_relion.io.particle_images import load_images
    from napari_gpu_relion.io.star import read_particles

    stacks = [_stack_file(tmp_path / f"m{k}.mrcs", n=40) + 1000 * k for k in range(3)]
    for k, s in enumerate(stacks):
        with mrcfile.new(tmp_path / f"m{k}.mrcs", overwrite=True) as m:
            m.set_data(s)
    names = [f"{i + 1:06d}@m{k}.mrcs" for k in range(3) for i in range(40)]
    starfile.write({"optics": pd.DataFrame({"rlnOpticsGroup": [1], "rlnImagePixelSize": [1.0], "rlnImageSize": [8],
                                            "rlnImageDimensionality": [2]}),
                    "particles": pd.DataFrame({"rlnImageName": names, "rlnOpticsGroup": 1})}, tmp_path / "p.star")
    table = read_particles(tmp_path / "p.star")
    every = np.concatenate(stacks)
    parsed = []
    real = mrc_module.mrc_header_info
    headers: dict = {}
    try:
        mrc_module.mrc_header_info = lambda p: parsed.append(p) or real(p)
        rng = np.random.default_rng(2)
        for rows in (np.arange(120), rng.permutation(120)[:50], np.arange(30, 90), np.array([119, 0, 60])):
            np.testing.assert_array_equal(load_images(table, rows=rows, headers=headers, check_values=True),
                                          every[rows])
    finally:
        mrc_module.mrc_header_info = real
    assert len(parsed) == 3 and set(headers) == {tmp_path / f"m{k}.mrcs" for k in range(3)}

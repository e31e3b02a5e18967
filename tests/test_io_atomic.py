"""Atomic writes: a failed write leaves neither a partial file nor a temporary file behind."""

from __future__ import annotations

import os

import numpy as np
import pytest

from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.atomic import atomic_path, ensure_not_input
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.io.star import read_coordinates, write_coordinates


class Boom(Exception):
    pass


def test_success_replaces_and_leaves_no_temp(tmp_path):
    final = tmp_path / "out.star"
    with atomic_path(final) as tmp:
        assert tmp.parent == tmp_path
        assert tmp.name.startswith(".")
        assert tmp.suffix == ".star"
        assert not final.exists()  # nothing visible until the block succeeds
        tmp.write_text("data_\n")
    assert final.read_text() == "data_\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.star"]


def test_exception_leaves_no_final_and_no_temp(tmp_path):
    final = tmp_path / "stack.mrcs"
    with pytest.raises(Boom):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"half written")
            raise Boom()
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_existing_file_survives_failed_write(tmp_path):
    final = tmp_path / "map.mrc"
    write_mrc(final, np.arange(64, dtype=np.float32).reshape(4, 4, 4), 2.0)
    before = final.read_bytes()
    with pytest.raises(Boom):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"garbage")
            raise Boom()
    assert final.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["map.mrc"]


def test_failed_writer_inside_write_function_keeps_old_file(tmp_path):
    """A writer that raises half-way (non-finite coordinate) must not touch the existing file."""
    final = tmp_path / "mic_autopick.star"
    write_coordinates(final, [10.0, 20.0], [30.0, 40.0], fom=[0.5, 0.25], class_number=0, psi=0.0)
    before = final.read_bytes()
    with pytest.raises(InputError):
        write_coordinates(final, [1.0, np.nan], [2.0, 3.0])
    assert final.read_bytes() == before
    assert read_coordinates(final)["rlnCoordinateX"].tolist() == [10.0, 20.0]
    assert [p.name for p in tmp_path.iterdir()] == ["mic_autopick.star"]


def test_creates_missing_parent_folder(tmp_path):
    final = tmp_path / "Extract" / "job005" / "Movies" / "mic1.mrcs"
    write_mrc(final, np.ones((2, 4, 4), np.float32), 1.5)
    assert read_mrc(final).data.shape == (2, 4, 4)


def test_ensure_not_input(tmp_path):
    a = tmp_path / "a.star"
    a.write_text("x")
    b = tmp_path / "b.star"
    ensure_not_input(b, a, None)  # different file: fine
    with pytest.raises(InputError) as err:
        ensure_not_input(tmp_path / "sub" / ".." / "a.star", b, a)
    assert "would overwrite an input" in str(err.value)
    assert "a.star" in str(err.value)
    link = tmp_path / "link.star"
    os.symlink(a, link)
    with pytest.raises(InputError):
        ensure_not_input(link, a)
    hard = tmp_path / "hard.star"
    os.link(a, hard)
    with pytest.raises(InputError):
        ensure_not_input(hard, a)

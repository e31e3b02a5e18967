"""Micrograph lists for picking and extraction: a micrographs STAR or a glob/list of MRC files, RELION's
output-path rule (job prefix removed), and the 2-column coordinate list (autopick.star).

Relative micrograph paths are RELION project paths, found by :func:`.jobdir.project_path` (the current folder
first, then the STAR file's folder and up to 3 of its parents), like particle stacks.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import InputError
from .jobdir import project_path
from .mrc import mrc_header_info, read_mrc, unusable_image
from .paths import is_star_path
from .star import ParticleTable, read_micrographs, read_star, write_star_blocks

__all__ = ["MicrographEntry", "MicrographList", "micrograph_list", "output_root", "read_micrograph",
           "write_coordinate_list", "read_coordinate_list", "check_micrographs", "SKIP_FLAG",
           "UnusableMicrograph"]

#: The option of autopick and extract that skips unusable micrographs instead of stopping before any work.
SKIP_FLAG = "--skip_bad_micrographs"

_JOB_PREFIX = re.compile(r"^(?:.*?/)?[A-Za-z0-9_]+/job\d{3}/")


@dataclass(frozen=True)
class MicrographEntry:
    name: str  # as written in rlnMicrographName (or the path given)
    path: Path  # resolved file
    row: int  # row in the table (0-based)
    line: int | None  # STAR line of the row, if known


@dataclass
class MicrographList:
    entries: list[MicrographEntry]
    table: pd.DataFrame  # one row per micrograph, optics merged (RELION column names)
    optics: pd.DataFrame
    pixel_size: float
    source: Path | None  # the STAR file, None for a glob
    has_ctf: bool


def _resolve(name: str, star: Path | None) -> Path:
    """A micrograph or coordinate file named in ``star``, where :func:`project_path` finds it; the name as it
    is when found nowhere (a job then reports that file, and skips it, when it reads it)."""
    found, _ = project_path(name, star)
    return Path(name) if found is None else found


def micrograph_list(source: str | os.PathLike, angpix: float = -1.0) -> MicrographList:
    """Micrographs from a STAR file (pixel size from its optics table) or from a glob pattern / a single
    MRC file / a text file with one path per line (then ``angpix`` Å is required)."""
    src = str(source)
    if is_star_path(src):
        table: ParticleTable = read_micrographs(src)
        px = table.pixel_size if angpix <= 0 else float(angpix)
        df = table.particles.reset_index(drop=True)
        entries = [MicrographEntry(str(n), _resolve(str(n), Path(src)), i, table.line_of(i))
                   for i, n in enumerate(df["rlnMicrographName"])]
        has_ctf = {"rlnDefocusU", "rlnDefocusV"} <= set(df.columns)
        return MicrographList(entries, df, table.optics, px, Path(src), has_ctf)
    if src.lower().endswith((".txt", ".list")) and Path(src).is_file():
        names = [ln.strip() for ln in Path(src).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    else:
        names = sorted(glob.glob(src)) if any(c in src for c in "*?[") else [src]
    if not names:
        raise InputError("no micrographs match this pattern", path=src)
    if angpix <= 0:
        raise InputError("--angpix (Å) is needed when micrographs are given as MRC files, not a STAR file",
                         path=src)
    df = pd.DataFrame({"rlnMicrographName": names, "rlnOpticsGroup": np.ones(len(names), np.int64),
                       "rlnMicrographPixelSize": float(angpix)})
    optics = pd.DataFrame({"rlnOpticsGroupName": ["opticsGroup1"], "rlnOpticsGroup": [1],
                           "rlnMicrographPixelSize": [float(angpix)]})
    entries = [MicrographEntry(n, Path(n), i, None) for i, n in enumerate(names)]
    return MicrographList(entries, df, optics, float(angpix), None, False)


def micrograph_shape(path: Path) -> tuple[int, int]:
    """(ny, nx) from the header; InputError for stacks/volumes or unreadable files."""
    info = mrc_header_info(path)
    shape = info.shape
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise InputError(f"expected a 2D micrograph, got data of shape {shape}", path=str(path))
    return int(shape[0]), int(shape[1])


def check_micrographs(ml: MicrographList, entries: list[MicrographEntry], skip: bool
                      ) -> tuple[list[MicrographEntry], dict[str, tuple[int, int]], list[str]]:
    """Before any work, from the headers: which of ``entries`` are readable 2D micrographs. Returns those, their
    (ny, nx) by name, and one line per micrograph left out. Unless ``skip``, the first unusable one is an
    InputError naming the STAR file, its line and the micrograph (a job never silently picks fewer)."""
    good: list[MicrographEntry] = []
    shapes: dict[str, tuple[int, int]] = {}
    failures: list[str] = []
    first: tuple[MicrographEntry, Exception] | None = None
    for e in entries:
        try:
            shapes[e.name] = micrograph_shape(e.path)
        except (InputError, OSError) as exc:
            failures.append(f"{e.name}: {' '.join(str(exc).splitlines())}")
            first = first or (e, exc)
            continue
        good.append(e)
    if first is not None and not skip:
        e, exc = first
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise InputError(f"micrograph {e.name!r} cannot be used ({' '.join(str(exc).splitlines())}){more}; nothing "
                         f"was done: fix or remove it, or give {SKIP_FLAG} to go on without it",
                         path=None if ml.source is None else str(ml.source), line=e.line,
                         column="rlnMicrographName" if ml.source is not None else None)
    return good, shapes, failures


class UnusableMicrograph(InputError):
    """A micrograph whose pixels no job can use: NaN or infinite pixels, or every pixel one value (blank). Seen only
    when its pixels are read, after the job has started; ``reason`` is the problem without the file name."""

    def __init__(self, reason: str, path: Path):
        super().__init__(f"micrograph cannot be used: {reason}", path=str(path))
        self.reason = reason


def read_micrograph(path: Path) -> np.ndarray:
    """The micrograph (ny, nx) as a lazy memory map in its file dtype (uint16 stays uint16).

    UnusableMicrograph when a pixel is NaN or infinite (it would give NaN particles, or no picks) or when every
    pixel has the same value: checked here, as particle images are, in two passes (minimum, maximum) over the
    pixels that the job reads next anyway."""
    micrograph_shape(path)
    data = read_mrc(path, mmap=True).data
    data = data.reshape(data.shape[-2:])
    problem = unusable_image(data[np.newaxis])
    if problem is not None:
        raise UnusableMicrograph(problem[1], path)
    return data


def output_root(name: str) -> str:
    """RELION's per-micrograph root: the path without its leading '<JobType>/jobNNN/' and without extension
    ('MotionCorr/job002/Movies/mic001.mrc' -> 'Movies/mic001'); absolute paths keep only the file name."""
    s = str(name).replace("\\", "/")
    m = _JOB_PREFIX.match(s)
    if m:
        s = s[m.end():]
    elif s.startswith("/"):
        s = Path(s).name
    s = s.lstrip("./") if s.startswith("./") else s
    return str(Path(s).with_suffix(""))


def write_coordinate_list(path: Path, micrographs: list[str], coordinate_files: list[str]) -> Path:
    """RELION 4/5 autopick.star: block data_coordinate_files with rlnMicrographName, rlnMicrographCoordinates."""
    df = pd.DataFrame({"rlnMicrographName": list(micrographs), "rlnMicrographCoordinates": list(coordinate_files)})
    return write_star_blocks(path, {"coordinate_files": df})


def read_coordinate_list(path: str | os.PathLike) -> dict[str, Path]:
    """{micrograph name: coordinate file} from an autopick.star-style list (paths resolved like micrographs)."""
    p = Path(path)
    blocks = read_star(p)
    df = next((b for b in blocks.values() if isinstance(b, pd.DataFrame)
               and {"rlnMicrographName", "rlnMicrographCoordinates"} <= set(b.columns)), None)
    if df is None:
        raise InputError("no table with rlnMicrographName and rlnMicrographCoordinates (expected RELION's "
                         "autopick.star layout)", path=str(p), column="rlnMicrographCoordinates")
    return {str(m): _resolve(str(c), p) for m, c in zip(df["rlnMicrographName"], df["rlnMicrographCoordinates"],
                                                       strict=True)}

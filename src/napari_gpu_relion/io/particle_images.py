"""Particle images named in RELION tables: ``<n>@<stack>`` image names, where their stacks are, their pixels.

Conventions kept from RELION: image numbers count from 1; stack paths are relative to the project folder
(RELION's working directory), found by :func:`.jobdir.project_path` (the current folder first, then the STAR
file's folder and up to three of its parents); stacks are read lazily, each opened once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..errors import InputError
from .image_names import parse_image_name
from .jobdir import project_path
from .mrc import LazyStack, MrcHeaderInfo, mrc_header_info, unusable_image

if TYPE_CHECKING:
    from .star import ParticleTable

__all__ = ["parse_image_name", "image_locations", "image_names_for", "load_images", "check_image_stacks",
           "norm_check_rows", "check_normalisation"]

#: The largest |pixel value| a particle image may have. The E-step's scores are float32 sums over an image's
#: Fourier pixels of products of two values in the images' units (the transform is divided by the pixel count, so
#: a Fourier value is at most the largest pixel): (1e16)^2 x the 10^6 pixels of a 1400-px box's half-plane is
#: 1e38, within float32's largest value (3.4e38); beyond it sums and squares overflow to inf and the job's
#: results are NaN. Normalised particles are within +-100.
MAX_ABS_PIXEL = 1e16

#: RELION's check that particles are normalised (ml_optimiser.cpp, calculateSumOfPowerSpectraAndAverageImage,
#: on the images of its initial noise spectra: at most 1000 per optics group): the background (outside the
#: particle circle) should have mean 0 and stddev 1, and an image whose background mean is beyond +-0.5 x its
#: stddev, or whose stddev is below 0.5 or above 2, is reported (RELION names --dont_check_norm). The mean test
#: is RELION's as it is. The stddev test is RELION's band relative to the median background stddev of the images
#: checked instead of 1: particles in other units than RELION's (the simulated ones have stddev ~9, a micrograph's
#: counts more) give the same results (the noise model and references take the data's units), while one image
#: scaled apart from the others is still found.
NORM_MAX_MEAN_IN_STDDEV = 0.5
NORM_STDDEV_BAND = (0.5, 2.0)
NORM_CHECK_IMAGES = 1000  # per optics group, as RELION's initial noise spectra
#: RELION's default edge of the particle mask (pixels): without --particle_diameter the mask is (box - 5) px wide.
MASK_EDGE_PX = 5.0


def _s(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _parse_names(parts: pd.DataFrame, table: ParticleTable) -> tuple[np.ndarray, list[str]]:
    """0-based indices and stack strings for every row; InputError with the STAR line of a bad name."""
    if "rlnImageName" not in parts.columns:
        raise InputError(f"no rlnImageName column in data_{table.block}", path=_s(table.path),
                         column="rlnImageName")
    names = parts["rlnImageName"].astype(str).str.strip()
    split = names.str.partition("@")
    ok = np.array((split[1] == "@") & split[0].str.fullmatch(r"\d+").fillna(False)
                  & (split[2].str.len() > 0) & ~split[2].str.contains(r"\s", regex=True), dtype=bool)
    idx = np.zeros(len(names), dtype=np.int64)
    if ok.any():
        idx[ok] = split[0][ok].astype(np.int64).to_numpy() - 1
    ok &= idx >= 0
    if not ok.all():
        row = int(np.argmin(ok))
        try:
            parse_image_name(names.iloc[row])
            message = f"malformed image name {names.iloc[row]!r}"
        except InputError as exc:
            message = str(exc).split(": ", 1)[-1]
        raise InputError(message, path=_s(table.path), line=table.line_of(parts.index[row]),
                         column="rlnImageName")
    return idx, split[2].tolist()


def _first_relative(stacks: list[str]) -> str | None:
    """The first stack path that is relative (looked at once per distinct stack), None if all are absolute."""
    return next((s for s in dict.fromkeys(stacks) if not Path(s).is_absolute()), None)


def _project_base(star: Path | None, stacks: list[str], project_dir: str | os.PathLike | None
                  ) -> tuple[Path | None, list[Path]]:
    """The project folder that the relative stack paths start from (None if not found), and the folders tried.

    A given ``project_dir`` is used as it is (a stack missing there is reported when it is read). Otherwise
    the folder where :func:`project_path` finds the first relative stack: one project folder for all rows,
    as in RELION.
    """
    if project_dir is not None:
        return Path(project_dir), [Path(project_dir)]
    first = _first_relative(stacks)
    if first is None:  # only absolute stack paths: no project folder needed
        return Path("/"), [Path("/")]
    found, tried = project_path(first, star)
    return (tried[-1] if found is not None else None), tried  # project_path stops at the folder it found


def _locations(parts: pd.DataFrame, table: ParticleTable, project_dir: str | os.PathLike | None
               ) -> tuple[list[Path], np.ndarray]:
    idx, stacks = _parse_names(parts, table)
    if not stacks:
        return [], idx
    base, tried = _project_base(table.path, stacks, project_dir)
    if base is None:
        first = _first_relative(stacks)
        looked = ", ".join(str(t) for t in tried)
        raise InputError(f"cannot find image stack {first!r}; looked in {looked}. Run the command in the RELION "
                         "project folder (the folder that the stack paths in rlnImageName start from)",
                         path=_s(table.path), line=table.line_of(parts.index[stacks.index(first)]),
                         column="rlnImageName")
    cache: dict[str, Path] = {}
    paths = []
    for s in stacks:
        q = cache.get(s)
        if q is None:
            q = cache[s] = Path(s) if Path(s).is_absolute() else base / s
        paths.append(q)
    return paths, idx


def image_locations(table: ParticleTable, project_dir: str | os.PathLike | None = None
                    ) -> tuple[list[Path], np.ndarray]:
    """Stack file (Path) and 0-based image index of every particle row, in row order.

    Relative stack paths start from ``project_dir``; when None, from the project folder found by
    :func:`.jobdir.project_path` for the first relative stack (the current folder, else the STAR file's
    folder or one of its 3 parents). InputError, listing the folders tried, when it is found nowhere.
    """
    return _locations(table.particles, table, project_dir)


def image_names_for(table: ParticleTable, out_path: str | os.PathLike,
                    locations: tuple[list[Path], np.ndarray] | None = None) -> pd.Series:
    """rlnImageName of ``table``'s rows for a STAR file written at ``out_path``: unchanged when the stacks are
    found from there by the same rule as on reading (RELION's project-relative names), otherwise with absolute
    stack paths, so that a job's output STAR in another folder still finds its images. ``locations``: the
    table's image_locations when known (a job writing every iteration parses the names once)."""
    names = table.particles["rlnImageName"].astype(str)
    try:
        paths, idx = image_locations(table) if locations is None else locations
    except InputError:  # the stacks are not here at all: nothing better to write than the names as they are
        return names
    if not paths:
        return names
    stacks = names.str.partition("@")[2]
    base, _ = _project_base(Path(out_path), stacks.tolist(), None)
    first = dict(zip(stacks, paths, strict=True))  # stack text -> where it was found
    if base is not None and all((base / s).resolve() == q.resolve() for s, q in first.items()):
        return names
    # each stack's absolute path resolved once (a resolve per row took 1.4 s of every 100,000-row data STAR)
    where = {q: str(q.resolve()) for q in dict.fromkeys(paths)}
    return pd.Series([f"{i + 1:06d}@{where[q]}" for i, q in zip(idx, paths, strict=True)], index=names.index)


def _volume_problem(stack_path: Path, info: MrcHeaderInfo) -> str | None:
    """Why a file named as a particle stack is a 3D map instead (None when it can be a stack of images): not .mrcs,
    its header says a volume, and it is a cube. The extension counts first (RELION's .mrcs stacks are 3D arrays
    of images), and the shape second: real stacks saved as .mrc with a volume header exist (EMPIAR-10076's
    7 images of 320 px), but they are not cubes, while a map given by mistake is."""
    if len(info.shape) == 4:
        return f"{stack_path} holds a stack of volumes {info.shape}, not particle images"
    if stack_path.suffix.lower() == ".mrcs" or not info.is_volume or len(set(info.shape)) != 1:
        return None
    n = info.shape[0]
    return (f"{stack_path} is a 3D map ({n} x {n} x {n}, MRC header: space group {info.ispg}), not a stack of "
            f"particle images; particle stacks are .mrcs files (if it really holds {n} images, save it as .mrcs)")


def check_image_stacks(table: ParticleTable, project_dir: str | os.PathLike | None = None
                       ) -> tuple[list[Path], np.ndarray]:
    """Before any work: every stack the table names exists, is a stack of images (not a 3D map), holds the image
    numbers asked for, and holds images of the table's rlnImageSize. Reads one header per stack, no pixels.
    InputError naming the STAR file, the line of the first row concerned, the stack and the image otherwise.
    Returns every row's location (image_locations), for load_images."""
    parts = table.particles
    if not len(parts):
        return [], np.zeros(0, dtype=np.int64)
    star = _s(table.path)
    paths, idx = _locations(parts, table, project_dir)
    codes, stacks = pd.factorize(pd.Series(paths, dtype=object))
    by = pd.DataFrame({"code": codes, "index": idx})
    first = by.groupby("code").head(1).index.to_numpy()  # row position of each stack's first row
    highest = by.groupby("code")["index"].idxmax().to_numpy()  # row position of its highest image number
    expected = parts["rlnImageSize"].to_numpy() if "rlnImageSize" in parts.columns else None
    sizes = np.zeros((len(stacks), 2), dtype=np.int64)
    for k, stack_path in enumerate(stacks):
        pos = int(first[k])
        line = table.line_of(parts.index[pos])
        if not stack_path.is_file():
            raise InputError(f"image stack {stack_path} not found (named in rlnImageName "
                             f"{parts['rlnImageName'].iloc[pos]!r})", path=star, line=line, column="rlnImageName")
        try:
            info = mrc_header_info(stack_path)
        except InputError as exc:
            raise InputError(f"image stack {exc}", path=star, line=line, column="rlnImageName") from exc
        problem = _volume_problem(stack_path, info)
        if problem is not None:
            raise InputError(problem, path=star, line=line, column="rlnImageName")
        n = info.shape[0] if len(info.shape) == 3 else 1
        top = int(highest[k])
        if idx[top] >= n:
            raise InputError(f"image {idx[top] + 1} of stack {stack_path} is asked for "
                             f"({parts['rlnImageName'].iloc[top]!r}) but the stack has only {n} images",
                             path=star, line=table.line_of(parts.index[top]), column="rlnImageName")
        sizes[k] = info.shape[-2:]
    if expected is not None:
        ny, nx = sizes[codes, 0], sizes[codes, 1]
        wrong = (expected != nx) | (expected != ny)
        if wrong.any():
            pos = int(np.argmax(wrong))
            raise InputError(f"images in {stacks[codes[pos]]} are {ny[pos]} x {nx[pos]} px but rlnImageSize is "
                             f"{expected[pos]}", path=star, line=table.line_of(parts.index[pos]), column="rlnImageSize")
    else:
        other = np.flatnonzero((sizes != sizes[0]).any(axis=1))
        if other.size:
            k = int(other[0])
            raise InputError(f"images in {stacks[k]} are {sizes[k, 0]} x {sizes[k, 1]} px but those in {stacks[0]} "
                             f"are {sizes[0, 0]} x {sizes[0, 1]} px", path=star,
                             line=table.line_of(parts.index[int(first[k])]), column="rlnImageName")
    return paths, idx


def load_images(table: ParticleTable, rows: Iterable[int] | None = None,
                project_dir: str | os.PathLike | None = None, check_values: bool = False,
                locations: tuple[list[Path], np.ndarray] | None = None,
                headers: dict[Path, MrcHeaderInfo] | None = None) -> np.ndarray:
    """Particle images as float32 (n, N, N), in row order; ``rows`` are 0-based positions (default: all).

    Each stack file is opened once and only the needed images are read. InputError (naming the STAR file,
    the row's line, the stack and the index) for a missing stack, a 3D map named as a stack, an image number
    beyond the stack, or images whose size disagrees with rlnImageSize; with ``check_values`` (the jobs) also for
    an image with NaN or infinite pixels or a blank one (every pixel equal), which no job can use.
    ``locations``: every row's (stack, index) as image_locations or check_image_stacks gave them for this table,
    so that a job reading its images block by block parses the names once, not per block (the parsing holds
    Python's lock, 6 ms per block of 128 names, which a background reader takes from the job's thread).
    ``headers``: the stacks' parsed headers by path, kept by such a job between blocks (filled here).
    """
    parts = table.particles
    positions = None
    if rows is not None:
        positions = np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64).ravel()
        if positions.size and (positions.min() < 0 or positions.max() >= len(parts)):
            raise InputError(f"row positions must be in 0..{len(parts) - 1}, got "
                             f"{positions.min()}..{positions.max()}", path=_s(table.path))
        parts = parts.iloc[positions]
    star = _s(table.path)
    if locations is not None and len(locations[1]) != len(table.particles):
        raise ValueError(f"locations of {len(locations[1])} rows for a table of {len(table.particles)}")
    if locations is None:
        paths, idx = _locations(parts, table, project_dir)
    elif positions is None:
        paths, idx = locations
    else:
        paths, idx = [locations[0][p] for p in positions], locations[1][positions]
    expected = parts["rlnImageSize"].to_numpy() if "rlnImageSize" in parts.columns else None
    groups: dict[Path, list[int]] = {}
    for pos, q in enumerate(paths):
        groups.setdefault(q, []).append(pos)
    out: np.ndarray | None = None
    for stack_path, members in groups.items():
        sel = np.asarray(members, dtype=np.int64)
        first_line = table.line_of(parts.index[sel[0]])
        if not stack_path.is_file():
            raise InputError(f"image stack {stack_path} not found (named in rlnImageName "
                             f"{parts['rlnImageName'].iloc[sel[0]]!r})", path=star, line=first_line,
                             column="rlnImageName")
        info = None if headers is None else headers.get(stack_path)
        with LazyStack(stack_path, info) as stack:
            if headers is not None:
                headers[stack_path] = stack.info
            problem = _volume_problem(stack_path, stack.info)
            if problem is not None:
                raise InputError(problem, path=star, line=first_line, column="rlnImageName")
            n = len(stack)
            beyond = idx[sel] >= n
            if beyond.any():
                pos = int(sel[np.argmax(beyond)])
                raise InputError(f"image {idx[pos] + 1} of stack {stack_path} is asked for "
                                 f"({parts['rlnImageName'].iloc[pos]!r}) but the stack has only {n} images",
                                 path=star, line=table.line_of(parts.index[pos]), column="rlnImageName")
            ny, nx = stack.shape[1:]
            if expected is not None:
                wrong = (expected[sel] != nx) | (expected[sel] != ny)
                if wrong.any():
                    pos = int(sel[np.argmax(wrong)])
                    raise InputError(f"images in {stack_path} are {ny} x {nx} px but rlnImageSize is "
                                     f"{expected[pos]}", path=star, line=table.line_of(parts.index[pos]),
                                     column="rlnImageSize")
            if out is None:
                out = np.empty((len(parts), ny, nx), dtype=np.float32)
            elif out.shape[1:] != (ny, nx):
                raise InputError(f"images in {stack_path} are {ny} x {nx} px but earlier stacks have "
                                 f"{out.shape[1]} x {out.shape[2]} px", path=star, line=first_line,
                                 column="rlnImageName")
            if sel[-1] - sel[0] + 1 == sel.size:  # consecutive rows of the result (rows in stack order): read in place
                images = stack.read(idx[sel], out=out[sel[0]:sel[-1] + 1])
            else:
                images = stack.read(idx[sel])
                out[sel] = images
            bad = unusable_image(images, MAX_ABS_PIXEL) if check_values else None
            if bad is not None:
                pos = int(sel[bad[0]])
                raise InputError(f"image {idx[pos] + 1} of stack {stack_path} ({parts['rlnImageName'].iloc[pos]!r}) "
                                 f"cannot be used: {bad[1]}", path=star, line=table.line_of(parts.index[pos]),
                                 column="rlnImageName")
    if out is None:
        box = int(expected[0]) if expected is not None and len(expected) else 0
        out = np.empty((0, box, box), dtype=np.float32)
    return out


# ------------------------------------------------------------------------------------------------------------
# RELION's check that the particles are normalised


def norm_check_rows(optics_group: np.ndarray, per_group: int = NORM_CHECK_IMAGES) -> np.ndarray:
    """The rows whose images the normalisation check looks at: the first ``per_group`` of each optics group (the
    images of RELION's initial noise spectra, which it checks), in row order."""
    og = np.asarray(optics_group)
    return np.sort(np.concatenate([np.flatnonzero(og == g)[:per_group] for g in np.unique(og)])) if og.size \
        else np.zeros(0, dtype=np.int64)


def check_normalisation(table: ParticleTable, rows: np.ndarray, mean: np.ndarray, std: np.ndarray,
                        radius_px: float, allow: bool = False) -> str | None:
    """RELION's check that particles are normalised, from the background ``mean`` and ``std`` (outside the
    particle circle of ``radius_px`` pixels: compute.extraction.background_stats) of the images of table rows
    ``rows`` (see NORM_MAX_MEAN_IN_STDDEV and NORM_STDDEV_BAND for the tests): None when they pass.
    Otherwise an InputError naming the first image that fails (its rlnImageName, STAR line,
    background mean and stddev) and --dont_check_norm; with ``allow`` (--dont_check_norm given) the same as a
    warning line to show instead."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return None
    mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    ok = np.isfinite(mean)
    if not ok.any():
        return None
    med = float(np.median(std[ok]))
    lo, hi = NORM_STDDEV_BAND
    bad_mean = ok & (np.abs(mean) > NORM_MAX_MEAN_IN_STDDEV * std)
    bad_std = ok & (((std < lo * med) | (std > hi * med)) if med > 0 else np.zeros_like(ok))
    bad = bad_mean | bad_std
    if not bad.any():
        return None
    k = int(np.argmax(bad))
    parts = table.particles
    name = str(parts["rlnImageName"].iloc[rows[k]]).strip()
    if bad_mean[k]:
        why = f"the mean is beyond +-{NORM_MAX_MEAN_IN_STDDEV:g} x the stddev"
    else:
        why = (f"the stddev is {std[k] / med:.3g} x the median {med:.4g} of the images checked (RELION's band: "
               f"{lo:g} to {hi:g})")
    r = int(np.floor(abs(radius_px) + 0.5))  # RELION's ROUND
    what = (f"particle image {name} is not normalised: its background (outside the {r}-px "
            f"particle circle) has mean {mean[k]:.4g} and stddev {std[k]:.4g}: {why}; {int(bad.sum())} of "
            f"{rows.size} images checked fail")
    if allow:
        return (f"--dont_check_norm: {what}. Running anyway: particles not normalised as RELION expects (background "
                f"mean 0, stddev 1) can give empty classes and wrong maps")
    raise InputError(f"{what}. Normalise the particles (background mean 0, stddev 1, e.g. relion_preprocess "
                     f"--norm), or give --dont_check_norm (RELION's flag) to run anyway",
                     path=_s(table.path), line=table.line_of(parts.index[rows[k]]), column="rlnImageName")

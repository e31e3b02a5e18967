"""MRC / MRCS reading and writing (maps, micrographs, particle stacks).

Reading parses the header with mrcfile (permissive, so old RELION stacks without the ``MAP`` stamp open)
and maps the data with ``numpy.memmap``: a 4096 x 4096 micrograph or a million-particle stack costs no
memory until pixels are touched. Writing always goes through :func:`atomic_path`.

Array layout is what mrcfile gives: (y, x) for one image, (n, y, x) for a stack, (z, y, x) for a volume.
Pixel sizes are in Å per pixel.
"""

from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import mrcfile
import mrcfile.utils
import numpy as np

from ..errors import InputError
from .atomic import atomic_path

__all__ = ["MrcData", "MrcHeaderInfo", "LazyStack", "read_mrc", "write_mrc", "is_stack", "mrc_header_info",
           "unusable_image", "map_problem", "require_usable_map"]

_HEADER_BYTES = 1024


@dataclass(frozen=True)
class MrcHeaderInfo:
    """What is needed to map an MRC file: dtype (with byte order), array shape, data offset (bytes)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    pixel_size: float | None
    ispg: int
    nz: int
    mz: int = 0

    @property
    def is_volume(self) -> bool:
        """The header says a 3D map, not a stack of images: a space group other than 0 (MRC2014: 0 = images,
        1 = a volume) with more than one section and sampling mz = nz along z (stacks have mz = 1)."""
        return self.ispg != 0 and self.nz > 1 and self.mz == self.nz


@dataclass(frozen=True, eq=False)
class MrcData:
    """Pixels and pixel size (Å, None when the header says 0) of one MRC file."""

    data: np.ndarray
    pixel_size: float | None
    path: Path


_VALID_MODES = frozenset({0, 1, 2, 3, 4, 6, 12, 101})


def _precheck(path: Path, size: int) -> None:
    """Cheap sanity check of the size/mode words (either byte order) before mrcfile parses the file.

    Stops garbage files early: mrcfile would otherwise try to read a nonsense extended header.
    """
    with open(path, "rb") as fh:
        head = fh.read(_HEADER_BYTES)
    for order in "<>":
        nx, ny, nz, mode = struct.unpack(order + "4i", head[:16])
        (nsymbt,) = struct.unpack(order + "i", head[92:96])
        if mode in _VALID_MODES and nx > 0 and ny > 0 and nz > 0:
            if not 0 <= nsymbt <= size - _HEADER_BYTES:
                raise InputError(f"not a readable MRC file: extended header of {nsymbt} bytes does not "
                                 f"fit in the {size}-byte file", path=str(path))
            return
    nx, ny, nz, mode = struct.unpack("<4i", head[:16])
    raise InputError(f"not an MRC file: header words nx={nx}, ny={ny}, nz={nz}, mode={mode} are not a valid "
                     "MRC size and mode", path=str(path))


def mrc_header_info(path: str | os.PathLike) -> MrcHeaderInfo:
    """Read and check an MRC header; InputError naming the file if it is not a readable MRC file."""
    p = Path(path)
    if not p.exists():
        raise InputError("MRC file not found", path=str(p))
    if p.is_dir():
        raise InputError("expected an MRC file but this is a folder", path=str(p))
    size = p.stat().st_size
    if size < _HEADER_BYTES:
        raise InputError(f"not an MRC file: {size} bytes, shorter than the {_HEADER_BYTES}-byte header",
                         path=str(p))
    _precheck(p, size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with mrcfile.open(p, mode="r", permissive=True, header_only=True) as mrc:
                header = mrc.header.copy()
        except Exception as exc:  # mrcfile raises ValueError/OSError/struct errors on garbage
            raise InputError(f"not a readable MRC file ({exc})", path=str(p)) from exc
    notes = "; ".join(str(w.message) for w in caught)
    if header is None:
        raise InputError(f"not a readable MRC file (no header{': ' + notes if notes else ''})", path=str(p))
    try:
        dtype = mrcfile.utils.data_dtype_from_header(header)
        shape = tuple(int(s) for s in mrcfile.utils.data_shape_from_header(header))
    except Exception as exc:
        extra = f"; {notes}" if notes else ""
        raise InputError(f"not a readable MRC file ({exc}{extra})", path=str(p)) from exc
    nx, ny, nz = int(header.nx), int(header.ny), int(header.nz)
    if nx <= 0 or ny <= 0 or nz <= 0 or any(s <= 0 for s in shape):
        raise InputError(f"MRC header gives an empty or invalid size nx={nx}, ny={ny}, nz={nz}"
                         f"{' (' + notes + ')' if notes else ''}", path=str(p))
    nsymbt = int(header.nsymbt)
    if nsymbt < 0:
        raise InputError(f"MRC header has a negative extended-header size ({nsymbt})", path=str(p))
    offset = _HEADER_BYTES + nsymbt
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size < offset + nbytes:
        raise InputError(f"MRC file is truncated: header promises {shape} {dtype.name} "
                         f"({offset + nbytes} bytes) but the file has {size} bytes", path=str(p))
    pixel_size = _header_pixel_size(header)
    return MrcHeaderInfo(dtype=dtype, shape=shape, offset=offset, pixel_size=pixel_size,
                         ispg=int(header.ispg), nz=nz, mz=int(header.mz))


def _header_pixel_size(header: np.recarray) -> float | None:
    """cella.x / mx in Å, at the float32 precision the header stores (1.23 stays 1.23); None if unset."""
    mx = int(header.mx)
    if mx <= 0:
        return None
    pixel = np.float32(header.cella.x) / np.float32(mx)
    if not np.isfinite(pixel) or pixel <= 0:
        return None
    return float(str(pixel))  # shortest decimal that reads back as the same float32


def _memmap(path: Path, info: MrcHeaderInfo) -> np.memmap:
    """Read-only memory map of the data block (nothing is read until indexed)."""
    return np.memmap(path, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)


def read_mrc(path: str | os.PathLike, *, mmap: bool = False) -> MrcData:
    """Read an MRC/MRCS file. With ``mmap=True`` the data is a lazy read-only ``np.memmap``.

    Without mmap the data is loaded into memory in native byte order and keeps the file's dtype
    (uint16 micrographs stay uint16). Pixel size (Å) is taken from the header (cella.x / mx).
    """
    p = Path(path)
    info = mrc_header_info(p)
    mm = _memmap(p, info)
    if mmap:
        data: np.ndarray = mm
    else:
        data = np.array(mm, dtype=info.dtype.newbyteorder("="))
        del mm
    return MrcData(data=data, pixel_size=info.pixel_size, path=p)


def _read_exactly(fh, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill the byte buffers ``views`` one after another from file ``fh``, starting at byte ``offset``: positioned
    scatter reads where the system has them (threads reading one file share no position; Python's lock is
    released during each), else seek and read."""
    views = [v.cast("B") for v in views]
    k = 0  # the first buffer not yet full
    while k < len(views):
        if hasattr(os, "preadv"):
            n = os.preadv(fh.fileno(), views[k:k + _IOV_MAX], offset)
        else:
            fh.seek(offset)
            n = fh.readinto(views[k])
        if not n:
            raise InputError(f"the file ends before the images asked for (at byte {offset})", path=str(path))
        offset += n
        while k < len(views) and n >= len(views[k]):
            n -= len(views[k])
            k += 1
        if n:
            views[k] = views[k][n:]


def _iov_max() -> int:
    """Buffers one scatter read takes (1024 on Linux and macOS; POSIX guarantees 16)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        n = -1
    return int(min(n, 1024)) if n > 0 else 16


_IOV_MAX = _iov_max()


def is_stack(path: str | os.PathLike) -> bool:
    """True for an image stack: suffix ``.mrcs``, or header space group 0 with more than one section."""
    p = Path(path)
    if p.suffix.lower() == ".mrcs":
        return True
    info = mrc_header_info(p)
    return info.ispg == 0 and info.nz > 1


def unusable_image(images: np.ndarray, max_abs: float | None = None) -> tuple[int, str] | None:
    """The first image of a stack (n, y, x), or section of a map, that no job can use, and why: NaN or infinite
    pixels, every pixel the same value (a blank image: nothing to align, and a zero variance), or, with
    ``max_abs``, a pixel beyond +-max_abs. None when every image is usable."""
    arr = np.asarray(images)
    if arr.ndim < 2 or arr.size == 0:
        return None
    flat = arr.reshape(arr.shape[0] if arr.ndim > 2 else 1, -1)
    # two passes over the pixels: a NaN makes an image's minimum and maximum NaN, an infinite pixel one of them
    # infinite; the count and kind are found for the one image reported
    lo, hi = flat.min(axis=1), flat.max(axis=1)
    if np.issubdtype(flat.dtype, np.floating):
        bad = ~(np.isfinite(lo) & np.isfinite(hi))
        if bad.any():
            k = int(np.argmax(bad))
            finite = np.isfinite(flat[k])
            kinds = "NaN" if np.isnan(flat[k]).any() else "infinite"
            return k, f"{int((~finite).sum())} of {flat.shape[1]} pixels are {kinds}"
    blank = lo == hi
    big = np.maximum(hi, -lo) > max_abs if max_abs is not None else np.zeros_like(blank)
    if blank.any() or big.any():
        k = int(np.argmax(blank | big))
        if blank[k]:
            return k, f"every pixel is {lo[k]:g} (blank)"
        v = hi[k] if hi[k] >= -lo[k] else lo[k]
        return k, (f"a pixel is {float(v):.3g}, beyond +-{max_abs:.0e} (float32 sums of such values overflow; "
                   f"normalised particles are within +-100)")
    return None


def map_problem(data: np.ndarray) -> str | None:
    """Why a whole map (or one image) cannot be used: NaN or infinite values, or one value everywhere (blank);
    None when it can."""
    arr = np.asarray(data)
    if arr.size == 0:
        return f"it is empty (shape {arr.shape})"
    problem = unusable_image(arr.reshape((1,) + arr.shape))
    if problem is None:
        return None
    return problem[1].replace("pixels", "values").replace("every pixel", "every value")


def require_usable_map(data: np.ndarray, path: str | os.PathLike, what: str = "map") -> None:
    """InputError naming the file when a map (or image) holds NaN or infinite values or is blank (one value
    everywhere): such a map gives NaN or meaningless results, so it is refused before any work."""
    problem = map_problem(data)
    if problem is not None:
        raise InputError(f"the {what} cannot be used: {problem}", path=str(path))


def _dtype_for_writing(data: np.ndarray) -> np.dtype:
    """Keep float16 and the integer types MRC stores natively; everything else becomes float32."""
    kind = data.dtype
    if kind == np.float16:
        return np.dtype(np.float16)
    if kind in (np.int8, np.int16, np.uint16):
        return kind.newbyteorder("=")
    if kind == np.uint8:
        return np.dtype(np.uint16)  # mrcfile stores uint8 widened to mode 6
    if kind == np.bool_:
        return np.dtype(np.int8)
    if np.iscomplexobj(data):
        raise InputError(f"cannot write complex data ({kind}) as an image; take the real part or modulus")
    return np.dtype(np.float32)


def write_mrc(path: str | os.PathLike, data: np.ndarray, pixel_size: float | None, *,
              stack: bool | None = None) -> Path:
    """Write a 2D image, an image stack or a volume atomically; returns the path.

    ``stack=None`` means: a stack if the suffix is ``.mrcs``, otherwise a 3D array is a volume.
    Stacks get space group 0 (2D data of 1 image is written as a stack of one), volumes space group 1.
    Header statistics are computed; ``pixel_size`` (Å) goes into the voxel size (None writes 0 = unknown).
    """
    p = Path(path)
    arr = np.asarray(data)
    if arr.ndim not in (2, 3):
        raise InputError(f"can only write 2D images, stacks or volumes, got an array of shape {arr.shape}",
                         path=str(p))
    if arr.size == 0:
        raise InputError(f"refusing to write an empty array of shape {arr.shape}", path=str(p))
    if pixel_size is not None:
        ps = float(pixel_size)
        if not np.isfinite(ps) or ps <= 0:
            raise InputError(f"pixel size must be a positive number of Å, got {pixel_size}", path=str(p))
    else:
        ps = 0.0
    if stack is None:
        stack = p.suffix.lower() == ".mrcs"
    arr = np.ascontiguousarray(arr, dtype=_dtype_for_writing(arr))
    if stack and arr.ndim == 2:
        arr = arr[np.newaxis]
    with atomic_path(p) as tmp:
        with mrcfile.new(tmp, overwrite=True) as mrc:
            mrc.set_data(arr)
            if arr.ndim == 3:
                if stack:
                    mrc.set_image_stack()
                else:
                    mrc.set_volume()
            mrc.voxel_size = ps  # set_data has written the header's statistics (a second pass: 0.05 s at 256^3)
    return p


#: Images are read straight from the file (LazyStack.read) in windows of the stack that hold the asked images with
#: gaps of at most this many other images between them (read too, into a scratch buffer: one system call per
#: window instead of one per run; a random half's rows have gaps of one or two images)...
DIRECT_READ_MAX_GAP = 8
#: ...when there is at most one window per this many images asked for; more scattered rows (a few images from each
#: of many places in a stack) are read through the memory map.
DIRECT_READ_MIN_IMAGES_PER_WINDOW = 8


class LazyStack:
    """A particle stack, read only where images are asked for (positioned reads or a memory map).

    A single 2D image is a stack of one; a 3D ``.mrc`` volume-typed file is treated as its sections (RELION
    does the same when a STAR file points into it with ``n@file.mrc``). ``info``: the file's header parsed
    already (mrc_header_info), so that a reader opening the stack block after block parses it once.
    """

    def __init__(self, path: str | os.PathLike, info: MrcHeaderInfo | None = None):
        self.path = Path(path)
        self.info = info = mrc_header_info(self.path) if info is None else info
        if len(info.shape) == 4:
            raise InputError(f"expected an image stack but the file is a stack of volumes {info.shape}",
                             path=str(self.path))
        shape = tuple(int(s) for s in info.shape)
        self.shape: tuple[int, int, int] = (1,) + shape if len(shape) == 2 else shape  # type: ignore[assignment]
        self._open = True
        self._mm: np.ndarray | None = None  # mapped at the first read that needs it (mapping and unmapping cost)
        self.pixel_size: float | None = info.pixel_size
        # float32 in this machine's byte order: images can be read from the file into their array directly
        self._direct = info.dtype == np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, indices: int | np.ndarray | list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Images at 0-based ``indices`` as float32 (n, y, x); InputError for an index outside the stack.
        ``out``: a C-contiguous float32 (n, y, x) array to read them into (returned).

        Float32 stacks in this machine's byte order are read by one positioned scatter read per window of the
        stack, straight into the result (the kernel copies from its page cache; Python's lock is released
        meanwhile), when the indices lie in windows with gaps of at most DIRECT_READ_MAX_GAP images (a job reads
        its particles in stack order, or one random half's rows), at least DIRECT_READ_MIN_IMAGES_PER_WINDOW
        images per window; scattered or repeated indices and other modes go through the memory map."""
        if not self._open:
            raise ValueError(f"{self.path}: stack is closed")
        idx = np.atleast_1d(np.asarray(indices))
        if idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise InputError(f"image indices must be integers, got {idx.dtype}", path=str(self.path))
        idx = idx.ravel().astype(np.int64)
        bad = (idx < 0) | (idx >= len(self))
        if bad.any():
            first = int(idx[np.argmax(bad)])
            raise InputError(f"image index {first} (0-based; {first + 1} counting from 1) is outside the "
                             f"stack of {len(self)} images", path=str(self.path))
        shape = (idx.size,) + self.shape[1:]
        if out is not None and (out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
        if idx.size == 0:
            return np.empty(shape, dtype=np.float32) if out is None else out
        if self._direct:
            order = np.argsort(idx, kind="stable")
            ordered = idx[order]
            step = np.diff(ordered)
            windows = np.flatnonzero(step > DIRECT_READ_MAX_GAP + 1) + 1  # where a new window starts
            if step.all() and (windows.size + 1) * DIRECT_READ_MIN_IMAGES_PER_WINDOW <= idx.size:  # no repeats
                in_order = bool((np.diff(idx) > 0).all())
                dest = out if out is not None and in_order else np.empty(shape, dtype=np.float32)
                self._read_windows(ordered, step, windows, dest)
                if in_order:
                    return dest
                res = out if out is not None else np.empty(shape, dtype=np.float32)
                res[order] = dest
                return res
        if self._mm is None:
            try:
                self._mm = _memmap(self.path, self.info).reshape(self.shape)
            except ValueError as exc:  # the file changed since its header was read (a job keeps headers)
                raise InputError(f"the file no longer holds the images its header promised ({exc})",
                                 path=str(self.path)) from exc
        if out is None:
            return np.asarray(self._mm[idx], dtype=np.float32)
        out[...] = self._mm[idx]
        return out

    def _read_windows(self, ordered: np.ndarray, step: np.ndarray, windows: np.ndarray, dest: np.ndarray) -> None:
        """Images ``ordered`` (ascending, no repeats; ``step`` its differences, ``windows`` the positions that
        start a window) into ``dest`` (n, y, x) float32: one positioned read per window, the images between the
        asked ones into a scratch buffer."""
        ib = int(np.prod(self.shape[1:])) * 4  # bytes per image
        flat = dest.reshape(-1).view(np.uint8)
        gap = step - 1
        inner = gap[gap <= DIRECT_READ_MAX_GAP]  # the gaps within windows (those between windows are not read)
        scratch = np.empty(int(inner.max(initial=0)) * ib, dtype=np.uint8)
        runs = np.flatnonzero(np.diff(ordered, prepend=-2) != 1)  # positions where a run of consecutive images starts
        ends = np.append(runs[1:], ordered.size)
        window_of_run = np.searchsorted(windows, runs, side="right")  # windows start at runs' starts
        with open(self.path, "rb", buffering=0) as fh:
            views: list = []
            first = 0
            for r, (a, b) in enumerate(zip(runs.tolist(), ends.tolist(), strict=True)):
                if views and window_of_run[r] != window_of_run[r - 1]:  # a new window: read the last one
                    _read_exactly(fh, views, self.info.offset + int(ordered[first]) * ib, self.path)
                    views = []
                if views:  # the images between the previous run and this one
                    views.append(memoryview(scratch[:int(gap[a - 1]) * ib]))
                else:
                    first = a
                views.append(memoryview(flat[a * ib:b * ib]))
            _read_exactly(fh, views, self.info.offset + int(ordered[first]) * ib, self.path)

    def close(self) -> None:
        """Drop the memory map (the OS unmaps it once no array views remain)."""
        self._open = False
        self._mm = None

    def __enter__(self) -> LazyStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LazyStack({str(self.path)!r}, shape={self.shape}, pixel_size={self.pixel_size})"

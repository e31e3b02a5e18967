"""The particle set of an EM job: a particles STAR with the per-particle hidden-variable state that the iterations
update (angles, offsets, classes, Pmax, norm, ...), read with clear errors and written back as RELION's
run_itNNN_data.star."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute.backend import get_array_module
from ..compute.ctf import CtfParams, OpticsAberrations, parse_zernike
from ..errors import InputError
from ..io.particle_images import check_image_stacks, image_names_for, load_images
from ..io.star import ParticleTable, read_particles, write_particles
from ..io.write_queue import formats_text
from ..runtime.memory import READ_AHEAD_MIN_BYTES
from .read_ahead import BLOCK_ROWS, ImageReadAhead

#: The parts of ParticleSet.seconds_reading: the job's thread waiting for the background reader's next block, reading
#: rows itself (the reader had not started them), and moving images into the store (the copies to the GPU the
#: reader's threads did not make, through CuPy's page-locked staging blocks, and the scatters into the store).
READING_PARTS = ("waiting for the reader", "read by the job's thread", "into the store")
#: Rows moved at once when the kept images move to another array (keep_images_on).
MOVE_ROWS = 2048
ANGLES = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
CTF_COLUMNS = ("rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle", "rlnVoltage", "rlnSphericalAberration",
               "rlnAmplitudeContrast")


@dataclass
class ParticleSet:
    """A particles STAR with the per-particle hidden-variable state the EM iterations update."""

    table: ParticleTable
    pixel_size: float
    box: int
    angles: np.ndarray  # (n, 3) rot, tilt, psi (degrees)
    offsets_px: np.ndarray  # (n, 2) origin offsets (pixels)
    norm: np.ndarray  # (n,) rlnNormCorrection
    subset: np.ndarray  # (n,) 1 or 2
    optics_group: np.ndarray  # (n,) 0-based
    scale_group: np.ndarray  # (n,) 0-based index into scale_group_names
    scale_group_names: list
    ctf: CtfParams | None
    classes: np.ndarray = None  # (n,) 0-based
    pmax: np.ndarray = None
    nr_significant: np.ndarray = None
    log_likelihood: np.ndarray = None
    residual_power: np.ndarray = None
    checked: np.ndarray = None  # (n,) bool: the row's image has been read once and found usable
    kept: np.ndarray | None = None  # (capacity, box, box) float32 images kept in memory (NumPy or CuPy)
    slot: np.ndarray | None = None  # (n,) int64: the row's place in ``kept``, -1 when it is not there
    ahead: ImageReadAhead | None = None  # the background reader of the images not yet kept (read_ahead)
    # every row's (stack path, image index), parsed once (check_image_stacks)
    locations: tuple | None = field(default=None, repr=False, compare=False)
    # the stacks' headers, parsed on their first reading (the reader and the job's thread read block by block)
    headers: dict = field(default_factory=dict, repr=False, compare=False)
    # seconds the job's thread has spent reading images or waiting for the background reader (images()): the part
    # of an E-step that is disk, not compute, so that MPI ranks' shares follow their compute speed only
    seconds_reading: float = field(default=0.0, repr=False, compare=False)
    # seconds_reading in its parts (READING_PARTS): where an E-step's reading time goes (issue 47: iteration 1's
    # reading grew with a rank's image count as if the background reader overlapped nothing)
    reading_parts: dict = field(default_factory=lambda: dict.fromkeys(READING_PARTS, 0.0), repr=False,
                                compare=False)

    def __post_init__(self):
        n = len(self.table)
        for name, dt in (("classes", np.int64), ("pmax", float), ("nr_significant", np.int64),
                         ("log_likelihood", float), ("residual_power", float), ("checked", bool)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, dtype=dt))

    def __len__(self) -> int:
        return len(self.table)

    @property
    def n_optics_groups(self) -> int:
        return int(self.optics_group.max()) + 1

    @property
    def image_bytes(self) -> int:
        """Bytes of all the images as float32."""
        return len(self) * self.box * self.box * 4

    @property
    def in_memory(self) -> np.ndarray | None:
        """(n,) bool: the row's image is kept (None when images are not kept)."""
        return None if self.slot is None else self.slot >= 0

    def keep_images_in_memory(self) -> None:
        """From now on each image is read from its stack once and then kept in memory (RELION's
        --preread_images, filled as the rows are first asked for): later iterations read no files. The array is
        allocated untouched, so an MPI rank's memory holds only the rows it reads."""
        if self.kept is None:
            self.kept = np.empty((len(self), self.box, self.box), dtype=np.float32)
            self.slot = np.full(len(self), -1, dtype=np.int64)

    def keep_images_on(self, xp, capacity: int | None = None) -> None:
        """Keep the images in an array of ``xp`` (CuPy: on the GPU, so that an iteration neither copies them on
        the host nor uploads them): the images read so far move there, the others are read into it as they are
        first asked for. ``capacity`` (images) smaller than the set makes a store for an MPI rank's own rows: each
        row takes a free place when first read, ``retain`` frees the places of rows the rank no longer has, and a
        row that finds no place is read from its stack each time it is asked for."""
        n = len(self)
        cap = n if capacity is None else max(1, min(int(capacity), n))
        old, old_slot = self.kept, self.slot
        self.kept = xp.empty((cap, self.box, self.box), dtype=np.float32)
        self.slot = np.full(n, -1, dtype=np.int64)
        if old is not None:  # in pieces: no second host copy of a large store
            done = np.flatnonzero(old_slot >= 0)
            for i in range(0, done.size, MOVE_ROWS):
                part = done[i:i + MOVE_ROWS]
                self._store(part, old[get_array_module(old).asarray(old_slot[part])])

    @property
    def _identity(self) -> bool:
        """The store has a place for every row: row r lives at place r."""
        return self.kept is not None and len(self.kept) == len(self)

    def retain(self, rows) -> None:
        """The rows this rank will ask for (its blocks of the halves this iteration): a store smaller than the set
        frees the places of the rows it holds that are not among them."""
        if self.kept is None or self._identity:
            return
        wanted = np.zeros(len(self), dtype=bool)
        wanted[np.asarray(rows, dtype=np.int64)] = True
        self.slot[~wanted] = -1

    def _places(self, rows: np.ndarray) -> np.ndarray:
        """Places in the store for ``rows`` (distinct, not held): free places in order, -1 where none is left."""
        if self._identity:
            return rows.copy()
        used = np.zeros(len(self.kept), dtype=bool)
        used[self.slot[self.slot >= 0]] = True
        free = np.flatnonzero(~used)[:len(rows)]
        out = np.full(len(rows), -1, dtype=np.int64)
        out[:len(free)] = free
        return out

    def _store(self, rows: np.ndarray, data) -> None:
        """Keep ``data`` (images of the distinct rows ``rows``, not held) where the store has room."""
        xp = get_array_module(self.kept)
        places = self._places(rows)
        ok = places >= 0
        if ok.all():
            self.kept[xp.asarray(places)] = xp.asarray(data)
        elif ok.any():  # a full store keeps what fits (data may be on the host or the device)
            part = data[get_array_module(data).asarray(np.flatnonzero(ok))]
            self.kept[xp.asarray(places[ok])] = xp.asarray(part)
        self.slot[rows[ok]] = places[ok]

    def read_ahead(self, order, threads: int = 1, ahead_bytes: int = READ_AHEAD_MIN_BYTES,
                   upload: Callable | None = None) -> None:
        """Read the images of rows ``order`` (in the order the job will ask for them) from their stacks in
        ``threads`` background threads while the job starts and computes (jobs/read_ahead.py); images() takes them
        as they come, and reads itself the rows the reader has not started; the threads hold at most ``ahead_bytes``
        of images not yet taken (runtime.memory.read_ahead_bytes), more for a request. ``upload`` (the store is on
        a GPU: compute.backend.thread_upload): the threads copy each block to the GPU too, so that the job's thread
        only moves it into the store there. Nothing when images are not kept in memory or when they all are
        already; while a reader runs, only its bound is raised to ``ahead_bytes`` and ``upload`` given to it."""
        block_bytes = BLOCK_ROWS * self.box * self.box * 4
        if upload is not None and (self.kept is None or get_array_module(self.kept) is np):
            upload = None  # no store on the GPU
        if self.ahead is not None:
            self.ahead.raise_ahead(ahead_bytes // block_bytes)
            self.ahead.then(upload)
            return
        if self.kept is None:
            return
        order = np.asarray(order, dtype=np.int64)
        _, first = np.unique(order, return_index=True)
        order = order[np.sort(first)]
        order = order[self.slot[order] < 0]
        if order.size == 0:
            return
        self.ahead = ImageReadAhead(self._read, order, len(self), BLOCK_ROWS, ahead_bytes // block_bytes,
                                    threads=threads, then=upload)

    def stop_reading(self) -> None:
        """End the background reader (the job ends, is cancelled or failed); the rows it has not read are read
        when asked for."""
        if self.ahead is not None:
            self.ahead.stop()
            self.ahead = None

    def _take_read_ahead(self, rows: np.ndarray) -> None:
        """Request ``rows`` from the reader (those it has not started and will not reach soon are images()'s to
        read), then move into the store the blocks it had read when asked, and more only while a row of ``rows``
        is still coming (a thread's error is raised here, in the job's thread). Taking every block as it came let
        several fast threads hand the whole set to one call: the initial model's 1,000 images took 20.9 s and moved
        100,000 box-256 images into the host's store, which then took 33.8 s to move to the GPU (2 H200s,
        thirty-seventh session)."""
        self.ahead.request(rows)
        more = self.ahead.ready()
        while self.ahead is not None:
            wait = self.ahead.coming(rows)
            if not wait and more <= 0:
                if self.ahead.exhausted():
                    self.stop_reading()
                return
            more -= 1
            t0 = time.perf_counter()
            try:
                item = self.ahead.next(wait=wait)
            except BaseException:
                self.stop_reading()
                raise
            finally:
                self._count(READING_PARTS[0], t0)
            if item is None:
                if self.ahead.finished:
                    self.stop_reading()
                return
            got, data = item
            t0 = time.perf_counter()
            self._store(got, data)
            self._count(READING_PARTS[2], t0)

    def _count(self, part: str, t0: float) -> None:
        """Add the seconds since ``t0`` (time.perf_counter) to reading part ``part`` (READING_PARTS)."""
        self.reading_parts[part] += time.perf_counter() - t0

    def images(self, rows):
        """The images of ``rows`` (float32; an array of the kept images' module, so on the GPU when they are kept
        there); the first time a row is read its image is checked (InputError naming the stack, the image and the
        STAR line for NaN or infinite pixels or a blank image, which give NaN results)."""
        rows = np.asarray(rows, dtype=np.int64)
        t0 = time.perf_counter()
        if self.kept is None:
            out = self._read(rows)
            self._count(READING_PARTS[1], t0)
            self.seconds_reading += time.perf_counter() - t0
            return out
        if self.ahead is not None:
            self._take_read_ahead(rows)
        xp = get_array_module(self.kept)
        new = np.unique(rows[self.slot[rows] < 0])
        data = None
        if new.size:
            t1 = time.perf_counter()
            data = self._read(new)
            self._count(READING_PARTS[1], t1)
            t1 = time.perf_counter()
            self._store(new, data)
            self._count(READING_PARTS[2], t1)
        self.seconds_reading += time.perf_counter() - t0
        places = self.slot[rows]
        if (places >= 0).all():
            return self.kept[xp.asarray(places)]
        out = xp.empty((len(rows), self.box, self.box), dtype=np.float32)  # a full store: some rows from the read
        held = places >= 0
        out[xp.asarray(np.flatnonzero(held))] = self.kept[xp.asarray(places[held])]
        out[xp.asarray(np.flatnonzero(~held))] = xp.asarray(data[np.searchsorted(new, rows[~held])])
        return out

    def _read(self, rows: np.ndarray) -> np.ndarray:
        check = not self.checked[rows].all()
        out = load_images(self.table, rows=rows, check_values=check, locations=self.locations,
                          headers=self.headers).astype(np.float32, copy=False)
        self.checked[rows] = True
        return out

    def ctf_rows(self, rows) -> CtfParams | None:
        return None if self.ctf is None else self.ctf.subset(np.asarray(rows))


def load_particle_set(path: Path, ctf: bool, seed: int = 0, halves: bool = True) -> ParticleSet:
    """Read a particles STAR for refinement; clear errors (file, column) for what is missing. Particles
    without rlnRandomSubset are split into random halves (kept when present, as RELION does)."""
    table = read_particles(path, require=("rlnImageName",))
    locations = check_image_stacks(table)  # every stack there, an image stack, long enough, of the box size
    df = table.particles
    n = len(df)
    if ctf:
        missing = [c for c in CTF_COLUMNS if c not in df.columns]
        if missing:
            raise InputError(f"--ctf needs the CTF column(s) {', '.join(missing)} (in the particles or optics "
                             "table)", path=str(path), column=", ".join(missing))
    apix = table.pixel_size
    box = table.box_size
    ang = np.zeros((n, 3))
    for j, c in enumerate(ANGLES):
        if c in df:
            ang[:, j] = df[c].to_numpy(float)
    if "rlnOriginXAngst" in df and "rlnOriginYAngst" in df:
        off = np.stack([df["rlnOriginXAngst"].to_numpy(float), df["rlnOriginYAngst"].to_numpy(float)], 1) / apix
    elif "rlnOriginX" in df and "rlnOriginY" in df:
        off = np.stack([df["rlnOriginX"].to_numpy(float), df["rlnOriginY"].to_numpy(float)], 1)
    else:
        off = np.zeros((n, 2))
    norm = df["rlnNormCorrection"].to_numpy(float) if "rlnNormCorrection" in df else np.ones(n)
    if "rlnRandomSubset" in df:
        subset = df["rlnRandomSubset"].to_numpy(int)
        bad = ~np.isin(subset, (1, 2))
        if bad.any():
            row = int(np.argmax(bad))
            raise InputError(f"rlnRandomSubset must be 1 or 2; row {row + 1} has {subset[row]}", path=str(path),
                             column="rlnRandomSubset", line=table.line_of(df.index[row]))
    else:
        subset = np.random.default_rng(seed).permutation(np.arange(n) % 2) + 1
    for h in (1, 2) if halves else ():
        if (subset == h).sum() < 2:
            raise InputError(f"too few particles for two gold-standard halves: half {h} has {(subset == h).sum()} "
                             f"of {n} particles (need at least 2 in each)", path=str(path), column="rlnRandomSubset")
    og = df["rlnOpticsGroup"].to_numpy(int) if "rlnOpticsGroup" in df else np.ones(n, int)
    _, og0 = np.unique(og, return_inverse=True)
    key = "rlnGroupNumber" if "rlnGroupNumber" in df else ("rlnMicrographName" if "rlnMicrographName" in df else None)
    if key is None:
        names, sg = ["1"], np.zeros(n, int)
    else:
        u, sg = np.unique(df[key].astype(str).to_numpy(), return_inverse=True)
        names = list(u)
    return ParticleSet(table, apix, box, ang, off, norm, subset, og0, sg, names,
                       CtfParams.from_table(df) if ctf else None, locations=locations)


def _used_groups(table: ParticleTable) -> list[tuple[int, dict | None]]:
    """(rlnOpticsGroup number, its optics row or None) of each group the particles use, in the order of their
    0-based optics_group (sorted numbers); [] without an optics table."""
    optics = table.optics
    if optics is None or len(optics) == 0 or "rlnOpticsGroup" not in optics:
        return []
    rows = {int(r["rlnOpticsGroup"]): r for _, r in optics.iterrows()}
    df = table.particles
    numbers = np.unique(df["rlnOpticsGroup"].to_numpy(int)) if "rlnOpticsGroup" in df else np.array([1])
    return [(int(g), rows.get(int(g))) for g in numbers]


def _per_group(table: ParticleTable, read, present) -> tuple | None:
    """read(row) of each used group (read(None) for a group missing from the optics table); None when no value
    is ``present``."""
    out = tuple(read(row) for _, row in _used_groups(table))
    return out if any(present(v) for v in out) else None


def _applying(table: ParticleTable, values, present, describe, what: str, detail: str) -> str | None:
    """'applying <what> of optics group(s) <groups> <detail>': the groups whose value is ``present`` (None: no
    line), each as describe(name, value)."""
    if values is None:
        return None
    groups = [describe(str(row.get("rlnOpticsGroupName", g)) if row is not None else str(g), v)
              for (g, row), v in zip(_used_groups(table), values, strict=True) if present(v)]
    return f"applying {what} of optics group(s) {', '.join(groups)} {detail}"


def _has_aberrations(a: OpticsAberrations) -> bool:
    return a.has_odd or a.has_even


def optics_aberrations(table: ParticleTable) -> tuple[OpticsAberrations, ...] | None:
    """The higher-order aberrations of each optics group the particles use, in the order of their 0-based
    optics_group (sorted rlnOpticsGroup numbers): rlnBeamTiltX/Y (mrad), rlnOddZernike, rlnEvenZernike, with the
    group's Cs and voltage; None when no group has any (what relion_ctf_refine and our ctf_refine write)."""
    return _per_group(table, lambda r: OpticsAberrations() if r is None else row_aberrations(r), _has_aberrations)


def row_aberrations(row) -> OpticsAberrations:
    """One optics-table row's (a mapping's) beam tilt (mrad), odd and even Zernike terms, Cs and voltage."""
    return OpticsAberrations(float(row.get("rlnBeamTiltX", 0.0) or 0.0), float(row.get("rlnBeamTiltY", 0.0) or 0.0),
                             parse_zernike(row.get("rlnOddZernike")), parse_zernike(row.get("rlnEvenZernike")),
                             float(row.get("rlnSphericalAberration", 2.7)), float(row.get("rlnVoltage", 300.0)))


def applied_aberrations(table: ParticleTable, aberrations) -> str | None:
    """The line that says which optics groups' beam tilt and Zernike aberrations a job applies (None: none)."""
    return _applying(table, aberrations, _has_aberrations, lambda name, _: name,
                     "the beam tilt and Zernike aberrations", "(rlnBeamTiltX/Y, rlnOddZernike, rlnEvenZernike): "
                     "images demodulated, CTFs with the even terms")


MAG_COLUMNS = ("rlnMagMat00", "rlnMagMat01", "rlnMagMat10", "rlnMagMat11")


def row_magnification(row) -> np.ndarray | None:
    """One optics-table row's anisotropic magnification matrix (2x2, rlnMagMat00/01/10/11), None for the
    identity or no columns."""
    m = np.array([[float(row.get("rlnMagMat00", 1.0)), float(row.get("rlnMagMat01", 0.0))],
                  [float(row.get("rlnMagMat10", 0.0)), float(row.get("rlnMagMat11", 1.0))]])
    return None if np.abs(m - np.eye(2)).max() <= 1e-9 else m


def optics_magnifications(table: ParticleTable) -> tuple[np.ndarray | None, ...] | None:
    """Each optics group's anisotropic magnification matrix (what relion_ctf_refine --fit_aniso writes) in the
    order of the particles' 0-based optics_group, None per group without one; None when no group has one. The EM
    jobs and reconstruct apply them as RELION does: projections and insertions at A^T (M k), CTFs at M k."""
    return _per_group(table, lambda r: None if r is None else row_magnification(r), lambda m: m is not None)


def applied_magnifications(table: ParticleTable, mags) -> str | None:
    """The line that says which optics groups' magnification matrices a job applies (None: none)."""
    return _applying(table, mags, lambda m: m is not None,
                     lambda name, m: f"{name} ({' '.join(f'{v:.4f}' for v in np.ravel(m))})",
                     "the anisotropic magnification", "(rlnMagMat00/01/10/11): projections, insertions and CTFs "
                     "at the magnified frequencies")


def data_table(ps: ParticleSet) -> pd.DataFrame:
    """The particles with the refined hidden variables in RELION's columns."""
    df = ps.table.particles.copy()
    df["rlnAngleRot"], df["rlnAngleTilt"], df["rlnAnglePsi"] = ps.angles[:, 0], ps.angles[:, 1], ps.angles[:, 2]
    df["rlnOriginXAngst"] = ps.offsets_px[:, 0] * ps.pixel_size
    df["rlnOriginYAngst"] = ps.offsets_px[:, 1] * ps.pixel_size
    for c in ("rlnOriginX", "rlnOriginY"):
        if c in df:
            del df[c]
    df["rlnClassNumber"] = ps.classes + 1
    df["rlnNormCorrection"] = ps.norm
    df["rlnLogLikeliContribution"] = ps.log_likelihood
    df["rlnMaxValueProbDistribution"] = ps.pmax
    df["rlnNrOfSignificantSamples"] = ps.nr_significant
    df["rlnRandomSubset"] = ps.subset
    return df


def particle_state(ps: ParticleSet) -> ParticleSet:
    """A particle set with its own copy of every per-particle value the iterations change, sharing the (unchanged)
    table: what one iteration's data.star says, handed to the write thread while the next iteration changes ps."""
    return replace(ps, angles=ps.angles.copy(), offsets_px=ps.offsets_px.copy(), norm=ps.norm.copy(),
                   subset=ps.subset.copy(), classes=ps.classes.copy(), pmax=ps.pmax.copy(),
                   nr_significant=ps.nr_significant.copy(), log_likelihood=ps.log_likelihood.copy(),
                   residual_power=ps.residual_power.copy(), checked=ps.checked.copy(), kept=None, slot=None,
                   ahead=None)


@formats_text
def write_data_star(path: Path, ps: ParticleSet) -> None:
    """run_itNNN_data.star of ``ps`` (a particle_state: the table is made on the thread that writes it)."""
    write_particles(path, data_star_table(path, ps), ps.table.optics)


def data_star_table(path: Path, ps: ParticleSet) -> pd.DataFrame:
    """The table of run_itNNN_data.star at ``path`` (image names relative to it), with its own copy of every
    column: later changes to the particle set do not reach it (it may be written on another thread)."""
    df = data_table(ps)
    df["rlnImageName"] = image_names_for(ps.table, path, ps.locations).to_numpy()
    return df.copy(deep=True)


"""Particle extraction (the counterpart of relion_preprocess --extract).

Per micrograph: read lazily, move to the device, cut all boxes with one gather (coordinates truncated as
RELION does; partially outside boxes keep edge-replicated pixels unless --skip_edge), Fourier-rescale,
remove dust, subtract the background ramp, normalise on the background ring, invert contrast, and write one
stack <o>/Particles/<micrograph path without job prefix>.mrcs. Then <o>/particles.star with an optics table
(rlnImagePixelSize, rlnImageSize after rescaling) and the coordinate and CTF columns passed through.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute import extraction as ex
from ..compute.backend import to_host
from ..compute.geometry import euler_to_matrix
from ..errors import InputError
from ..events import Finished, Message, ParticlesExtracted, Started
from ..io.micrographs import (
    SKIP_FLAG,
    check_micrographs,
    micrograph_list,
    output_root,
    read_coordinate_list,
    read_micrograph,
)
from ..io.mrc import write_mrc
from ..io.star import read_coordinates, read_particles, write_particles
from ..runtime.device import backend_for
from ..runtime.distributed import root_events, world
from ..runtime.memory import batched_with_oom_retry, free_cached_memory, image_batch
from .common import (
    check_no_spaces,
    check_not_another_jobs_files,
    check_output_folder,
    check_outputs_not_inputs,
    check_pixel_size,
    holding_lock,
    mrc_bytes,
    param,
    prepare_output,
    write_note,
)
from .micrograph_driver import Round, failure_report, over_micrographs, read_or_skip

JOB_NAME = "extract"
#: Extracted images per micrograph sent to the viewer's gallery (ParticlesExtracted); the stack has them all.
GALLERY_IMAGES = 64

_CTF_COLUMNS = ("rlnCtfMaxResolution", "rlnCtfFigureOfMerit", "rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle",
                "rlnCtfBfactor", "rlnCtfScalefactor", "rlnPhaseShift", "rlnBeamTiltX", "rlnBeamTiltY")


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="Micrographs STAR file (or a glob of MRC files with --angpix)")
    o: Path = param(flag="--o", help="Output folder (particles.star and Particles/)")
    coord_list: Path | None = param(None, "--coord_list", "Coordinate list (autopick.star: rlnMicrographName, "
                                    "rlnMicrographCoordinates)")
    reextract_data_star: Path | None = param(None, "--reextract_data_star",
                                             "Re-extract the particles of this STAR file instead")
    recenter: bool = param(False, "--recenter", "Re-centre re-extracted particles on their origin offsets")
    recenter_x: float = param(0.0, "--recenter_x", "X of the point to re-centre on (pixels of the particles)")
    recenter_y: float = param(0.0, "--recenter_y", "Y of the point to re-centre on (pixels)")
    recenter_z: float = param(0.0, "--recenter_z", "Z of the point to re-centre on (pixels)")
    extract_size: int = param(-1, "--extract_size", "Box size to cut out (micrograph pixels, even)")
    scale: int = param(-1, "--scale", "Rescale boxes to this size (pixels, even); -1 = no rescaling")
    norm: bool = param(False, "--norm", "Normalise on the background (mean 0, std 1 outside --bg_radius)")
    bg_radius: float = param(-1.0, "--bg_radius", "Background radius (pixels of the rescaled box); -1 = 75 %")
    no_ramp: bool = param(False, "--no_ramp", "Do not subtract a background plane before normalising")
    white_dust: float = param(-1.0, "--white_dust", "Replace pixels above this many sigma (-1 = off)")
    black_dust: float = param(-1.0, "--black_dust", "Replace pixels below minus this many sigma (-1 = off)")
    invert_contrast: bool = param(False, "--invert_contrast", "Invert contrast (black particles become white)")
    minimum_pick_fom: float = param(-9999.0, "--minimum_pick_fom", "Only particles with a FOM above this")
    skip_edge: bool = param(False, "--skip_edge", "Skip particles whose box leaves the micrograph (RELION keeps "
                            "them, with edge pixels repeated)")
    float16: bool = param(False, "--float16", "Write stacks in float16 (MRC mode 12)")
    skip_bad_micrographs: bool = param(False, SKIP_FLAG, "Skip micrographs that are missing or not readable 2D "
                                       "images (with a warning) instead of stopping before any work")
    angpix: float = param(-1.0, "--angpix", "Micrograph pixel size (Å) for MRC globs")
    random_seed: int = param(0, "--random_seed", "Seed for dust replacement noise")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index; MPI: RELION's 0:1:2:3, ranks take them in turn")

    def __post_init__(self):
        if self.i is None or self.o is None:
            raise InputError("--i (micrographs) and --o (output folder) are required")
        check_output_folder(self.o, "--o")
        check_pixel_size(self.angpix, "--angpix", "the micrographs STAR file")
        if self.batch < 0:
            raise InputError(f"--batch must be >= 0 (0: from free memory), got {self.batch}")
        if (self.coord_list is None) == (self.reextract_data_star is None):
            raise InputError("give either --coord_list or --reextract_data_star")
        for f, what in ((self.coord_list, "--coord_list"), (self.reextract_data_star, "--reextract_data_star")):
            if f is not None and not Path(f).is_file():
                raise InputError(f"{what}: file not found", path=str(f))
        if self.extract_size <= 0 or self.extract_size % 2:
            raise InputError(f"--extract_size must be a positive even number of pixels, got {self.extract_size}")
        if self.scale != -1 and (self.scale <= 0 or self.scale % 2):
            raise InputError(f"--scale must be a positive even number of pixels (or -1), got {self.scale}")
        out = self.scale if self.scale > 0 else self.extract_size
        if self.norm and self.bg_radius > 0 and 2 * self.bg_radius > out:
            raise InputError(f"--bg_radius {self.bg_radius} px does not fit the {out}-pixel box (2 x radius > box)")
        if self.recenter and self.reextract_data_star is None:
            raise InputError("--recenter needs --reextract_data_star")
        self.check_outputs()

    def check_outputs(self) -> None:
        """What the job writes (<o>/particles.star, <o>/note.txt and the stacks, whose paths particles.star names)
        overwrites none of its inputs nor another job's particles.star, and has no spaces (issue 50)."""
        out = Path(self.o)
        check_no_spaces(out, "--o", "the particle stacks' paths are written into particles.star (rlnImageName)")
        check_outputs_not_inputs([out / "particles.star", out / "note.txt"],
                                 [("--i", self.i), ("--coord_list", self.coord_list),
                                  ("--reextract_data_star", self.reextract_data_star)])
        star = out / "particles.star"
        check_not_another_jobs_files(out, JOB_NAME, [star] if star.exists() else [], without_note=False)

    @property
    def out_size(self) -> int:
        return self.scale if self.scale > 0 else self.extract_size

    @property
    def background_radius(self) -> float:
        return self.bg_radius if self.bg_radius > 0 else float(int(0.375 * self.out_size))


def _coordinates_from_list(p: Params, names: list[str]) -> dict[str, tuple[pd.DataFrame, Path]]:
    cl = read_coordinate_list(p.coord_list)
    out = {}
    for nm in names:
        f = cl.get(nm)
        if f is None:
            continue
        out[nm] = (read_coordinates(f), f)
    return out


def _coordinates_from_particles(p: Params, apix_mic: float) -> tuple[dict[str, tuple[pd.DataFrame, Path]], list]:
    t = read_particles(p.reextract_data_star, require=("rlnMicrographName", "rlnCoordinateX", "rlnCoordinateY"))
    df = t.particles.copy()
    notes = []
    p_part = t.pixel_size
    if p.recenter:
        ox = df["rlnOriginXAngst"].to_numpy(float) if "rlnOriginXAngst" in df else np.zeros(len(df))
        oy = df["rlnOriginYAngst"].to_numpy(float) if "rlnOriginYAngst" in df else np.zeros(len(df))
        c = np.array([p.recenter_x, p.recenter_y, p.recenter_z], float)
        if np.any(c != 0):
            A = euler_to_matrix(*(df[k].to_numpy(float) if k in df else np.zeros(len(df))
                                  for k in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")))
            rc = A.transpose(0, 2, 1) @ c
        else:
            rc = np.zeros((len(df), 3))
        o_x = (ox / p_part - rc[:, 0]) * (p_part / apix_mic)
        o_y = (oy / p_part - rc[:, 1]) * (p_part / apix_mic)
        rx, ry = np.sign(o_x) * np.floor(np.abs(o_x) + 0.5), np.sign(o_y) * np.floor(np.abs(o_y) + 0.5)
        df["rlnCoordinateX"] = df["rlnCoordinateX"].to_numpy(float) - rx
        df["rlnCoordinateY"] = df["rlnCoordinateY"].to_numpy(float) - ry
        df["rlnOriginXAngst"] = (o_x - rx) * apix_mic
        df["rlnOriginYAngst"] = (o_y - ry) * apix_mic
        notes.append(f"re-centred {len(df)} particles on their origin offsets")
    keep = [c for c in df.columns if c not in t.optics.columns or c == "rlnOpticsGroup"]
    df = df[[c for c in keep if c not in ("rlnImageName", "rlnOpticsGroup")]]
    out = {str(nm): (g.drop(columns=["rlnMicrographName"]).reset_index(drop=True), Path(p.reextract_data_star))
           for nm, g in df.groupby("rlnMicrographName", sort=False)}
    return out, notes


@dataclass
class _Extraction:
    """One rank's extraction in the per-micrograph driver (jobs.micrograph_driver): ``extract`` cuts and writes
    one micrograph's particle stack (every rank), ``collect`` gathers every rank's particle rows (rank 0)."""

    p: Params
    ml: object
    todo: list
    coords: dict
    shapes: dict
    be: object
    out_dir: Path
    rows: list = field(default_factory=list)  # (index in todo, particle rows)
    n_total: int = 0
    n_edge: int = 0

    def extract(self, k: int, stop: int) -> Iterator:
        """Micrograph todo[k]: its stack written, ParticlesExtracted yielded; a Round with (k, rows or None,
        boxes leaving the micrograph)."""
        p, e, xp = self.p, self.todo[k], self.be.xp
        B, b, apix = p.extract_size, p.out_size, self.ml.pixel_size
        df, _src = self.coords[e.name]
        df = df.reset_index(drop=True)
        if p.minimum_pick_fom > -9999 and "rlnAutopickFigureOfMerit" in df:
            df = df[df["rlnAutopickFigureOfMerit"].to_numpy(float) > p.minimum_pick_fom].reset_index(drop=True)
        xi, yi = ex.truncate_coordinates(df["rlnCoordinateX"], df["rlnCoordinateY"])
        ny, nx = self.shapes[e.name]
        inside = ex.box_inside(xi, yi, B, ny, nx)
        n_edge = int((~inside).sum())
        if p.skip_edge:
            df, xi, yi = df[inside].reset_index(drop=True), xi[inside], yi[inside]
        if len(df) == 0:
            return Round([(k, None, n_edge)], done=1)
        mic, failure = read_or_skip(e, p.skip_bad_micrographs,
                                    lambda path: xp.asarray(np.asarray(read_micrograph(path))))
        if failure is not None:
            return Round([(k, None, n_edge)], [failure], done=1, progress=False)
        stack = np.empty((len(df), b, b), np.float16 if p.float16 else np.float32)
        per = (B * B + 6 * b * b) * 16
        batch = p.batch or image_batch(self.be.free_bytes(), per, len(df))

        def work(i0: int, i1: int, mic=mic, xi=xi, yi=yi, stack=stack, seed=p.random_seed + k) -> None:
            boxes = ex.cut_boxes(mic, xi[i0:i1], yi[i0:i1], B)
            imgs = ex.process_particles(boxes, b, p.norm, p.background_radius, p.white_dust, p.black_dust,
                                        not p.no_ramp, p.invert_contrast, seed + i0)
            stack[i0:i1] = to_host(imgs)

        for item in batched_with_oom_retry(len(df), batch, work, self.be):
            if isinstance(item, Message):
                yield item
        del mic
        stack_path = self.out_dir / "Particles" / (output_root(e.name) + ".mrcs")
        write_mrc(stack_path, stack, apix * B / b, stack=True)
        yield ParticlesExtracted(e.name, e.row, np.stack([xi, yi], 1).astype(np.float64), B, apix,
                                 stack[:GALLERY_IMAGES].astype(np.float32), apix * B / b, stack_path)
        return Round([(k, _particle_rows(df, e, stack_path, self.ml), n_edge)], done=1)

    def collect(self, results: list) -> Iterator:
        """Rank 0: every rank's particle rows and counts of a round (no event)."""
        for k, part, n_edge in results:
            self.n_edge += n_edge
            if part is not None:
                self.rows.append((k, part))
                self.n_total += len(part)
        yield from ()


def _particle_rows(df: pd.DataFrame, e, stack_path: Path, ml) -> pd.DataFrame:
    """The particles.star rows of one micrograph's stack: image names, micrograph, optics group, CTF columns."""
    part = df.copy()
    part["rlnImageName"] = [f"{j + 1:06d}@{stack_path}" for j in range(len(df))]
    part["rlnMicrographName"] = e.name
    mrow = ml.table.iloc[e.row]
    part["rlnOpticsGroup"] = int(mrow.get("rlnOpticsGroup", 1))
    for c in _CTF_COLUMNS:
        if c in ml.table.columns and c not in ml.optics.columns and c not in part.columns:
            part[c] = mrow[c]
    return part


def run(p: Params) -> Iterator:
    """Under MPI every rank extracts its block of the micrographs and writes their particle stacks (as
    relion_preprocess_mpi); rank 0 gathers the particle rows, writes particles.star and yields the events."""
    yield from root_events(world(), holding_lock(_run(p), Path(p.o) / "particles", JOB_NAME, "--o"))


def _run(p: Params) -> Iterator:
    comm = world()
    ml = micrograph_list(p.i, p.angpix)
    apix = ml.pixel_size
    B, b = p.extract_size, p.out_size
    out_dir = Path(p.o)
    be = backend_for(p)
    names = [e.name for e in ml.entries]
    notes: list[str] = []
    if p.coord_list is not None:
        coords = _coordinates_from_list(p, names)
    else:
        coords, notes = _coordinates_from_particles(p, apix)
    todo = [e for e in ml.entries if e.name in coords]
    if not todo:
        raise InputError("no micrograph of --i has coordinates (names must match rlnMicrographName)",
                         path=str(p.coord_list or p.reextract_data_star), column="rlnMicrographName")
    # every micrograph readable and every coordinate inside it, from the headers, before anything is written
    todo, shapes, failures = check_micrographs(ml, todo, p.skip_bad_micrographs)
    if not todo:
        raise InputError(f"none of the micrographs with coordinates can be used: {'; '.join(failures[:3])}",
                         path=str(p.i))
    n_boxes = 0
    for e in todo:
        df, src = coords[e.name]
        n_boxes += len(df)
        xi, yi = ex.truncate_coordinates(df["rlnCoordinateX"], df["rlnCoordinateY"])
        ny, nx = shapes[e.name]
        bad = ~ex.box_touches(xi, yi, B, ny, nx)
        if bad.any():
            r = int(np.argmax(bad))
            col = "rlnCoordinateX" if not (0 <= xi[r] < nx) else "rlnCoordinateY"
            val = df[col].iloc[r]
            raise InputError(f"particle {r + 1} at ({df['rlnCoordinateX'].iloc[r]}, {df['rlnCoordinateY'].iloc[r]})"
                             f" is outside micrograph {e.name} ({nx} x {ny} px): {col} = {val}; the box of "
                             f"{B} px would be entirely outside", path=str(src), column=col)
    stacks = n_boxes * b * b * (2 if p.float16 else 4) + len(todo) * mrc_bytes(0)
    out_notes = (prepare_output(out_dir, stacks + n_boxes * 600, "the particle stacks and STAR file")
                 if comm.is_root else [])  # rank 0 alone checks the disk and removes stale temporaries
    yield Started(JOB_NAME, out_dir, be.name, f"extracting from {len(todo)} micrographs, box {B} -> {b} px")
    yield from out_notes
    for t in notes:
        yield Message(t)
    for f in failures:
        yield Message(f"skipping micrograph {f}", "warning")
    comm.barrier()  # every rank writes stacks: none before rank 0's checks have passed (else it stops them all)
    out_dir.mkdir(parents=True, exist_ok=True)
    if comm.is_root:
        write_note(out_dir, JOB_NAME, p)
    todo = [e for e in todo if e.name in shapes]
    job = _Extraction(p, ml, todo, coords, shapes, be, out_dir)
    failures += yield from over_micrographs(comm, len(todo), job.extract, job.collect, "extracting")
    if not comm.is_root:
        return
    rows = [part for _, part in sorted(job.rows, key=lambda kp: kp[0])]  # micrograph order, whichever rank
    n_total, n_edge = job.n_total, job.n_edge
    if not rows:
        raise InputError("no particles were extracted" + (f"; failures: {'; '.join(failures)}" if failures else ""))
    parts = pd.concat(rows, ignore_index=True)
    optics = ml.optics.copy()
    optics = optics[optics["rlnOpticsGroup"].isin(parts["rlnOpticsGroup"].unique())]
    optics = optics.drop(columns=[c for c in ("rlnMicrographPixelSize",) if c in optics.columns])
    optics["rlnImagePixelSize"] = apix * B / b
    optics["rlnImageSize"] = np.int64(b)
    optics["rlnImageDimensionality"] = np.int64(2)
    optics["rlnCtfDataAreCtfPremultiplied"] = np.int64(0)
    parts = parts.drop(columns=[c for c in optics.columns if c in parts.columns and c != "rlnOpticsGroup"])
    first = ["rlnCoordinateX", "rlnCoordinateY"]
    parts = parts[first + [c for c in parts.columns if c not in first]]
    star = write_particles(out_dir / "particles.star", parts, optics.reset_index(drop=True))
    free_cached_memory(be)
    summary = f"{n_total} particles from {len(rows)} micrographs, box {B} -> {b} px ({apix * B / b:.3f} Å/px)"
    if n_edge:
        summary += f"; {n_edge} boxes left the micrograph ({'skipped' if p.skip_edge else 'edge pixels repeated'})"
    if failures:
        yield failure_report(failures)
        summary += f"; {len(failures)} failed"
    yield Finished({"particles": star}, summary)

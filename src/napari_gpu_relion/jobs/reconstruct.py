"""Reconstruct a map from the angles and offsets in a particles STAR (the counterpart of relion_reconstruct).

Per batch of particles: FFT, apply the origin offset as a phase shift, optionally multiply by the CTF (and
weight by CTF^2), then one batched trilinear insertion into the padded Fourier grid. Finally Hermitian
pairing, point-group symmetrisation and the unregularised reconstruction with RELION's weight floor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cancel import check_cancel
from ..compute.backend import to_host
from ..compute.backprojector import BackProjector
from ..compute.ctf import CtfParams, ctf_from_frequencies, ctf_half_grid, demodulation_factors, gamma_offsets
from ..compute.extraction import background_stats
from ..compute.fourier import half_grid_indices, phase_shift_2d, rfft_centered
from ..compute.geometry import euler_to_matrix, magnified, magnified_frequencies, symmetry_group
from ..errors import InputError
from ..events import Finished, MapUpdated, Message, Progress, Started
from ..io.atomic import ensure_not_input
from ..io.mrc import map_problem, write_mrc
from ..io.particle_images import (
    MASK_EDGE_PX,
    check_image_stacks,
    check_normalisation,
    load_images,
    norm_check_rows,
)
from ..io.star import ParticleTable, read_particles
from ..runtime.device import backend_for
from ..runtime.distributed import accumulator_grids, root_events, world
from ..runtime.memory import batched_with_oom_retry, free_cached_memory, image_batch
from .common import check_output_file, check_pixel_size, mrc_bytes, param, prepare_output, require_file, write_note
from .particles import applied_aberrations, applied_magnifications, optics_aberrations, optics_magnifications

JOB_NAME = "reconstruct"

ANGLE_COLUMNS = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")
CTF_COLUMNS = ("rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle", "rlnVoltage", "rlnSphericalAberration",
               "rlnAmplitudeContrast")


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="Particles STAR file with angles and offsets")
    o: Path = param(flag="--o", help="Output map (.mrc)")
    ctf: bool = param(False, "--ctf", "Apply CTF correction (multiply by CTF, weight by CTF²)")
    sym: str = param("C1", "--sym", "Point-group symmetry (C1, Cn, Dn, T, O, I, ...)")
    subset: int = param(0, "--subset", "Only this random subset (1 or 2); 0 = all particles")
    maxres: float = param(-1.0, "--maxres", "Maximum resolution to use (Å); -1 = Nyquist")
    pad: int = param(2, "--pad", "Padding factor of the Fourier grid")
    angpix: float = param(-1.0, "--angpix", "Pixel size (Å); -1 = from the STAR optics table")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index; MPI: RELION's 0:1:2:3, ranks take them in turn")
    dont_check_norm: bool = param(False, "--dont_check_norm", "Run even when the particles do not look normalised "
                                  "(RELION's flag; background mean 0, stddev 1 outside a circle of box - 5 px, "
                                  "RELION's default mask): a warning instead of the error")

    def __post_init__(self):
        require_file(self.i, "--i particles STAR", (".star",))
        if self.o is None or Path(self.o).suffix.lower() not in (".mrc", ".map"):
            raise InputError(f"--o must be an .mrc or .map file, got '{self.o}'")
        ensure_not_input(self.o, self.i)
        check_output_file(self.o, "--o")
        check_pixel_size(self.angpix, "--angpix", "the STAR file's optics table")
        if self.maxres <= 0 and self.maxres != -1:
            raise InputError(f"--maxres must be a resolution in Å (> 0), or -1 for Nyquist; got {self.maxres:g}")
        if self.batch < 0:
            raise InputError(f"--batch must be at least 1 particle (or 0: from the free memory), got {self.batch}")
        symmetry_group(self.sym)  # raises InputError for unknown names
        if self.subset not in (0, 1, 2):
            raise InputError(f"--subset must be 1 or 2 (or 0 for all), got {self.subset}")
        if self.pad < 1:
            raise InputError(f"--pad must be >= 1, got {self.pad}")


def particle_offsets_px(table: ParticleTable, pixel_size: float) -> np.ndarray:
    """(n, 2) origin offsets in pixels from rlnOriginX/YAngst (3.1+) or rlnOriginX/Y (3.0, pixels)."""
    df = table.particles
    if "rlnOriginXAngst" in df and "rlnOriginYAngst" in df:
        return np.stack([df["rlnOriginXAngst"].to_numpy(float), df["rlnOriginYAngst"].to_numpy(float)], 1) / pixel_size
    if "rlnOriginX" in df and "rlnOriginY" in df:
        return np.stack([df["rlnOriginX"].to_numpy(float), df["rlnOriginY"].to_numpy(float)], 1)
    raise InputError("offset columns missing: need rlnOriginXAngst and rlnOriginYAngst (or rlnOriginX/rlnOriginY "
                     f"in RELION 3.0 files); the file has {', '.join(df.columns)}", path=str(table.path))


def load_for_reconstruction(path: Path, ctf: bool, subset: int) -> ParticleTable:
    table = read_particles(path, require=("rlnImageName",) + ANGLE_COLUMNS)
    if ctf:  # CTF columns may live in the optics table: check the merged table
        missing = [c for c in CTF_COLUMNS if c not in table.particles.columns]
        if missing:
            raise InputError(f"--ctf needs the CTF column(s) {', '.join(missing)} (in the particles or optics "
                             "table)", path=str(path), column=", ".join(missing))
    if subset:
        if "rlnRandomSubset" not in table.particles:
            raise InputError("--subset needs the column rlnRandomSubset", path=str(path))
        keep = table.particles["rlnRandomSubset"].to_numpy() == subset
        if not keep.any():
            raise InputError(f"no particles with rlnRandomSubset == {subset}", path=str(path))
        table = ParticleTable(**{**table.__dict__, "particles": table.particles[keep]})
    return table


def run(p: Params) -> Iterator:
    """Under MPI every rank back-projects its block of the particles; the grids are summed and rank 0
    reconstructs, writes and yields the events."""
    yield from root_events(world(), _run(p))


def _run(p: Params) -> Iterator:
    comm = world()
    table = load_for_reconstruction(Path(p.i), p.ctf, p.subset)
    apix = p.angpix if p.angpix > 0 else table.pixel_size
    offsets = particle_offsets_px(table, apix)
    locations = check_image_stacks(table)  # every stack there, an image stack, long enough, of the box size
    df = table.particles
    n = len(df)
    N = table.box_size
    # RELION's check that the particles are normalised, on the first 1000 images of each optics group, before any
    # work (their values checked too): the background outside RELION's default particle mask, (N - 5) px wide
    rows = norm_check_rows(df["rlnOpticsGroup"].to_numpy() if "rlnOpticsGroup" in df else np.ones(n, int))
    radius = (N - MASK_EDGE_PX) / 2
    stats = [background_stats(load_images(table, rows=rows[a:a + 256], check_values=True, locations=locations), radius)
             for a in range(0, rows.size, 256)]
    norm_warning = check_normalisation(table, rows, np.concatenate([m for m, _ in stats] or [np.zeros(0)]),
                                       np.concatenate([s for _, s in stats] or [np.zeros(0)]), radius,
                                       p.dont_check_norm)
    be = backend_for(p)
    xp = be.xp
    out = Path(p.o)
    notes = prepare_output(out.parent, mrc_bytes(N, N, N), "the map", "--o") if comm.is_root else []  # rank 0 writes
    yield Started(JOB_NAME, out.parent, be.name, f"reconstructing {n} particles, box {N}, {apix:.3f} Å/px")
    yield from notes
    if norm_warning:
        yield Message(norm_warning, "warning")
    aberrations = optics_aberrations(table) if p.ctf else None
    line = applied_aberrations(table, aberrations)
    if line:
        yield Message(line)
    mags = optics_magnifications(table)
    line = applied_magnifications(table, mags)
    if line:
        yield Message(line)
    if comm.is_root:
        write_note(out.parent, JOB_NAME, p)
    r_max = N / 2 if p.maxres <= 0 else min(N / 2, N * apix / p.maxres)
    sym = symmetry_group(p.sym)
    ang = df[list(ANGLE_COLUMNS)].to_numpy(np.float64)
    ctfp = CtfParams.from_table(df) if p.ctf else None
    groups = (np.unique(df["rlnOpticsGroup"].to_numpy(int), return_inverse=True)[1] if "rlnOpticsGroup" in df
              else np.zeros(n, int))
    demod = None if aberrations is None else demodulation_factors(aberrations, N, apix, xp)
    ky, kx = half_grid_indices(N, 2, xp)
    even = None if aberrations is None else gamma_offsets(aberrations, kx / (N * apix), ky / (N * apix), xp)
    bp = BackProjector(N, p.pad, r_max, ndim=3, xp=xp)
    per_image = 700 * N * N + 8 * N * N
    batch = p.batch or image_batch(be.free_bytes(), per_image, n, most=4096)

    mine = comm.share(n)  # this rank's particles (all of them without MPI)

    def work(j0: int, j1: int) -> None:
        i0, i1 = int(mine[j0]), int(mine[j1 - 1]) + 1
        imgs = xp.asarray(load_images(table, rows=np.arange(i0, i1), check_values=True, locations=locations))
        F = rfft_centered(imgs.astype(np.float32), 2)
        F = phase_shift_2d(F, xp.asarray(offsets[i0:i1]), N)  # shifting by +origin centres the particle
        A = xp.asarray(euler_to_matrix(ang[i0:i1, 0], ang[i0:i1, 1], ang[i0:i1, 2]))
        g = xp.asarray(groups[i0:i1])
        if demod is not None:
            F = F * demod[g]  # the odd aberrations taken off the images (RELION's demodulatePhase)
        if mags is not None:  # each group's magnification: insertion at A^T (M k)
            gh = groups[i0:i1]
            for j in np.unique(gh):
                sel = xp.asarray(np.flatnonzero(gh == j))
                A[sel] = magnified(A[sel], mags[j])
        if ctfp is not None:
            if even is None and mags is None:
                c = ctf_half_grid(ctfp.subset(slice(i0, i1)), N, apix, xp=xp)
            else:  # with each group's even aberrations in gamma and its magnified frequencies
                c = xp.empty(F.shape, dtype=np.float32)
                gh = groups[i0:i1]
                for j in np.unique(gh):
                    sel = np.flatnonzero(gh == j)
                    fx, fy = magnified_frequencies(None if mags is None else mags[j],
                                                   xp.broadcast_to(kx / (N * apix), (N, N // 2 + 1)),
                                                   xp.broadcast_to(ky / (N * apix), (N, N // 2 + 1)))
                    c[xp.asarray(sel)] = ctf_from_frequencies(ctfp.subset(i0 + sel), fx, fy, xp,
                                                             gamma_offset=None if even is None else even[j])
            bp.insert_images(A, F * c, c * c, check=check_cancel)
        else:
            bp.insert_images(A, F, xp.ones(F.shape, dtype=np.float32), check=check_cancel)

    for item in batched_with_oom_retry(mine.size, batch, work, be):
        if isinstance(item, Message):
            yield item
        else:
            yield Progress(item[0], item[1], "back-projecting")
    comm.sum_arrays(accumulator_grids(bp))
    if not comm.is_root:
        return
    bp.enforce_hermitian()
    if sym.order > 1:
        yield Message(f"symmetrising with {sym.name} ({sym.order} operators)")
        bp.symmetrise(sym.matrices)
    vol = to_host(bp.reconstruct())
    problem = map_problem(vol)
    if problem is not None:  # never a NaN map on disk
        raise InputError(f"the reconstruction cannot be used ({problem}); nothing written", path=str(out))
    write_mrc(out, vol, apix)
    free_cached_memory(be)
    yield MapUpdated(out.stem, vol, apix, out)
    yield Finished({"map": out}, f"wrote {out} ({N}³, {apix:.3f} Å/px) from {n} particles")

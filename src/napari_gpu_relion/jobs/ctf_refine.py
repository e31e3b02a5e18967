"""Per-particle CTF refinement: ``relion_ctf_refine`` (RELION's CtfRefine job), on the GPU over many particles at once.

RELION's flags: ``--i`` particles STAR (angles, offsets, rlnRandomSubset, CTF), ``--f`` the PostProcess STAR (its
half maps, mask and FSC; RELION always needs it) or the half maps ``--m1``/``--m2`` (with ``--mask``; without
``--f`` every frequency has weight 1), ``--o`` the output folder (CtfRefine/jobNNN/), ``--fit_defocus`` with
``--fit_mode`` (5 characters p/m/f: phase shift, defocus, astigmatism, Cs, B-factor; default fpmfm; Cs must be f,
as RELION's GUI always passes), ``--kmin_defocus``, ``--bf_range``, ``--max_defocus_iters``; ``--fit_beamtilt``
with ``--kmin_tilt`` and ``--odd_aberr_max_n`` (3: trefoil too); ``--fit_aberr`` with ``--kmin_aberr`` and
``--even_aberr_max_n``. ``--j`` is accepted (RELION's GUI passes it) and unused. ``--fit_aniso`` (anisotropic
magnification) and ``--fit_bfacs`` are not done here yet.

Written, as RELION names them: ``<o>/particles_ctf_refine.star`` (the input with the refined rlnDefocusU/V/Angle,
and rlnPhaseShift, rlnCtfBfactor, rlnCtfScalefactor where fitted; the optics table with rlnBeamTiltX/Y,
rlnOddZernike and rlnEvenZernike of the groups fitted), and per optics group the aberration plots as PNG
(``asymmetric_aberrations_optics-group_N.png``, ``symmetric_aberrations_optics-group_N.png``: RELION's EPS names).
Every particle is compared with the projection of the OTHER half map at its pose (RELION 5.0.1 uses its own half;
docs/ctf_refinement.md). Under MPI the micrographs are shared among the ranks; the aberration sums are added
over the ranks and rank 0 fits and writes. The method: compute/ctf_refine.py.

Around the fits (issue 51 times the whole command): the particle images are read in a background thread ahead of
the batches (:class:`_ImagesAhead`), the plots drawn by a helper process that sets up matplotlib while the
particles are refined (:class:`_Plotter`), and CuPy is imported and the GPU's context made while the inputs are read
(runtime.device.warm_device).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..cancel import check_cancel
from ..compute import ctf_refine as CR
from ..compute.backend import to_host
from ..compute.ctf import CtfParams, OpticsAberrations, format_zernike
from ..compute.geometry import euler_to_matrix
from ..compute.projector import prepare_reference, stack_references
from ..errors import InputError
from ..events import Finished, Message, Progress, Started
from ..io.atomic import atomic_path, ensure_not_input
from ..io.jobdir import project_path
from ..io.mrc import read_mrc, require_usable_map
from ..io.particle_images import check_image_stacks, load_images
from ..io.star import ParticleTable, read_particles, read_star, write_particles
from ..runtime.device import backend_for, host_available_bytes, warm_device
from ..runtime.distributed import root_events, world
from ..runtime.memory import batched_with_oom_retry, free_cached_memory, image_batch, read_ahead_bytes
from .common import check_output_folder, param, prepare_output, require_file, write_note
from .particles import MAG_COLUMNS, row_aberrations, row_magnification
from .read_ahead import ImageReadAhead, read_threads
from .reconstruct import ANGLE_COLUMNS, particle_offsets_px

JOB_NAME = "ctf_refine"
OUTPUT_STAR = "particles_ctf_refine.star"
CTF_COLUMNS = ("rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle", "rlnVoltage", "rlnSphericalAberration",
               "rlnAmplitudeContrast")
#: Most particles per batch (a GPU batch is a few large arrays; the CPU gains nothing from more).
MAX_BATCH_GPU = 4096
MAX_BATCH_CPU = 256


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="Particles STAR with angles, offsets, rlnRandomSubset and CTF (e.g. "
                    "Refine3D/job040/run_data.star)")
    o: Path = param(flag="--o", help="Output folder (e.g. CtfRefine/job041/): writes particles_ctf_refine.star "
                    "and the aberration plots", mode="d")
    f: Path | None = param(None, "--f", "PostProcess STAR (postprocess.star): the half maps, the mask and the FSC "
                           "that weights the frequencies")
    m1: Path | None = param(None, "--m1", "Half map 1 (instead of the PostProcess STAR's)")
    m2: Path | None = param(None, "--m2", "Half map 2 (instead of the PostProcess STAR's)")
    mask: Path | None = param(None, "--mask", "Mask applied to the half maps (default: the PostProcess STAR's)")
    angpix_ref: float = param(-1.0, "--angpix_ref", "Pixel size of the half maps (Å); -1 = from their header")
    pad: int = param(2, "--pad", "Padding factor of the projector")
    fit_defocus: bool = param(False, "--fit_defocus", "Refine the CTF parameters named by --fit_mode (defocus, "
                              "astigmatism, phase shift, B-factor) per particle or per micrograph")
    fit_mode: str = param(CR.FIT_MODE, "--fit_mode", "5 characters p (per particle), m (per micrograph) or f "
                          "(fixed) for the phase shift, defocus, astigmatism, Cs (must be f) and B-factor/scale")
    kmin_defocus: float = param(CR.KMIN_DEFOCUS_A, "--kmin_defocus", "Lowest resolution (Å) of the defocus fit")
    bf_range: float = param(CR.BF_RANGE_A, "--bf_range", "Defocus searched (Å) on either side of the current "
                            "value before the local refinement; 0 = no search")
    max_defocus_iters: int = param(CR.MAX_DEFOCUS_ITERS, "--max_defocus_iters", "Most iterations of the local "
                                   "CTF refinement")
    fit_beamtilt: bool = param(False, "--fit_beamtilt", "Estimate the beam tilt (and with --odd_aberr_max_n 3 "
                               "the trefoil) per optics group")
    kmin_tilt: float = param(CR.KMIN_TILT_A, "--kmin_tilt", "Lowest resolution (Å) of the beam-tilt fit")
    odd_aberr_max_n: int = param(0, "--odd_aberr_max_n", "Highest degree of the odd Zernike polynomials fitted "
                                 "(antisymmetric aberrations); below 3 only the beam tilt")
    fit_aberr: bool = param(False, "--fit_aberr", "Estimate the symmetric aberrations (even Zernike "
                            "polynomials) per optics group")
    kmin_aberr: float = param(CR.KMIN_ABERR_A, "--kmin_aberr", "Lowest resolution (Å) of the symmetric fit")
    even_aberr_max_n: int = param(CR.EVEN_ABERR_MAX_N, "--even_aberr_max_n", "Highest degree of the even "
                                  "Zernike polynomials fitted (symmetric aberrations)")
    fit_aniso: bool = param(False, "--fit_aniso", "Estimate the anisotropic magnification matrix per optics group "
                            "(rlnMagMat00/01/10/11)")
    kmin_mag: float = param(CR.KMIN_MAG_A, "--kmin_mag", "Lowest resolution (Å) of the magnification fit")
    keep_astig: bool = param(False, "--keep_astig", "With --fit_aniso: keep the defocus and astigmatism as they "
                             "are (by default they are translated to the new magnification's coordinates)")
    j: int = param(1, "--j", "Threads (accepted for RELION's command lines; not used)")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index; MPI: RELION's 0:1:2:3, ranks take them in turn")

    def modes(self) -> CR.FitModes:
        try:
            return CR.FitModes.parse(self.fit_mode)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def __post_init__(self):
        require_file(self.i, "--i particles STAR", (".star",))
        if self.o is None:
            raise InputError("--o output folder is required (e.g. CtfRefine/job041/)")
        check_output_folder(self.o, "--o")
        if self.f is not None:
            require_file(self.f, "--f PostProcess STAR", (".star",))
        if (self.m1 is None) != (self.m2 is None):
            raise InputError("--m1 and --m2 go together (the two half maps)")
        if self.f is None and self.m1 is None:
            raise InputError("give the PostProcess STAR (--f) or the two half maps (--m1, --m2)")
        for flag, v in (("--m1", self.m1), ("--m2", self.m2), ("--mask", self.mask)):
            if v is not None:
                require_file(v, f"{flag} map", (".mrc", ".map"))
        if self.angpix_ref != -1 and not self.angpix_ref > 0:
            raise InputError(f"--angpix_ref must be a pixel size in Å (> 0), or -1; got {self.angpix_ref:g}")
        if self.pad < 1:
            raise InputError(f"--pad must be >= 1, got {self.pad}")
        m = self.modes()
        if m.cs != "f":
            raise InputError(f"--fit_mode {self.fit_mode}: Cs (the 4th character) must be f: Cs is an optics-group "
                             "value here (RELION's GUI never fits it either)")
        if not (self.fit_defocus or self.fit_beamtilt or self.fit_aberr or self.fit_aniso):
            raise InputError("nothing to fit: give --fit_defocus, --fit_beamtilt, --fit_aberr and/or --fit_aniso")
        if self.fit_defocus and not m.fits_anything:
            raise InputError(f"--fit_defocus with --fit_mode {self.fit_mode} fits nothing (every character f)")
        for flag, v in (("--kmin_defocus", self.kmin_defocus), ("--kmin_tilt", self.kmin_tilt),
                        ("--kmin_aberr", self.kmin_aberr), ("--kmin_mag", self.kmin_mag)):
            if not v > 0:
                raise InputError(f"{flag} must be a resolution in Å (> 0), got {v:g}")
        if self.bf_range < 0:
            raise InputError(f"--bf_range must be 0 or more Å, got {self.bf_range:g}")
        if self.max_defocus_iters < 1:
            raise InputError(f"--max_defocus_iters must be at least 1, got {self.max_defocus_iters}")
        if self.odd_aberr_max_n < 0 or (self.odd_aberr_max_n >= 3 and self.odd_aberr_max_n % 2 == 0):
            raise InputError(f"--odd_aberr_max_n must be 0 (beam tilt only) or an odd degree >= 3, got "
                             f"{self.odd_aberr_max_n}")
        if self.even_aberr_max_n < 2 or self.even_aberr_max_n % 2:
            raise InputError(f"--even_aberr_max_n must be an even degree >= 2, got {self.even_aberr_max_n}")
        if self.batch < 0:
            raise InputError(f"--batch must be at least 1 particle (or 0: from the free memory), got {self.batch}")
        ensure_not_input(self.output_star(), self.i, self.f, self.m1, self.m2, self.mask)

    def output_star(self) -> Path:
        return Path(self.o) / OUTPUT_STAR

    def options(self) -> CR.CtfRefineOptions:
        return CR.CtfRefineOptions(
            fit_defocus=self.fit_defocus, modes=self.modes(), kmin_defocus_A=self.kmin_defocus,
            bf_range_A=self.bf_range, max_iters=self.max_defocus_iters, fit_beamtilt=self.fit_beamtilt,
            kmin_tilt_A=self.kmin_tilt, odd_aberr_max_n=self.odd_aberr_max_n, fit_aberr=self.fit_aberr,
            kmin_aberr_A=self.kmin_aberr, even_aberr_max_n=self.even_aberr_max_n, fit_aniso=self.fit_aniso,
            kmin_mag_A=self.kmin_mag)


# ----------------------------------------------------------------------------------------------------------
# Inputs


@dataclass
class _Reference:
    half1: np.ndarray
    half2: np.ndarray
    angpix: float
    mask: np.ndarray | None
    shell_weight: np.ndarray | None
    names: tuple[Path, Path, Path | None]


def _resolve(name: str, star: Path, what: str) -> Path:
    found, tried = project_path(name, star)
    if found is None:
        raise InputError(f"{what} {name} named in the PostProcess STAR is not there (looked in "
                         f"{', '.join(str(t) for t in tried)})", path=str(star))
    return found


def _load_reference(p: Params) -> _Reference:
    h1, h2, mask_path, weight = p.m1, p.m2, p.mask, None
    if p.f is not None:
        blocks = read_star(p.f)
        general = blocks.get("general")
        if isinstance(general, pd.DataFrame):
            general = general.iloc[0].to_dict() if len(general) else {}
        general = general or {}
        if h1 is None:
            for label in ("rlnUnfilteredMapHalf1", "rlnUnfilteredMapHalf2"):
                if label not in general:
                    raise InputError(f"the PostProcess STAR has no {label} in data_general: give --m1 and --m2",
                                     path=str(p.f), column=label)
            h1 = _resolve(str(general["rlnUnfilteredMapHalf1"]), Path(p.f), "half map")
            h2 = _resolve(str(general["rlnUnfilteredMapHalf2"]), Path(p.f), "half map")
        if mask_path is None and "rlnMaskName" in general:
            mask_path = _resolve(str(general["rlnMaskName"]), Path(p.f), "mask")
        fsc = blocks.get("fsc")
        if not isinstance(fsc, pd.DataFrame) or "rlnFourierShellCorrelationCorrected" not in fsc:
            raise InputError("the PostProcess STAR has no data_fsc with rlnFourierShellCorrelationCorrected",
                             path=str(p.f))
        idx = fsc["rlnSpectralIndex"].to_numpy(int) if "rlnSpectralIndex" in fsc else np.arange(len(fsc))
        curve = np.zeros(int(idx.max()) + 1)
        curve[idx] = fsc["rlnFourierShellCorrelationCorrected"].to_numpy(float)
        weight = CR.fsc_shell_weight(curve)
    maps = []
    for path in (h1, h2):
        m = read_mrc(path)
        if m.data.ndim != 3 or len(set(m.data.shape)) != 1 or m.data.shape[0] % 2:
            raise InputError(f"a half map must be a cubic 3D map with an even box, got shape {m.data.shape}",
                             path=str(path))
        require_usable_map(m.data, path, "half map")
        maps.append(m)
    if maps[0].data.shape != maps[1].data.shape:
        raise InputError(f"the half maps differ in size: {maps[0].data.shape} ({h1}) vs {maps[1].data.shape} ({h2})")
    apix = p.angpix_ref if p.angpix_ref > 0 else maps[0].pixel_size
    if not apix:
        raise InputError("the half map's header has no pixel size: give --angpix_ref", path=str(h1))
    mask = None
    if mask_path is not None:
        mask = np.asarray(read_mrc(mask_path).data, np.float32)
        if mask.shape != maps[0].data.shape:
            raise InputError(f"mask shape {mask.shape} differs from the half maps {maps[0].data.shape}",
                             path=str(mask_path))
        if not np.isfinite(mask).all():
            raise InputError("the mask holds NaN or infinite values", path=str(mask_path))
    return _Reference(np.asarray(maps[0].data, np.float32), np.asarray(maps[1].data, np.float32), float(apix),
                      mask, weight, (Path(h1), Path(h2), None if mask_path is None else Path(mask_path)))


def _optics_aberrations(table: ParticleTable) -> tuple[list[OpticsAberrations], dict[int, int], list]:
    """Each optics group's aberrations and magnification matrix (None: none) in the optics table's order, and
    group number -> index."""
    opt = table.optics
    groups, index, mags = [], {}, []
    for i, row in enumerate(opt.itertuples(index=False)):
        r = row._asdict()
        if int(r.get("rlnCtfDataAreCtfPremultiplied", 0) or 0):
            raise InputError(f"optics group {r['rlnOpticsGroup']}: CTF-premultiplied particles are not supported "
                             "(RELION does not check its fits for them either)", path=str(table.path))
        groups.append(row_aberrations(r))
        mags.append(row_magnification(r))
        index[int(r["rlnOpticsGroup"])] = i
    return groups, index, mags


def _load_particles(p: Params) -> ParticleTable:
    table = read_particles(p.i, require=("rlnImageName", "rlnRandomSubset") + ANGLE_COLUMNS + CTF_COLUMNS)
    subsets = set(np.unique(table.particles["rlnRandomSubset"].to_numpy(int)).tolist())
    if not subsets <= {1, 2}:
        raise InputError(f"rlnRandomSubset must be 1 or 2 (the gold-standard halves), found {sorted(subsets)}",
                         path=str(p.i), column="rlnRandomSubset")
    return table


def _image_reader(table: ParticleTable, locations) -> Callable[[np.ndarray], np.ndarray]:
    """The images of table rows, checked (NaN, infinite, blank), read with the table's parsed locations and the
    stacks' headers kept between calls, from a table of the two columns load_images looks at (taking a batch's
    rows of the whole table copied every column: 1.5 s of a 100,000-particle run)."""
    cols = [c for c in ("rlnImageName", "rlnImageSize") if c in table.particles]
    slim = ParticleTable(table.particles[cols], table.optics, table.path, table.version, table.block,
                         row_lines=table.row_lines)
    headers: dict = {}

    def read(rows: np.ndarray) -> np.ndarray:
        return load_images(slim, rows=rows, check_values=True, locations=locations, headers=headers)
    return read


class _ImagesAhead:
    """The batches' images read in background threads (jobs/read_ahead.ImageReadAhead with the batches as its
    blocks), in the order the refinement takes them (``seq``: rows, ``cuts``: the batches' boundaries in ``seq``), at
    most ``ahead`` batches ahead, so that reading the stacks overlaps the refinement. :meth:`take` gives the images
    of positions [p0, p1) of ``seq``: a batch, or part of one when a batch was cut after running out of memory (p0
    never goes back). A reading error is raised by ``take``, again at every later call."""

    def __init__(self, read: Callable[[np.ndarray], np.ndarray], seq: np.ndarray, cuts: np.ndarray, ahead: int,
                 threads: int = 1):
        blocks = [seq[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True)]
        self._reader = ImageReadAhead(read, seq, int(seq.max()) + 1 if seq.size else 0, 0, max(1, int(ahead)),
                                      blocks=blocks, threads=threads)
        self._held: list[tuple[int, int, np.ndarray]] = []  # (p0, p1, images) taken from the reader
        self._end = 0  # where the reader's next block starts
        self._error: BaseException | None = None

    def take(self, p0: int, p1: int) -> np.ndarray:
        self._held = [h for h in self._held if h[1] > p0]
        while self._end < p1:
            if self._error is not None:
                raise self._error
            try:
                item = self._reader.next(wait=True)
            except BaseException as exc:  # noqa: BLE001 - kept: an out-of-memory retry asks again
                self._error = exc
                continue
            if item is None:
                raise RuntimeError(f"the image reader stopped at position {self._end} of the particles "
                                   f"({p1} asked for)")
            rows, imgs = item
            self._held.append((self._end, self._end + len(rows), imgs))
            self._end += len(rows)
        parts = [im[max(p0, a) - a:min(p1, b) - a] for a, b, im in self._held if a < p1 and b > p0]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        self._reader.stop()
        self._held = []

    @property
    def alive(self) -> bool:
        return self._reader.alive


def _micrographs(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(order of the rows grouped by micrograph, the micrograph number of each row in that order); one micrograph
    for all rows without rlnMicrographName."""
    if "rlnMicrographName" not in df:
        return np.arange(len(df)), np.zeros(len(df), np.int64)
    codes, _ = pd.factorize(df["rlnMicrographName"].astype(str), sort=False)
    order = np.argsort(codes, kind="stable")
    return order, codes[order].astype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# Outputs


def _plot(path: Path, pix: CR.FitPixels, phase, weight, fit, odd: bool, title: str) -> Path:
    """The per-pixel phase (where weighted) and its fit, on the centred grid (RELION's EPS, as PNG). The axes sit
    at fixed places (a layout engine measured every label again: a third of the plot's time)."""
    from matplotlib.figure import Figure  # noqa: PLC0415  (no pyplot: savefig draws with Agg, no GUI backend)

    seen = np.where(np.asarray(weight) > 0, np.asarray(phase), np.nan)
    obs = CR.full_grid_image(seen, pix, odd)
    fitted = CR.full_grid_image(fit, pix, odd)
    s = pix.box
    half = 0.5 / pix.angpix
    fig = Figure(figsize=(9, 4.4))
    for k, (img, name) in enumerate(((obs, "observed phase per pixel"), (fitted, "fit"))):
        ax = fig.add_axes((0.095 + 0.455 * k, 0.12, 0.33, 0.74))
        im = ax.imshow(img, origin="lower", cmap="RdBu_r", vmin=-np.pi, vmax=np.pi, interpolation="nearest",
                       extent=(-half, half * (s - 2) / s, -half, half * (s - 2) / s))
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("kx (1/Å)")
        ax.set_ylabel("ky (1/Å)")
    fig.colorbar(im, cax=fig.add_axes((0.905, 0.16, 0.015, 0.66)), label="phase (rad)")
    fig.suptitle(title, fontsize=11)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    return path


def _warm_matplotlib() -> None:
    """Import matplotlib's Figure and Agg and draw one text: its font set-up (the font list, the font file; seconds
    on a machine without matplotlib's font cache) done before the plots."""
    import io  # noqa: PLC0415

    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(1, 1))
    fig.text(0.5, 0.5, "kx (1/Å) 0.1")
    fig.savefig(io.BytesIO(), format="png", dpi=10)


def _plot_helper() -> None:
    """The plotting helper process of :class:`_Plotter`: matplotlib set up, then the plots read from stdin (a
    pickled list of :func:`_plot`'s arguments) drawn."""
    _warm_matplotlib()
    for args in pickle.load(sys.stdin.buffer):
        _plot(*args)


class _Plotter:
    """The aberration plots, drawn by a helper process started with the job: it imports matplotlib and sets up its
    fonts while the particles are refined, then draws the plots while the job writes the STAR file, on a core of
    its own (in a thread of the job it would share the job's GIL: the refinement's kernel launches, the STAR's
    formatting), niced so that on a machine of few cores the job's own work goes first (on the shared 2-core VM
    the two were within its noise). On a 2-core CPU matplotlib's import took 0.3-0.45 s of the command and each
    plot 0.15-0.3 s; in the H200 profile of 4,000 particles its text set-up took 4.4 s (under cProfile).
    :meth:`wait` (before the job reports done) returns the paths, each written atomically; where the helper could
    not start or failed, the plots are drawn in the job's process instead (a warning says why)."""

    def __init__(self):
        self._tasks: list[tuple] = []
        self._why: str | None = None  # why the plots are to be drawn in the job's process
        self._err = tempfile.TemporaryFile()
        root = str(Path(__file__).resolve().parents[2])  # this package's folder first: the child runs this code
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-P", "-c", "import os; hasattr(os, 'nice') and os.nice(10); "
                 "from napari_gpu_relion.jobs.ctf_refine import _plot_helper; _plot_helper()"],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._err, env=env)
        except (OSError, ValueError) as exc:
            self._proc, self._why = None, f"could not start: {exc}"

    def submit(self, path: Path, pix: CR.FitPixels, *rest) -> None:
        """A plot (:func:`_plot`'s arguments; the pixels' indices taken to the host)."""
        host = CR.FitPixels(pix.box, pix.angpix, to_host(pix.ky), to_host(pix.kx), None, None, None, None)
        self._tasks.append((path, host, *rest))

    def start(self) -> None:
        """Hand the plots submitted to the helper (after the fits, before the STAR file is written)."""
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(pickle.dumps(self._tasks))
            self._proc.stdin.close()
        except OSError as exc:  # it has died
            self._why = f"stopped early ({exc})"
            self.close()

    def wait(self) -> tuple[list[Path], str | None]:
        """The plots' paths, and why they were drawn here (None: the helper drew them)."""
        why = self._why
        if self._proc is not None:
            rc = self._proc.wait()
            if rc == 0:
                return [t[0] for t in self._tasks], None
            self._err.seek(0)
            tail = self._err.read().decode(errors="replace").strip().splitlines()[-3:]
            why = f"exited with code {rc}" + (f": {' / '.join(tail)}" if tail else "")
            self._proc = None
        return [_plot(*t) for t in self._tasks], why

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        self._err.close()


def _write_star(p: Params, table: ParticleTable, theta: np.ndarray | None, groups: list[OpticsAberrations],
                index: dict[int, int], odd: dict[int, CR.OddFit], even: dict[int, CR.EvenFit],
                modes: CR.FitModes, mags: dict[int, np.ndarray] | None = None, defocus_only: bool = False) -> Path:
    """The particles with the refined CTF columns (``theta``; ``defocus_only``: only the defocus and astigmatism,
    as --fit_aniso translates them) and the optics table with the fitted aberrations and magnification matrices."""
    df = table.particles.copy()
    optics = table.optics.copy()
    if theta is not None:
        cols = CR.array_to_columns(theta, df["rlnAmplitudeContrast"].to_numpy(float))
        keep = ["rlnDefocusU", "rlnDefocusV", "rlnDefocusAngle"]
        if modes.phase != "f" and not defocus_only:
            keep.append("rlnPhaseShift")
        if modes.bfactor != "f" and not defocus_only:
            keep += ["rlnCtfBfactor", "rlnCtfScalefactor"]
        for c in keep:
            df[c] = cols[c]
    rows = [index[int(g)] for g in optics["rlnOpticsGroup"]]
    if mags:
        for (i, j) in ((0, 0), (0, 1), (1, 0), (1, 1)):
            col = f"rlnMagMat{i}{j}"
            vals = optics[col].to_numpy(float).copy() if col in optics else np.full(len(optics), float(i == j))
            for r, gi in enumerate(rows):
                if gi in mags:
                    vals[r] = mags[gi][i, j]
            optics[col] = vals
    if odd:
        tx = optics["rlnBeamTiltX"].to_numpy(float).copy() if "rlnBeamTiltX" in optics else np.zeros(len(optics))
        ty = optics["rlnBeamTiltY"].to_numpy(float).copy() if "rlnBeamTiltY" in optics else np.zeros(len(optics))
        zo = [format_zernike(groups[i].odd) for i in rows]
        for r, gi in enumerate(rows):
            if gi in odd:
                tx[r], ty[r] = odd[gi].beam_tilt_x, odd[gi].beam_tilt_y
                if odd[gi].odd is not None:
                    zo[r] = format_zernike(odd[gi].odd)
        optics["rlnBeamTiltX"], optics["rlnBeamTiltY"] = tx, ty
        if any(o.odd is not None for o in odd.values()) or "rlnOddZernike" in optics:
            optics["rlnOddZernike"] = zo
    if even:
        ze = [format_zernike(groups[i].even) for i in rows]
        for r, gi in enumerate(rows):
            if gi in even:
                ze[r] = format_zernike(even[gi].even)
        optics["rlnEvenZernike"] = ze
    by_group = optics.set_index("rlnOpticsGroup")
    for col in ("rlnBeamTiltX", "rlnBeamTiltY", "rlnOddZernike", "rlnEvenZernike") + MAG_COLUMNS:
        if col in optics:  # the merged optics values of each row follow the new optics table
            df[col] = df["rlnOpticsGroup"].map(by_group[col]).to_numpy()
    out = ParticleTable(df, optics, table.path, table.version, table.block, table.extra_blocks, table.row_lines)
    return write_particles(p.output_star(), out)


# ----------------------------------------------------------------------------------------------------------


def run(p: Params) -> Iterator:
    """Under MPI every rank refines the particles of its share of the micrographs; the aberration sums are added
    over the ranks, rank 0 gathers the particles, fits the aberrations and writes."""
    yield from root_events(world(), _run(p))


def _run(p: Params) -> Iterator:
    closing: list = []  # the job's background reader and plotter
    try:
        yield from _job(p, closing)
    finally:
        for c in closing:
            c.close()


def _job(p: Params, closing: list) -> Iterator:
    comm = world()
    plotter = None
    if comm.is_root and (p.fit_beamtilt or p.fit_aberr):  # matplotlib set up in a helper process from now on
        plotter = _Plotter()
        closing.append(plotter)
    gpu_start = warm_device(p)  # CuPy and the GPU's context made while the inputs are read
    table = _load_particles(p)
    ref_in = _load_reference(p)
    groups, gindex, mags_in = _optics_aberrations(table)
    df = table.particles
    n = len(df)
    N = table.box_size
    apix = table.pixel_size
    if ref_in.half1.shape[0] != N:
        raise InputError(f"the half maps' box ({ref_in.half1.shape[0]}) differs from the particles' ({N}); "
                         "rescale the maps to the particles' box and pixel size", path=str(ref_in.names[0]))
    if abs(ref_in.angpix - apix) > 1e-3 * apix:
        raise InputError(f"the half maps' pixel size ({ref_in.angpix:.4f} Å) differs from the particles' "
                         f"({apix:.4f} Å)", path=str(ref_in.names[0]))
    locations = check_image_stacks(table)
    offsets = particle_offsets_px(table, apix)
    ang = df[list(ANGLE_COLUMNS)].to_numpy(np.float64)
    other = 2 - df["rlnRandomSubset"].to_numpy(int)  # subset 1 -> half map 2 (index 1), subset 2 -> half 1
    group = df["rlnOpticsGroup"].astype(int).map(gindex).to_numpy(np.int64)
    ctf_all = CtfParams.from_table(df)
    order, mic_of = _micrographs(df)
    n_mic = int(mic_of.max()) + 1 if n else 0
    starts = np.searchsorted(mic_of, np.arange(n_mic + 1))
    mine = comm.share(n_mic)
    if gpu_start is not None:
        gpu_start.join()
    be = backend_for(p)
    xp = be.xp
    out = Path(p.o)
    notes = prepare_output(out, Path(p.i).stat().st_size * 2 + 4 * 1024 * 1024, "the refined particles") \
        if comm.is_root else []
    opt = p.options()
    what = ", ".join(w for w, on in ((f"defocus ({opt.modes})", p.fit_defocus),
                                     ("beam tilt" + (f" and odd aberrations to n = {p.odd_aberr_max_n}"
                                                     if p.odd_aberr_max_n >= 3 else ""), p.fit_beamtilt),
                                     (f"even aberrations to n = {p.even_aberr_max_n}", p.fit_aberr),
                                     ("anisotropic magnification", p.fit_aniso)) if on)
    yield Started(JOB_NAME, out, be.name, f"CTF refinement of {n} particles on {n_mic} micrographs (box {N}, "
                  f"{apix:.3f} Å/px): {what}")
    yield from notes
    if p.f is None:
        yield Message("no PostProcess STAR (--f): every frequency up to Nyquist has weight 1", "warning")
    if comm.is_root:
        out.mkdir(parents=True, exist_ok=True)
        write_note(out, JOB_NAME, p)

    npix = CR.fit_pixels(N, apix).npix
    per_particle = CR.BYTES_PER_PARTICLE_PIXEL * npix + CR.BYTES_PER_IMAGE_PIXEL * N * N
    per_batch = p.batch or image_batch(be.free_bytes(), per_particle, max(n, 1),
                                       most=MAX_BATCH_GPU if be.is_gpu else MAX_BATCH_CPU)
    mean_per_mic = max(1, int(np.ceil(n / max(n_mic, 1))))
    mic_batch = max(1, per_batch // mean_per_mic)
    # this rank's rows in the order the batches take them; the batches' boundaries in it
    first = int(starts[mine[0]]) if mine.size else 0
    seq = order[first:int(starts[mine[-1] + 1])] if mine.size else order[:0]
    cuts = starts[mine[np.arange(0, mine.size, mic_batch)]] - first if mine.size else np.zeros(0, np.int64)
    cuts = np.append(cuts, seq.size)
    reader = None
    if seq.size:  # reading starts now, beside the reference's preparation and the refinement
        # the reader's blocks are the batches of whole micrographs (cuts), not per_batch images
        block_bytes = 4 * N * N * max(1, -(-seq.size // max(1, len(cuts) - 1)))
        ahead = read_ahead_bytes(host_available_bytes(), comm.ranks_on_host) // block_bytes
        reader = _ImagesAhead(_image_reader(table, locations), seq, cuts, ahead, read_threads(comm.ranks_on_host))
        closing.append(reader)

    v1, v2 = ref_in.half1, ref_in.half2
    if ref_in.mask is not None:
        v1, v2 = v1 * ref_in.mask, v2 * ref_in.mask
    reference = stack_references([prepare_reference(xp.asarray(v, dtype=np.float64), pad=p.pad) for v in (v1, v2)])
    refiner = CR.CtfRefiner(reference, N, apix, groups, opt, ref_in.shell_weight, xp, mags=mags_in)
    theta = np.zeros((n, CR.N_PARAMS)) if p.fit_defocus else None
    done_rows: list[np.ndarray] = []

    def work(j0: int, j1: int) -> None:
        m0, m1 = int(mine[j0]), int(mine[j1 - 1]) + 1
        rows = order[starts[m0]:starts[m1]]
        if rows.size == 0:
            return
        imgs = reader.take(int(starts[m0]) - first, int(starts[m1]) - first)
        A = euler_to_matrix(ang[rows, 0], ang[rows, 1], ang[rows, 2])
        th = refiner.process(imgs, A, offsets[rows], other[rows], ctf_all.subset(rows), group[rows],
                             mic_of[starts[m0]:starts[m1]] - m0, check=check_cancel)
        if theta is not None:
            theta[rows] = th
        done_rows.append(rows)

    for item in batched_with_oom_retry(mine.size, mic_batch, work, be):
        if isinstance(item, Message):
            yield item
        else:
            yield Progress(item[0], item[1], "micrographs")
    if p.fit_beamtilt or p.fit_aberr or p.fit_aniso:
        comm.sum_arrays(refiner.sums.arrays())  # in place, on the GPUs or through host buffers
    if theta is not None and comm.size > 1:
        parts = comm.gather((np.concatenate(done_rows) if done_rows else np.zeros(0, np.int64),
                             theta[np.concatenate(done_rows)] if done_rows else np.zeros((0, CR.N_PARAMS))))
        if comm.is_root:
            for rows, th in parts:
                theta[rows] = th
    if not comm.is_root:
        return
    odd, even = refiner.fit_aberrations()
    mags = refiner.fit_magnifications()
    free_cached_memory(be)
    outputs: dict[str, Path] = {}
    lines = []
    for gi, fit in odd.items():
        gnum = int(table.optics["rlnOpticsGroup"].iloc[gi])
        name = f"asymmetric_aberrations_optics-group_{gnum}.png"
        outputs[name] = out / name
        plotter.submit(out / name, refiner.pix, fit.phase, fit.weight, fit.fit, True,
                       f"optics group {gnum}: antisymmetric phase; beam tilt ({fit.beam_tilt_x:.3f}, "
                       f"{fit.beam_tilt_y:.3f}) mrad")
        lines.append(f"optics group {gnum}: beam tilt x {fit.beam_tilt_x:.4f} mrad, y {fit.beam_tilt_y:.4f} mrad"
                     + ("" if fit.odd is None else f"; odd Zernike {format_zernike(fit.odd)}"))
    for gi, fit in even.items():
        gnum = int(table.optics["rlnOpticsGroup"].iloc[gi])
        name = f"symmetric_aberrations_optics-group_{gnum}.png"
        outputs[name] = out / name
        plotter.submit(out / name, refiner.pix, fit.phase, fit.weight, fit.fit, False,
                       f"optics group {gnum}: symmetric phase offset")
        lines.append(f"optics group {gnum}: even Zernike {format_zernike(fit.even)}")
    for gi, m in mags.items():
        gnum = int(table.optics["rlnOpticsGroup"].iloc[gi])
        mean, aniso = CR.magnification_anisotropy(m)
        lines.append(f"optics group {gnum}: magnification matrix {m[0, 0]:.5f} {m[0, 1]:.5f} {m[1, 0]:.5f} "
                     f"{m[1, 1]:.5f}; anisotropy {100 * aniso:.3f} %, mean {mean:.5f}")
        if abs(mean - 1) > 0.005:
            lines.append(f"optics group {gnum}: the mean magnification differs from the nominal pixel size by "
                         f"{100 * (mean - 1):+.2f} %: this changes the pixel size of the reconstruction")
    adapted = mags and not p.keep_astig
    if adapted:  # the defocus terms carried to the new coordinates, group by group (RELION's adaptAstigmatism)
        theta = CR.params_to_array(ctf_all) if theta is None else theta
        for gi, m in mags.items():
            rows = np.flatnonzero(group == gi)
            theta[rows] = CR.adapt_astigmatism(theta[rows], mags_in[gi], m)
    for line in lines:
        yield Message(line)
    if plotter is not None:
        plotter.start()  # the plots drawn beside the STAR file's writing
    outputs["particles"] = _write_star(p, table, theta, groups, gindex, odd, even, opt.modes, mags,
                                       defocus_only=not p.fit_defocus)
    if plotter is not None:
        _, why = plotter.wait()
        if why is not None:
            yield Message(f"the plotting helper process {why}; the plots were drawn in the job's process",
                          "warning")
    summary = f"wrote {outputs['particles']} ({n} particles)"
    if theta is not None:
        before = CR.params_to_array(ctf_all)[:, 1]
        change = theta[:, 1] - before
        summary += (f"; mean defocus changed by {np.sqrt(np.mean(change ** 2)):.1f} Å rms "
                    f"(mean {np.mean(change):+.1f} Å)")
    yield Finished(outputs, summary)

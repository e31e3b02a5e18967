"""Autopicking (the counterpart of relion_autopick): Laplacian-of-Gaussian or template picking on the GPU.

Per micrograph: read lazily, normalise (outliers to the mean), embed into a square, FFT, crop to the working
grid W (from --lowpass with --shrink 0; the z-score template FOM on a grid ZSCORE_OVERSAMPLE = 2 times finer),
then
- LoG: 11 scale-normalised LoG filters, best response and size per pixel, RELION's size filter, threshold and
  greedy exclusion (LoG micrographs are batched on the device);
- templates: references (2D stack, or projections of a 3D map) masked, inverted, rotated in-plane in the
  Fourier domain, multiplied by the micrograph's CTF, correlated in batches of (reference, ψ) FFTs with
  RELION's probability-ratio FOM, then RELION's peak search and pruning.
Writes <odir>/<micrograph path without job prefix>_autopick.star per micrograph and <odir>/autopick.star
(rlnMicrographName, rlnMicrographCoordinates), and yields one MicrographPicked event per micrograph.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..compute import picking as pk
from ..compute import template_reference as tr
from ..compute.backend import to_host
from ..compute.ctf import CtfParams, ctf_from_frequencies
from ..compute.fourier import half_grid_indices, round_half_away
from ..compute.sampling import direction_grid
from ..errors import InputError, is_out_of_memory
from ..events import Finished, Message, MicrographPicked, Started
from ..io.micrographs import (
    SKIP_FLAG,
    MicrographList,
    check_micrographs,
    micrograph_list,
    output_root,
    write_coordinate_list,
)
from ..io.mrc import is_stack, read_mrc, require_usable_map, write_mrc
from ..io.star import write_coordinates
from ..runtime.device import backend_for
from ..runtime.distributed import root_events, world
from ..runtime.memory import free_cached_memory, keep_template_cache, template_pick_batch
from .common import (
    check_no_spaces,
    check_output_folder,
    check_pixel_size,
    holding_lock,
    param,
    prepare_output,
    write_note,
)
from .micrograph_driver import Round, failure_report, over_micrographs, read_or_skip

JOB_NAME = "autopick"
#: The z-score FOM maps' grid is this many times finer than RELION's working grid W (at most the micrograph's
#: size; compute.picking.oversampled_size): with a 20 Å reference its correlation peaks are about one W pixel
#: wide, and a particle centred between W pixels in both directions lost 0.45-0.80 of its FOM (8-10 %) on W
#: (benchmarks/picking_recall.py --sampling, issue 48). It costs about 4x the FFTs. LoG and --fom relion keep W.
ZSCORE_OVERSAMPLE = 2
#: Template figures of merit (--fom): the matched-filter z-score (default) and RELION's probability ratio.
FOM_KINDS = ("zscore", "relion")


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="Micrographs STAR file, or a glob of MRC files (then --angpix)")
    odir: Path = param(flag="--odir", help="Output folder (e.g. AutoPick/job004/)")
    angpix: float = param(-1.0, "--angpix", "Micrograph pixel size (Å); needed for MRC globs")
    LoG: bool = param(False, "--LoG", "Laplacian-of-Gaussian picking (no templates)")
    LoG_diam_min: float = param(-1.0, "--LoG_diam_min", "Smallest particle diameter (Å)")
    LoG_diam_max: float = param(-1.0, "--LoG_diam_max", "Largest particle diameter (Å)")
    LoG_neighbour: float = param(100.0, "--LoG_neighbour", "Exclusion radius between LoG picks (% of diameter)")
    Log_invert: bool = param(False, "--Log_invert", "Particles are white (bright) instead of black")
    LoG_adjust_threshold: float = param(0.0, "--LoG_adjust_threshold",
                                        "LoG threshold: mean + this many standard deviations")
    LoG_upper_threshold: float = param(99999.0, "--LoG_upper_threshold",
                                       "LoG upper threshold (standard deviations); stronger picks are dropped")
    LoG_robust_stats: bool = param(False, "--LoG_robust_stats",
                                   "Threshold statistics from median and MAD (not RELION; insensitive to "
                                   "contamination)")
    Log_max_search: int = param(5, "--Log_max_search", "Competing LoG sizes up to this multiple/fraction")
    ref: Path | None = param(None, "--ref", "References: 2D stack (.mrcs) or 3D map (.mrc)")
    angpix_ref: float = param(-1.0, "--angpix_ref", "Pixel size of the references (Å); -1 = header")
    ang: float = param(10.0, "--ang", "In-plane (psi) angular sampling of the templates (degrees)")
    healpix_order: int = param(1, "--healpix_order", "HEALPix order of projection directions (3D reference)")
    sym: str = param("C1", "--sym", "Symmetry of the 3D reference")
    ctf: bool = param(False, "--ctf", "Multiply the templates by each micrograph's CTF")
    invert: bool = param(False, "--invert", "Invert the templates (white references, black particles)")
    lowpass: float = param(20.0, "--lowpass", "Low-pass filter and working-grid Nyquist (Å); -1 = none")
    shrink: float = param(0.0, "--shrink", "Working size: 0 = from --lowpass, <=1 = fraction, >1 = pixels")
    particle_diameter: float = param(-1.0, "--particle_diameter", "Particle diameter (Å); -1 = from references")
    shrink_particle_mask: int = param(2, "--shrink_particle_mask", "Shrink the particle disc by this (pixels)")
    fom: str = param("zscore", "--fom", "Template figure of merit: zscore (matched filter on the whitened "
                     "micrograph, in noise standard deviations) or relion (RELION's probability ratio)")
    threshold: float = param(6.0, "--threshold", "Template FOM threshold: picks need FOM >= this (zscore: noise "
                             "standard deviations; relion: RELION's ratio, its GUI default 0.05)")
    no_local_sigma: bool = param(False, "--no_local_sigma", "zscore: do not divide by the local standard "
                                 "deviation around each pixel (which damps contamination edges)")
    min_distance: float = param(100.0, "--min_distance", "Minimum distance between template picks (Å); -1 = "
                                "half the reference box")
    max_stddev_noise: float = param(1.1, "--max_stddev_noise", "Reject picks where the local std exceeds "
                                    "this (micrograph std units; zscore: of the whitened micrograph); -1 = off")
    min_avg_noise: float = param(-999.0, "--min_avg_noise", "Reject picks where the local mean is below this")
    skip_side: int = param(0, "--skip_side", "Keep this many micrograph pixels from the edges free of picks")
    pad: int = param(2, "--pad", "Padding factor of the template Fourier grids")
    outlier_removal_zscore: float = param(8.0, "--outlier_removal_zscore", "Outlier pixels set to the mean")
    skip_bad_micrographs: bool = param(False, SKIP_FLAG, "Skip micrographs that are missing or not readable 2D "
                                       "images (with a warning) instead of stopping before any work")
    random_seed: int = param(1, "--random_seed", "Seed (noise fill of non-square micrographs)")
    batch: int = param(0, "--batch", "Micrographs (LoG; 0 = 1) or templates (0 = from free memory) per batch")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index; MPI: RELION's 0:1:2:3, ranks take them in turn")

    def __post_init__(self):
        if self.i is None:
            raise InputError("--i (micrographs STAR or MRC glob) is required")
        if self.odir is None:
            raise InputError("--odir (output folder) is required")
        check_output_folder(self.odir, "--odir")
        check_no_spaces(self.odir, "--odir", "autopick.star lists the coordinate files under it")
        check_pixel_size(self.angpix, "--angpix", "the micrographs STAR file")
        check_pixel_size(self.angpix_ref, "--angpix_ref", "the reference header")
        if self.batch < 0:
            raise InputError(f"--batch must be >= 0 (0: from free memory), got {self.batch}")
        if self.LoG == (self.ref is not None):
            raise InputError("give either --LoG or --ref (templates), not both or neither")
        if self.LoG:
            if self.LoG_diam_min <= 0 or self.LoG_diam_max <= 0:
                raise InputError(f"--LoG_diam_min and --LoG_diam_max must be > 0 Å, got {self.LoG_diam_min} "
                                 f"and {self.LoG_diam_max}")
            if self.LoG_diam_min > self.LoG_diam_max:
                raise InputError(f"--LoG_diam_min ({self.LoG_diam_min} Å) is larger than --LoG_diam_max "
                                 f"({self.LoG_diam_max} Å)")
            if self.LoG_neighbour <= 0:
                raise InputError(f"--LoG_neighbour must be > 0 %, got {self.LoG_neighbour}")
            if self.Log_max_search < 2:
                raise InputError(f"--Log_max_search must be >= 2, got {self.Log_max_search}")
        else:
            if not Path(self.ref).is_file():
                raise InputError("--ref: reference file not found", path=str(self.ref))
            if self.ang <= 0 or self.ang > 360:
                raise InputError(f"--ang must be in (0, 360] degrees, got {self.ang}")
            if self.pad < 1:
                raise InputError(f"--pad must be >= 1, got {self.pad}")
            if self.fom not in FOM_KINDS:
                raise InputError(f"--fom must be one of {', '.join(FOM_KINDS)}, got {self.fom!r}")
        if self.shrink < 0:
            raise InputError(f"--shrink must be >= 0, got {self.shrink}")


# ----------------------------------------------------------------------------------------------------------
# References


@dataclass
class References:
    refs: np.ndarray  # (K, s, s) masked, inverted as asked, at the micrograph pixel size
    disc: np.ndarray  # (s, s) bool
    radius_px: int  # particle disc radius (micrograph pixels)
    diameter_A: float
    angles: np.ndarray | None  # (K, 3) projection angles for a 3D reference
    projections: tuple[np.ndarray, float] | None = None  # a 3D reference's projections and their pixel size (Å)


def load_references(p: Params, apix: float, odir: Path | None) -> tuple[References, list[str]]:
    """Read, project (3D), rescale to ``apix``, mask and invert the references; notes for the log. A 3D reference's
    projections are written to ``odir``/reference_projections.mrcs (with ``odir`` None, kept in ``projections``
    for the caller to write once the job has started)."""
    notes = []
    m = read_mrc(p.ref)
    header_px = m.pixel_size
    if p.angpix_ref > 0:
        ref_px = float(p.angpix_ref)
    else:
        if header_px is None:
            raise InputError("the reference header has no pixel size: give --angpix_ref (Å)", path=str(p.ref))
        if abs(header_px - apix) > 0.01:
            raise InputError(f"the references have {header_px} Å/px (header) but the micrographs {apix} Å/px; "
                             "give --angpix_ref to confirm the reference pixel size (they are then rescaled)",
                             path=str(p.ref))
        ref_px = header_px
    require_usable_map(m.data, p.ref, "reference")
    data = np.asarray(m.data, np.float32)
    angles = projections = None
    if data.ndim == 3 and not is_stack(p.ref):
        s = data.shape[-1]
        if data.shape != (s, s, s) or s % 2:
            raise InputError(f"a 3D reference must be a cube with an even edge, got {data.shape}", path=str(p.ref))
        _, rot, tilt = direction_grid(p.healpix_order, p.sym)
        data = tr.project_map(data, rot, tilt, ref_px, p.lowpass)
        angles = np.stack([rot, tilt, np.zeros_like(rot)], 1)
        projections = (data, ref_px)
        if odir is not None:
            write_mrc(odir / "reference_projections.mrcs", data, ref_px)
        notes.append(f"projected the 3D reference in {len(rot)} directions (HEALPix order {p.healpix_order}, "
                     f"{p.sym}){'' if odir is None else ' into ' + str(odir / 'reference_projections.mrcs')}")
    if data.ndim == 2:
        data = data[None]
    s = data.shape[-1]
    if data.shape[-2] != s or s % 2:
        raise InputError(f"references must be square with an even edge, got {data.shape[-2:]}", path=str(p.ref))
    if abs(ref_px - apix) > 1e-6:
        data = tr.rescale_images(data, ref_px, apix)
        new = data.shape[-1]
        notes.append(f"references rescaled from {s} px at {ref_px} Å/px to {new} px at {apix} Å/px")
        s = new
    diam = p.particle_diameter if p.particle_diameter > 0 else pk.auto_particle_diameter(data, apix)
    if diam <= 0 or diam > s * apix:
        raise InputError(f"particle diameter {diam:.1f} Å does not fit the {s}-pixel references "
                         f"({s * apix:.1f} Å); give --particle_diameter", path=str(p.ref))
    R = tr.disc_radius(diam, apix, p.shrink_particle_mask)
    if R < 1:
        raise InputError(f"particle disc radius {R} px is too small (--particle_diameter {diam} Å, "
                         f"--shrink_particle_mask {p.shrink_particle_mask})")
    disc = pk.particle_disc(s, R)
    refs = data * disc
    if p.invert:
        refs = -refs
    return References(refs.astype(np.float32), disc, R, float(diam), angles, projections), notes


# ----------------------------------------------------------------------------------------------------------
# Per-shape setup


@dataclass
class Setup:
    grid: pk.Grid
    downsize: int
    inside: object  # (w, w) bool on the device
    extra: dict


def _grid(ny: int, nx: int, p: Params, apix: float) -> tuple[pk.Grid, int, float]:
    """The FOM maps' grid (RELION's working grid W; ZSCORE_OVERSAMPLE times finer for the z-score template FOM),
    the low-pass size (downsize_mic) and RELION's working scale W/n (which picks its peak-search rule)."""
    n = pk.square_size(ny, nx)
    w = pk.working_size(n, apix, p.lowpass, p.shrink)
    factor = ZSCORE_OVERSAMPLE if (not p.LoG and p.fom == "zscore") else 1
    return pk.Grid(n, pk.oversampled_size(w, n, factor), ny, nx), pk.downsize_mic(n, apix, p.lowpass), w / n


def _ctf_on(ctf: CtfParams, box: int, w: int, apix: float, xp):
    """CTF (w, w//2+1) at the frequencies k / (box apix) of a box-size grid (k integer, cropped to w)."""
    ky, kx = half_grid_indices(w, 2, xp)
    fx = xp.broadcast_to(kx / (box * apix), (w, w // 2 + 1))
    fy = xp.broadcast_to(ky / (box * apix), (w, w // 2 + 1))
    return ctf_from_frequencies(ctf, fx, fy, xp)[0]


def _prepare(batch_raw: list[np.ndarray], g: pk.Grid, p: Params, xp, invert: bool, seed: int):
    m = xp.asarray(np.stack(batch_raw))
    x = pk.normalise_micrographs(m, p.outlier_removal_zscore, invert=invert)
    return pk.embed_square(x, g.n, seed)


def _log_batch(raws: list[np.ndarray], setup: Setup, p: Params, apix: float, xp, seed: int):
    """LoG picks for a batch of same-shape micrographs: list of (X, Y, FOM) host arrays."""
    g = setup.grid
    x = _prepare(raws, g, p, xp, invert=not p.Log_invert, seed=seed)
    F = pk.crop_spectrum(pk.micrograph_spectrum(x), g.w)
    del x
    ds = setup.extra["diameters"]
    best, which = pk.log_fom(F, g.n, apix, ds)
    fom, upper = pk.log_threshold(best, which, ds, p.LoG_diam_min, p.LoG_diam_max, setup.inside,
                                  p.LoG_adjust_threshold, p.LoG_upper_threshold, p.LoG_robust_stats)
    fom_h, which_h, up_h = to_host(fom), to_host(which), to_host(upper)
    out = []
    for b in range(fom_h.shape[0]):  # per micrograph of the batch: the sequential greedy search
        rad = pk.log_pick_radius(which_h[b], ds, p.LoG_diam_min, apix, g.scale, p.LoG_neighbour)
        py, px, v = pk.greedy_pick(fom_h[b], rad, float(up_h[b]))
        X, Y = g.to_micrograph(py, px)
        out.append((X, Y, v))
    return out


def _template_one(raw: np.ndarray, setup: Setup, refs: References, p: Params, apix: float, ctf: CtfParams | None,
                  xp, seed: int, batch: int):
    g = setup.grid
    e = setup.extra
    x = _prepare([raw], g, p, xp, invert=False, seed=seed)[0]
    X = pk.crop_spectrum(pk.micrograph_spectrum(x), g.w)
    s = refs.refs.shape[-1]
    c_w = None if ctf is None else _ctf_on(ctf, g.n, g.w, apix, xp)
    if p.fom == "zscore":
        del x
        mic = pk.whiten_micrograph(X, e["ring_ww"], e["n_ring_w"], setup.downsize / 2)
        maps = pk.template_zscore_maps(mic, e["bank"], e["psi"], e["pixels"], g.n, c_w, not p.no_local_sigma,
                                       batch=batch, cache=e["cache"])
    else:
        X2 = pk.crop_spectrum(pk.micrograph_spectrum(x * x), g.w)
        del x
        c_ps = None if ctf is None else _ctf_on(ctf, s, s, apix, xp)
        am, a2 = pk.template_means(e["refs_dev"], e["disc_dev"], c_ps, setup.downsize / 2 * s / g.n)
        maps = pk.template_fom_maps(X, X2, e["bank"], e["psi"], e["pixels"], e["ring_w"], e["n_ring"],
                                    e["n_disc"], am, a2, g.n, c_w, batch=batch, cache=e["cache"])
    min_d = p.min_distance if p.min_distance > 0 else s / 2 * apix
    py, px, f, k, pi = pk.template_picks(maps, setup.inside, p.threshold, refs.radius_px * g.scale,
                                         float(round_half_away(np.float64(min_d / apix))) * g.scale,
                                         p.max_stddev_noise, p.min_avg_noise, e["relion_scale"])
    Xc, Yc = g.to_micrograph(py, px)
    return Xc, Yc, f, k + 1, e["psi"][pi]


def _setup(shape: tuple[int, int], p: Params, apix: float, xp, refs: References | None, be) -> Setup:
    ny, nx = shape
    g, down, relion_scale = _grid(ny, nx, p, apix)
    extra: dict = {"relion_scale": relion_scale}
    if p.LoG:
        skip = int(max(p.skip_side, int(0.5 * p.LoG_diam_min / apix)) * g.scale)
        extra["diameters"] = pk.log_diameters(p.LoG_diam_min, p.LoG_diam_max, p.Log_max_search)
    else:
        s = refs.refs.shape[-1]
        skip = max(1, int((p.skip_side + s / 2) * g.scale))
        psi = tr.psi_angles(p.ang)
        refs_dev = xp.asarray(refs.refs)
        ring = ~refs.disc
        extra.update(
            psi=psi, refs_dev=refs_dev, disc_dev=xp.asarray(refs.disc),
            bank=pk.prepare_templates(refs_dev, p.pad), pixels=pk.template_pixels(g.w, down / 2, xp),
            ring_w=pk.box_spectrum(xp.asarray(ring, np.float64), g.n, g.w),
            n_ring=int(ring.sum()), n_disc=int(refs.disc.sum()))
        box_w = max(2, int(round_half_away(np.float64(s * g.scale / 2))) * 2)
        extra["ring_ww"], extra["n_ring_w"] = pk.ring_on_grid(g.w, box_w, refs.radius_px * g.scale, xp)
        cache_bytes = len(refs.refs) * len(psi) * g.w * (g.w // 2 + 1) * 8
        extra["cache"] = {} if keep_template_cache(cache_bytes, be.free_bytes()) else None
    return Setup(g, down, g.inside(skip, xp), extra)


# ----------------------------------------------------------------------------------------------------------


def _ctf_of(ml: MicrographList, row: int) -> CtfParams | None:
    if not ml.has_ctf:
        return None
    return CtfParams.from_table(ml.table.iloc[[row]])


def _pick_items(items: list, st: Setup, refs: References | None, p: Params, apix: float, ml: MicrographList, be,
                i: int) -> list:
    """Picks of same-shape micrographs [(entry, raw)] (LoG: one batch; templates: the first alone, batches of
    (reference, psi) pairs from runtime.memory) as (entry, X, Y, FOM, class, psi) host arrays; ``i``: the index
    of the round's first micrograph (the LoG noise seed)."""
    out = []
    if p.LoG:
        res = _log_batch([np.asarray(r) for _, r in items], st, p, apix, be.xp, p.random_seed + i)
        for (e, _), (X, Y, v) in zip(items, res, strict=True):
            z = np.zeros(len(X))
            out.append((e, X, Y, v, z.astype(int), z))
    else:
        e, r = items[0]
        n_pairs = len(refs.refs) * len(st.extra["psi"])
        tb = p.batch or template_pick_batch(be.free_bytes(), st.grid.w, n_pairs)
        X, Y, v, k, psi = _template_one(np.asarray(r), st, refs, p, apix, _ctf_of(ml, e.row), be.xp,
                                        p.random_seed + e.row, tb)
        out.append((e, X, Y, v, k, psi))
    return out


@dataclass
class _Picking:
    """One rank's picking job in the per-micrograph driver (jobs.micrograph_driver): ``pick`` reads and picks
    (every rank, no file written), ``write`` writes every rank's picks of a round (rank 0)."""

    p: Params
    ml: MicrographList
    entries: list
    refs: References | None
    be: object
    odir: Path
    mic_batch: int  # LoG micrographs per batch (halved on running out of memory)
    setups: dict = field(default_factory=dict)  # per micrograph shape
    done_names: list = field(default_factory=list)
    done_files: list = field(default_factory=list)
    n_picks: int = 0

    def pick(self, i: int, stop: int) -> Iterator:
        """This rank's next micrograph(s) from entries[i] (at most ``mic_batch``, before ``stop``): a Round of
        (entry, X, Y, FOM, class, psi) host arrays."""
        p, apix = self.p, self.ml.pixel_size
        chunk = self.entries[i:min(i + self.mic_batch, stop)]
        raws: dict[tuple[int, int], list] = {}
        read_failures = []
        for e in chunk:
            raw, failure = read_or_skip(e, p.skip_bad_micrographs)
            if failure is None:
                raws.setdefault(raw.shape, []).append((e, raw))
            else:
                read_failures.append(failure)
        results = []
        try:
            for shape, items in raws.items():
                if shape not in self.setups:
                    self.setups[shape] = _setup(shape, p, apix, self.be.xp, self.refs, self.be)
                    g = self.setups[shape].grid
                    yield Message(f"{shape[1]} x {shape[0]} px micrographs: working grid {g.w} px "
                                  f"({apix / g.scale:.2f} Å/px)")
                results += _pick_items(items, self.setups[shape], self.refs, p, apix, self.ml, self.be, i)
        except Exception as exc:  # noqa: BLE001
            if is_out_of_memory(exc) and self.mic_batch > 1:
                free_cached_memory(self.be)
                self.mic_batch = max(1, self.mic_batch // 2)
                yield Message(f"out of memory; retrying with {self.mic_batch} micrographs per batch", "warning")
                return Round([], read_failures, 0)  # the same micrographs again in the next round
            raise
        return Round(results, read_failures, len(chunk))

    def write(self, results: list) -> Iterator:
        """Rank 0: every rank's picks of a round to their coordinate files, one MicrographPicked each."""
        for e, X, Y, v, k, psi in results:
            f = self.odir / (output_root(e.name) + "_autopick.star")
            write_coordinates(f, X, Y, fom=v, class_number=k, psi=psi)
            self.done_names.append(e.name)
            self.done_files.append(str(f))
            self.n_picks += len(X)
            yield MicrographPicked(e.name, e.row, np.stack([X, Y], 1).astype(np.float64) if len(X) else
                                   np.zeros((0, 2)), np.asarray(v, np.float64))


def run(p: Params) -> Iterator:
    """Under MPI every rank picks its block of the micrographs; after each round rank 0 gathers the picks, writes
    every file and yields the events."""
    yield from root_events(world(), holding_lock(_run(p), Path(p.odir) / "autopick", JOB_NAME, "--odir"))


def _run(p: Params) -> Iterator:
    comm = world()
    ml = micrograph_list(p.i, p.angpix)
    apix = ml.pixel_size
    if p.ctf and not ml.has_ctf:
        raise InputError("--ctf needs rlnDefocusU and rlnDefocusV in the micrographs STAR", path=str(p.i),
                         column="rlnDefocusU")
    odir = Path(p.odir)
    be = backend_for(p)
    # headers, before any work (every rank: a bad micrograph or reference stops them all alike)
    entries, _, failures = check_micrographs(ml, ml.entries, p.skip_bad_micrographs)
    if not entries:
        raise InputError(f"none of the {len(ml.entries)} micrographs can be used: {'; '.join(failures[:3])}",
                         path=str(p.i))
    n = len(entries)
    mode = "LoG" if p.LoG else "templates"
    refs, ref_notes = load_references(p, apix, None) if not p.LoG else (None, [])  # bad references: before work
    # per micrograph a coordinate STAR (about 100 bytes a pick; a few hundred picks) and its line in autopick.star
    need = n * 64 * 1024 + (0 if refs is None or refs.projections is None else refs.projections[0].nbytes + 1024)
    notes = prepare_output(odir, need, "the coordinate files", "--odir") if comm.is_root else []  # rank 0 writes
    yield Started(JOB_NAME, odir, be.name, f"picking {n} micrographs ({mode}, {apix:.3f} Å/px)")
    yield from notes
    for f in failures:
        yield Message(f"skipping micrograph {f}", "warning")
    if comm.is_root:
        odir.mkdir(parents=True, exist_ok=True)
        write_note(odir, JOB_NAME, p)
        if refs is not None and refs.projections is not None:
            write_mrc(odir / "reference_projections.mrcs", *refs.projections)
            ref_notes.append(f"the projections are in {odir / 'reference_projections.mrcs'}")
    if refs is not None:
        for t in ref_notes:
            yield Message(t)
        yield Message(f"{len(refs.refs)} references of {refs.refs.shape[-1]} px, particle diameter "
                      f"{refs.diameter_A:.1f} Å (disc radius {refs.radius_px} px)")
    # LoG: batches of micrographs; templates: one micrograph, batches of (reference, psi) pairs
    # one LoG micrograph at a time unless --batch says otherwise: on the H100 batches of 4 were 4x slower than
    # single micrographs at 4096 px (benchmarks/results/picking_h100.json)
    job = _Picking(p, ml, entries, refs, be, odir, max(1, p.batch) if (p.LoG and p.batch) else 1)
    failures += yield from over_micrographs(comm, n, job.pick, job.write, "picking")
    if not comm.is_root:
        return
    # keep STAR order; write the list even when some micrographs failed
    order = {e.name: e.row for e in ml.entries}
    idx = np.argsort([order[nm] for nm in job.done_names], kind="stable")
    out = write_coordinate_list(odir / "autopick.star", [job.done_names[j] for j in idx],
                                [job.done_files[j] for j in idx])
    free_cached_memory(be)
    summary = f"{job.n_picks} particles picked from {len(job.done_names)} of {len(ml.entries)} micrographs ({mode})"
    if failures:
        yield failure_report(failures)
        summary += f"; {len(failures)} failed: " + ", ".join(f.split(":")[0] for f in failures)
    yield Finished({"coordinates": out}, summary)


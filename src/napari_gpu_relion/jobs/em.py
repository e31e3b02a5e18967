"""The EM iteration shared by refine3d, class3d and class2d (relion_refine; relion_algorithm.md 6-7).

``run(job)`` is the one iteration driver, with RELION's named steps:

    for each iteration:  update_sampling -> expectation -> maximization -> update_resolution
                         -> check_convergence -> write (and the events the viewer shows)

What differs per job is an ``EMJob`` subclass (jobs/refine3d.py, class3d.py, class2d.py): how the references
are made and reconstructed, how the sampling changes, when it has converged, which files it writes. The state
between iterations is one ``compute.schedule.EMState`` (scalars) plus the model arrays of ``EMModel``, saved
in the optimiser and model STARs so that ``--continue`` resumes exactly. The E-step over a set of particles
runs in batches sized by the memory plan (compute/backend.plan_memory), halving on out-of-memory.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from ..cancel import bound_check, check_cancel
from ..compute import host_threads
from ..compute.backend import thread_upload, to_host
from ..compute.backprojector import BackProjectorStack
from ..compute.estep import EStepSetup, EStepSums, expectation_batch, prepare_batch
from ..compute.expectation import PixelSet, pixel_set
from ..compute.extraction import background_stats
from ..compute.fourier import fourier_resize
from ..compute.geometry import matrix_to_euler
from ..compute.masks import soft_spherical_mask
from ..compute.maximization import (
    initial_data_vs_prior,
    initial_noise_spectrum,
    normalised_direction_priors,
    references_tau2,
    update_norm,
    update_scales,
)
from ..compute.projector import prepare_references
from ..compute.sampling import check_healpix_order, check_offset_search, local_candidates, local_search_rows
from ..compute.schedule import EMState
from ..compute.simulate import fit_box
from ..errors import InputError
from ..events import Finished, Message, Progress, Started
from ..io.atomic import ensure_not_input
from ..io.jobdir import RunFiles, project_path
from ..io.model_star import (
    PARAM_PREFIX,
    params_from_optimiser,
    params_to_optimiser,
    read_model_star,
    read_optimiser_star,
    state_from_optimiser,
    state_to_optimiser,
    write_optimiser_star,
)
from ..io.mrc import read_mrc, require_usable_map
from ..io.particle_images import NORM_CHECK_IMAGES, check_normalisation, norm_check_rows, parse_image_name
from ..io.paths import is_star_path
from ..io.star import read_star, warm_writer
from ..io.write_queue import HELPER_FROM_PARTICLES, WriteQueue
from ..marks import memory_mark
from ..runtime.device import Backend, backend_for, compute_threads, host_available_bytes, set_matmul_tf32
from ..runtime.distributed import (
    REBALANCE_AFTER,
    assign,
    deal_owners,
    deal_runs,
    describe_owners,
    fixed_work,
    gather_items,
    merge_particles,
    owned,
    owners,
    rank_report,
    rank_speeds,
    rebalance_owners,
    root_events,
    sum_estep,
    world,
)
from ..runtime.kernel_preload import Preload
from ..runtime.memory import (
    READ_AHEAD_MIN_BYTES,
    JobMemory,
    MemoryPlan,
    SearchSpace,
    batched_with_oom_retry,
    choose_padding,
    device_images_capacity,
    device_pool_line,
    device_read_ahead_bytes,
    free_cached_memory,
    memory_trace_active,
    pinned_maps_ok,
    plan_memory,
    read_ahead_bytes,
    refusal,
    release_cached,
)
from .common import (
    check_output_folder,
    check_run_output,
    em_iteration_bytes,
    flag_of,
    holding_lock,
    input_paths,
    param,
    prepare_output,
    require_file,
    write_note,
)
from .particles import (
    ParticleSet,
    applied_aberrations,
    applied_magnifications,
    load_particle_set,
    optics_aberrations,
    optics_magnifications,
    particle_state,
    write_data_star,
)
from .read_ahead import read_threads

#: Width of the raised-cosine edge of the particle mask (pixels), RELION's default.
MASK_EDGE = 5.0
#: Read the images not yet kept in memory in a background thread, in the E-step's order, while it computes
#: (ParticleSet.read_ahead); off only to compare.
READ_AHEAD = True
#: The reader's threads also copy each block to the GPU once the image store is there (compute.backend.thread_upload);
#: ``NAPARI_GPU_RELION_READ_UPLOADS=0`` leaves the copies to the job's thread (to compare).
READ_UPLOADS = os.environ.get("NAPARI_GPU_RELION_READ_UPLOADS", "1").strip() not in ("0", "false", "no", "off")


# ----------------------------------------------------------------------------------------------------------
# Options every relion_refine-style job shares
# ----------------------------------------------------------------------------------------------------------


# A job's Params is ``class Params(em.EMParams, em.EMCorrections, em.EMOptions, Options, em.EMInputs)`` with its
# own options in ``Options`` (EMCorrections only where relion_refine takes --norm/--scale: refine3d, class3d,
# class2d): dataclass fields come in reverse MRO order, so forms and --help list the inputs, the job's own
# options, the shared options, the corrections, then how to run it.


@dataclass(frozen=True)
class EMInputs:
    """Inputs and output of every relion_refine-style job."""

    i: Path | None = param(None, "--i", "Particles STAR file")
    o: Path | None = param(None, "--o", "Output rootname, as RELION's (Class3D/job001/run writes "
                           "Class3D/job001/run_it001_data.star, ...); an existing folder means <folder>/run",
                           mode="root")


@dataclass(frozen=True)
class EMOptions:
    """The options of relion_refine that refine3d, class3d and class2d share (RELION's names and defaults)."""

    particle_diameter: float = param(-1.0, "--particle_diameter", "Mask diameter (Å); -1 = (box - 5) x pixel size")
    offset_range: float = param(5.0, "--offset_range", "Translation search range (pixels)")
    offset_step: float = param(2.0, "--offset_step", "Coarse translation step (pixels)")
    ctf: bool = param(False, "--ctf", "Do CTF correction")
    flatten_solvent: bool = param(False, "--flatten_solvent", "Mask the references with a soft sphere")
    zero_mask: bool = param(False, "--zero_mask", "Fill outside the particle mask with zeros (else noise)")
    pad: int = param(2, "--pad", "Padding factor of the Fourier grids")
    offset: float = param(10.0, "--offset", "Initial sigma of the offset prior (Å)")
    angstrom_offset_prior: bool = param(False, "--angstrom_offset_prior", "The offset prior with offsets and "
                                        "translations both in Å, at the searched translations; default: RELION 5's "
                                        "arithmetic (translation in Å added to the offset in pixels, on the "
                                        "unperturbed grid: a prior pixel-size times narrower), for RELION's "
                                        "results. 2D classification always uses the Å prior")
    subpixel_offsets: bool = param(False, "--subpixel_offsets", "Search the translations around each particle's "
                                   "exact offset (not RELION's: RELION searches around the offset rounded to whole "
                                   "pixels, which a search range below half a pixel cannot leave; "
                                   "docs/high_resolution.md)")
    random_seed: int = param(0, "--random_seed", "Random seed (halves, seeding, perturbation, noise)")


@dataclass(frozen=True)
class EMCorrections:
    """RELION's corrections of the particle images, as its GUI passes them to relion_refine for 3D auto-refine and
    2D/3D classification (the M-step of EMJob.update_corrections)."""

    norm: bool = param(False, "--norm", "Per-particle norm correction")
    scale: bool = param(False, "--scale", "Per-group intensity-scale correction")


@dataclass(frozen=True)
class EMParams:
    """How an EM job runs (--continue, --batch, --cpu, --gpu) and the checks every EM job's Params share."""

    continue_from: Path | None = param(None, "--continue", "Continue from a run_itNNN_optimiser.star")
    batch: int = param(0, "--batch", "Particles per batch; 0 = from free memory")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index; MPI: RELION's 0:1:2:3, ranks take them in turn")
    memory_limit: float = param(0.0, "--memory_limit", "Most memory (GiB) the job may plan with on its device; "
                                "0 = all free memory. A job that cannot fit is refused before it starts")
    tf32: bool = param(False, "--tf32", "GPU: the score and sum GEMMs in TF32 on tensor cores (faster, inputs "
                       "rounded to 10 bits; benchmarks/README.md has what it changes)")
    coarse_float32: bool = param(False, "--coarse_float32", "GPU: the coarse pass's score GEMMs in float32 "
                                 "(default: TF32 on tensor cores; that pass only selects the samples the fine "
                                 "pass scores again in float32: the same poses for >= 99.9 % of particles and "
                                 "the same resolution, benchmarks/README.md, TF32)")
    preread_images: bool = param(False, "--preread_images", "Keep every particle image in memory after its first "
                                 "reading, however large the set (done anyway when the images take at most a "
                                 "quarter of the free RAM)")
    dont_check_norm: bool = param(False, "--dont_check_norm", "Run even when the particles do not look normalised "
                                  "(RELION's flag; background mean 0, stddev 1 outside the particle circle): a "
                                  "warning instead of the error")
    j: int = param(0, "--j", "CPU: threads for the projections and insertions (RELION's option); 0 = this rank's "
                   "share of the cores, at most 8. The results are the same for any count; a GPU job ignores it")

    #: Options that --continue takes from the command line, not from the optimiser STAR.
    RUNTIME = ("continue_from", "cpu", "gpu", "batch", "memory_limit", "tf32", "coarse_float32", "preread_images",
               "dont_check_norm", "j")
    #: Saved options that a --continue changes when its command line gives them a value other than their default,
    #: as RELION's --continue does (MlOptimiser::parseContinue; each job adds its own). The others stay as saved
    #: and are named in a warning (not_continued).
    CONTINUE_CHANGES = ("tau2_fudge", "particle_diameter", "pad", "flatten_solvent", "norm", "scale")
    #: Options a job gained after runs of it were written, with the value those runs had: a --continue of such a
    #: run, whose optimiser STAR lacks them, takes that value; any other missing option is a damaged file.
    NEWER_OPTIONS = {"subpixel_offsets": False}

    def check(self, needs_ref: bool, healpix_order: int = 0) -> None:
        """Clear errors before any work (called by each job's __post_init__); a --continue checks its runtime
        options here and the rest when it reads the optimiser STAR."""
        if self.batch < 0:
            raise InputError(f"--batch must be at least 1 particle (or 0: from the free memory), got {self.batch}")
        if not self.memory_limit >= 0:
            raise InputError(f"--memory_limit must be >= 0 GiB (0: all free memory), got {self.memory_limit}")
        if self.j < 0:
            raise InputError(f"--j must be at least 1 thread (or 0: this rank's share of the cores), got {self.j}")
        if self.continue_from is not None:  # the values a --continue may change (CONTINUE_CHANGES), checked too
            require_file(self.continue_from, "--continue optimiser STAR", (".star",))
            self.check_values()
            return
        require_file(self.i, "--i particles STAR", (".star",))
        if needs_ref:
            require_file(getattr(self, "ref", None), "--ref reference map", (".mrc", ".map", ".star"))
        if self.o is None:
            raise InputError("--o (output rootname, e.g. Refine3D/job001/run) is required")
        check_output_folder(RunFiles.from_output(self.o).folder, "--o")
        ensure_not_input(RunFiles.from_output(self.o).data(1), self.i)
        check_healpix_order(healpix_order)
        self.check_values()

    def check_values(self) -> None:
        """Clear errors for the values of the options that a --continue may change too."""
        if self.particle_diameter <= 0 and self.particle_diameter != -1:
            raise InputError(f"--particle_diameter must be > 0 Å, or -1 for (box - 5) x pixel size; got "
                             f"{self.particle_diameter:g}")
        check_offset_search(self.offset_range, self.offset_step, np.inf)  # the box: plan_job_memory
        if self.pad < 1:
            raise InputError(f"--pad must be >= 1, got {self.pad}")
        if not getattr(self, "tau2_fudge", 1.0) > 0:
            raise InputError(f"--tau2_fudge must be > 0, got {self.tau2_fudge}")


def saved_options(params_cls) -> tuple[str, ...]:
    """The options a --continue takes from the optimiser STAR: all but the data, the output and RUNTIME."""
    skip = {"i", "ref", "o", *EMParams.RUNTIME}
    return tuple(f for f in params_cls.__dataclass_fields__ if f not in skip)


def continued_params(params_cls, p):
    """The Params of a --continue: the saved options from the optimiser STAR, the data STAR and model of that
    iteration as --i / --ref, the same rootname, and this call's runtime options (and --iter when given: a value
    other than the default, or the default for a run that has done all the iterations it was started with)."""
    opt = read_optimiser_star(p.continue_from, require=("rlnCurrentIteration", "rlnExperimentalDataStarFile",
                                                        "rlnModelStarFile", "rlnOutputRootName"))
    base = Path(p.continue_from).parent
    given = {k: getattr(p, k) for k in EMParams.RUNTIME}
    given["i"] = base / Path(str(opt["rlnExperimentalDataStarFile"])).name
    given["o"] = base / Path(str(opt["rlnOutputRootName"])).name
    if "ref" in params_cls.__dataclass_fields__:
        given["ref"] = None
    if "iter" in params_cls.__dataclass_fields__:
        # --iter as given; its default value (which may be what the user typed) only for a run that has done all the
        # iterations it was started with (continued without --iter, a run stopped early repeats the uninterrupted one)
        default, saved = params_cls.__dataclass_fields__["iter"].default, opt.get(f"{PARAM_PREFIX}iter")
        done = int(opt["rlnCurrentIteration"])
        if p.iter != default or (saved is not None and done >= int(saved) and p.iter > done):
            given["iter"] = p.iter
    for k, before in params_cls.NEWER_OPTIONS.items():
        if f"{PARAM_PREFIX}{k}" not in opt:
            given[k] = before
    for k in params_cls.CONTINUE_CHANGES:  # given on this command line (a value other than the default)
        if k in params_cls.__dataclass_fields__ and getattr(p, k) != params_cls.__dataclass_fields__[k].default:
            given[k] = getattr(p, k)
    return params_from_optimiser(params_cls, opt, source=p.continue_from, **given), opt


def not_continued(params_cls, asked, continued) -> list[str]:
    """The options of a --continue's command line (``asked``) that the run does not take: given with a value other
    than their default and other than the saved one, which the continued run (``continued``) keeps ("--pad 1
    (the run keeps 2)"). --iter, the runtime options and CONTINUE_CHANGES change on --continue (RELION's own
    --continue changes a few more; a user who typed one should hear that it did not apply, not find it out from
    the results)."""
    out = []
    for name in saved_options(params_cls):
        fld = params_cls.__dataclass_fields__[name]
        if name == "iter":
            continue
        value, kept = getattr(asked, name), getattr(continued, name)
        if isinstance(value, str) and isinstance(kept, str) and value.casefold() == kept.casefold():
            continue  # --sym c1 is the run's C1
        if value != fld.default and value != kept:
            if isinstance(value, bool):  # a flag: as typed (--flatten_solvent, --no-subpixel_offsets)
                out.append(f"{flag_of(fld) if value else '--no-' + flag_of(fld)[2:]} (the run keeps it "
                           f"{'on' if kept else 'off'})")
            else:
                out.append(f"{flag_of(fld)} {value} (the run keeps {kept})")
    return out


def not_continued_line(params_cls, ignored: list[str]) -> str:
    """The warning that names the options a --continue did not apply (not_continued), and those it changes."""
    fields = params_cls.__dataclass_fields__
    changes = ", ".join(flag_of(fields[k]) for k in params_cls.CONTINUE_CHANGES if k in fields)
    return (f"--continue keeps the run's saved options; not applied: {'; '.join(ignored)} (--continue changes only "
            f"--iter, the runtime options and {changes})")


# ----------------------------------------------------------------------------------------------------------
# The model: references and the arrays the M-step updates, per gold-standard half (one "half" in classification)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class EMModel:
    """Per half h: the K class references refs[h] (K, N, N[, N]): float64, or float32 after an M-step (the
    values of the float32 maps written: held as float32 on the host, half the bytes to convert, keep and send to
    the device; each use converts them to float64 exactly, as before), the noise spectra sigma2[h]
    (optics groups, shells), the class distribution pdf_class[h] (K,) and orientation distribution
    pdf_dir[h] (K, n_dirs); shared: group scale corrections and 2D class offset priors (K, 2) in Å."""

    refs: list[np.ndarray]
    sigma2: list[np.ndarray]
    pdf_class: list[np.ndarray]
    pdf_dir: list[np.ndarray | None]
    scales: np.ndarray
    prior_offsets_A: np.ndarray | None = None

    @property
    def n_classes(self) -> int:
        return int(self.refs[0].shape[0])


@dataclass
class Iteration:
    """What one iteration computed, passed from step to step."""

    final: bool
    cc: bool
    current_size: int
    sampling: object
    coarse_size: int
    local_sigma: float | None
    plan: MemoryPlan | None = None
    sums: list = field(default_factory=list)  # EStepSums per half
    accumulators: list = field(default_factory=list)  # BackProjector(Stack) per half
    old_angles: np.ndarray | None = None
    old_offsets: np.ndarray | None = None
    old_classes: np.ndarray | None = None
    ssnr: list = field(default_factory=list)  # SSNR_MAP per class (or the gold-standard one)
    fsc: np.ndarray | None = None
    references: list = field(default_factory=list)  # the prepared (padded Fourier) references per half
    seconds_estep: float = 0.0  # the E-step of every half, the two below included
    seconds_waiting: float = 0.0  # MPI: waiting for the slowest rank at the end of each half's E-step
    seconds_summing: float = 0.0  # MPI: sums over ranks and merging the particles' results
    seconds_reading: float = 0.0  # of the E-step: this process reading images or waiting for its reader
    reading_parts: dict = field(default_factory=dict)  # seconds_reading in its parts (particles.READING_PARTS)
    bytes_at_start: int = 0  # MPI: what this rank had sent before this iteration (comm.bytes_sent)
    particles_here: int = 0  # MPI: the particles of this rank's E-step
    mstep_parts: dict = field(default_factory=dict)  # M-step part -> s (timed), in the timing line

    @contextmanager
    def timed(self, part: str, be: Backend):
        """Add the time of the block (its work on this thread's stream finished) to the M-step part ``part``."""
        t = time.time()
        yield
        if be.is_gpu:  # this stream only: not the read-ahead's uploads or another job's kernels
            be.xp.cuda.get_current_stream().synchronize()
        self.mstep_parts[part] = self.mstep_parts.get(part, 0.0) + time.time() - t


class EMJob:
    """The job-specific part of an EM run. The driver calls the steps in RELION's order; the base class holds
    what every job shares (reading the data, the E-step over the halves, --continue)."""

    name = "em"
    ndim = 3  # of the references
    needs_halves = False  # gold-standard auto-refine
    #: Every iteration's E-step reads every particle of the halves: the images are read ahead from the start
    #: (not the initial model's, whose iterations read random subsets: its images are read as asked for)
    reads_every_image = True
    own_orientation = False  # --skip_align: each particle only at its own orientation
    #: Fixed work with one owner rank each (runtime.distributed.assign): each class's reconstruction is summed on
    #: and made by one rank, and the maps are gathered (maximization); a job that keeps state of every class on
    #: every rank (the initial model's moments) owns nothing.
    owned_kinds: tuple[str, ...] = ("reconstruction",)
    room_after_images: int = 0  # bytes the run's plan leaves free on the GPU once the image store is made

    def __init__(self, p):
        self.p = p
        self.comm = world()  # MPI ranks share the particles of each half; size 1 without MPI
        self.t_start = time.time()
        self.continued = p.continue_from is not None
        self.opt: dict | None = None
        self.not_continued: list[str] = []  # options of the command line a --continue does not take
        if self.continued:
            self.p, self.opt = continued_params(type(p), p)
            self.not_continued = not_continued(type(p), p, self.p)
        self.files = RunFiles.from_output(self.p.o)
        check_run_output(self.files, self.name, input_paths(self.p), self.continued)  # before any work (issue 50)
        self.be: Backend = backend_for(self.p)
        if self.be.is_gpu:  # the ranks' GPU-to-GPU sums get ready (NCCL) while the job starts
            self.comm.prepare_device_sum()
        self.startup = {"the device": time.time() - self.t_start}  # step -> s, the start-up line
        # the GPU kernels this job will use get ready in the background while it reads its particles and prepares
        # its references (kernel_preload; the host's first rank compiles the shipped modules for the host, unless
        # the command line already started that); stopped when the job ends, or here if it cannot start
        self.preload = Preload(self.name, self.be.device, compile_ahead=self.comm.local_rank == 0).start()
        try:
            self._read_inputs()
        except BaseException:
            self.preload.finish()
            raise
        self.startup["reading the particles"] = time.time() - self.t_start - sum(self.startup.values())

    def _read_inputs(self) -> None:
        self.ps: ParticleSet = load_particle_set(Path(self.p.i), self.p.ctf, seed=self.p.random_seed,
                                                 halves=self.needs_halves)
        self.N, self.apix = self.ps.box, self.ps.pixel_size
        # beam tilt and Zernike terms of the optics groups (ctf_refine's), applied in the E-step with the CTF
        self.aberrations = optics_aberrations(self.ps.table) if self.p.ctf else None
        self.mags = optics_magnifications(self.ps.table)  # per optics group, or None: no anisotropic magnification
        self.images_note = keep_images(self.ps, self.p.preread_images, host_available_bytes())
        self.diameter, self.mask_r = particle_mask(self.ps, self.p.particle_diameter, MASK_EDGE)
        self.halves = ([np.flatnonzero(self.ps.subset == h) for h in (1, 2)] if self.needs_halves
                       else [np.arange(len(self.ps))])
        # the average norm correction starts at the particles' mean rlnNormCorrection (1 for new particles, as
        # RELION's 1); a --continue takes the saved one (restore_state)
        self.state = EMState(order=getattr(self.p, "healpix_order", 0), offset_range=self.p.offset_range,
                             offset_step=self.p.offset_step, sigma_offset_A=self.p.offset,
                             norm_average=float(self.ps.norm.mean()))
        # RELION's HealpixSampling::initialise draws the perturbation once at setup and every iteration adds one
        # more, so iteration 1's is the second draw (a --continue takes the saved one)
        if not self.continued:
            self.state.perturb_sampling(self.p.random_seed)
        self.model: EMModel | None = None
        self.data_vs_prior: list[np.ndarray] | None = None  # the last M-step's SSNR per class (--scale's shells)
        self._plan_shown = False
        self.speeds: list[float] | None = None  # MPI: each rank's measured E-step speed (its share of the next)
        self.rank_work_recent: list[list] = []  # MPI: (particles, seconds) per rank in the last few iterations
        self._run_owners: list[np.ndarray] | None = None  # MPI: the rank of each run of each half's particles
        self._owners_speeds: list[float] | None = None  # the speeds _run_owners were balanced for
        self.job_memory: JobMemory | None = None
        self._prepared: tuple | None = None  # ((iteration, image size), prepared references per half)
        # the iterations' files, written while the next computes (a large set's through a helper process, whose
        # STAR formatting does not hold this process's lock while the job launches its kernels)
        self.writer = WriteQueue(f"{self.name} files", helper_process=len(self.ps) >= HELPER_FROM_PARTICLES)
        self.helper_noted = False
        self.files_from = 0  # the number (WriteQueue.handed) of the latest iteration's first write

    # ---- the job-specific steps ----
    @functools.cached_property
    def solvent_mask(self):
        """The soft spherical mask of --flatten_solvent (float32, the box of the references, on the job's device):
        made once per job, on the device (0.65 s on the host at box 256, issue 15)."""
        return soft_spherical_mask(self.N, self.mask_r, MASK_EDGE, self.ndim, xp=self.be.xp)

    def describe(self) -> str:
        raise NotImplementedError

    def max_iterations(self) -> int:
        """The iteration the job stops at the latest (--iter); 0 where it stops when it has converged."""
        return int(getattr(self.p, "iter", 0) or 0)

    def initial_model(self) -> EMModel:
        raise NotImplementedError

    def update_sampling(self) -> Iterator:
        """Before the E-step: sizes and the sampling of this iteration; yields Messages and returns the
        Iteration."""
        raise NotImplementedError

    def expectation_options(self, it: Iteration, h: int) -> dict:
        """Keyword options of the E-step of half h: direction/class priors, local searches, ..."""
        return {}

    def maximization(self, it: Iteration) -> None:
        raise NotImplementedError

    def update_corrections(self, sums: list[EStepSums]) -> None:
        """M-step of RELION's image corrections from this iteration's E-step ``sums`` (one per half), for the jobs
        whose Params has EMCorrections; called after a non-CC E-step only. --norm: each particle's norm correction
        from its residual power (rlnNormCorrection, in the units of the images' real-space noise std) and their new
        average; --scale (more than one group): each group's intensity scale from the sums of signal x reference
        and reference power (1 on average over the particles)."""
        p, st, m, ps = self.p, self.state, self.model, self.ps
        if p.norm:
            ps.norm = update_norm(ps.norm, st.norm_average, ps.residual_power)
            st.norm_average = float(ps.norm.mean())
        if p.scale and len(m.scales) > 1:
            counts = np.bincount(ps.scale_group, minlength=len(m.scales)).astype(float)
            m.scales = update_scales(sum(s.xa for s in sums), sum(s.aa for s in sums), counts, m.scales)

    def scale_shells(self, refs, pix: PixelSet, h: int):
        """For --scale with more than one group: (K, pixels of ``pix``) bool on the device, the pixels whose shell
        has the class's SSNR above 3 (RELION's shells for the scale sums). The SSNR is the last M-step's
        (data_vs_prior: SSNR_MAP per class, or the FSC's in auto-refine); before the first M-step of this run it is
        RELION's initial estimate from the prepared references ``refs`` (initial_data_vs_prior); a --continue takes
        the model STAR's rlnSsnrMap (restore_state). None when the scales are not refined."""
        if not getattr(self.p, "scale", False) or len(self.model.scales) < 2:
            return None
        dvp = self.data_vs_prior
        if dvp is None:
            tau2 = np.stack(references_tau2(refs))
            dvp = initial_data_vs_prior(tau2, self.model.sigma2[h], self.model.pdf_class[h], len(self.ps),
                                        self.p.tau2_fudge, self.ndim)
        shells = np.asarray(to_host(pix.shell), np.int64)
        mask = np.stack([np.asarray(d, np.float64)[np.minimum(shells, len(d) - 1)] > 3.0 for d in dvp])
        return self.be.asarray(mask)

    def update_resolution(self, it: Iteration) -> None:
        raise NotImplementedError

    def check_convergence(self, it: Iteration) -> bool:
        """True when the iteration just done was the last."""
        raise NotImplementedError

    def write(self, it: Iteration) -> Iterator:
        """Write this iteration's files (optimiser STAR last) and yield the viewer's events."""
        raise NotImplementedError

    def finished(self) -> Finished:
        raise NotImplementedError

    def restore(self) -> EMModel:
        """The model saved by the iteration --continue names (and the particles' classes)."""
        raise NotImplementedError

    # ---- shared machinery ----
    def budget_bytes(self) -> int:
        """The memory this job may plan with: the device's free memory shared by the MPI ranks on that device,
        at most --memory_limit, the least over the ranks (so that every rank makes the same choices)."""
        free = self.be.free_bytes()
        device = (self.comm.host, self.be.device) if self.be.is_gpu else (self.comm.host, self.comm.rank)
        ranks = self.comm.allgather((device, int(free)))
        shares = [f // sum(d == other for other, _ in ranks) for d, f in ranks]  # ranks sharing a GPU split it
        budget = min(shares)
        if self.p.memory_limit > 0:
            budget = min(budget, int(self.p.memory_limit * 1024**3))
        return int(budget)

    def plan_job_memory(self) -> Iterator:
        """Before iteration 1: the particles' normalisation (RELION's check, not on a --continue), the translation
        range against the box, and the whole run's memory plan at the full image size with one particle's E-step
        at the first iteration's search. A padding that cannot fit falls back to --pad 1 (said); a job that
        cannot fit at all, or not even one particle per batch, is refused with the numbers."""
        p, st = self.p, self.state
        if not self.continued:  # a --continue goes on with what its run accepted (auto-refine widens the range)
            check_offset_search(p.offset_range, p.offset_step, self.N)
            rows, mean, std = self.background_stats()
            warning = check_normalisation(self.ps.table, rows, mean, std, self.mask_r, p.dont_check_norm)
            if warning:
                yield Message(warning, "warning")
        line = applied_aberrations(self.ps.table, self.aberrations)
        if line:
            yield Message(line)
        line = applied_magnifications(self.ps.table, self.mags)
        if line:
            yield Message(line)
        group = getattr(self, "sym", None)
        search = SearchSpace(self.ndim, self.model.n_classes, st.offset_range, st.offset_step, order=st.order,
                             sym=group.name if group is not None else "C1",
                             sym_order=group.order if group is not None else 1, psi_step=getattr(p, "psi_step", 0.0),
                             local_sigma=st.sigma_ang if st.local else max(getattr(p, "sigma_ang", 0.0), 0.0),
                             own_orientation=self.own_orientation, first_size=st.current_size(self.N),
                             pixel_size=self.apix, diameter_A=self.diameter)
        budget = self.budget_bytes()
        self.job_memory, note = choose_padding(
            self.p.pad, box=self.N, ndim=self.ndim, n_classes=self.model.n_classes, n_halves=len(self.halves),
            budget_bytes=budget, search=search)
        if not self.job_memory.fits:
            raise InputError(refusal(self.job_memory, self.name))
        if note is not None:
            self.p = replace(self.p, pad=self.job_memory.pad)
            yield Message(note, "warning")

    def own_blocks(self, speeds=None) -> list[np.ndarray]:
        """This rank's particles of each half (every particle in one process): runs of rows dealt in turn, so
        every rank gets the same mix of the set, whatever its order (runtime.distributed.deal_owners); after new
        ``speeds`` (the ranks' measured speeds), the fewest runs moved for shares in proportion to them
        (rebalance_owners), so that the ranks keep most of the images they hold."""
        size = self.comm.size
        runs = [deal_runs(len(r), size) for r in self.halves]
        if self._run_owners is None or [len(o) for o in self._run_owners] != runs:  # first, or new halves' sizes
            self._run_owners = [deal_owners(n, size) for n in runs]  # (the initial model's growing mini-batches)
            self._owners_speeds = None
        if speeds is not None and speeds is not self._owners_speeds:
            self._owners_speeds = speeds
            self._run_owners = [rebalance_owners(o, [len(x) for x in np.array_split(r, len(o))], speeds)
                                for o, r in zip(self._run_owners, self.halves, strict=True)]
        return [self.comm.deal(r, o) for r, o in zip(self.halves, self._run_owners, strict=True)]

    def keep_images_on_device(self) -> None:
        """After the run's memory plan: keep the images on the GPU (no host copy and upload of every batch in every
        iteration: 0.34 s of a 2.0 s box-256 iteration on the H100, issue 15; under MPI a rank without them read
        its 13 GB share of 100,000 box-256 images from the disk every iteration, issue 47) when they fit the
        policy of runtime.memory.device_images_capacity. An MPI rank keeps only its own rows (retain)."""
        plan, ps = self.job_memory, self.ps
        if not self.be.is_gpu or plan is None:
            return
        own = sum(len(b) for b in self.own_blocks()) if self.comm.size > 1 else None
        capacity = device_images_capacity(len(ps), ps.box * ps.box * 4, plan.budget_bytes - plan.peak, own)
        if capacity == 0:
            return
        ps.keep_images_on(self.be.xp, capacity)
        self.room_after_images = plan.budget_bytes - plan.peak - capacity * ps.box * ps.box * 4
        whose = "" if own is None else f" of this rank's {own} particles, room for {capacity}"
        self.images_note = (f"images{whose} kept on the GPU after their first reading "
                            f"({capacity * ps.box * ps.box * 4 / 1024**3:.2f} GiB)")

    def load_reference(self, path: Path) -> np.ndarray:
        return load_reference(path, self.N, self.apix, getattr(self.p, "trust_ref_size", False))

    def initial_sigma2(self) -> np.ndarray:
        """(G, N/2+1) initial noise spectra per optics group from up to 1000 particles each (NORM_CHECK_IMAGES: the
        images whose background RELION's normalisation check looks at, whose statistics are kept for it)."""
        out = np.zeros((self.ps.n_optics_groups, self.N // 2 + 1))
        stats = []
        for g in range(self.ps.n_optics_groups):
            rows = np.flatnonzero(self.ps.optics_group == g)[:NORM_CHECK_IMAGES]
            imgs = self.be.asarray(self.ps.images(rows))
            out[g] = initial_noise_spectrum(imgs, self.mask_r, self.p.zero_mask, MASK_EDGE)
            stats.append((rows, *(to_host(a) for a in background_stats(imgs, self.mask_r))))
        self._background = stats
        return out

    def background_stats(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, mean, stddev) of the particle backgrounds that the normalisation check judges (io/particle_images
        norm_check_rows: up to NORM_CHECK_IMAGES per optics group), in row order: those initial_sigma2 measured on
        the images it read, else measured here."""
        stats = getattr(self, "_background", None)
        if stats is None:
            rows = norm_check_rows(self.ps.optics_group)
            imgs = self.be.asarray(self.ps.images(rows))
            stats = [(rows, *(to_host(a) for a in background_stats(imgs, self.mask_r)))]
        rows, mean, std = (np.concatenate(c) for c in zip(*stats, strict=True))
        order = np.argsort(rows, kind="stable")
        return rows[order], mean[order], std[order]

    def accumulators(self, current_size: int):
        """A BackProjectorStack of K classes for one half (refine3d overrides: one BackProjector)."""
        return BackProjectorStack(self.model.n_classes, self.N, self.p.pad, current_size / 2, ndim=self.ndim,
                                  xp=self.be.xp, dtype=np.float64)

    def expectation(self, it: Iteration) -> Iterator:
        """The E-step of every half: prepared references, memory plan, batches of particles; fills it.sums and
        it.accumulators and updates the particles' hidden variables."""
        xp, N, K = self.be.xp, self.N, self.model.n_classes
        smp = it.sampling
        pix_c, pix_f = pixel_set(N, it.coarse_size, xp), pixel_set(N, it.current_size, xp)
        it.old_angles, it.old_offsets = self.ps.angles.copy(), self.ps.offsets_px.copy()
        it.old_classes = self.ps.classes.copy()
        n_dirs = getattr(smp, "n_dirs", 1)
        frefs = it.references = self.prepared_references(it.current_size)
        memory_mark("E-step: references prepared (when the sampling did not)")
        rows = (1 if self.own_orientation else
                smp.n_orient if it.local_sigma is None else local_search_rows(smp.angular_step, it.local_sigma))
        it.plan = plan_memory(self.budget_bytes(), box=N, ndim=self.ndim, pad=self.p.pad,
                              n_references=K * len(self.halves), rows_per_particle=K * rows,
                              translations=smp.translations.shape[0], coarse_pixels=pix_c.npix,
                              requested_batch=self.p.batch, adaptive_chunks=self.be.is_gpu,
                              largest_transient=self.job_memory.largest_transient,
                              gathered_slices=it.local_sigma is not None and not self.own_orientation)
        if not self._plan_shown:  # once per run, at its first iteration
            self._plan_shown = True
            yield Message("memory plan of the whole run (full image size):\n" + self.job_memory.table())
            yield Message(it.plan.describe())
            if self.comm.size > 1:
                yield Message(describe_owners(self.assignment(it), K, len(self.halves)))
        blocks = self.own_blocks(self.speeds)  # this rank's block of each half (by measured speed)
        if self.comm.size > 1:  # a rank's image store keeps this iteration's blocks
            self.ps.retain(np.concatenate(blocks))
        t0, read0, parts0 = time.time(), self.ps.seconds_reading, dict(self.ps.reading_parts)
        for h, mine in enumerate(blocks):
            acc = self.accumulators(it.current_size)
            memory_mark("E-step: accumulators")
            members = acc.members if hasattr(acc, "members") else [acc]
            sums = EStepSums(members, N // 2 + 1, self.ps.n_optics_groups, n_dirs,
                             n_scale_groups=len(self.model.scales))
            opts = self.expectation_options(it, h)
            setup_kw = dict(log_pdf_direction=opts.pop("log_pdf_direction", None),
                            sigma_offset_A=self.state.sigma_offset_A, cc=it.cc,
                            relion_offset_prior=opts.pop("relion_offset_prior", not self.p.angstrom_offset_prior),
                            class_offset_prior_A=opts.pop("class_offset_prior_A", None),
                            max_significants=opts.pop("max_significants", -1), coarse_tf32=not self.p.coarse_float32,
                            max_fine_bytes=it.plan.fine_chunk_bytes, max_union_bytes=it.plan.union_bytes,
                            scale_shells=self.scale_shells(frefs[h], pix_f, h), check_cancel=bound_check(),
                            aberrations=self.aberrations)
            stage = f"it {self.state.iteration:03d}" + (f" half {h + 1}" if len(self.halves) > 1 else "")
            it.particles_here += len(mine)
            n_halves = len(self.halves)
            done = 0
            for mag, member in self.magnification_groups:  # one setup per magnification (one without any)
                sub = mine if member is None else mine[member[mine]]
                if sub.size == 0:
                    continue
                setup = EStepSetup(frefs[h], smp, pix_c, pix_f, self.apix, self.be.asarray(self.model.sigma2[h]),
                                   mag=mag, **setup_kw)
                for ev in run_estep(self.ps, sub, setup, sums, self.be, mask_radius_px=self.mask_r,
                                    zero_mask=self.p.zero_mask, do_norm=getattr(self.p, "norm", False),
                                    norm_average=self.state.norm_average, scales=self.model.scales,
                                    batch=it.plan.batch, stage=stage, seed=self.p.random_seed + self.state.iteration,
                                    local_sigma=it.local_sigma, sym=getattr(self.p, "sym", "C1"),
                                    subpixel_offsets=getattr(self.p, "subpixel_offsets", False), **opts):
                    if isinstance(ev, Progress):  # the E-step is nearly all of an iteration's time
                        ev = replace(ev, done=done + ev.done, total=max(len(mine), 1),
                                     iteration=self.state.iteration, iterations=self.max_iterations(),
                                     iteration_fraction=(h + (done + ev.done) / max(len(mine), 1)) / n_halves)
                    yield ev
                done += sub.size
                del setup
            if self.comm.size > 1:  # timed apart: load imbalance, then the sums themselves
                t1 = time.time()
                self.comm.barrier()
                t2 = time.time()
                sum_estep(self.comm, sums, acc, self.reconstruction_owners(h, it))  # grids on their owners
                merge_particles(self.comm, self.ps, mine)
                it.seconds_waiting += t2 - t1
                it.seconds_summing += time.time() - t2
            memory_mark("E-step: end of the half (last batch's sums, MPI sums)")
            it.sums.append(sums)
            it.accumulators.append(acc)
        self._prepared = None  # it.references keeps them for the M-step; nothing else holds them after it
        it.seconds_estep = time.time() - t0
        it.seconds_reading = self.ps.seconds_reading - read0
        it.reading_parts = {k: v - parts0.get(k, 0.0) for k, v in self.ps.reading_parts.items()}

    def owned_kinds_of(self, it: Iteration) -> tuple[str, ...]:
        """The kinds of fixed work with one owner each in iteration ``it`` (owned_kinds)."""
        return self.owned_kinds

    @functools.cached_property
    def magnification_groups(self) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
        """(matrix, member) per distinct anisotropic magnification of the particles' optics groups (rlnMagMat):
        ``member`` a bool mask over the particles (None: all of them). [(None, None)] without any matrix."""
        if self.mags is None:
            return [(None, None)]
        groups: dict = {}  # matrix (as a tuple, None for none) -> (matrix, member)
        for g, m in enumerate(self.mags):
            key = None if m is None else tuple(np.asarray(m).ravel())
            mat, member = groups.get(key, (m, np.zeros(len(self.ps), bool)))
            groups[key] = (mat, member | (self.ps.optics_group == g))
        return list(groups.values())

    def assignment(self, it: Iteration) -> dict:
        """Which ranks do each item of an iteration's fixed work (runtime.distributed.assign)."""
        return assign(fixed_work(len(self.model.refs[0]), len(self.model.refs)), self.comm, self.owned_kinds_of(it))

    def reconstruction_owners(self, h: int, it: Iteration) -> list[int | None]:
        """The rank that sums and reconstructs each class of half h (None: every rank)."""
        return owners(self.assignment(it), "reconstruction", len(self.model.refs[h]), h)

    def my_classes(self, h: int, it: Iteration) -> tuple[int, int]:
        """(lo, hi): the block of classes of half h whose maps this rank makes in the M-step (lo == hi: none)."""
        mine = [k for k, o in enumerate(self.reconstruction_owners(h, it)) if o is None or o == self.comm.rank]
        return (mine[0], mine[-1] + 1) if mine else (0, 0)

    def gather_classes(self, h: int, part: list, it: Iteration) -> list:
        """Every class's M-step result of half h, in class order, on every rank: ``part`` holds this rank's
        (classes my_classes(h)); the owners' blocks are in rank order."""
        if all(o is None for o in self.reconstruction_owners(h, it)):
            return list(part)
        return [x for block in self.comm.allgather(list(part)) for x in block]

    def gather_class_maps(self, h: int, maps, it: Iteration) -> np.ndarray:
        """Every class's map of half h on the host, in class order, on every rank, from ``maps`` (this rank's
        block my_classes(h), NumPy or CuPy; None or empty for none): with owner ranks through gather_items."""
        if self.comm.size == 1 or all(o is None for o in self.reconstruction_owners(h, it)):
            return np.asarray(to_host(maps, pinned=maps is not None and self.pinned_maps(maps.nbytes)))
        lo, hi = self.my_classes(h, it)
        dtypes = self.comm.allgather(None if maps is None or hi <= lo else np.dtype(maps.dtype).str)
        dtype = np.dtype(next(d for d in dtypes if d is not None))
        shape = (len(self.model.refs[h]),) + tuple(self.model.refs[h][0].shape)
        return gather_items(self.comm, self.be.xp, shape, dtype, {lo + i: maps[i] for i in range(hi - lo)},
                             pinned=self.pinned_maps(int(np.prod(shape)) * dtype.itemsize))

    def warm_pinned_maps(self) -> None:
        """Page-locked blocks for the M-step's maps, made while the first E-step runs: nothing here (the
        classification jobs' class maps come back page-locked: em_classification.Classification)."""

    def pinned_maps(self, nbytes: int) -> bool:
        """Whether maps of ``nbytes`` come back from the GPU into page-locked memory (runtime.memory's policy)."""
        return self.be.is_gpu and pinned_maps_ok(nbytes, host_available_bytes(), self.comm.ranks_on_host)

    def prepared_references(self, current_size: int) -> list[list]:
        """The padded Fourier references of every half at this iteration's image size, prepared once per
        iteration (the accuracy estimate and the E-step share them)."""
        key = (self.state.iteration, current_size)
        if self._prepared is None or self._prepared[0] != key:
            K, H = len(self.model.refs[0]), len(self.model.refs)
            mine = owned(assign(fixed_work(K, H), self.comm), "prepare reference", self.comm)
            refs = []
            for h, half in enumerate(self.model.refs):  # 2D references in batches (prepare_references)
                ks = [k for k in range(len(half)) if (k, h) in mine]
                made = dict(zip(ks, prepare_references([half[k] for k in ks], self.p.pad, r_max=current_size / 2,
                                                       to_device=self.be.asarray), strict=True))
                refs.append([made.get(k) for k in range(len(half))])
            self._prepared = (key, refs)
        return self._prepared[1]

    def files_iteration(self, it: Iteration) -> int | None:
        """The iteration number in this iteration's file names (auto-refine's final files have none)."""
        return self.state.iteration

    def saved_scales(self, model) -> np.ndarray:
        """The group scale corrections of a model STAR (1 for every group when it has none)."""
        return model.scales if model.scales is not None else np.ones(len(self.ps.scale_group_names))

    def saved_direction_priors(self, model) -> np.ndarray | None:
        """(K, n_dirs) the orientation distribution of each class in a model STAR, normalised to 1 (RELION's of a
        class sums to its class distribution; ours keeps the two apart), or None when it has none."""
        return normalised_direction_priors(np.stack(model.pdf_orient)) if model.pdf_orient else None

    def optimiser_entries(self, it: Iteration, data: Path, models: list[Path]) -> dict:
        """The optimiser STAR of an iteration: RELION's labels, the saved options and the EMState."""
        opt = {"rlnOutputRootName": str(self.files.root), "rlnModelStarFile": models[0].name,
               "rlnExperimentalDataStarFile": data.name, "rlnCurrentIteration": self.state.iteration,
               "rlnHasConverged": int(it.final), "rlnNumberOfIterWithoutResolutionGain":
               self.state.nr_iter_wo_resol_gain, "rlnNumberOfIterWithoutChangingAssignments":
               self.state.nr_iter_wo_large_changes}
        if len(models) > 1:
            opt["rlnModelStarFile2"] = models[1].name
        opt.update(params_to_optimiser(self.p, saved_options(type(self.p))))
        opt.update(state_to_optimiser(self.state))
        return opt

    def save(self, fn, *args, **kwargs) -> None:
        """Hand a file write to the job's WriteQueue: ``fn(*args, **kwargs)`` runs on its thread, after the writes
        handed over before it. The arguments must be the job's own copies that nothing changes afterwards."""
        self.writer.put(fn, *args, **kwargs)

    def save_data_star(self, path: Path) -> Path:
        """The particles' current state as RELION's run_itNNN_data.star (their values copied now; the table is made
        and written by the WriteQueue, while the next iteration computes)."""
        self.save(write_data_star, path, particle_state(self.ps))
        return Path(path)

    def write_optimiser(self, it: Iteration, data: Path, models: list[Path]) -> Path:
        """The optimiser STAR (handed over after the files it names, so it appears after them)."""
        path = self.files.optimiser(self.files_iteration(it))
        self.writer.put_after_all(write_optimiser_star, path, self.optimiser_entries(it, data, models))
        return Path(path)

    def restore_state(self) -> list:
        """EMState, particles' classes and the model files of the iteration --continue names."""
        state_from_optimiser(self.state, self.opt)
        self.state.iteration = int(self.opt["rlnCurrentIteration"])
        base = Path(self.p.continue_from).parent
        names = [self.opt["rlnModelStarFile"]] + ([self.opt["rlnModelStarFile2"]] if self.needs_halves else [])
        models = [read_model_star(base / Path(str(n)).name) for n in names]
        self.data_vs_prior = models[0].ssnr  # the saved SSNR per class: --scale's shells, as uninterrupted
        if "rlnClassNumber" in self.ps.table.particles:
            self.ps.classes[:] = self.ps.table.particles["rlnClassNumber"].to_numpy(int) - 1
        return models


def run(job: EMJob) -> Iterator:
    """The iteration driver: RELION's steps in RELION's order, for any EMJob. Under MPI every rank runs it (the
    M-step too, on the summed accumulators); rank 0 alone writes the files and yields the events."""
    yield from root_events(job.comm, _run(job))


def _run(job: EMJob) -> Iterator:
    """_iterate with the thread's matrix products in TF32 for the job's duration when --tf32 asks for it, and on the
    CPU its NumPy projections and insertions in --j threads (compute/host_threads); both as before afterwards,
    also after a cancel or an error (other jobs may run in this worker thread next), while rank 0
    (the one that writes) holds the rootname's lock (jobs/common.holding_lock: a second job on the same --o is
    refused, naming the holder)."""
    yield from holding_lock(_with_thread_settings(job), job.files.root, job.name, "--o")


def _with_thread_settings(job: EMJob) -> Iterator:
    on = set_matmul_tf32(job.be, job.p.tf32)
    note = ("--tf32: the E-step's float32 matrix products run in TF32 on tensor cores" if on else
            "--tf32 has no effect on the CPU: NumPy computes in float32" if job.p.tf32 else None)
    # the NumPy path's projections and insertions in threads, this rank's share of the host's cores
    threads = 1 if job.be.is_gpu else (job.p.j or compute_threads(job.comm.ranks_on_host))
    try:
        with host_threads.using(threads):
            yield from _iterate(job, note)
    finally:
        if getattr(job, "ps", None) is not None:
            job.ps.stop_reading()
        if on:
            set_matmul_tf32(job.be, False)


def _iterate(job: EMJob, tf32_note: str | None) -> Iterator:
    """_loop with the job's WriteQueue drained at the end: the Finished event comes after the files are whole; a
    cancel or an error waits for the files already handed over (they are written whole) and is what is raised."""
    done, waited = False, 0.0
    try:
        yield from _loop(job, tf32_note)
        done = True
    finally:
        job.preload.finish()  # and count what the job compiled
        if done:
            t = time.time()
            try:
                job.writer.drain()  # the files' own time (closing the helper and its processes comes after)
            finally:
                waited = time.time() - t
                job.writer.close()
        else:
            try:
                job.writer.close()
            except Exception:  # noqa: BLE001 - the job's own error (or cancel) is the one to report
                pass
    if job.comm.is_root:
        if waited >= 0.05:  # the fixed cost after the last iteration (benchmarks/scaling.py reads it)
            slowest = job.writer.slowest_since(job.files_from)
            yield Message(f"  the last iteration's files were whole {waited:.2f} s after it"
                          + (f" (the slowest: {slowest})" if slowest else ""))
        line = job.preload.summary()
        if line:
            yield Message(line)
        yield job.finished()


def _read_ahead(job: EMJob, ahead_bytes: int | None = None) -> None:
    """This rank's images read from the disk in the E-step's order, in background threads, while the job starts and
    computes (jobs/read_ahead.py), at most ``ahead_bytes`` ahead (default: the memory policy's share of the host,
    and with the store on the GPU, the threads copy the blocks there within the room the plan leaves: READ_UPLOADS);
    a reader already running gets that bound."""
    ranks = job.comm.ranks_on_host
    upload = None
    if ahead_bytes is None:
        ahead_bytes = read_ahead_bytes(host_available_bytes(), ranks)
        on_device = device_read_ahead_bytes(ahead_bytes, job.room_after_images)
        if READ_UPLOADS and job.be.is_gpu and on_device:
            upload = thread_upload(job.be.device)  # None where the job's stream is CuPy's per-thread one
            ahead_bytes = on_device if upload is not None else ahead_bytes
    job.ps.read_ahead(np.concatenate(job.own_blocks()), read_threads(ranks), ahead_bytes, upload)


def _loop(job: EMJob, tf32_note: str | None) -> Iterator:
    root = job.comm.is_root
    if root and len(job.ps) >= HELPER_FROM_PARTICLES:  # the writer's helper starts beside the start-up (its close,
        # in _iterate, ends it however the job ends)
        job.writer.put(warm_writer, (write_data_star.__module__, write_optimiser_star.__module__), len(job.ps))
    if READ_AHEAD and job.reads_every_image:  # from the disk in the E-step's order while the job starts and computes;
        _read_ahead(job, READ_AHEAD_MIN_BYTES)  # little until the images' store is made: what the initial model
        # takes from the reader goes to the host's store, and from there to the GPU's at ~0.8 GB/s
    t = time.time()
    job.model = job.restore() if job.continued else job.initial_model()
    job.startup["the initial model"], t = time.time() - t, time.time()
    pad_notes = list(job.plan_job_memory())  # refused here, before any file is written, when it cannot fit
    job.startup["the memory plan"], t = time.time() - t, time.time()
    job.keep_images_on_device()
    job.startup["room for the images on the GPU"] = time.time() - t
    if READ_AHEAD and job.reads_every_image:  # the store's final home: the reader may go whole batches ahead (a
        _read_ahead(job)  # store made just now, on the GPU, not kept on the host, starts its reader here)
    job.warm_pinned_maps()
    refs = job.model.refs  # K maps per half: the first iteration's files must fit on the disk before it starts
    notes = prepare_output(job.files.folder, em_iteration_bytes(sum(len(r) for r in refs), job.N, job.ndim,
                                                                len(job.ps), job.p.i, len(refs)),
                           "one iteration's files") if root else []  # rank 0 alone writes (and cleans up)
    yield Started(job.name, job.files.folder, job.be.name, job.describe())
    if job.not_continued:
        yield Message(not_continued_line(type(job.p), job.not_continued), "warning")
    if tf32_note:
        yield Message(tf32_note)
    yield from notes
    yield from pad_notes
    yield Message(job.images_note)
    if root:
        job.files.folder.mkdir(parents=True, exist_ok=True)
        write_note(job.files.folder, job.name, job.p)
        yield Message(startup_line(time.time() - job.t_start, job.startup, job.state.iteration + 1))
    while True:
        job.state.iteration += 1
        it = yield from job.update_sampling()
        it.bytes_at_start = job.comm.bytes_sent
        memory_mark("sampling: the rest")
        yield from job.expectation(it)
        check_cancel()  # cancel points between the steps, never inside write(): its files stay whole
        t_m = time.time()
        job.maximization(it)
        if it.ssnr:  # the SSNR per class of this M-step: the next E-step's shells for --scale
            job.data_vs_prior = [np.asarray(x, np.float64) for x in it.ssnr]
        memory_mark("M-step")
        check_cancel()
        job.update_resolution(it)
        last = job.check_convergence(it)
        t_w = time.time()
        ranks = None
        if job.comm.size > 1:  # every rank: the report (rank 0) and the next E-step's shares by measured speed
            own = it.seconds_estep - it.seconds_waiting - it.seconds_summing
            ranks = job.comm.allgather((own, it.seconds_waiting, job.comm.bytes_sent - it.bytes_at_start,
                                        it.particles_here, it.seconds_reading))
            # shares follow the compute speed: reading an image happens once per rank that holds it, and a share
            # moved for a first iteration's disk time would only make the receiving rank read more
            work = [(r[3], r[0] - r[4]) for r in ranks]
            job.rank_work_recent = [*job.rank_work_recent, work][-REBALANCE_AFTER:]
            job.speeds = rank_speeds(job.speeds, job.rank_work_recent)
        if root:
            job.files_from = job.writer.handed  # this iteration's writes: those numbered from here
            yield from job.write(it)
            if job.writer.helper_note and not job.helper_noted:  # once: the files are written in this process
                job.helper_noted = True
                yield Message(f"  {job.writer.helper_note}; the files are written by this process", "warning")
        memory_mark("resolution, files")
        if root:
            yield Message(f"  iteration {job.state.iteration} timing: " + iteration_timing(it, t_w - t_m,
                                                                                          time.time() - t_w,
                                                                                          job.comm))
            if ranks:
                yield Message(f"  iteration {job.state.iteration} {rank_report(ranks)}")
            pool = device_pool_line(job.be)
            if pool:
                yield Message(f"  iteration {job.state.iteration}: {pool}")
        # Nothing of this iteration stays alive into the next one: its accumulators and prepared references
        # (it.accumulators, it.references) would otherwise be held while the next iteration prepares its own
        # references (the final iteration's peak, at the full image size; issue 21).
        del it
        trace = memory_trace_active()
        if trace is not None:
            memory_mark("end of iteration")
            line = trace.end_iteration(job.state.iteration)
            if root:
                yield Message(f"  iteration {job.state.iteration} {line}")
        if last:
            break
    free_cached_memory(job.be)


def startup_line(seconds: float, steps: dict[str, float], first: int = 1) -> str:
    """One line of the time from the job's start to its first iteration, ``first`` (after --continue, the one after
    the saved iteration; what benchmarks/scaling.py reads: the fixed cost that more GPUs do not shorten), with the
    steps that took 0.05 s or more."""
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in steps.items() if v >= 0.05)
    return f"  start-up: {seconds:.2f} s before iteration {first}" + (f" ({parts})" if parts else "")


def iteration_timing(it: Iteration, seconds_mstep: float, seconds_files: float, comm) -> str:
    """One line of where an iteration's time went (what benchmarks/scaling.py reads): the E-step, of it the
    wait for the slowest rank and the sums over ranks (MPI), the M-step with the resolution update, the files."""
    mpi = (f" (waiting for the slowest rank {it.seconds_waiting:.2f} s, sums over ranks {it.seconds_summing:.2f} s "
           f"through {comm.reduction_path})" if comm.size > 1 else "")
    reading = ""
    if it.seconds_reading >= 0.005:
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in it.reading_parts.items() if v >= 0.005)
        reading = f"; the E-step read images for {it.seconds_reading:.2f} s" + (f" ({parts})" if parts else "")
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in it.mstep_parts.items())
    return (f"E-step {it.seconds_estep:.2f} s{mpi}, M-step {seconds_mstep:.2f} s" + (f" ({parts})" if parts else "")
            + f", files {seconds_files:.2f} s{reading}")


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


def keep_images(ps: ParticleSet, asked: bool, available_bytes: int) -> str:
    """Keep the particle images in memory after their first reading (so that iterations 2, 3, ... read no files:
    0.8 s of a 3.2 s box-256 iteration on the H100 machine, issue 15) when --preread_images asks for it or they
    take at most a quarter of the available RAM; a line saying which. Refused before any work when asked for and
    larger than the available RAM."""
    need = ps.image_bytes
    size = f"{need / 1024**3:.2f} GiB"
    if asked and need > available_bytes:
        raise InputError(f"--preread_images: the {len(ps)} images need {size} but only "
                         f"{available_bytes / 1024**3:.2f} GiB of RAM is available; leave the option off to read "
                         f"them from the disk each iteration")
    if asked or need <= available_bytes // 4:
        ps.keep_images_in_memory()
        return f"images kept in memory after their first reading ({size})"
    return (f"images read from the disk each iteration ({size} would be more than a quarter of the "
            f"{available_bytes / 1024**3:.1f} GiB of RAM available; --preread_images keeps them anyway)")


def particle_mask(ps: ParticleSet, particle_diameter: float, edge_px: float) -> tuple[float, float]:
    """(diameter in Å, mask radius in pixels): --particle_diameter, or (box - edge) x pixel size when it is
    not positive; an error when it is larger than the box."""
    N, apix = ps.box, ps.pixel_size
    diameter = particle_diameter if particle_diameter > 0 else (N - edge_px) * apix
    if diameter > N * apix:
        raise InputError(f"--particle_diameter {diameter:g} Å is larger than the box ({N} px x {apix:.3f} Å = "
                         f"{N * apix:.1f} Å)")
    return diameter, diameter / (2 * apix)


def load_reference(path: Path, box: int, apix: float, trust_ref_size: bool) -> np.ndarray:
    """A cubic 3D reference map at the particles' box and pixel size (rescaled in Fourier space and cropped or
    padded only with --trust_ref_size)."""
    m = read_mrc(path)
    vol = np.asarray(m.data, np.float64)
    if vol.ndim != 3 or len(set(vol.shape)) != 1:
        raise InputError(f"the reference must be a cubic 3D map, got shape {vol.shape}", path=str(path))
    ref_apix = float(m.pixel_size) if m.pixel_size else apix
    matches = vol.shape[0] == box and abs(ref_apix - apix) <= 1e-3 * apix
    if not matches and not trust_ref_size:
        raise InputError(f"the reference has box {vol.shape[0]} at {ref_apix:.4f} Å/px but the particles have box "
                         f"{box} at {apix:.4f} Å/px; give --trust_ref_size to rescale it, or a matching map",
                         path=str(path))
    require_usable_map(vol, path, "reference map")  # NaN or blank: refused before any work, not a NaN result
    if matches:
        return vol
    n_new = int(round(vol.shape[0] * ref_apix / apix / 2)) * 2
    vol = fourier_resize(vol, n_new, 3) if n_new != vol.shape[0] else vol
    return fit_box(vol.astype(np.float32), box).astype(np.float64)


def reference_paths(ref: Path) -> list[Path]:
    """The reference map(s) of --ref: the map itself, or the rlnReferenceImage entries of a STAR file (e.g. a
    previous run's _model.star), resolved by the project-path rule."""
    if not is_star_path(ref):
        return [ref]
    table = next((b for b in read_star(ref).values() if isinstance(b, pd.DataFrame)
                  and "rlnReferenceImage" in b.columns), None)
    if table is None or not len(table):
        raise InputError("no rlnReferenceImage entries (expected a list of maps, e.g. a _model.star)",
                         path=str(ref), column="rlnReferenceImage")
    out = []
    for name in table["rlnReferenceImage"].astype(str):
        found, tried = project_path(name, ref)
        if found is None:
            raise InputError(f"reference map {name!r} listed in {ref} not found (looked in "
                             f"{', '.join(map(str, tried))})", path=str(ref), column="rlnReferenceImage")
        require_file(found, f"reference map listed in {ref}", (".mrc", ".map"))
        out.append(found)
    return out


def reference_images(model_star: Path) -> list[np.ndarray]:
    """The class references a model STAR lists (rlnReferenceImage: ``map.mrc`` or ``n@stack.mrcs``), float64."""
    model = read_model_star(model_star)
    out = []
    for name in model.classes["rlnReferenceImage"].astype(str):
        idx, stack = parse_image_name(name) if "@" in name else (0, name)
        found, tried = project_path(stack, model_star)
        if found is None:
            raise InputError(f"reference image {name!r} not found (looked in {', '.join(map(str, tried))})",
                             path=str(model_star), column="rlnReferenceImage")
        data = np.asarray(read_mrc(found).data, np.float64)
        out.append(data[idx] if "@" in name else data)  # parse_image_name counts from 0
    return out


# ----------------------------------------------------------------------------------------------------------
# The E-step over a set of particles
# ----------------------------------------------------------------------------------------------------------


def run_estep(ps: ParticleSet, rows: np.ndarray, setup: EStepSetup, sums: EStepSums, be: Backend, *,
              mask_radius_px: float, zero_mask: bool, do_norm: bool, norm_average: float, scales: np.ndarray,
              batch: int, local_sigma: float | None = None, sym: str = "C1", stage: str = "E-step", seed: int = 0,
              class_log_prior: np.ndarray | None = None, own_orientation: bool = False,
              subpixel_offsets: bool = False) -> Iterator:
    """E-step over ``rows`` of the particle set in batches (halving on out-of-memory); updates the particle
    state (angles, offsets, classes, pmax, ...) and ``sums``. Yields Progress / Message events.

    ``local_sigma`` (degrees): local searches around each particle's angles. ``own_orientation``
    (--skip_align): the setup's sampling is GivenOrientations with one row per particle of the set; each particle
    is compared, in every class, only at its own orientation and exact offset. ``subpixel_offsets``: every
    particle's translations are searched around its exact offset, not around the offset rounded to whole pixels
    (RELION's)."""
    n = rows.size
    sig2_host = to_host(setup.sigma2)
    K = len(setup.refs)
    split = []  # union groups of the batches whose union of significant orientations exceeded the plan's budget
    shrinks: list[str] = []  # what the fine passes ran smaller after out-of-memory (expectation_batch)

    def work(i0: int, i1: int) -> None:
        r = rows[i0:i1]
        imgs = be.asarray(ps.images(r))
        nf = (norm_average / ps.norm[r]) if do_norm else np.ones(r.size)
        noise = None if zero_mask else sig2_host[ps.optics_group[r]]  # each particle's own optics group
        prep = prepare_batch(imgs, nf, ps.offsets_px[r], mask_radius_px, MASK_EDGE, noise_sigma2=noise,
                             seed=seed, particle_ids=r, subpixel=own_orientation or subpixel_offsets)
        cand = lpc = None
        if local_sigma is not None:
            cand, lpc = local_candidates(ps.angles[r], setup.sampling, local_sigma, sym, K, xp=be.xp)
        elif own_orientation:
            R = setup.sampling.n_orient
            cand = r[:, None] + R * np.arange(K)[None, :]
            lpc = np.zeros(cand.shape)
        res = expectation_batch(setup, prep, ps.ctf_rows(r), ps.optics_group[r], scales[ps.scale_group[r]], sums,
                                candidates=cand, candidate_log_prior=lpc, scale_group_index=ps.scale_group[r],
                                class_log_prior=None if class_log_prior is None else class_log_prior[r])
        rot, tilt, psi = matrix_to_euler(res.matrices)
        ps.angles[r] = np.stack([rot, tilt, psi], axis=1)
        ps.offsets_px[r] = res.offsets_px
        ps.classes[r] = res.classes
        ps.pmax[r] = res.pmax
        ps.nr_significant[r] = res.nr_significant
        ps.log_likelihood[r] = res.log_likelihood
        ps.residual_power[r] = res.residual_power
        if res.union_groups > 1:
            split.append(res.union_groups)
        if res.memory_note:
            shrinks.append(res.memory_note)

    for item in batched_with_oom_retry(n, batch, work, be):
        if isinstance(item, Message):
            yield item
        else:
            if shrinks:
                yield Message(f"  {stage}: out of memory in the fine pass; it ran on smaller: " + "; ".join(shrinks),
                              "warning")
                shrinks.clear()
            yield Progress(item[0], item[1], stage)
    if split:
        yield Message(f"  {stage}: the union of significant orientations of {len(split)} batch(es) exceeded "
                      f"{setup.max_union_bytes / 1024**3:.2f} GiB; their fine passes ran in {sum(split)} groups "
                      f"of particles")
    setup.union_cache = None  # the kept union slices go with the half's last batch
    release_cached(be)

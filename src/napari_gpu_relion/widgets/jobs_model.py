"""The jobs panel's model (no Qt, no napari): the project's jobs, what each produced, and which next job can use it.

Like RELION's job list: every job folder ``<project>/<Type>/jobNNN/`` (RELION's layout: AutoPick, Extract,
Class2D, Select, Class3D, Refine3D, MaskCreate, PostProcess, Reconstruct, InitialModel, CtfRefine, LocalRes) is a
:class:`JobRecord` with its job type, folder, status, last iteration and outputs. Outputs are read from the files on
disk (the same for the plugin's own jobs, jobs run from the command line and jobs RELION itself ran), and a job
started from a dock in this napari session is known at once through :data:`SESSION` (the dock tells it,
widgets/job_widget.py), with its live state (queued, running, cancelling, finished, failed, cancelled) and its last
iteration.

Status of a job folder that this session did not start: RELION's exit files (``RELION_JOB_EXIT_SUCCESS``,
``_FAILURE``, ``_ABORTED``); otherwise "finished" when the job's final output is there, "running" when a file of
the folder changed in the last RUNNING_WINDOW seconds, else "unknown" (stopped, or still running elsewhere).

Chaining (:func:`offers`): each output has a kind (micrographs, coordinates, particles, classified particles, refined
particles, map, half map, mask, post-processing STAR, local-resolution map) and :data:`CONSUMERS` says which field of
which next job takes that kind: coordinates -> extraction, particles -> 2D/3D classification, 3D auto-refine,
reconstruction, classified particles -> class selection, refined particles (a finished auto-refine's or CTF
refinement's data STAR) -> CTF refinement, map -> 3D refinement/classification reference and mask creation, half map
-> post-processing, mask -> post-processing, post-processing STAR -> CTF refinement and local resolution. An
:class:`Offer` holds every value to put into the next job's dock, its output folder included (the next free
``<Type>/jobNNN``, numbered across the project as RELION does), and the companions the next job needs, found from
the job's own files (:func:`companions`): extraction gets the picked micrographs; CTF refinement from a refinement
gets the newest post-processing of that refinement (else its two half maps), from a post-processing the refinement's
particles, from a CTF refinement the same maps; local resolution from a post-processing gets its half maps, its mask
and its sharpening B-factor; a refinement after a CTF refinement gets the former refinement's map as reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..io.jobdir import iteration_data, iteration_model, job_number, note_commands, project_path
from ..io.star import read_star

__all__ = [
    "JOB_TYPES",
    "WIDGET_NAMES",
    "CONSUMERS",
    "Output",
    "JobRecord",
    "Offer",
    "SessionJobs",
    "SESSION",
    "scan_job_folder",
    "scan_project",
    "merge_records",
    "next_job_folder",
    "project_of",
    "offers",
    "ProjectScan",
    "scan_jobs",
    "companions",
    "newest_postprocess_of",
    "note_arguments",
    "count_running",
    "ACTIVE",
]

#: Our job name -> RELION's job-type folder (``<project>/<Type>/jobNNN``).
JOB_TYPES = {"autopick": "AutoPick", "extract": "Extract", "class2d": "Class2D", "select": "Select",
             "class3d": "Class3D", "refine3d": "Refine3D", "mask_create": "MaskCreate", "postprocess": "PostProcess",
             "reconstruct": "Reconstruct", "initial_model": "InitialModel", "ctf_refine": "CtfRefine",
             "local_resolution": "LocalRes"}
_JOB_OF_TYPE = {v.lower(): k for k, v in JOB_TYPES.items()}
#: Our job name -> its dock's name in napari.yaml (what *Plugins > GPU RELION* lists).
WIDGET_NAMES = {"autopick": "Auto-picking", "extract": "Particle extraction", "class2d": "2D classification",
                "select": "Class selection", "class3d": "3D classification", "refine3d": "3D auto-refine",
                "mask_create": "Mask creation", "postprocess": "Post-process", "reconstruct": "Reconstruct",
                "initial_model": "3D initial model", "ctf_refine": "CTF refinement",
                "local_resolution": "Local resolution"}
#: RELION's program names (in a note.txt) -> our job name.
_PROGRAMS = {"relion_autopick": "autopick", "relion_preprocess": "extract", "relion_refine": None,
             "relion_postprocess": "postprocess", "relion_mask_create": "mask_create",
             "relion_reconstruct": "reconstruct", "relion_ctf_refine": "ctf_refine"}

#: Seconds since a file of a folder changed within which a job without an exit file counts as running.
RUNNING_WINDOW = 600.0
#: RELION's exit files -> status.
EXIT_FILES = {"RELION_JOB_EXIT_SUCCESS": "finished", "RELION_JOB_EXIT_FAILURE": "failed",
              "RELION_JOB_EXIT_ABORTED": "cancelled"}

# output kinds
MICROGRAPHS = "micrographs"
COORDINATES = "coordinates"
PARTICLES = "particles"
CLASSIFIED = "classified particles"
MAP = "map"
HALF_MAP = "half map"
MASK = "mask"
REFINED = "refined particles"  # a finished refinement's particles (poses, both halves): CTF refinement's input
POSTPROCESSED = "post-processing"  # postprocess.star: its half maps, mask, FSC and B-factor
LOCRES = "local resolution"  # relion_locres.mrc (Å per voxel): shown, taken by no job

#: (output kind, next job, field of its Params): which next job takes which output.
CONSUMERS: tuple[tuple[str, str, str], ...] = (
    (COORDINATES, "extract", "coord_list"),
    (MICROGRAPHS, "autopick", "i"),
    (MICROGRAPHS, "extract", "i"),
    (PARTICLES, "class2d", "i"),
    (PARTICLES, "class3d", "i"),
    (PARTICLES, "refine3d", "i"),
    (PARTICLES, "reconstruct", "i"),
    (PARTICLES, "initial_model", "i"),
    (CLASSIFIED, "select", "i"),
    (CLASSIFIED, "class3d", "i"),
    (CLASSIFIED, "refine3d", "i"),
    (MAP, "refine3d", "ref"),
    (MAP, "class3d", "ref"),
    (MAP, "mask_create", "i"),
    (HALF_MAP, "postprocess", "i"),
    (MASK, "postprocess", "mask"),
    (REFINED, "ctf_refine", "i"),
    (POSTPROCESSED, "ctf_refine", "f"),
    (POSTPROCESSED, "local_resolution", "i"),
)

#: How each job's output field is filled for a new job folder: a folder, or a file in it.
_OUTPUT_FIELD = {"autopick": ("odir", None), "extract": ("o", None), "class2d": ("o", None), "class3d": ("o", None),
                 "refine3d": ("o", None), "postprocess": ("o", None), "select": ("o", "particles.star"),
                 "mask_create": ("o", "mask.mrc"), "reconstruct": ("o", "reconstruct.mrc"),
                 "initial_model": ("o", None), "ctf_refine": ("o", None), "local_resolution": ("o", None)}


@dataclass(frozen=True)
class Output:
    """One thing a job produced: its kind (what a next job may take), the file, and a label for people."""

    kind: str
    path: Path
    label: str


@dataclass(frozen=True)
class JobRecord:
    """One job of the list: job name (ours: "class2d"), folder, status, last iteration (None: not iterative or none
    yet), outputs, and the inputs it was run with (flag -> value, from the session or its note.txt)."""

    job: str
    folder: Path
    status: str = "unknown"
    iteration: int | None = None
    outputs: tuple[Output, ...] = ()
    inputs: dict[str, str] = field(default_factory=dict)
    session: bool = False  # started from a dock of this napari session

    @property
    def job_type(self) -> str:
        """RELION's name of the job type ("Class2D")."""
        return JOB_TYPES.get(self.job, self.job)

    @property
    def number(self) -> int | None:
        """The NNN of a ``jobNNN`` folder."""
        return job_number(self.folder)

    def display_folder(self, project: Path | None = None) -> str:
        """The folder relative to the project (``Class2D/job003``) when it lies inside it."""
        if project is not None:
            with contextlib.suppress(ValueError):
                return str(self.folder.resolve().relative_to(Path(project).resolve()))
        return str(self.folder)


@dataclass(frozen=True)
class Offer:
    """Use ``output`` of a job as input of ``job`` (our name): ``values`` are the Params fields to set in its dock
    (paths as str; the output folder included)."""

    job: str
    output: Output
    values: dict[str, str]

    @property
    def label(self) -> str:
        return f"{WIDGET_NAMES.get(self.job, self.job)} ← {self.output.label}"


# ----------------------------------------------------------------------------------------------------------
# note.txt


def note_arguments(folder: Path) -> tuple[str | None, dict[str, str]]:
    """(job name, {flag: value}) of the last command in ``folder/note.txt`` (io/jobdir.note_commands; RELION's
    programs as the job they stand for); (None, {}) without a readable note. Flags without a value map to ""."""
    commands = note_commands(folder)
    if not commands:
        return None, {}
    last = commands[-1]
    program = last.program
    job = _PROGRAMS.get(program) if program is not None and program.startswith("relion_") else program
    if job == "postprocess" and "--locres" in last.args:  # RELION's LocalRes job runs relion_postprocess --locres
        job = "local_resolution"
    return job, dict(last.args)


def _input_path(value: str, folder: Path) -> Path:
    """A path from a note.txt: absolute stands; relative is relative to the project (two levels above a
    ``<Type>/jobNNN`` folder), else to the folder itself, else to the current folder (the first that exists)."""
    p = Path(value)
    if p.is_absolute():
        return p
    project = folder.parent.parent if job_number(folder) is not None else folder
    for base in (project, folder, Path.cwd()):  # RELION runs in the project; a command line may have run elsewhere
        if (base / p).exists():
            return base / p
    return project / p


# ----------------------------------------------------------------------------------------------------------
# One job folder on disk


def _job_of_folder(folder: Path) -> str | None:
    """Our job name from ``<Type>/jobNNN`` (RELION's type folder), else from its note.txt."""
    job = _JOB_OF_TYPE.get(folder.parent.name.lower())
    if job is not None:
        return job
    noted, args = note_arguments(folder)
    if noted in JOB_TYPES:
        return noted
    if noted is None and args:  # relion_refine: 2D, 3D classification or auto-refine
        if "--auto_refine" in args:
            return "refine3d"
        return "class3d" if "--ref" in args else "class2d"
    return None


def _iterations(folder: Path, names: list[str]) -> tuple[str | None, list[int]]:
    """(rootname, iterations with a model STAR) of a relion_refine-style folder."""
    roots: dict[str, set[int]] = {}
    for name in names:
        f = iteration_model(name)
        if f is not None:
            roots.setdefault(f.root, set()).add(f.iteration)
    if not roots:  # only the final files of an auto-refine (the iterations deleted)
        finals = [n[: -len("_model.star")] for n in names if n.endswith("_model.star")]
        return (finals[0] if finals else None), []
    root = max(roots, key=lambda r: (max(roots[r]), r == "run"))
    return root, sorted(roots[root])


def _newest_data(folder: Path, names: list[str], root: str | None) -> Path | None:
    """The final data STAR, else that of the newest iteration."""
    if root is not None and f"{root}_data.star" in names:
        return folder / f"{root}_data.star"
    found = sorted((f.iteration, n) for n in names if (f := iteration_data(n)) is not None
                   and (root is None or f.root == root))
    return folder / found[-1][1] if found else None


def _outputs(job: str, folder: Path, names: list[str], inputs: dict[str, str]) -> tuple[list[Output], int | None,
                                                                                        bool]:
    """(outputs, last iteration, final output present) of a job folder from its files."""
    out: list[Output] = []
    have = set(names)
    iteration = None
    final = False

    def add(kind: str, name: str, label: str) -> None:
        if name in have:
            out.append(Output(kind, folder / name, label))

    if job == "autopick":
        add(COORDINATES, "autopick.star", "coordinates (autopick.star)")
        final = "autopick.star" in have
        if (folder / "edited_picks" / "autopick.star").is_file():
            out.insert(0, Output(COORDINATES, folder / "edited_picks" / "autopick.star",
                                 "edited picks (edited_picks/autopick.star)"))
        if inputs.get("--i"):
            out.append(Output(MICROGRAPHS, _input_path(inputs["--i"], folder), "micrographs (its input)"))
    elif job == "extract":
        add(PARTICLES, "particles.star", "particles (particles.star)")
        final = "particles.star" in have
    elif job == "initial_model":
        root, its = _iterations(folder, names)
        iteration = its[-1] if its else None
        if root is not None:
            final = f"{root}_class001.mrc" in have
            add(MAP, "initial_model.mrc", "initial model on the symmetry axes, symmetrised (initial_model.mrc)")
            add(MAP, f"{root}_class001.mrc", "initial model")
    elif job in ("class2d", "class3d", "refine3d"):
        root, its = _iterations(folder, names)
        iteration = its[-1] if its else None
        data = _newest_data(folder, names, root)
        if job == "refine3d" and root is not None:
            final = f"{root}_model.star" in have
            add(HALF_MAP, f"{root}_half1_class001_unfil.mrc", "half map 1 (unfiltered)")
            add(MAP, f"{root}_class001.mrc", "refined map")
            if data is not None:
                out.append(Output(PARTICLES, data, f"particles with angles ({data.name})"))
            if final:  # CTF refinement takes the final poses only, as RELION's
                add(REFINED, f"{root}_data.star", f"refined particles ({root}_data.star)")
        elif root is not None:
            wanted = inputs.get("--iter")
            final = wanted is not None and wanted.isdigit() and iteration is not None and iteration >= int(wanted)
            if data is not None:
                out.append(Output(CLASSIFIED, data, f"classified particles ({data.name})"))
            add(PARTICLES, "selected_particles.star", "selected classes (selected_particles.star)")
            if job == "class3d" and iteration is not None:
                for name in sorted(n for n in names if n.startswith(f"{root}_it{iteration:03d}_class")
                                   and n.endswith(".mrc")):
                    out.append(Output(MAP, folder / name, f"class map {name}"))
    elif job == "select":
        stars = [n for n in names if n.endswith(".star")]
        for name in sorted(stars, key=lambda n: n != "particles.star"):
            out.append(Output(PARTICLES, folder / name, f"selected particles ({name})"))
        final = bool(stars)
    elif job == "postprocess":
        add(MAP, "postprocess_masked.mrc", "sharpened masked map")
        add(MAP, "postprocess.mrc", "sharpened map")
        add(POSTPROCESSED, "postprocess.star", "postprocess.star")
        final = "postprocess.star" in have
    elif job == "ctf_refine":
        add(PARTICLES, "particles_ctf_refine.star", "CTF-refined particles (particles_ctf_refine.star)")
        add(REFINED, "particles_ctf_refine.star", "CTF-refined particles (particles_ctf_refine.star)")
        final = "particles_ctf_refine.star" in have
    elif job == "local_resolution":
        for name in sorted(n for n in names if n.endswith("_locres_filtered.mrc")):
            out.append(Output(MAP, folder / name, f"locally filtered map ({name})"))
        for name in sorted(n for n in names if n.endswith("_locres.mrc")):
            out.append(Output(LOCRES, folder / name, f"local resolution ({name})"))
        final = any(n.endswith("_locres.mrc") for n in names)
    elif job == "mask_create":
        for name in sorted(n for n in names if n.endswith(".mrc")):
            out.append(Output(MASK, folder / name, f"mask ({name})"))
        final = bool(out)
    elif job == "reconstruct":
        for name in sorted(n for n in names if n.endswith(".mrc")):
            out.append(Output(MAP, folder / name, f"map ({name})"))
        final = bool(out)
    return out, iteration, final


def _disk_status(folder: Path, names: list[str], final: bool, now: float) -> str:
    for name, status in EXIT_FILES.items():
        if name in names:
            return status
    if final:
        return "finished"
    newest = 0.0
    for name in names:
        with contextlib.suppress(OSError):
            newest = max(newest, (folder / name).stat().st_mtime)
    return "running" if names and now - newest < RUNNING_WINDOW else "unknown"


def scan_job_folder(folder: str | os.PathLike, job: str | None = None, now: float | None = None) -> JobRecord | None:
    """The record of one job folder from its files (None if the job type is not known)."""
    folder = Path(folder)
    job = job or _job_of_folder(folder)
    if job is None or not folder.is_dir():
        return None
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    _, args = note_arguments(folder)
    outputs, iteration, final = _outputs(job, folder, names, args)
    status = _disk_status(folder, names, final, time.time() if now is None else now)
    return JobRecord(job, folder, status, iteration, tuple(outputs), args)


def scan_project(project: str | os.PathLike, now: float | None = None) -> list[JobRecord]:
    """Every ``<project>/<Type>/jobNNN`` folder of a known job type, by job number."""
    project = Path(project)
    records: list[JobRecord] = []
    for job, type_dir in JOB_TYPES.items():
        base = project / type_dir
        if not base.is_dir():
            continue
        try:
            entries = os.listdir(base)
        except OSError:
            continue
        for entry in entries:
            if job_number(entry) is not None and (base / entry).is_dir():
                record = scan_job_folder(base / entry, job, now)
                if record is not None:
                    records.append(record)
    return sorted(records, key=lambda r: (r.number if r.number is not None else 10**9, str(r.folder)))


#: Statuses of a job that has not stopped.
ACTIVE = ("running", "queued", "cancelling")


def count_running(records: Iterable[JobRecord]) -> int:
    """Jobs not stopped (running, queued, cancelling), each job folder counted once."""
    folders = set()
    for rec in records:
        if rec.status in ACTIVE:
            try:
                folders.add(rec.folder.resolve())
            except OSError:
                folders.add(rec.folder)
    return len(folders)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


def merge_records(disk: Iterable[JobRecord], session: Iterable[JobRecord]) -> list[JobRecord]:
    """The project's jobs: a job of this session replaces the disk record of its folder (its status and iteration
    are live; the outputs are the union, files on disk first)."""
    merged = list(disk)
    for rec in session:
        for k, old in enumerate(merged):
            if _same(old.folder, rec.folder):
                seen = {o.path for o in old.outputs}
                outputs = old.outputs + tuple(o for o in rec.outputs if o.path not in seen)
                iteration = rec.iteration if rec.iteration is not None else old.iteration
                merged[k] = replace(rec, outputs=outputs, iteration=iteration, inputs={**old.inputs, **rec.inputs})
                break
        else:
            merged.append(rec)
    return merged


# ----------------------------------------------------------------------------------------------------------
# Chaining


def project_of(folder: str | os.PathLike) -> Path | None:
    """``<project>`` of a job folder ``<project>/<Type>/jobNNN`` (a job type of ours or RELION's: a capitalised
    name), None for a folder not laid out that way."""
    folder = Path(folder).expanduser().absolute()
    if job_number(folder) is not None and folder.parent.name[:1].isupper():
        return folder.parent.parent
    return None


def next_job_folder(project: str | os.PathLike, job: str, taken: Iterable[Path] = ()) -> Path:
    """``<project>/<Type>/jobNNN`` for a new ``job``: NNN one above the highest job number in the project (RELION
    numbers jobs across all types) and above those of ``taken`` folders."""
    project = Path(project)
    highest = 0
    for type_dir in set(JOB_TYPES.values()) | {p.name for p in _subdirs(project)}:
        for entry in _subdirs(project / type_dir):
            n = job_number(entry)
            if n is not None:
                highest = max(highest, n)
    for folder in taken:
        n = job_number(folder)
        if n is not None:
            highest = max(highest, n)
    return project / JOB_TYPES.get(job, job) / f"job{highest + 1:03d}"


def _subdirs(folder: Path) -> list[Path]:
    try:
        return [folder / e for e in os.listdir(folder) if (folder / e).is_dir()]
    except OSError:
        return []


def _output_value(job: str, folder: Path) -> tuple[str, str]:
    name, file = _OUTPUT_FIELD[job]
    return name, str(folder / file) if file else str(folder)


def offers(record: JobRecord, project: str | os.PathLike | None = None, taken: Iterable[Path] = ()) -> list[Offer]:
    """What the next jobs can take from ``record``'s outputs, one Offer per (output, next job). Each fills the
    field that takes the output, the companions it needs (:func:`companions`) and a new output folder in
    ``project`` (default: two levels above the job folder). An output whose next job cannot be given what it
    needs (a post-processing STAR that names no readable half map, for local resolution) offers nothing."""
    if project is None:
        project = record.folder.parent.parent if record.number is not None else record.folder.parent
    result: list[Offer] = []
    for output in record.outputs:
        for kind, job, name in CONSUMERS:
            if kind != output.kind:
                continue
            extra = companions(record, output, job, Path(project))
            if extra is None:
                continue
            values = {name: str(output.path), **extra}
            if kind != MASK:  # a mask completes a post-processing whose half map is already set
                out_name, out_value = _output_value(job, next_job_folder(project, job, taken))
                values[out_name] = out_value
            result.append(Offer(job, output, values))
    return result


@dataclass(frozen=True)
class ProjectScan:
    """One scan for the Jobs dock: the jobs, and the offers of the job of ``folder`` (the one selected when the scan
    began; None: none selected, or not listed)."""

    records: list[JobRecord]
    folder: Path | None = None
    offers: tuple[Offer, ...] = ()


def scan_jobs(project: Path | None, selected: Path | None = None) -> ProjectScan:
    """The Jobs dock's list: the project's job folders and this session's jobs, and the offers of the job of folder
    ``selected`` (:func:`offers`, new folders numbered after every listed job). All of the dock's reading of folders
    and files: call it in a worker thread."""
    disk = scan_project(project) if project is not None and project.is_dir() else []
    records = merge_records(disk, SESSION.records())
    chosen = next((r for r in records if selected is not None and r.folder == selected), None)
    if chosen is None:
        return ProjectScan(records)
    return ProjectScan(records, chosen.folder, tuple(offers(chosen, project, [r.folder for r in records])))


def companions(record: JobRecord, output: Output, job: str, project: Path) -> dict[str, str] | None:
    """The other fields of next job ``job`` that ``record`` says how to fill when ``output`` goes into it (they may
    replace the consumer's own field: local resolution takes the half map a post-processing STAR names, not the
    STAR; "" empties a field, so that a value the dock remembers from another job does not stay); None when the job
    cannot be given what it needs.

    * extraction of picks: the micrographs that were picked;
    * CTF refinement of a refinement's particles: the newest post-processing of that refinement (``--f``: its half
      maps, mask and FSC weighting, RELION's inputs), else the refinement's two half maps (``--m1``, ``--m2``); of
      a CTF refinement's particles (a second round): the maps that round used; from a post-processing STAR: the
      particles of the refinement whose half maps it post-processed;
    * local resolution from a post-processing STAR: its half maps, its mask and its sharpening B-factor (the
      locally filtered map is sharpened as the post-processed one);
    * a refinement of a CTF refinement's particles: the map of the refinement they came from as reference."""
    values: dict[str, str] = {}
    if job == "extract" and output.kind == COORDINATES:
        micrographs = next((o for o in record.outputs if o.kind == MICROGRAPHS), None)
        if micrographs is not None:
            values["i"] = str(micrographs.path)
    elif job == "ctf_refine" and output.kind == REFINED:
        if record.job == "refine3d":
            star = newest_postprocess_of(record.folder, project)
            halves = _half_maps(record.folder) if star is None else None
            if star is not None:
                values.update(f=str(star), m1="", m2="", mask="")  # the STAR's half maps and mask
            elif halves is not None:
                values.update(f="", m1=str(halves[0]), m2=str(halves[1]))
        elif record.job == "ctf_refine":
            for flag in ("--f", "--m1", "--m2", "--mask"):
                given = record.inputs.get(flag)
                values[flag[2:]] = str(_input_path(given, record.folder)) if given else ""
    elif job == "ctf_refine" and output.kind == POSTPROCESSED:
        half1 = _postprocess_file(output.path, "rlnUnfilteredMapHalf1")
        data = _final_data(half1.parent) if half1 is not None else None
        if data is not None:
            values["i"] = str(data)
    elif job == "local_resolution" and output.kind == POSTPROCESSED:
        half1 = _postprocess_file(output.path, "rlnUnfilteredMapHalf1")
        if half1 is None:
            return None
        half2 = _postprocess_file(output.path, "rlnUnfilteredMapHalf2")
        mask = _postprocess_file(output.path, "rlnMaskName")
        values.update(i=str(half1), i2="" if half2 is None else str(half2), mask="" if mask is None else str(mask))
        bfactor = _postprocess_general(output.path).get("rlnBfactorUsedForSharpening")
        with contextlib.suppress(TypeError, ValueError):
            values["adhoc_bfac"] = f"{float(bfactor):.2f}"
    elif job == "refine3d" and output.kind == PARTICLES and record.job == "ctf_refine":
        reference = _ctf_refine_reference(record)
        if reference is not None:
            values["ref"] = str(reference)
    return values


def _postprocess_general(star: Path) -> dict[str, Any]:
    """The ``data_general`` block of a post-processing STAR ({} when it cannot be read). Read once per version of
    the file: the Jobs dock asks for its offers after every poll of the project, several labels each time."""
    try:
        st = Path(star).stat()
    except OSError:
        return {}
    return dict(_general_block(str(star), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=64)
def _general_block(star: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """_postprocess_general of one version (path, modification time, size) of a STAR file."""
    try:
        general = read_star(Path(star)).get("general")
    except (InputError, OSError, ValueError):
        return {}
    if general is not None and hasattr(general, "iloc"):  # a loop block of one row
        general = general.iloc[0].to_dict() if len(general) else {}
    return dict(general) if isinstance(general, dict) else {}


def _postprocess_file(star: Path, label: str) -> Path | None:
    """The existing file that a post-processing STAR's ``label`` names (RELION's project-relative paths)."""
    name = _postprocess_general(star).get(label)
    if name is None or not str(name).strip():
        return None
    found, _ = project_path(str(name), star)
    return found


def newest_postprocess_of(refine_folder: Path, project: Path) -> Path | None:
    """The postprocess.star of the project's newest PostProcess job whose half map 1 lies in ``refine_folder``."""
    base = project / JOB_TYPES["postprocess"]
    folders = sorted((f for f in _subdirs(base) if job_number(f) is not None), key=job_number, reverse=True)
    for folder in folders:
        star = folder / "postprocess.star"
        if star.is_file():
            half1 = _postprocess_file(star, "rlnUnfilteredMapHalf1")
            if half1 is not None and _same(half1.parent, refine_folder):
                return star
    return None


def _half_maps(refine_folder: Path) -> tuple[Path, Path] | None:
    """The final unfiltered half maps of a refinement folder (both must be there)."""
    try:
        names = set(os.listdir(refine_folder))
    except OSError:
        return None
    root, _ = _iterations(refine_folder, sorted(names))
    if root is None:
        return None
    halves = tuple(refine_folder / f"{root}_half{k}_class001_unfil.mrc" for k in (1, 2))
    return halves if all(h.name in names for h in halves) else None


def _final_data(refine_folder: Path) -> Path | None:
    """A finished refinement's final data STAR (``run_data.star``), None for anything else."""
    try:
        names = sorted(os.listdir(refine_folder))
    except OSError:
        return None
    root, _ = _iterations(refine_folder, names)
    if root is None or f"{root}_model.star" not in names or f"{root}_data.star" not in names:
        return None
    return refine_folder / f"{root}_data.star"


def _ctf_refine_reference(record: JobRecord) -> Path | None:
    """The map of the refinement whose half maps a CTF refinement used (through its --f or --m1)."""
    half1 = None
    if record.inputs.get("--f"):
        half1 = _postprocess_file(_input_path(record.inputs["--f"], record.folder), "rlnUnfilteredMapHalf1")
    elif record.inputs.get("--m1"):
        half1 = _input_path(record.inputs["--m1"], record.folder)
    if half1 is None:
        return None
    folder = half1.parent
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    root, _ = _iterations(folder, names)
    return folder / f"{root}_class001.mrc" if root is not None and f"{root}_class001.mrc" in names else None


# ----------------------------------------------------------------------------------------------------------
# The jobs of this napari session


def _status_of(job: Any) -> str:
    state = getattr(job, "state", None)
    return str(getattr(state, "value", state)) if state is not None else "unknown"


#: Jobs whose ``--o`` is an output rootname in the job folder (relion_refine's ``<folder>/run``; local resolution's
#: ``<folder>/relion``, as RELION's LocalRes job), also where Params do not say so.
ROOTNAME_JOBS = ("class2d", "class3d", "refine3d", "initial_model", "local_resolution")


def _is_rootname(params: Any, name: str) -> bool:
    """True if field ``name`` of ``params`` is a relion_refine output rootname (``param(..., mode="root")``)."""
    with contextlib.suppress(TypeError):
        for f in dataclasses.fields(params):
            if f.name == name:
                return f.metadata.get("mode") == "root"
    return False


def output_folder(job: str, params: Any) -> Path | None:
    """The folder a job writes to, from its Params (``--o`` rootname, folder or file; autopick's ``--odir``): the
    folder of a rootname (``InitialModel/job005/run`` -> ``InitialModel/job005``, never a job of its own)."""
    for name in ("odir", "o"):
        value = getattr(params, name, None)
        if value is None:
            continue
        p = Path(value)
        if job in ROOTNAME_JOBS or _is_rootname(params, name) or p.suffix:
            return p.parent  # a rootname (<folder>/run) or a file
        return p
    return None


@dataclass(eq=False)
class _SessionJob:
    job: str
    folder: Path
    runner_job: Any
    params: Any
    widget: Any  # weakref.ref to the dock widget, or None
    iteration: int | None = None
    outputs: dict[str, Path] = field(default_factory=dict)


class SessionJobs:
    """The jobs started from docks in this napari session (one registry per process, :data:`SESSION`).

    A job dock calls :meth:`started` when it submits a job; the registry follows the job's state, iterations and
    final outputs through the runner's Job (``state_callbacks``, ``on(event type, callback)``) and calls its
    listeners (:meth:`connect`, held weakly when they are bound methods) on every change."""

    def __init__(self) -> None:
        self._jobs: list[_SessionJob] = []
        self._listeners: list[Any] = []

    def started(self, widget: Any, params: Any, job: Any) -> None:
        """A dock submitted ``job`` (the runner's Job) with ``params``."""
        name = getattr(widget, "job_name", None) or getattr(job, "name", "job")
        folder = output_folder(name, params)
        if folder is None:
            return
        entry = _SessionJob(name, folder, job, params, weakref.ref(widget) if widget is not None else None)
        self._jobs = [e for e in self._jobs if not _same(e.folder, folder) or e.job != name]
        self._jobs.append(entry)
        from ..events import Finished, IterationFinished  # no Qt: the job events

        if hasattr(job, "state_callbacks"):
            job.state_callbacks.append(self._changed)
        if hasattr(job, "on"):
            job.on(IterationFinished, functools.partial(self._iteration, entry))
            job.on(Finished, functools.partial(self._finished, entry))
        self._notify()

    def _iteration(self, entry: _SessionJob, event: Any) -> None:
        entry.iteration = int(event.iteration)
        self._notify()

    def _finished(self, entry: _SessionJob, event: Any) -> None:
        entry.outputs = {k: Path(v) for k, v in (event.outputs or {}).items()}
        self._notify()

    def _changed(self, _job: Any) -> None:
        self._notify()

    def connect(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` after every change (a bound method is held weakly)."""
        import inspect

        self._listeners.append(weakref.WeakMethod(callback) if inspect.ismethod(callback) else (lambda: callback))

    def _notify(self) -> None:
        alive = []
        for ref in self._listeners:
            callback = ref()
            if callback is None:
                continue
            alive.append(ref)
            with contextlib.suppress(Exception):
                callback()
        self._listeners = alive

    def latest_project(self) -> Path | None:
        """The project folder of the newest session job laid out as ``<project>/<Type>/jobNNN`` (None if none)."""
        for e in reversed(self._jobs):
            project = project_of(e.folder)
            if project is not None:
                return project
        return None

    def widget_of(self, folder: Path) -> Any:
        """The dock widget that ran the job of ``folder`` (None when it is gone)."""
        for entry in reversed(self._jobs):
            if _same(entry.folder, folder) and entry.widget is not None:
                return entry.widget()
        return None

    def records(self) -> list[JobRecord]:
        """The session's jobs as records (status from the runner; iteration from its events; files on disk)."""
        out = []
        for e in self._jobs:
            disk = scan_job_folder(e.folder, e.job) if e.folder.is_dir() else None
            outputs = disk.outputs if disk is not None else ()
            inputs = {f"--{k}": str(v) for k, v in vars(e.params).items() if v is not None} if hasattr(
                e.params, "__dict__") else {}
            if e.job == "autopick" and getattr(e.params, "i", None) is not None:  # as given, not as the note says
                outputs = tuple(o for o in outputs if o.kind != MICROGRAPHS) + (
                    Output(MICROGRAPHS, Path(e.params.i).expanduser().absolute(), "micrographs (its input)"),)
            iteration = e.iteration if e.iteration is not None else (disk.iteration if disk is not None else None)
            out.append(JobRecord(e.job, e.folder, _status_of(e.runner_job), iteration, outputs, inputs, True))
        return out

    def clear(self) -> None:
        """Forget every job (tests)."""
        self._jobs.clear()


#: The registry of this process's napari session.
SESSION = SessionJobs()

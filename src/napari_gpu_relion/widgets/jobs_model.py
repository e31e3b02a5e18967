"""The jobs panel's model (no Qt, no napari): the project's jobs, what each produced, and which next job can use it.

Like RELION's job list: every job folder ``<project>/<Type>/jobNNN/`` (RELION's layout: AutoPick, Extract,
Class2D, Select, Class3D, Refine3D, MaskCreate, PostProcess, Reconstruct) is a :class:`JobRecord` with its job
type, folder, status, last iteration and outputs. Outputs are read from the files on disk (the same for the
plugin's own jobs, jobs run from the command line and jobs RELION itself ran), and a job started from a dock in
this napari session is known at once through :data:`SESSION` (the dock tells it, widgets/job_widget.py), with its
live state (queued, running, cancelling, finished, failed, cancelled) and its last iteration.

Status of a job folder that this session did not start: RELION's exit files (``RELION_JOB_EXIT_SUCCESS``,
``_FAILURE``, ``_ABORTED``); otherwise "finished" when the job's final output is there, "running" when a file of
the folder changed in the last RUNNING_WINDOW seconds, else "unknown" (stopped, or still running elsewhere).

Chaining (:func:`offers`): each output has a kind (micrographs, coordinates, particles, classified particles, map,
half map, mask) and :data:`CONSUMERS` says which field of which next job takes that kind: coordinates ->
extraction, particles -> 2D/3D classification, 3D auto-refine, reconstruction, classified particles -> class
selection, map -> 3D refinement/classification reference and mask creation, half map -> post-processing, mask ->
post-processing. An :class:`Offer` holds every value to put into the next job's dock, its output folder included
(the next free ``<Type>/jobNNN``, numbered across the project as RELION does).
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

from ..io.jobdir import iteration_data, iteration_model, job_number, note_commands

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
    "note_arguments",
    "count_running",
    "ACTIVE",
]

#: Our job name -> RELION's job-type folder (``<project>/<Type>/jobNNN``).
JOB_TYPES = {"autopick": "AutoPick", "extract": "Extract", "class2d": "Class2D", "select": "Select",
             "class3d": "Class3D", "refine3d": "Refine3D", "mask_create": "MaskCreate", "postprocess": "PostProcess",
             "reconstruct": "Reconstruct", "initial_model": "InitialModel"}
_JOB_OF_TYPE = {v.lower(): k for k, v in JOB_TYPES.items()}
#: Our job name -> its dock's name in napari.yaml (what *Plugins > GPU RELION* lists).
WIDGET_NAMES = {"autopick": "Auto-picking", "extract": "Particle extraction", "class2d": "2D classification",
                "select": "Class selection", "class3d": "3D classification", "refine3d": "3D auto-refine",
                "mask_create": "Mask creation", "postprocess": "Post-process", "reconstruct": "Reconstruct",
                "initial_model": "3D initial model"}
#: RELION's program names (in a note.txt) -> our job name.
_PROGRAMS = {"relion_autopick": "autopick", "relion_preprocess": "extract", "relion_refine": None,
             "relion_postprocess": "postprocess", "relion_mask_create": "mask_create",
             "relion_reconstruct": "reconstruct"}

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
)

#: How each job's output field is filled for a new job folder: a folder, or a file in it.
_OUTPUT_FIELD = {"autopick": ("odir", None), "extract": ("o", None), "class2d": ("o", None), "class3d": ("o", None),
                 "refine3d": ("o", None), "postprocess": ("o", None), "select": ("o", "particles.star"),
                 "mask_create": ("o", "mask.mrc"), "reconstruct": ("o", "reconstruct.mrc"),
                 "initial_model": ("o", None)}


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
        final = "postprocess.star" in have
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
    field that takes the output, the companions it needs (extraction: the picked micrographs with their
    coordinates) and a new output folder in ``project`` (default: two levels above the job folder)."""
    if project is None:
        project = record.folder.parent.parent if record.number is not None else record.folder.parent
    micrographs = next((o for o in record.outputs if o.kind == MICROGRAPHS), None)
    result: list[Offer] = []
    for output in record.outputs:
        for kind, job, name in CONSUMERS:
            if kind != output.kind:
                continue
            values = {name: str(output.path)}
            if job == "extract" and kind == COORDINATES and micrographs is not None:
                values["i"] = str(micrographs.path)
            if kind != MASK:  # a mask completes a post-processing whose half map is already set
                out_name, out_value = _output_value(job, next_job_folder(project, job, taken))
                values[out_name] = out_value
            result.append(Offer(job, output, values))
    return result


# ----------------------------------------------------------------------------------------------------------
# The jobs of this napari session


def _status_of(job: Any) -> str:
    state = getattr(job, "state", None)
    return str(getattr(state, "value", state)) if state is not None else "unknown"


#: Jobs whose ``--o`` is a relion_refine output rootname (``<folder>/run``), also where Params do not say so.
ROOTNAME_JOBS = ("class2d", "class3d", "refine3d", "initial_model")


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

"""RELION's job-folder layout and project-relative paths: the one module that spells their names.

relion_refine's ``--o`` is a *rootname*: ``--o Refine3D/job001/run`` writes ``Refine3D/job001/run_it001_data.star``,
``run_it001_model.star`` (``run_it001_half1_model.star`` in auto-refine), ``run_it001_optimiser.star``,
``run_it001_class001.mrc`` (``run_it001_half1_class001.mrc``; 2D: ``run_it001_classes.mrcs``) and, after an
auto-refine converges, ``run_data.star``, ``run_model.star``, ``run_class001.mrc`` and
``run_half1_class001_unfil.mrc``. :class:`RunFiles` makes and parses these names; :func:`iteration_model`,
:func:`iteration_data` and :func:`final_model_root` read them from a folder's listing (a continued run's
``run_ct3_it010_data.star`` has the rootname ``run_ct3``), :func:`job_number` the ``jobNNN`` of a job folder.

Paths inside STAR files are relative to the RELION project folder, the folder RELION runs in.
:func:`project_path` resolves them the same way everywhere (particles' stacks, micrographs, references, the
files a viewer opens).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_ITER = re.compile(r"^(?P<root>.+?)_it(?P<it>\d{3,})_(?P<rest>.+)$")
_ITER_MODEL = re.compile(r"^(?P<root>.+?)_it(?P<it>\d{3,})_(?:half(?P<half>[12])_)?model\.star$")
_ITER_DATA = re.compile(r"^(?P<root>.+?)_it(?P<it>\d{3,})_data\.star$")
_FINAL_MODEL = re.compile(r"^(?P<root>.+)_model\.star$")
_JOB_FOLDER = re.compile(r"^job(?P<number>\d+)$")


def _owned_name(name: str) -> re.Pattern:
    """The names of the files runs under the rootname ``name`` write (RunFiles.owns)."""
    return re.compile(rf"^{re.escape(name)}_(?:it\d{{3,}}_.+|(?:half[12]_)?(?:data|model|optimiser)\.star"
                      rf"|(?:half[12]_)?class\d{{3}}(?:_unfil)?\.mrc|classes\.mrcs)$")


def _tag(iteration: int | None) -> str:
    return "" if iteration is None else f"_it{iteration:03d}"


@dataclass(frozen=True)
class RunFiles:
    """The files of one relion_refine-style job under the rootname ``root`` (folder / name prefix).
    ``iteration=None`` names the final (converged) files of an auto-refine."""

    root: Path

    @classmethod
    def from_output(cls, o: str | os.PathLike) -> RunFiles:
        """``--o`` as RELION reads it: a rootname (``Class2D/job003/run``). A folder means ``<folder>/run`` (what
        RELION's GUI passes for a job folder): an existing folder, a path that ends in a separator, and a RELION job
        folder's name ``jobNNN`` that is not an existing file (``Class2D/job005``, made if needed: the command
        line's paths lose their trailing separator, and RELION never names a rootname so)."""
        text = os.fspath(o)
        p = Path(text)
        if text.endswith(("/", os.sep)) or p.is_dir() or (job_number(p) is not None and not p.exists()):
            return cls(p / "run")
        return cls(p)

    @property
    def folder(self) -> Path:
        return self.root.parent

    @property
    def name(self) -> str:
        return self.root.name

    def _file(self, iteration: int | None, suffix: str) -> Path:
        return self.folder / f"{self.name}{_tag(iteration)}_{suffix}"

    def data(self, iteration: int | None = None) -> Path:
        return self._file(iteration, "data.star")

    def model(self, iteration: int | None = None, half: int | None = None) -> Path:
        return self._file(iteration, f"half{half}_model.star" if half else "model.star")

    def optimiser(self, iteration: int | None = None) -> Path:
        return self._file(iteration, "optimiser.star")

    def class_map(self, k: int, iteration: int | None = None, half: int | None = None) -> Path:
        """3D class map (class ``k`` counted from 1), of one half in auto-refine."""
        return self._file(iteration, f"half{half}_class{k:03d}.mrc" if half else f"class{k:03d}.mrc")

    def grad_moment(self, moment: int, n: int, iteration: int | None = None) -> Path:
        """An image of a gradient run's moments (RELION's names, e.g. run_it010_1moment001.mrc): ``moment`` 1
        (first moments; of pseudo half-set 2 numbered K + k) or 2 (second moments), ``n`` counted from 1."""
        return self._file(iteration, f"{moment}moment{n:03d}.mrc")

    def unfiltered_half_map(self, half: int, k: int = 1) -> Path:
        """The final unfiltered half map of an auto-refine (the input of post-processing)."""
        return self.folder / f"{self.name}_half{half}_class{k:03d}_unfil.mrc"

    def classes_stack(self, iteration: int) -> Path:
        """2D classification: the class averages of an iteration as one stack."""
        return self._file(iteration, "classes.mrcs")

    def owns(self, path: str | os.PathLike) -> bool:
        """True for a file that runs under this rootname write: in its folder, named ``<name>_itNNN_...`` (any
        iteration's file) or one of the final files (``<name>_data.star``, ``<name>_model.star``,
        ``<name>_half1_class001_unfil.mrc``, ...). The folder is compared by resolved path."""
        q = Path(path)
        if not _owned_name(self.name).match(q.name):
            return False
        try:
            return q.parent.resolve() == self.folder.resolve()
        except OSError:
            return False

    def existing_files(self) -> list[Path]:
        """The files of this rootname (:meth:`owns`) that exist in its folder, sorted by name."""
        if not self.folder.is_dir():
            return []
        pat = _owned_name(self.name)
        return sorted(q for q in self.folder.iterdir() if pat.match(q.name) and q.is_file())

    def iterations(self) -> list[int]:
        """The iterations whose optimiser STAR exists (written last: the iteration is complete), ascending."""
        pat = re.compile(rf"^{re.escape(self.name)}_it(\d{{3,}})_optimiser\.star$")
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for q in self.folder.iterdir() if (m := pat.match(q.name)))

    def latest_data(self) -> Path | None:
        """The final data STAR if it exists, else that of the newest iteration that has one."""
        if self.data().is_file():
            return self.data()
        pat = re.compile(rf"^{re.escape(self.name)}_it(\d{{3,}})_data\.star$")
        found = sorted((int(m.group(1)), q) for q in self.folder.glob(f"{self.name}_it*_data.star")
                       if (m := pat.match(q.name)))
        return found[-1][1] if found else None


def parse_run_file(path: str | os.PathLike) -> tuple[RunFiles, int | None, str]:
    """(RunFiles, iteration, what) of a file named as above: ``Class2D/job1/run_it025_classes.mrcs`` ->
    (RunFiles('Class2D/job1/run'), 25, 'classes.mrcs'); final files give iteration None and a guessed root
    (the text before the last ``_``-separated known part)."""
    p = Path(path)
    m = _ITER.match(p.name)
    if m:
        return RunFiles(p.parent / m.group("root")), int(m.group("it")), m.group("rest")
    for what in ("data.star", "model.star", "optimiser.star", "class001.mrc"):
        if p.name.endswith("_" + what):
            return RunFiles(p.parent / p.name[: -len(what) - 1]), None, what
    stem, _, rest = p.name.rpartition("_")
    return RunFiles(p.parent / (stem or p.stem)), None, rest


@dataclass(frozen=True)
class IterationFile:
    """What the name of an iteration's file says: ``run_it025_half1_model.star`` -> rootname ``run`` (the file name
    prefix, without the folder), iteration 25, half set 1 (None outside auto-refine's half sets)."""

    root: str
    iteration: int
    half: int | None = None


def iteration_model(name: str | os.PathLike) -> IterationFile | None:
    """The model STAR of an iteration: ``run_it025_model.star`` -> (``run``, 25, None),
    ``run_it025_half2_model.star`` -> (``run``, 25, 2); None for any other name (final files included). Only the
    last part of a path is read."""
    m = _ITER_MODEL.match(Path(name).name)
    if m is None:
        return None
    return IterationFile(m.group("root"), int(m.group("it")), int(m.group("half")) if m.group("half") else None)


def iteration_data(name: str | os.PathLike) -> IterationFile | None:
    """The data STAR of an iteration: ``run_it025_data.star`` -> (``run``, 25), ``run_ct3_it010_data.star`` (a run
    continued from iteration 3) -> (``run_ct3``, 10); None for any other name. Only the last part of a path is
    read."""
    m = _ITER_DATA.match(Path(name).name)
    return None if m is None else IterationFile(m.group("root"), int(m.group("it")))


def final_model_root(name: str | os.PathLike) -> str | None:
    """The rootname of a model STAR that is not an iteration's (an auto-refine's final ``run_model.star`` ->
    ``run``); None for an iteration's model STAR (:func:`iteration_model`) and for any other name. Only the last
    part of a path is read."""
    text = Path(name).name
    m = _FINAL_MODEL.match(text)
    return None if m is None or _ITER_MODEL.match(text) else m.group("root")


def job_number(name: str | os.PathLike) -> int | None:
    """The NNN of a RELION job folder ``jobNNN`` (``Class2D/job005`` -> 5); None for any other name. Only the last
    part of a path is read."""
    m = _JOB_FOLDER.match(Path(name).name)
    return None if m is None else int(m.group("number"))


def data_for_classes_stack(stack: str | os.PathLike) -> Path | None:
    """The data STAR of the same iteration as a 2D classes stack (``run_it025_classes.mrcs`` ->
    ``run_it025_data.star``), None if the name is not such a stack."""
    files, it, what = parse_run_file(stack)
    if it is None or what != "classes.mrcs":
        return None
    return files.data(it)


def model_for_data(data_star: str | os.PathLike) -> Path | None:
    """The model STAR written beside a data STAR (``run_it025_data.star`` -> ``run_it025_model.star``,
    ``run_data.star`` -> ``run_model.star``); None if the name does not end in ``_data.star``."""
    p = Path(data_star)
    if not p.name.endswith("_data.star"):
        return None
    return p.with_name(p.name[: -len("_data.star")] + "_model.star")


def project_path(name: str | os.PathLike, star: str | os.PathLike | None = None,
                 project_dir: str | os.PathLike | None = None) -> tuple[Path | None, list[Path]]:
    """Resolve a path written in a STAR file (RELION's rule: relative to the project folder) and say where it
    was looked for. Absolute paths stand. ``project_dir`` given: only there. Otherwise the project folder is
    the current folder (where RELION runs); failing that, the STAR file's folder and up to three of its parents
    (a job folder is two levels below its project: ``Extract/job007/particles.star``). A bare file name is
    looked for beside the STAR file first.

    Returns (the existing file, or None; the folders tried in order)."""
    q = Path(name)
    if q.is_absolute():
        return (q if q.exists() else None), [Path("/")]
    if project_dir is not None:
        base = Path(project_dir)
        return ((base / q) if (base / q).exists() else None), [base]
    bases = [Path.cwd()]
    if star is not None:
        here = Path(star).resolve().parent
        bases += [here, *list(here.parents)[:3]]
        if len(q.parts) == 1:  # a bare file name (our model STARs name their maps so): beside the STAR first
            bases.insert(0, here)
    tried: list[Path] = []
    for b in bases:
        if b in tried:
            continue
        tried.append(b)
        if (b / q).exists():
            return b / q, tried
    return None, tried


@dataclass(frozen=True)
class NoteCommand:
    """One command recorded in a job folder's note.txt: ``program`` is our job's name (``napari-gpu-relion class2d
    ...``: "class2d"), RELION's program without ``_mpi`` (`` `which relion_refine_mpi` ...``: "relion_refine"),
    or None for another program; ``args`` maps each flag to the word after it ("" when another flag follows)."""

    program: str | None
    args: dict[str, str]


def note_commands(folder: str | os.PathLike) -> list[NoteCommand]:
    """The commands a folder's note.txt records (lines with a ``--`` flag, comments left out), oldest first; []
    without a readable note.txt. The program is looked for among the words before the first flag (an ``mpirun -n
    3`` may come first)."""
    try:
        text = (Path(folder) / "note.txt").read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        line = line.strip()
        if " --" not in line or line.startswith(("#", "++++")):
            continue
        try:
            words = shlex.split(line.replace("`which ", "").replace("`", ""))
        except ValueError:
            words = line.split()
        program = None
        for k, word in enumerate(words):
            if word.startswith("--"):
                break
            name = Path(word).name
            if name.startswith("napari-gpu-relion") and k + 1 < len(words):
                program = words[k + 1]
                break
            if name.startswith("relion_"):
                program = name.removesuffix("_mpi")
                break
        args = {w: ("" if k + 1 >= len(words) or words[k + 1].startswith("--") else words[k + 1])
                for k, w in enumerate(words) if w.startswith("--")}
        out.append(NoteCommand(program, args))
    return out

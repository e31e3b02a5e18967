"""Following a RELION job folder live (no Qt, no napari): which iteration is new and complete, and its events.

Any relion_refine-style job folder (ours, or one RELION itself is writing on a cluster: Class2D/job010,
Class3D/..., Refine3D/...) or a post-processing folder. :class:`FolderFollower` is given the folder and scanned
again and again (widgets/jobs_panel.py does it in a worker thread); :meth:`FolderFollower.poll` returns the job
events (widgets/display.py draws them, as it draws a running job's) of the newest *complete* state it has not
shown yet, or nothing:

* 2D classification: ``<root>_itNNN_classes.mrcs`` + ``_model.star`` -> ClassAveragesUpdated (the class grid);
* 3D classification: ``<root>_itNNN_class00K.mrc`` + ``_model.star`` -> one MapUpdated per class;
* 3D auto-refine: ``<root>_itNNN_half{1,2}_class001.mrc`` + ``_half{1,2}_model.star`` -> both half maps and the
  gold-standard FSC (``rlnGoldStandardFsc`` of the model STAR); after convergence ``<root>_class001.mrc`` +
  ``<root>_model.star``;
* post-processing: ``postprocess.star`` (its FSC curves) and ``postprocess_masked.mrc`` (else ``postprocess.mrc``).

Complete means: the model STAR(s) of the iteration exist (RELION writes an iteration's maps before its model STAR;
this plugin's large jobs may write the model STAR first, beside the maps, and its optimiser STAR last), parse, and
every image they name (``rlnReferenceImage``, looked for in the followed
folder) has all the bytes its MRC header promises; and no file of the iteration changed in the last ``settle_s``
seconds (RELION writes in place, not through a temporary file: a STAR being written may already parse). An
incomplete iteration is simply looked at again at the next scan, and :attr:`FolderFollower.waiting` says what it
waits for (the files a model STAR names that are not there, or not whole yet, by name; a file just written; a STAR
that does not parse yet), so that a folder whose model STAR names maps that never come does not wait in silence.
When several iterations are complete at once (a folder opened late), only the newest is shown.

:func:`view_of` says which view of the viewer a job's result wants (2D: picks, class averages, particles; 3D: maps),
so that the viewer follows the kind of job shown (widgets/display.py); :func:`job_label` names a job folder in plot
titles ("Refine3D/job012").
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..compute.fsc import resolution_shell
from ..errors import InputError
from ..events import ClassAveragesUpdated, FscUpdated, MapUpdated, MicrographPicked, ParticlesExtracted
from ..io.jobdir import final_model_root, iteration_model
from ..io.mrc import mrc_header_info, read_mrc
from ..io.star import read_star
from .layers import postprocess_fsc

__all__ = ["SETTLE_S", "Snapshot", "FolderFollower", "is_job_folder", "model_snapshot", "snapshot_events", "view_of",
           "job_label", "MAX_NAMED", "postprocess_snapshot"]

#: Seconds a file must be left unchanged before it is read (a file RELION is still writing changes).
SETTLE_S = 1.0
#: Order key of final files: after every iteration.
_FINAL = 10**9
#: Files named at most in a waiting message (then "and N more").
MAX_NAMED = 3


@dataclass(frozen=True)
class Snapshot:
    """One complete state of a job folder: its kind ("class2d", "class3d", "refine3d", "postprocess"), the
    iteration (None: the final files of an auto-refine, or a post-processing), its STAR files and its images."""

    kind: str
    iteration: int | None
    stars: tuple[Path, ...]
    images: tuple[Path, ...]
    key: tuple = ()

    @property
    def description(self) -> str:
        if self.kind == "postprocess":
            return "post-processing"
        return "final" if self.iteration is None else f"iteration {self.iteration}"


def is_job_folder(folder: str | os.PathLike) -> bool:
    """True if ``folder`` holds a model STAR of an iteration (or a final one) or a postprocess.star."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(iteration_model(n) for n in names) or "postprocess.star" in names or any(
        n.endswith("_model.star") for n in names)


def _complete_mrc(path: Path) -> bool:
    """The MRC file exists and holds every byte its header promises."""
    try:
        info = mrc_header_info(path)
        need = info.offset + int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
        return path.stat().st_size >= need
    except (InputError, OSError, ValueError):
        return False


def _image_file(name: str, folder: Path) -> Path:
    """The file of an ``rlnReferenceImage`` (``000001@Class2D/job010/run_it025_classes.mrcs`` or a map path), looked
    for in the followed folder (the images of an iteration lie beside its model STAR)."""
    return folder / Path(str(name).split("@")[-1]).name


def _classes_table(blocks: dict) -> pd.DataFrame:
    table = blocks.get("model_classes")
    if table is None:
        raise InputError("no data_model_classes block")
    return table if isinstance(table, pd.DataFrame) else pd.DataFrame([table])


def _general(blocks: dict) -> dict:
    general = blocks.get("model_general", {})
    if isinstance(general, pd.DataFrame):
        return general.iloc[0].to_dict() if len(general) else {}
    return dict(general)


class FolderFollower:
    """Scans one job folder for its newest complete state (see the module docstring).

    ``settle_s``: seconds a file must be unchanged before it is read. ``label`` names the layers (default: the
    folder's name, e.g. ``job010``)."""

    def __init__(self, folder: str | os.PathLike, settle_s: float = SETTLE_S, label: str | None = None):
        self.folder = Path(folder)
        self.settle_s = float(settle_s)
        self.label = label or self.folder.name
        self.shown: Snapshot | None = None
        #: What the newest state not shown yet waits for (files named), after the last scan; None if nothing.
        self.waiting: str | None = None

    # -- scanning ------------------------------------------------------------------------------------------

    def _settled(self, paths: list[Path], now: float) -> bool:
        try:
            return all(now - p.stat().st_mtime >= self.settle_s for p in paths)
        except OSError:
            return False

    def candidates(self) -> list[tuple[tuple, str, int | None, list[Path]]]:
        """(order key, kind hint, iteration, model STARs) of every state the folder's names announce, newest
        first."""
        try:
            names = set(os.listdir(self.folder))
        except OSError:
            return []
        found: list[tuple[tuple, str, int | None, list[Path]]] = []
        if "postprocess.star" in names:
            star = self.folder / "postprocess.star"
            with contextlib.suppress(OSError):
                found.append(((_FINAL, star.stat().st_mtime_ns), "postprocess", None, [star]))
        iterations: dict[tuple[str, int], set[int | None]] = {}
        for name in names:
            f = iteration_model(name)
            if f is not None:
                iterations.setdefault((f.root, f.iteration), set()).add(f.half)
        for (root, it), halves in iterations.items():
            if halves & {1, 2}:
                stars = [self.folder / f"{root}_it{it:03d}_{h}_model.star" for h in ("half1", "half2")]
                found.append(((it,), "refine3d", it, stars))
            else:
                found.append(((it,), "class", it, [self.folder / f"{root}_it{it:03d}_model.star"]))
        roots = {root for root, _ in iterations}
        for name in names:
            root = final_model_root(name)
            if root is not None and (not roots or root in roots) and f"{root}_class001.mrc" in names:
                found.append(((_FINAL - 1,), "refine3d", None, [self.folder / name]))
        return sorted(found, key=lambda c: c[0], reverse=True)

    def complete(self, kind: str, iteration: int | None, stars: list[Path], key: tuple,
                 now: float | None = None) -> Snapshot | None:
        """The snapshot of one candidate if all its files are there, whole and settled; else None."""
        return self.check(kind, iteration, stars, key, now)[0]

    def check(self, kind: str, iteration: int | None, stars: list[Path], key: tuple,
              now: float | None = None) -> tuple[Snapshot | None, str | None]:
        """(the snapshot of one candidate, None) if all its files are there, whole and settled; else (None, what it
        waits for, in words that name the files)."""
        now = time.time() if now is None else now
        what = _describe(kind, iteration)
        missing_stars = [s for s in stars if not s.is_file()]
        if missing_stars:
            return None, f"{what}: waiting for {_names(missing_stars)}"
        try:
            if kind == "postprocess":
                images = [self.folder / n for n in ("postprocess_masked.mrc", "postprocess.mrc")
                          if (self.folder / n).is_file()][:1]
                blocks = read_star(stars[0])
                if "fsc" not in blocks:
                    return None, f"{what}: {stars[0].name} has no data_fsc block (yet)"
            else:
                images = []
                for star in stars:
                    blocks = read_star(star)
                    names = _classes_table(blocks)["rlnReferenceImage"]
                    images.extend(dict.fromkeys(_image_file(n, self.folder) for n in names))
                if kind == "class":
                    dim = int(float(_general(blocks).get("rlnReferenceDimensionality", 0)))
                    kind = "class2d" if dim == 2 or any(p.suffix == ".mrcs" for p in images) else "class3d"
        except (InputError, OSError, ValueError, KeyError) as exc:  # not written through yet: looked at again
            return None, f"{what}: {_names(stars)} cannot be read yet ({_short_error(exc)})"
        missing = [p for p in images if not p.is_file()]
        if missing:
            return None, (f"{what}: {_names(missing)} named in {_names(stars)} "
                          f"{'is' if len(missing) == 1 else 'are'} not in {self.folder}")
        partial = [p for p in images if not _complete_mrc(p)]
        if partial:
            return None, f"{what}: {_names(partial)} not whole yet (shorter than its header says)"
        if not self._settled([*stars, *images], now):
            return None, f"{what}: its files were written less than {self.settle_s:g} s ago"
        return Snapshot(kind, iteration, tuple(stars), tuple(images), key), None

    def scan(self, now: float | None = None) -> Snapshot | None:
        """The newest complete state not shown yet (and remember it as shown); None when there is none.
        :attr:`waiting` says what the newest state not shown yet waits for (None when there is none)."""
        shown_key = self.shown.key if self.shown is not None else None
        self.waiting = None
        for key, kind, iteration, stars in self.candidates():
            if shown_key is not None and key <= shown_key:
                return None
            snap, reason = self.check(kind, iteration, stars, key, now)
            if snap is not None:
                self.shown = snap
                return snap
            if self.waiting is None:
                self.waiting = reason
        return None

    def poll(self, now: float | None = None) -> list[Any]:
        """The events of the newest complete state not shown yet ([] when there is none)."""
        snap = self.scan(now)
        return [] if snap is None else snapshot_events(snap, self.label)


def _describe(kind: str, iteration: int | None) -> str:
    if kind == "postprocess":
        return "post-processing"
    return "final files" if iteration is None else f"iteration {iteration}"


def _names(paths: list[Path]) -> str:
    """File names, at most MAX_NAMED of them ("a, b, c and 4 more")."""
    names = [p.name for p in paths]
    text = ", ".join(names[:MAX_NAMED])
    return text + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def _short_error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def view_of(event: Any) -> int | None:
    """The view (napari's ndisplay) a job's result is seen in: 2 for picks, class averages and extracted particles,
    3 for a 3D map; None for anything else (FSC curves, messages)."""
    if isinstance(event, ClassAveragesUpdated | MicrographPicked | ParticlesExtracted):
        return 2
    if isinstance(event, MapUpdated):
        volume = getattr(event, "volume", None)
        return 3 if volume is None or np.ndim(volume) == 3 else 2
    return None


def job_label(folder: str | os.PathLike | None, fallback: str = "") -> str:
    """A job's name in titles: ``<Type>/jobNNN`` for a RELION-style job folder (its last two parts), else the
    folder's name; ``fallback`` without a folder."""
    if folder is None or not str(folder):
        return fallback
    p = Path(folder)
    if p.name == "run" or p.suffix:  # a rootname or an output file: its folder
        p = p.parent
    if p.name.startswith("job") and p.name[3:].isdigit() and p.parent.name:
        return f"{p.parent.name}/{p.name}"
    return p.name or fallback


def model_snapshot(path: str | os.PathLike) -> Snapshot:
    """The state one model STAR stands for (``run_it025_model.star``; ``run_it025_half1_model.star`` with its
    other half when it is there; a final ``run_model.star``); InputError when it or an image it names is missing
    or incomplete."""
    p = Path(path)
    follower = FolderFollower(p.parent, settle_s=0.0)
    f = iteration_model(p)
    if f is not None and f.half:
        prefix = p.name[: -len(f"_half{f.half}_model.star")]  # <root>_itNNN as the name spells it
        stars = [p.parent / f"{prefix}_half{h}_model.star" for h in (1, 2)]
        snap, reason = follower.check("refine3d", f.iteration, [s for s in stars if s.is_file()], ())
    elif f is not None:
        snap, reason = follower.check("class", f.iteration, [p], ())
    else:
        snap, reason = follower.check("refine3d", None, [p], ())
    if snap is None:
        raise InputError(f"not shown: {reason}" if reason else "not a readable model STAR", path=str(p))
    return snap


def postprocess_snapshot(path: str | os.PathLike) -> Snapshot:
    """The post-processing a ``postprocess.star`` stands for: its FSC curves and the map beside it
    (``postprocess_masked.mrc``, else ``postprocess.mrc``; none when neither is there); InputError saying why when
    the STAR cannot be shown."""
    p = Path(path)
    snap, reason = FolderFollower(p.parent, settle_s=0.0).check("postprocess", None, [p], ())
    if snap is None:
        raise InputError(f"not shown: {reason}" if reason else "not a post-processing STAR", path=str(p))
    return snap


# ----------------------------------------------------------------------------------------------------------
# Snapshot -> job events


def _pixel_size(header_pixel: float | None, general: dict) -> float:
    if header_pixel:
        return float(header_pixel)
    value = general.get("rlnPixelSize")
    with contextlib.suppress(TypeError, ValueError):
        if value is not None and float(value) > 0:
            return float(value)
    return 1.0


def _column(table: pd.DataFrame, label: str, n: int, default: float) -> np.ndarray:
    if label in table.columns:
        return pd.to_numeric(table[label], errors="coerce").fillna(default).to_numpy(np.float64)
    return np.full(n, default)


def _gold_standard_fsc(blocks: dict, general: dict) -> FscUpdated | None:
    curve = blocks.get("model_class_1")
    if not isinstance(curve, pd.DataFrame) or not {"rlnResolution", "rlnGoldStandardFsc"} <= set(curve.columns):
        return None
    freq = pd.to_numeric(curve["rlnResolution"], errors="coerce").to_numpy(np.float64)
    fsc = pd.to_numeric(curve["rlnGoldStandardFsc"], errors="coerce").to_numpy(np.float64)
    # the FSC-0.143 resolution of the curve itself, a dip skipped as refine3d reports it (RELION's
    # rlnCurrentResolution is the SSNR-based resolution that drives its image size, several shells below the 0.143
    # crossing while the refinement runs)
    shell = resolution_shell(np.nan_to_num(fsc, nan=0.0), 0.143, skip_dips=True)
    res = 1.0 / freq[shell] if 0 < shell < freq.size and freq[shell] > 0 else float("nan")
    return FscUpdated(freq, {"gold-standard FSC": fsc}, res)


def snapshot_events(snap: Snapshot, label: str) -> list[Any]:
    """The events that show ``snap`` (read from its files): class grid, maps, FSC. Layer names start with
    ``label``."""
    if snap.kind == "postprocess":
        events: list[Any] = [postprocess_fsc(snap.stars[0])]
        for image in snap.images:
            mrc = read_mrc(image)
            events.append(MapUpdated(f"{label} postprocess", np.asarray(mrc.data, np.float32),
                                     _pixel_size(mrc.pixel_size, {}), image))
        return events
    blocks = read_star(snap.stars[0])
    general = _general(blocks)
    if snap.kind == "class2d":
        table = _classes_table(blocks)
        stack = snap.images[0]
        mrc = read_mrc(stack)
        images = np.asarray(mrc.data, np.float32).reshape(-1, *mrc.data.shape[-2:])
        k = len(images)
        dist = _column(table, "rlnClassDistribution", k, 0.0)[:k]
        res = _column(table, "rlnEstimatedResolution", k, 999.0)[:k]
        return [ClassAveragesUpdated(f"{label} classes", images, dist, res, _pixel_size(mrc.pixel_size, general),
                                     stack)]
    events = []
    if snap.kind == "class3d":
        for image in snap.images:
            mrc = read_mrc(image)
            name = image.stem.rsplit("_", 1)[-1]  # class001
            events.append(MapUpdated(f"{label} {name}", np.asarray(mrc.data, np.float32),
                                     _pixel_size(mrc.pixel_size, general), image))
        return events
    # refine3d: both half maps of an iteration, or the final map
    names = ["half1", "half2"] if snap.iteration is not None else ["map"]
    for name, image in zip(names, snap.images, strict=False):
        mrc = read_mrc(image)
        events.append(MapUpdated(f"{label} {name}", np.asarray(mrc.data, np.float32),
                                 _pixel_size(mrc.pixel_size, general), image))
    fsc = _gold_standard_fsc(blocks, general)
    if fsc is not None:
        events.append(fsc)
    return events

"""Class selection (RELION's Select job): keep the particles of chosen classes of a classification.

Classes are chosen by number (``--classes 1,4,7``) and/or by the class table of the matching _model.star
(``--min_class_distribution``, ``--max_class_resolution``): a class is kept when it passes every criterion
given. The napari class grid calls :func:`select_particles` too, so both write the same file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..events import Finished, Started
from ..io.atomic import ensure_not_input
from ..io.jobdir import model_for_data
from ..io.particle_images import image_names_for
from ..io.star import ParticleTable, read_particles, read_star, write_particles
from .common import check_output_file, param, prepare_output, require_file, write_note

JOB_NAME = "select"


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="Particles STAR of a classification (run_itNNN_data.star)")
    o: Path = param(flag="--o", help="Output particles STAR (e.g. Select/job010/particles.star)")
    classes: str = param("", "--classes", "Class numbers to keep, comma-separated (1-based); empty = all")
    min_class_distribution: float = param(-1.0, "--min_class_distribution",
                                          "Keep classes holding at least this fraction of the particles (0-1)")
    max_class_resolution: float = param(-1.0, "--max_class_resolution",
                                        "Keep classes with an estimated resolution of at most this (Å)")
    model: Path | None = param(None, "--model", "Model STAR with the class table; default: --i with "
                               "_data.star replaced by _model.star")

    def __post_init__(self):
        require_file(self.i, "--i particles STAR", (".star",))
        if self.o is None or Path(self.o).suffix != ".star":
            raise InputError(f"--o must be a .star file, got '{self.o}'")
        ensure_not_input(self.o, self.i)
        check_output_file(self.o, "--o")
        parse_classes(self.classes)
        if self.min_class_distribution > 1:
            raise InputError(f"--min_class_distribution is a fraction (0-1), got {self.min_class_distribution}")


def parse_classes(text: str) -> list[int]:
    """'1,4, 7' -> [1, 4, 7]; InputError naming the bad entry."""
    out = []
    for tok in (t.strip() for t in str(text).split(",")):
        if not tok:
            continue
        if not tok.isdigit() or int(tok) < 1:
            raise InputError(f"--classes must be class numbers >= 1 separated by commas; bad entry '{tok}'")
        out.append(int(tok))
    return out


def model_path_for(data_star: Path) -> Path:
    model = model_for_data(data_star)
    if model is None:
        raise InputError("cannot find the model STAR of this file (its name does not end in _data.star): give "
                         "--model", path=str(data_star))
    return model


def classes_passing(model_star: Path, min_distribution: float = -1.0, max_resolution: float = -1.0) -> list[int]:
    """1-based class numbers of the model STAR's class table passing the thresholds (< 0 = not used)."""
    require_file(model_star, "model STAR", (".star",))
    blocks = read_star(model_star)
    if "model_classes" not in blocks:
        raise InputError("no data_model_classes block", path=str(model_star))
    t = blocks["model_classes"]
    keep = np.ones(len(t), bool)
    for label, limit, op in (("rlnClassDistribution", min_distribution, np.greater_equal),
                             ("rlnEstimatedResolution", max_resolution, np.less_equal)):
        if limit >= 0:
            if label not in t.columns:
                raise InputError(f"the class table has no {label}", path=str(model_star), column=label)
            keep &= op(t[label].to_numpy(float), limit)
    return [k + 1 for k in np.flatnonzero(keep)]


def select_particles(table: ParticleTable, classes: list[int]) -> ParticleTable:
    """The rows of ``table`` whose rlnClassNumber is in ``classes`` (all optics groups kept as they are)."""
    if "rlnClassNumber" not in table.particles.columns:
        raise InputError("the particles have no rlnClassNumber: select from a classification's _data.star",
                         path=str(table.path), column="rlnClassNumber")
    keep = table.particles["rlnClassNumber"].isin(classes).to_numpy()
    return dataclasses.replace(table, particles=table.particles[keep].reset_index(drop=True), row_lines=None)


def write_selection(table: ParticleTable, classes: list[int], out: Path) -> ParticleTable:
    """Write the particles of ``classes`` (1-based) to ``out`` atomically, image names valid from there; returns
    them. The Select job and the 2D class grid's "Save selection" both write through here."""
    ensure_not_input(Path(out), table.path)
    sel = select_particles(table, classes)
    if len(sel):
        sel.particles["rlnImageName"] = image_names_for(sel, Path(out)).to_numpy()
    write_particles(Path(out), sel)
    return sel


def run(p: Params) -> Iterator:
    table = read_particles(p.i)
    present = sorted(int(c) for c in np.unique(table.particles.get("rlnClassNumber", [])))
    chosen = parse_classes(p.classes) or present
    missing = [c for c in chosen if c not in present]
    if missing:
        raise InputError(f"--classes {', '.join(map(str, missing))} not among the classes of the particles "
                         f"({', '.join(map(str, present))})", path=str(p.i), column="rlnClassNumber")
    if p.min_class_distribution >= 0 or p.max_class_resolution >= 0:
        by_model = classes_passing(p.model or model_path_for(p.i), p.min_class_distribution, p.max_class_resolution)
        chosen = [c for c in chosen if c in by_model]
    out = Path(p.o)
    notes = prepare_output(out.parent, Path(p.i).stat().st_size, "the selected particles' STAR file")
    yield Started(JOB_NAME, out.parent, "CPU", f"selecting classes {chosen} of {p.i}")
    yield from notes
    out.parent.mkdir(parents=True, exist_ok=True)
    write_note(out.parent, JOB_NAME, p)
    sel = write_selection(table, chosen, out)
    yield Finished({"particles": out}, f"kept {len(sel)} of {len(table)} particles (classes "
                   f"{', '.join(map(str, chosen)) or 'none'})")

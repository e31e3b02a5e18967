"""RELION's model and optimiser STAR files of relion_refine-style jobs (run_itNNN_model.star,
run_itNNN_optimiser.star): writing them each iteration and reading back what --continue needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import InputError
from .star import read_star, write_star_blocks
from .write_queue import formats_text


@formats_text
def write_model_star(path: Path, general: dict, classes: pd.DataFrame, class_curves: list[pd.DataFrame],
                     sigma2: np.ndarray, scales: np.ndarray, group_names: list, pdf_orient: list[np.ndarray],
                     box: int, pixel_size: float) -> Path:
    """model_general, model_classes, model_class_N (per-class curves), model_groups (scale corrections),
    model_optics_group_N (noise spectra, shells 0..box/2) and model_pdf_orient_class_N (``pdf_orient`` as given:
    RELION's convention is that class k's sums to its class distribution: its E-step takes pdf_direction as the
    prior of class and direction together)."""
    blocks: dict = {"model_general": general, "model_classes": classes}
    for k, curve in enumerate(class_curves):
        blocks[f"model_class_{k + 1}"] = curve
    blocks["model_groups"] = pd.DataFrame({"rlnGroupNumber": np.arange(1, len(scales) + 1),
                                           "rlnGroupName": [str(g) for g in group_names],
                                           "rlnGroupScaleCorrection": scales})
    sh = np.arange(box // 2 + 1)
    for g in range(sigma2.shape[0]):
        blocks[f"model_optics_group_{g + 1}"] = pd.DataFrame({
            "rlnSpectralIndex": sh, "rlnResolution": sh / (box * pixel_size), "rlnSigma2Noise": sigma2[g]})
    for k, pdf in enumerate(pdf_orient):
        blocks[f"model_pdf_orient_class_{k + 1}"] = pd.DataFrame({"rlnOrientationDistribution": pdf})
    return write_star_blocks(path, blocks)


@dataclass
class ModelFile:
    """What --continue reads back from a model STAR."""

    path: Path
    classes: pd.DataFrame  # model_classes: rlnReferenceImage, rlnClassDistribution (, rlnClassPriorOffsetX/Y)
    sigma2: np.ndarray  # (optics groups, shells)
    scales: np.ndarray | None  # (groups,) rlnGroupScaleCorrection
    pdf_orient: list[np.ndarray]  # per class
    ssnr: list[np.ndarray] | None = None  # per class rlnSsnrMap (model_class_N), None where a class block lacks it

    @property
    def class_distribution(self) -> np.ndarray:
        return np.asarray(self.classes["rlnClassDistribution"], float)

    def prior_offsets_A(self) -> np.ndarray:
        """(K, 2) class offset priors (Å; 0 when the columns are absent)."""
        K = len(self.classes)
        return np.column_stack([np.asarray(self.classes.get(f"rlnClassPriorOffset{a}", np.zeros(K)), float)
                                for a in "XY"])


def _numbered(blocks: dict, prefix: str) -> list[str]:
    return sorted((k for k in blocks if k.startswith(prefix) and k[len(prefix):].isdigit()),
                  key=lambda s: int(s[len(prefix):]))


def _column(blocks: dict, name: str, label: str, path: Path) -> np.ndarray:
    """Column ``label`` of block ``name`` as floats; InputError naming the file, block and label otherwise."""
    table = pd.DataFrame(blocks[name]) if isinstance(blocks[name], pd.DataFrame) else pd.DataFrame([blocks[name]])
    if label not in table.columns:
        raise InputError(f"data_{name} has no {label} column (damaged, or not a model STAR of this program)",
                         path=str(path), column=label)
    try:
        return np.asarray(table[label], float)
    except (TypeError, ValueError) as exc:
        raise InputError(f"data_{name} has a value of {label} that is not a number", path=str(path),
                         column=label) from exc


def read_model_star(path: Path) -> ModelFile:
    """The class table, noise spectra, group scales and orientation distributions of a model STAR; a clear
    error naming the file, block and label when one that --continue needs is missing."""
    blocks = read_star(path)
    if "model_classes" not in blocks:
        raise InputError("not a model STAR file (no data_model_classes block)", path=str(path))
    classes = blocks["model_classes"]
    classes = pd.DataFrame(classes) if isinstance(classes, pd.DataFrame) else pd.DataFrame([classes])
    for label in ("rlnReferenceImage", "rlnClassDistribution"):
        if label not in classes.columns:
            raise InputError(f"data_model_classes has no {label} column", path=str(path), column=label)
    names = _numbered(blocks, "model_optics_group_")
    if not names:
        raise InputError("no model_optics_group_N block with rlnSigma2Noise", path=str(path))
    sigma2 = np.stack([_column(blocks, k, "rlnSigma2Noise", path) for k in names])
    scales = _column(blocks, "model_groups", "rlnGroupScaleCorrection", path) if "model_groups" in blocks else None
    pdfs = [_column(blocks, k, "rlnOrientationDistribution", path)
            for k in _numbered(blocks, "model_pdf_orient_class_")]
    curves = [blocks[k] for k in _numbered(blocks, "model_class_")]
    ssnr = ([np.asarray(pd.DataFrame(c)["rlnSsnrMap"], float) for c in curves]
            if curves and all(isinstance(c, pd.DataFrame) and "rlnSsnrMap" in c.columns for c in curves) else None)
    return ModelFile(Path(path), classes, sigma2, scales, pdfs, ssnr)


@formats_text
def write_optimiser_star(path: Path, state: dict) -> Path:
    return write_star_blocks(path, {"optimiser_general": state})


def read_optimiser_star(path: Path, require: tuple[str, ...] = ()) -> dict:
    """The optimiser_general block as a dict; an error naming the file and the missing labels of ``require``."""
    blocks = read_star(path)
    if "optimiser_general" not in blocks:
        raise InputError("not an optimiser STAR file (no data_optimiser_general block)", path=str(path))
    blk = blocks["optimiser_general"]
    opt = dict(blk) if not isinstance(blk, pd.DataFrame) else blk.iloc[0].to_dict()
    missing = [k for k in require if k not in opt]
    if missing:
        raise InputError(f"the optimiser STAR lacks {', '.join(missing)} (not written by this program, or "
                         "damaged)", path=str(path), column=missing[0])
    if "rlnCurrentIteration" in opt:
        opt["rlnCurrentIteration"] = _typed(opt["rlnCurrentIteration"], 0, "rlnCurrentIteration", path)
    return opt


PARAM_PREFIX = "rlnGpuRelionParam_"
STATE_PREFIX = "rlnGpuRelion_"


def params_to_optimiser(params, names) -> dict:
    """The job options ``names`` as rlnGpuRelionParam_<name> entries of an optimiser STAR (for --continue)."""
    out = {}
    for k in names:
        v = getattr(params, k)
        out[f"{PARAM_PREFIX}{k}"] = int(v) if isinstance(v, bool) else v
    return out


def params_from_optimiser(params_cls, opt: dict, *, source: str | Path | None = None, **given):
    """A job's Params from the rlnGpuRelionParam_<name> entries of an optimiser STAR (types from the field
    defaults), with ``given`` on top (e.g. --continue, --cpu, --gpu, the output rootname). Every option not
    given must be there: a damaged file is an InputError naming ``source`` and the label, never a run with other
    options than the one it continues."""
    kw = {}
    missing = []
    for f, fld in params_cls.__dataclass_fields__.items():
        key = f"{PARAM_PREFIX}{f}"
        if f in given:
            continue
        if key not in opt:
            missing.append(key)
            continue
        kw[f] = _typed(opt[key], fld.default, key, source)
    if missing:
        raise InputError(f"the optimiser STAR lacks the saved option(s) {', '.join(missing)} (not written by this "
                         "program, or damaged)", path=None if source is None else str(source), column=missing[0])
    return params_cls(**kw, **given)


def _typed(v, like, label: str = "", source: str | Path | None = None):
    """``v`` as the type of ``like``; InputError naming the label and value when it is not one."""
    try:
        if isinstance(like, bool):
            return bool(int(v))
        if isinstance(like, int):
            return int(v)
        if isinstance(like, float):
            return float(v)
    except (TypeError, ValueError) as exc:
        kind = "0 or 1" if isinstance(like, bool) else "a whole number" if isinstance(like, int) else "a number"
        raise InputError(f"value {v!r} of {label or 'an entry'} is not {kind}",
                         path=None if source is None else str(source), column=label or None) from exc
    return str(v)


def state_to_optimiser(state) -> dict:
    """A dataclass's fields as rlnGpuRelion_<name> entries (booleans as 0/1)."""
    return {f"{STATE_PREFIX}{k}": (int(v) if isinstance(v, bool) else v) for k, v in vars(state).items()}


def state_from_optimiser(state, opt: dict):
    """Set the fields of the dataclass ``state`` from rlnGpuRelion_<name> entries (types from the current
    values); returns ``state``."""
    for k, v in opt.items():
        if k.startswith(STATE_PREFIX) and not k.startswith(PARAM_PREFIX):
            name = k[len(STATE_PREFIX):]
            if hasattr(state, name):
                setattr(state, name, _typed(v, getattr(state, name), k))
    return state

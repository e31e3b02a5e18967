"""Writing job folders the way RELION 3.1+ lays them out (for the jobs-panel and follow-folder tests): model STARs
with RELION's blocks and labels, class stacks and maps, in a project folder ``<project>/<Type>/jobNNN``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from napari_gpu_relion.io.mrc import write_mrc

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "real"


def _loop(name: str, columns: dict[str, list]) -> str:
    labels = "".join(f"_{label} #{k + 1}\n" for k, label in enumerate(columns))
    rows = zip(*columns.values(), strict=True)
    body = "".join("  ".join(str(v) for v in row) + "\n" for row in rows)
    return f"\ndata_{name}\n\nloop_\n{labels}{body}\n"


def write_model_star(path: Path, references: list[str], distribution: list[float], resolution: list[float],
                     dim: int, box: int, apix: float, fsc: np.ndarray | None = None) -> Path:
    """A model STAR as relion_refine writes it: model_general, model_classes (rlnReferenceImage with the project-
    relative path), model_class_N curves (with rlnGoldStandardFsc when ``fsc`` is given)."""
    text = "\n# version 30001\n\ndata_model_general\n\n"
    general = {"rlnReferenceDimensionality": dim, "rlnDataDimensionality": 2, "rlnOriginalImageSize": box,
               "rlnCurrentResolution": min(resolution), "rlnPixelSize": apix, "rlnNrClasses": len(references)}
    text += "".join(f"_{k}  {v}\n" for k, v in general.items())
    text += "\n# version 30001\n" + _loop("model_classes", {
        "rlnReferenceImage": references, "rlnClassDistribution": distribution,
        "rlnAccuracyRotations": [3.0] * len(references), "rlnEstimatedResolution": resolution})
    shells = np.arange(box // 2 + 1)
    for k in range(len(references)):
        curve = {"rlnSpectralIndex": list(shells), "rlnResolution": list(shells / (box * apix)),
                 "rlnSsnrMap": [1.0] * len(shells)}
        if fsc is not None:
            curve["rlnGoldStandardFsc"] = list(np.round(fsc, 6))
        text += "\n# version 30001\n" + _loop(f"model_class_{k + 1}", curve)
    path.write_text(text)
    return path


def class2d_iteration(project: Path, job: str, it: int, images: np.ndarray, distribution: list[float],
                      apix: float = 3.0, model: bool = True) -> tuple[Path, Path]:
    """``<job>/run_itNNN_classes.mrcs`` and (``model``) its ``run_itNNN_model.star``; returns both paths."""
    folder = project / job
    folder.mkdir(parents=True, exist_ok=True)
    stack = write_mrc(folder / f"run_it{it:03d}_classes.mrcs", images.astype(np.float32), apix, stack=True)
    star = folder / f"run_it{it:03d}_model.star"
    if model:
        refs = [f"{k + 1:06d}@{job}/{stack.name}" for k in range(len(images))]
        write_model_star(star, refs, distribution, [10.0 + k for k in range(len(images))], 2, images.shape[-1], apix)
    return stack, star


def refine_iteration(project: Path, job: str, it: int, halves: tuple[np.ndarray, np.ndarray], fsc: np.ndarray,
                     apix: float = 3.0, which: tuple[int, ...] = (1, 2)) -> list[Path]:
    """``run_itNNN_half{h}_class001.mrc`` and ``run_itNNN_half{h}_model.star`` for the halves in ``which``."""
    folder = project / job
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for h in which:
        vol = write_mrc(folder / f"run_it{it:03d}_half{h}_class001.mrc", halves[h - 1].astype(np.float32), apix)
        star = write_model_star(folder / f"run_it{it:03d}_half{h}_model.star", [f"{job}/{vol.name}"], [1.0], [9.0],
                                3, halves[h - 1].shape[-1], apix, fsc)
        written += [vol, star]
    return written


def copy_real(name: str, dest: Path) -> Path:
    """A real RELION-made file of shared/data copied to ``dest`` (skips the test when shared/data is absent)."""
    import pytest

    src = REAL / name
    if not src.is_file():
        pytest.skip(f"shared data {src} not present")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return dest

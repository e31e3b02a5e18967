"""What RELION and we start iteration 1 of an auto-refine from (issue 15: why our <Pmax> after iteration 1 differs).

Reads RELION's run_it000_half1_model.star (its initial noise spectrum) and run_it000_half1_class001.mrc (its
iteration-0 reference) from a ``vs_relion.py run --job refine3d`` folder, builds ours from the same particles and
options (jobs.refine3d.Refine3D.initial_model), and compares them per Fourier shell: the ratio of the noise spectra
(ours / RELION's) and of the references' power spectra, and the references' correlation. With both programs'
run_it001 files present it compares the noise spectra after iteration 1 and <Pmax> too. Writes JSON.

Run: python benchmarks/compare_iteration0.py --data /root/d128 --relion relion_refine3d_tr --ours ours_refine3d_tr
    --ours_json trace_ours.json --out iteration0.json
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np

from napari_gpu_relion.cli import build_parser
from napari_gpu_relion.compute.fourier import radial_average, rfft_centered
from napari_gpu_relion.io.model_star import read_model_star
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import refine3d


def our_params(command: str, data: Path) -> refine3d.Params:
    """Our Params from the command line vs_relion.py ran (its log folder's command), paths made absolute."""
    argv = shlex.split(command)
    argv = argv[argv.index("refine3d"):]
    args = build_parser().parse_args(argv)
    kw = {f: getattr(args, f) for f in refine3d.Params.__dataclass_fields__}
    for k in ("i", "ref", "o"):
        kw[k] = str(data / kw[k])
    kw["o"] = str(data / "iteration0_scratch" / "run")
    return refine3d.Params(**kw)


def power_spectrum(x: np.ndarray, ndim: int = 3) -> np.ndarray:
    """Per-shell mean |X|^2 (RELION normalisation), shells 0..N/2."""
    F = rfft_centered(x, ndim)
    return radial_average(F.real**2 + F.imag**2, x.shape[-1], ndim)


def ratio(a: np.ndarray, b: np.ndarray) -> list[float]:
    return [float(x) for x in np.asarray(a, float) / np.maximum(np.asarray(b, float), 1e-300)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--relion", required=True, help="RELION's run folder inside --data")
    ap.add_argument("--ours", required=True, help="our run folder inside --data")
    ap.add_argument("--ours_json", required=True, help="vs_relion.py's JSON of that run (its command is reused)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    data = Path(a.data).resolve()
    rel, ours = data / a.relion / "run", data / a.ours / "run"
    command = json.loads(Path(a.ours_json).read_text())["ours"]["command"]
    job = refine3d.Refine3D(our_params(command, data))
    model = job.initial_model()
    ref_ours = np.asarray(model.refs[0][0], np.float64)
    s2_ours = np.asarray(model.sigma2[0][0], np.float64)
    rm = read_model_star(Path(f"{rel}_it000_half1_model.star"))
    s2_rel = rm.sigma2[0]
    ref_rel = np.asarray(read_mrc(Path(f"{rel}_it000_half1_class001.mrc")).data, np.float64)
    n = min(s2_ours.size, s2_rel.size)
    cc = float(np.corrcoef(ref_ours.ravel(), ref_rel.ravel())[0, 1])
    out = {"sigma2_ratio_ours_over_relion": ratio(s2_ours[:n], s2_rel[:n]),
           "reference_power_ratio_ours_over_relion": ratio(power_spectrum(ref_ours, 3), power_spectrum(ref_rel, 3)),
           "reference_cc": cc, "reference_sd": [float(ref_ours.std()), float(ref_rel.std())]}
    it1 = {}
    for name, root in (("ours", ours), ("relion", rel)):
        p = Path(f"{root}_it001_half1_model.star")
        if p.exists():
            it1[name] = read_model_star(p).sigma2[0]
    if len(it1) == 2:
        out["sigma2_it001_ratio_ours_over_relion"] = ratio(it1["ours"][:n], it1["relion"][:n])
    print(json.dumps({k: (np.round(v, 3).tolist() if isinstance(v, list) else v) for k, v in out.items()}))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

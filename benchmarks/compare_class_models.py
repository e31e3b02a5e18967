"""Two classification model STARs side by side (issue 16): class distribution, per-class SSNR_MAP
(rlnSsnrMap), tau2 and sigma2_ref where written, the noise spectrum of the first optics group, and the
class maps' correlation and standard-deviation ratio.

Run: python benchmarks/compare_class_models.py ours/run_it001_model.star relion/run_it002_model.star [--shells 12]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from napari_gpu_relion.io.model_star import read_model_star
from napari_gpu_relion.io.star import read_star
from napari_gpu_relion.jobs.em import reference_images

COLUMNS = ("rlnSsnrMap", "rlnReferenceTau2", "rlnReferenceSigma2")


def load(path: Path) -> dict:
    """The model STAR's tables of interest as arrays, and its class maps (the project's readers: the maps found as
    --ref model.star finds them)."""
    model, blocks = read_model_star(path), read_star(path)
    gen = blocks["model_general"]
    gen = gen if isinstance(gen, dict) else gen.iloc[0].to_dict()
    out = {"resolution_A": float(gen["rlnCurrentResolution"]), "image_size": int(gen["rlnCurrentImageSize"]),
           "class_distribution": model.class_distribution.tolist(), "classes": [],
           "sigma2_noise": model.sigma2[0]}
    for k, vol in enumerate(reference_images(path), start=1):
        t = blocks.get(f"model_class_{k}")
        t = None if t is None else pd.DataFrame(t)
        cols = {c: t[c].to_numpy(float) for c in COLUMNS if t is not None and c in t}
        out["classes"].append({"columns": cols, "map": vol})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--shells", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    a, b = load(Path(args.a)), load(Path(args.b))
    n = args.shells
    res = {"a": args.a, "b": args.b, "class_distribution": [a["class_distribution"], b["class_distribution"]],
           "image_size": [a["image_size"], b["image_size"]], "classes": []}
    for ca, cb in zip(a["classes"], b["classes"], strict=True):
        row = {"map_correlation": float(np.corrcoef(ca["map"].ravel(), cb["map"].ravel())[0, 1]),
               "map_std_ratio_a_over_b": float(ca["map"].std() / cb["map"].std())}
        for c in COLUMNS:
            if c in ca["columns"] and c in cb["columns"]:
                x, y = ca["columns"][c][:n], cb["columns"][c][:n]
                row[c + "_ratio_a_over_b"] = [float(u / v) if v else None for u, v in zip(x, y, strict=False)]
        res["classes"].append(row)
    if "sigma2_noise" in a and "sigma2_noise" in b:
        res["sigma2_noise_ratio_a_over_b"] = (a["sigma2_noise"][:n] / b["sigma2_noise"][:n]).tolist()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

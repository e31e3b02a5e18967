"""Two auto-refine runs' gold-standard FSC, SSNR and current resolution, iteration by iteration (issue 15).

Reads each run's run_itNNN_half1_model.star (RELION's or ours: the same labels) and writes, per iteration, both
programs' rlnCurrentResolution, image size, the first shell where the FSC drops below 0.5 and 0.143, and the
largest FSC difference over the shells both searched. Made to check whether RELION and we compute the same
iteration FSC (and so the same image sizes and resolution counter) on the same data.

Run (after ``vs_relion.py run --job refine3d`` of both sides on one data folder):
  python benchmarks/compare_iteration_fsc.py --a /root/r128/relion_refine3d_timed/run \
      --b /root/r128/ours_refine3d_f32/run --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import starfile

from napari_gpu_relion.compute.schedule import fsc_crossing


def iterations(root: Path) -> dict[int, dict]:
    out = {}
    for f in sorted(root.parent.glob(root.name + "_it*_half1_model.star")):
        it = int(re.search(r"_it(\d{3})_", f.name).group(1))
        m = starfile.read(f)
        gen, cls = m["model_general"], m["model_class_1"]
        fsc = cls["rlnGoldStandardFsc"].to_numpy(np.float64)
        out[it] = {"current_resolution_A": float(gen["rlnCurrentResolution"]),
                   "image_size": int(gen["rlnCurrentImageSize"]), "fsc": fsc,
                   "ssnr": cls["rlnSsnrMap"].to_numpy(np.float64),
                   "fsc_below_0.5": fsc_crossing(fsc, 0.5), "fsc_below_0.143": fsc_crossing(fsc, 0.143)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="rootname of run A (e.g. RELION's)")
    ap.add_argument("--b", required=True, help="rootname of run B (e.g. ours)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    A, B = iterations(Path(args.a)), iterations(Path(args.b))
    rows = []
    for it in sorted(set(A) & set(B)):
        a, b = A[it], B[it]
        r = min(a["image_size"], b["image_size"]) // 2  # shells both searched
        rows.append({"iteration": it,
                     **{f"{k}_{s}": x[k] for s, x in (("a", a), ("b", b))
                        for k in ("current_resolution_A", "image_size", "fsc_below_0.5", "fsc_below_0.143")},
                     "max_abs_fsc_difference": float(np.abs(a["fsc"][1:r] - b["fsc"][1:r]).max()),
                     "fsc_a": np.round(a["fsc"][: r + 1], 4).tolist(),
                     "fsc_b": np.round(b["fsc"][: r + 1], 4).tolist()})
        print(f"it {it:2d}: current resolution {a['current_resolution_A']:.2f} / {b['current_resolution_A']:.2f} Å, "
              f"size {a['image_size']} / {b['image_size']}, FSC<0.5 at shell {a['fsc_below_0.5']} / "
              f"{b['fsc_below_0.5']}, max |dFSC| {rows[-1]['max_abs_fsc_difference']:.3f}")
    Path(args.out).write_text(json.dumps({"a": args.a, "b": args.b, "iterations": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Ours' gold-standard FSC against RELION's near the 0.143 crossing, iteration by iteration, for runs of the same data.

Each iteration's half-1 model STAR holds the gold-standard FSC both programs decide their resolution (and with it
the convergence counters) from. For each pair of runs (ours, RELION's) and each iteration both wrote, this takes the
mean of ours minus RELION's over the shells from 4 below RELION's first shell under 0.143 to 2 above it, and the two
crossing shells. A systematic difference there moves the reported resolution by a shell now and then, and with it
the iteration count (docs/high_resolution.md).

    python benchmarks/fsc_near_crossing.py --pair OURS_ROOT RELION_ROOT [--pair ...] --out results/X.json

ROOT is a run's rootname (``.../run``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_iteration_fsc import iterations  # noqa: E402

from napari_gpu_relion.compute.schedule import fsc_crossing  # noqa: E402


def compare(ours_root: Path, relion_root: Path) -> list[dict]:
    """Per iteration both runs wrote (``compare_iteration_fsc.iterations``): the crossing shells and the mean FSC
    difference around RELION's."""
    ours, relion = iterations(ours_root), iterations(relion_root)
    rows = []
    for it in sorted(set(ours) & set(relion)):
        fo, fr = ours[it]["fsc"], relion[it]["fsc"]
        n = min(len(fo), len(fr))
        fo, fr = fo[:n], fr[:n]
        cr = fsc_crossing(fr, 0.143) % (n + 1)  # -1 (none below) -> n
        band = slice(max(cr - 4, 1), min(cr + 3, n))
        rows.append({"iteration": it, "crossing_ours": fsc_crossing(fo, 0.143) % (n + 1), "crossing_relion": cr,
                     "mean_difference_near_crossing": float((fo - fr)[band].mean())})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=2, action="append", required=True, metavar=("OURS_ROOT", "RELION_ROOT"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    pairs = [{"ours": o, "relion": r, "iterations": compare(Path(o), Path(r))} for o, r in a.pair]
    d = np.array([row["mean_difference_near_crossing"] for p in pairs for row in p["iterations"]])
    res = {"gpu": "CPU", "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "pairs": pairs,
           "iterations": int(d.size), "mean_difference": float(d.mean()) if d.size else None,
           "sd_difference": float(d.std()) if d.size else None,
           "crossings_differ": int(sum(r["crossing_ours"] != r["crossing_relion"] for p in pairs
                                       for r in p["iterations"]))}
    print(json.dumps({k: v for k, v in res.items() if k != "pairs"}))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

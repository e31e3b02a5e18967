"""LoG-pick the real 4096 x 4096 EPU micrograph (shared/data/real/real_micrograph_epu_4096.mrc, uint16,
0.667 Å/px), report the number of picks and the time, and save a picture with the picks circled.

Run: python benchmarks/pick_real_micrograph.py [--mrc PATH] [--png docs/images/real_micrograph_log_picks.png]
     [--diam_min 150 --diam_max 250] [--cpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.events import Finished, MicrographPicked
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.jobs import autopick

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mrc", default=str(ROOT.parent / "shared/data/real/real_micrograph_epu_4096.mrc"))
    ap.add_argument("--png", default=str(ROOT / "docs/images/real_micrograph_log_picks.png"))
    ap.add_argument("--diam_min", type=float, default=150.0)
    ap.add_argument("--diam_max", type=float, default=250.0)
    ap.add_argument("--adjust", type=float, default=0.0)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        p = autopick.Params(i=Path(args.mrc), odir=Path(tmp), angpix=0.667, LoG=True, LoG_diam_min=args.diam_min,
                            LoG_diam_max=args.diam_max, LoG_adjust_threshold=args.adjust, cpu=args.cpu)
        t = time.perf_counter()
        picks = None
        for ev in autopick.run(p):
            if isinstance(ev, MicrographPicked):
                picks = ev
            elif isinstance(ev, Finished):
                print(ev.summary)
        dt = time.perf_counter() - t
    n = 0 if picks is None else len(picks.coords)
    print(f"{n} LoG picks (diameters {args.diam_min:g}-{args.diam_max:g} Å, adjust {args.adjust:g}) in {dt:.2f} s")

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Circle  # noqa: PLC0415
    from scipy.ndimage import gaussian_filter  # noqa: PLC0415

    img = np.asarray(read_mrc(args.mrc).data, np.float32)
    f = 8  # display: 8 x 8 block means (512 px, 5.3 Å/px), then a Gaussian low-pass (sigma 1.5 binned px)
    small = gaussian_filter(img.reshape(img.shape[0] // f, f, img.shape[1] // f, f).mean((1, 3)), 1.5)
    lo, hi = np.percentile(small, [1, 99])
    fig, ax = plt.subplots(figsize=(8, 8), dpi=100)
    ax.imshow(small, cmap="gray", vmin=lo, vmax=hi)
    r = 0.5 * (args.diam_min + args.diam_max) / 2 / 0.667 / f
    if picks is not None:
        for x, y in picks.coords:
            ax.add_patch(Circle((x / f, y / f), r, fill=False, color="yellow", lw=0.7))
    ax.set_title(f"{Path(args.mrc).name}: {n} LoG picks ({args.diam_min:g}-{args.diam_max:g} Å)")
    ax.axis("off")
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, bbox_inches="tight")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

"""What picking_recall.py's per-particle SNR looks like beside a real micrograph (issue 48 item 4 asks for "SNR as
in real data"): the real EPU micrograph (shared/data/real/real_micrograph_epu_4096.mrc, 0.667 Å/px) Fourier-cropped
to picking_recall's 5 Å/px, and one micrograph of picking_recall's data at each SNR, all 512 x 512 and drawn the
same way (a Gaussian low-pass of 1.5 px, grey levels from the 1st to the 99th percentile). A picture, not a measure:
the real micrograph's particles are not the 70S ribosome and are packed several times denser.

Run: python benchmarks/picking_snr_picture.py --snr 0.02,0.03,0.1 --png docs/images/picking_snr_vs_real.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from scipy.ndimage import gaussian_filter

sys.path.insert(0, str(Path(__file__).resolve().parent))
import picking_recall as pr  # noqa: E402

from napari_gpu_relion.io.mrc import read_mrc  # noqa: E402

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real" / "real_micrograph_epu_4096.mrc"


def fourier_crop(img: np.ndarray, angpix: float, target: float) -> np.ndarray:
    """``img`` (square, even) resampled from ``angpix`` to ``target`` Å/px by cropping its Fourier transform."""
    n = img.shape[0]
    m = int(round(n * angpix / target)) // 2 * 2
    f = np.fft.fftshift(np.fft.fft2(img - img.mean()))
    c = n // 2
    return np.real(np.fft.ifft2(np.fft.ifftshift(f[c - m // 2:c + m // 2, c - m // 2:c + m // 2])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--snr", default="0.02,0.03,0.1")
    ap.add_argument("--png", default="docs/images/picking_snr_vs_real.png")
    a = ap.parse_args()
    real = fourier_crop(np.asarray(read_mrc(REAL).data, np.float32), 0.667, pr.APIX)[:pr.SIZE, :pr.SIZE]
    panels = [(f"real EPU micrograph at {pr.APIX:g} Å/px", real)]
    vol = pr.ribosome()
    with tempfile.TemporaryDirectory() as tmp:
        for snr in [float(s) for s in a.snr.split(",")]:
            d = Path(tmp) / f"s{snr}"
            d.mkdir()
            pr.make_dataset(d, vol, snr, n_mics=1)
            panels.append((f"picking_recall.py, 70S, SNR {snr:g}",
                           np.asarray(read_mrc(d / "Micrographs" / "mic000.mrc").data, np.float32)))
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axs = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.4), dpi=90)
    for ax, (title, im) in zip(axs, panels, strict=True):
        g = gaussian_filter(im, 1.5)
        lo, hi = np.percentile(g, [1, 99])
        ax.imshow(g, cmap="gray", vmin=lo, vmax=hi)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(a.png)
    print(a.png)


if __name__ == "__main__":
    main()

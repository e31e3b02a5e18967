"""How noisy is a real micrograph, in the terms of picking_recall.py's SNR? (issue 48 item 4: "SNR as in real data")

picking_recall.py's micrographs have white noise at a per-particle SNR (the CTF'd particle's variance in its 86-px
box over the noise variance). A real micrograph's noise is not white and its particles are unknown, so both are put
on one scale that needs neither: the **field SNR**, the power of everything above the noise between ``--low_cut`` and
``--top`` Å over the noise power in that band, with the noise power spectrum taken flat at its mean level in
``--noise_band`` (the band just finer than ``--top``: for white noise exact; for a counting detector, whose noise
power falls towards Nyquist, the noise near ``--top`` probably stands in for the coarser band fairly, and low-frequency
noise above that level would make the real figure smaller). Spectra are averaged over square tiles.

Then the simulated micrographs of picking_recall.py at given SNRs on the same scale, and the real micrograph's
per-particle SNR is estimated by the ratio of the field SNRs, divided by the ratio of particles per area (the real
field's LoG picks against the simulation's particles): an estimate, with the assumptions named in the JSON.

  python benchmarks/micrograph_snr.py --out benchmarks/results/micrograph_snr_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import picking_recall as pr  # noqa: E402

from napari_gpu_relion.io.mrc import read_mrc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "real" / "real_micrograph_epu_4096.mrc"


def field_snr(img: np.ndarray, apix: float, noise_band: tuple[float, float], top: float, low_cut: float,
              tile: int) -> tuple[float, float]:
    """(field SNR, noise power per Fourier pixel) of ``img`` (pixel size ``apix`` Å): the power between ``low_cut``
    and ``top`` Å above a flat noise level, the mean power in ``noise_band`` (Å, (fine, coarse)), over that noise
    power; power spectra averaged over the ``tile``-pixel squares of the image."""
    img = np.asarray(img, np.float64)
    ps = np.zeros((tile, tile))
    k = 0
    for i in range(0, img.shape[0] - tile + 1, tile):
        for j in range(0, img.shape[1] - tile + 1, tile):
            t = img[i:i + tile, j:j + tile]
            ps += np.abs(np.fft.fft2(t - t.mean())) ** 2 / tile ** 2
            k += 1
    ps /= k
    f = np.fft.fftfreq(tile)
    r = np.sqrt(f[:, None] ** 2 + f[None, :] ** 2) / apix  # 1/Å
    noise = float(ps[(r >= 1 / noise_band[1]) & (r < 1 / noise_band[0])].mean())
    sel = (r >= 1 / low_cut) & (r < 1 / top)
    return float((ps[sel] - noise).sum() / (noise * sel.sum())), noise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", type=Path, default=REAL)
    ap.add_argument("--real_apix", type=float, default=0.667)
    ap.add_argument("--real_picks", type=int, default=178,
                    help="particles in the real micrograph (pick_real_micrograph.py's LoG picks, 150-250 Å)")
    ap.add_argument("--snrs", default="0.02,0.03,0.1")
    ap.add_argument("--top", type=float, default=10.7, help="finest resolution counted (Å): 5.35 Å/px's Nyquist")
    ap.add_argument("--low_cut", type=float, default=100.0, help="coarsest resolution counted (Å): ice gradients out")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    img = np.asarray(read_mrc(a.real).data, np.float64)
    real, real_noise = field_snr(img, a.real_apix, (8.0, a.top), a.top, a.low_cut, 1024)
    side_A = img.shape[0] * a.real_apix
    res = {"gpu": "CPU", "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "real": {"file": str(a.real.name), "field_snr": real, "noise_band_A": [8.0, a.top],
                    "particles_per_1000A2": a.real_picks / (side_A / 1000) ** 2},
           "simulated": {}, "band_A": [a.top, a.low_cut]}
    print(f"real micrograph: field SNR {real:.3f} ({a.top:g}-{a.low_cut:g} Å, noise from 8-{a.top:g} Å)")
    vol = pr.ribosome()
    for snr in (float(s) for s in a.snrs.split(",")):
        with tempfile.TemporaryDirectory() as d:
            m = pr.make_dataset(Path(d), vol, snr, n_mics=1)[0]
        fs, _ = field_snr(-np.asarray(m.image, np.float64), pr.APIX, (10.0, 11.0), a.top, a.low_cut, pr.SIZE)
        side = pr.SIZE * pr.APIX
        per_area = len(m.coords) / (side / 1000) ** 2
        est = snr * (real / fs) * (per_area / res["real"]["particles_per_1000A2"])
        res["simulated"][f"{snr:g}"] = {"field_snr": fs, "particles_per_1000A2": per_area,
                                        "real_per_particle_snr_estimate": est}
        print(f"simulated SNR {snr:g}: field SNR {fs:.4f}; the real micrograph's per-particle SNR on this scale "
              f"~{est:.3f} (field SNR ratio {real / fs:.1f}, particles per area ratio "
              f"{res['real']['particles_per_1000A2'] / per_area:.2f})")
    res["assumptions"] = ("noise power flat below the noise band (white); particles per area from the LoG pick count; "
                          "particle mass and size differences (70S simulated, the real sample unknown) not corrected")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Science benchmark: picking accuracy on simulated low-SNR micrographs (issue 16, item 3).

Micrographs from the project's simulator (compute/simulate.py ``simulate_micrograph``): the pseudo-atomic phantom
(150 Å) at random orientations and known integer positions, the micrograph's CTF (defocus 1.2-2.4 µm, 300 kV),
dark particles (raw contrast), dark contamination blobs (1-2 box radii, soft edges) and white noise at a
per-particle SNR (signal variance inside each particle's box / noise variance). Pickers, all through
``jobs.autopick`` as the CLI runs them:

- ``log``: RELION's LoG (diameters 120-180 Å), curve over ``--LoG_adjust_threshold``;
- ``log_robust``: the same with ``--LoG_robust_stats`` (median/MAD; not RELION);
- ``map``: templates = the true 3D map (``--ref map.mrc --ctf --invert --lowpass 20 --ang 10``), curve over the
  FOM threshold;
- ``class2d``: templates = simulated 2D class averages (see :func:`class_averages`), same options;
- ``map_relion``, ``class2d_relion``: the same with ``--fom relion`` (RELION's probability-ratio FOM, what the
  template picker computed before issue 16).

A pick is correct within D/4 of a particle; particles overlapping contamination are "don't care" (as in
tests/test_autopick.py). For each threshold: recall and precision pooled over the micrographs. Reported: the
curves, the best recall at precision >= 0.8 and the precision at recall 0.6 and 0.9.

Run: python benchmarks/science_picking.py [--cpu] [--snr 0.1] [--n_mics 3] [--out benchmarks/results/X.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute import simulate as sim
from napari_gpu_relion.compute.fourier import irfft_centered, radius_grid, rfft_centered
from napari_gpu_relion.compute.geometry import euler_to_matrix
from napari_gpu_relion.compute.ground_truth import pick_matches
from napari_gpu_relion.events import MicrographPicked
from napari_gpu_relion.io.mrc import write_mrc
from napari_gpu_relion.jobs import autopick
from napari_gpu_relion.jobs.simulate import write_micrographs
from napari_gpu_relion.runtime.device import select_backend

APIX, BOX, DIAM = 3.0, 64, 150.0


def make_dataset(folder: Path, n_mics: int, size: int, n_particles: int, snr: float, seed: int = 0,
                 n_contamination: int = 2):
    """Write micrographs + micrographs.star + the true map into ``folder``; return (phantom, micrographs)."""
    ph = sim.pseudo_atomic_phantom(DIAM, seed=0)
    mics = [sim.simulate_micrograph(ph, (size, size), APIX, n_particles, BOX, snr=snr, seed=seed + 100 + k,
                                    n_contamination=n_contamination,
                                    defocus_A=12000.0 + 12000.0 * k / max(1, n_mics - 1))
            for k in range(n_mics)]
    write_micrographs(folder, mics, APIX)
    write_mrc(folder / "map.mrc", sim.phantom_volume(ph, BOX, APIX), APIX)
    return ph, mics


def fibonacci_directions(n: int) -> np.ndarray:
    """``n`` near-uniform viewing directions as (rot, tilt) degrees (Fibonacci sphere)."""
    i = np.arange(n) + 0.5
    tilt = np.degrees(np.arccos(1 - 2 * i / n))
    rot = (np.degrees(np.pi * (1 + 5**0.5) * i) + 180) % 360 - 180
    return np.stack([rot, tilt], 1)


def class_averages(ph: sim.Phantom, n_classes: int = 20, per_class: int = 40, spread_deg: float = 10.0,
                   snr: float = 20.0, lowpass_A: float = 12.0, seed: int = 5) -> np.ndarray:
    """Simulated 2D class averages (what 2D classification of these particles gives, without running it): per
    class a viewing direction (Fibonacci sphere) and the mean of ``per_class`` projections whose directions
    scatter by ``spread_deg`` (s.d. per Euler angle) with in-plane errors of 3° and offsets of 1 px (s.d.), at a
    random in-plane angle (the picker must find psi), low-passed to ``lowpass_A``, residual noise at ``snr``,
    background flat zero outside a 0.9-box circle, scaled to unit standard deviation (arbitrary units)."""
    rng = np.random.default_rng(seed)
    dirs = fibonacci_directions(n_classes)
    out = []
    for rot, tilt in dirs:
        psi0 = rng.uniform(-180, 180)
        ang = np.stack([rot + rng.normal(0, spread_deg, per_class), tilt + rng.normal(0, spread_deg, per_class),
                        psi0 + rng.normal(0, 3.0, per_class)], 1)
        A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
        p = sim.phantom_projections(ph, A, BOX, APIX, shifts_px=rng.normal(0, 1.0, (per_class, 2))).mean(0)
        out.append(p)
    avg = np.stack(out).astype(np.float64)
    avg += rng.normal(0, np.sqrt(avg.var(axis=(1, 2), keepdims=True) / snr), avg.shape)
    F = rfft_centered(avg, 2)
    F = np.where(radius_grid(BOX, 2) <= BOX * APIX / lowpass_A, F, 0)
    avg = irfft_centered(F, BOX, 2)
    c = np.arange(BOX) - BOX // 2
    avg *= (c[:, None] ** 2 + c[None, :] ** 2) < (0.45 * BOX) ** 2
    return (avg / avg.std(axis=(1, 2), keepdims=True)).astype(np.float32)


def run_picker(folder: Path, odir: str, cpu: bool, **kw) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Run autopick in ``folder``; {micrograph name: (xy (n, 2), fom (n,))}."""
    p = autopick.Params(i=folder / "micrographs.star", odir=folder / odir, cpu=cpu, **kw)
    out = {}
    for ev in autopick.run(p):
        if isinstance(ev, MicrographPicked):
            out[ev.name] = (np.asarray(ev.coords, float).reshape(-1, 2), np.asarray(ev.scores, float))
    return out


def care_mask(m: sim.SimulatedMicrograph) -> np.ndarray:
    """False for particles whose box overlaps a contamination blob (neither missed nor counted)."""
    t, c = m.coords.astype(float), m.contamination
    if not len(c):
        return np.ones(len(t), bool)
    d = np.hypot(t[:, None, 0] - c[None, :, 0], t[:, None, 1] - c[None, :, 1])
    return ~(d < c[None, :, 2] + BOX / 2).any(1)


def score(mics, picks: dict, threshold: float) -> tuple[float, float, int]:
    """(recall, precision, picks) pooled over the micrographs, picks with FOM >= threshold."""
    tot = np.zeros(4)
    for k, m in enumerate(mics):
        xy, fom = picks.get(f"Micrographs/mic{k:03d}.mrc", (np.zeros((0, 2)), np.zeros(0)))
        sel = fom >= threshold
        tot += pick_matches(m.coords.astype(float), xy[sel], DIAM / 4 / APIX, care_mask(m))
    return tot[0] / max(tot[1], 1), tot[2] / max(tot[3], 1), int(tot[3])


def curve_over_fom(mics, picks: dict, n_points: int = 60) -> list[dict]:
    """Recall/precision at FOM thresholds spread over the picks' FOM quantiles (highest first)."""
    fom = np.concatenate([f for _, f in picks.values()]) if picks else np.zeros(0)
    if not fom.size:
        return []
    ts = np.unique(np.quantile(fom, np.linspace(0, 1, n_points)))[::-1]
    out = []
    for t in ts:
        r, p, n = score(mics, picks, float(t))
        out.append({"threshold": float(t), "recall": r, "precision": p, "picks": n})
    return out


def summary(curve: list[dict]) -> dict:
    def prec_at(r0):
        ok = [c["precision"] for c in curve if c["recall"] >= r0]
        return max(ok) if ok else None

    good = [c for c in curve if c["precision"] >= 0.8]
    best = max(good, key=lambda c: c["recall"]) if good else None
    return {"recall_at_precision_0.8": best["recall"] if best else 0.0,
            "threshold_there": best["threshold"] if best else None,
            "precision_at_recall_0.6": prec_at(0.6), "precision_at_recall_0.9": prec_at(0.9),
            "max_recall": max(c["recall"] for c in curve) if curve else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--snr", type=float, default=0.1)
    ap.add_argument("--n_mics", type=int, default=3)
    ap.add_argument("--size", type=int, default=768)
    ap.add_argument("--n_particles", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pickers", default="log,log_robust,map,class2d,map_relion,class2d_relion")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be = select_backend(cpu=args.cpu)
    res = {"device": be.name, "host": platform.node(), "snr_per_particle": args.snr, "n_micrographs": args.n_mics,
           "micrograph_px": args.size, "particles_per_micrograph": args.n_particles, "pixel_size_A": APIX,
           "box_px": BOX, "particle_diameter_A": DIAM, "seed": args.seed, "pickers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ph, mics = make_dataset(folder, args.n_mics, args.size, args.n_particles, args.snr, args.seed)
        res["contamination_blobs"] = int(sum(len(m.contamination) for m in mics))
        res["particles_counted"] = int(sum(care_mask(m).sum() for m in mics))
        write_mrc(folder / "classes.mrcs", class_averages(ph), APIX)
        tmpl = {"ctf": True, "invert": True, "lowpass": 20.0, "ang": 10.0, "particle_diameter": DIAM,
                "threshold": -1e30, "min_distance": DIAM * 0.6}
        for name in args.pickers.split(","):
            t0 = time.perf_counter()
            fixed = {}
            if name.startswith("log"):
                curve = []
                for adj in np.arange(-1.0, 8.01, 0.25):
                    picks = run_picker(folder, f"{name}_{adj:g}", args.cpu, LoG=True, LoG_diam_min=120.0,
                                       LoG_diam_max=180.0, LoG_adjust_threshold=float(adj),
                                       LoG_robust_stats=name == "log_robust")
                    r, p, n = score(mics, picks, -np.inf)
                    curve.append({"threshold": float(adj), "recall": r, "precision": p, "picks": n})
                kind = "LoG_adjust_threshold"
            else:
                ref = "map.mrc" if name.startswith("map") else "classes.mrcs"
                fom = "relion" if name.endswith("_relion") else "zscore"
                picks = run_picker(folder, name, args.cpu, ref=folder / ref, fom=fom, **tmpl)
                curve = curve_over_fom(mics, picks)
                kind = "FOM"
                for t in ((3.0, 4.0, 5.0, 6.0, 7.0) if fom == "zscore" else ()):
                    r, p, n = score(mics, picks, t)
                    fixed[f"{t:g}"] = {"recall": r, "precision": p, "picks": n}
                    print(f"  {name} --threshold {t:g}: recall {r:.3f} precision {p:.3f} ({n} picks)")
            dt = time.perf_counter() - t0
            res["pickers"][name] = {"threshold_kind": kind, "seconds": dt, **summary(curve), "curve": curve}
            if kind == "FOM":
                res["pickers"][name]["at_threshold"] = fixed
            s = res["pickers"][name]
            print(f"{name:11s} recall@prec0.8 {s['recall_at_precision_0.8']:.3f} (threshold {s['threshold_there']}) "
                  f"prec@rec0.6 {s['precision_at_recall_0.6']} prec@rec0.9 {s['precision_at_recall_0.9']} "
                  f"max recall {s['max_recall']:.3f}  {dt:.1f} s", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

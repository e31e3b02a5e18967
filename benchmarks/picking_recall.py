"""Template picking's recall ceiling (issue 48, item 4): which particles are never picked at any threshold, and why.

Data (our simulator, seeded): three (--n_mics) 512 x 512 micrographs at 5 Å/px of the real 70S ribosome map
(../shared/data/real/ribosome70S_65px.mrc, ~5 Å/px, padded to an 86-pixel box), ~30 particles each at random
orientations, centres at least 360 Å (72 px) apart and at least 43 px from the edges, the micrograph's CTF
(defocus 1.5 / 2.0 / 2.5 µm in turn, 300 kV), dark particles, no contamination, white noise at a per-particle SNR
(signal variance inside each particle's box over the noise variance, as compute/simulate.py defines it).

Picking: the autopick job as the CLI runs it, with the issue's options ``--ref REF --angpix_ref 5 --ang 10 --ctf
--invert --lowpass 20 --threshold -999 --min_distance 200`` (so every peak is kept; the curve thresholds the picks'
FOMs afterwards), REF = the true map (``map``) or the map low-passed to 60 Å (``map60``). A particle is found when a
pick lies within --match_px (26 px = 130 Å, the ribosome's radius); a pick is correct when a particle lies within it.
Reported per SNR and reference: the recall ceiling (particles with a pick nearby at threshold -999), the precision at
recall 0.7 / 0.8 / 0.9 and the recall at precision >= 0.8, and with --diagnose the fate of every particle that is
never picked (see :func:`diagnose`).

"Before" = this script run on the code before the fix (the JSON names the commit; the simulator's new arguments were
already in place). After the fix, ``--oversample 1`` puts the z-score FOM back on RELION's working grid
(jobs.autopick.ZSCORE_OVERSAMPLE), which separates the two fixes; the pair rule stays fixed.

Run: python benchmarks/picking_recall.py --snr 0.01,0.02,0.03 --diagnose --label after \
        --out benchmarks/results/picking_recall_after_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.spatial import cKDTree

from napari_gpu_relion.compute import picking as pk
from napari_gpu_relion.compute import simulate as sim
from napari_gpu_relion.compute.fourier import irfft_centered, lowpass_map, round_half_away
from napari_gpu_relion.compute.projector import prepare_reference, project
from napari_gpu_relion.events import MicrographPicked
from napari_gpu_relion.io.micrographs import micrograph_list
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.jobs import autopick
from napari_gpu_relion.jobs.simulate import write_micrographs
from napari_gpu_relion.runtime.device import select_backend

APIX, BOX, SIZE = 5.0, 86, 512
MAP = Path(__file__).resolve().parents[2] / "shared" / "data" / "real" / "ribosome70S_65px.mrc"
OPTIONS = {"angpix_ref": APIX, "ang": 10.0, "ctf": True, "invert": True, "lowpass": 20.0, "threshold": -999.0,
           "min_distance": 200.0}


def ribosome(box: int = BOX) -> np.ndarray:
    """The 70S map in a ``box`` cube, unit standard deviation."""
    vol = sim.fit_box(np.asarray(read_mrc(MAP).data, np.float32), box)
    return (vol / vol.std()).astype(np.float32)


def make_dataset(folder: Path, vol: np.ndarray, snr: float, n_mics: int = 3, n_particles: int = 30, seed: int = 0,
                 size: int = SIZE, min_distance_px: float = 72.0, margin_px: int = 43) -> list:
    """Micrographs, micrographs.star, map.mrc and map60.mrc in ``folder``; returns the SimulatedMicrographs."""
    box = vol.shape[-1]
    ref = prepare_reference(vol.astype(np.float64), pad=2)

    def proj(A):
        return irfft_centered(project(ref, A), box, 2).astype(np.float32)

    # micrograph k of seed s draws from seed s * 1000 + 100 + k (seed 0 as before; before the thirty-sixth session
    # seed + 100 + k, so seeds 0 and 1 shared two micrographs), defocus 1.5 / 2.0 / 2.5 µm in turn
    mics = [sim.simulate_micrograph(None, (size, size), APIX, n_particles, box, snr=snr,
                                    seed=seed * 1000 + 100 + k, defocus_A=15000.0 + 5000.0 * (k % 3),
                                    n_contamination=0, min_distance_px=min_distance_px, projections_fn=proj,
                                    margin_px=margin_px)
            for k in range(n_mics)]
    write_micrographs(folder, mics, APIX)
    write_mrc(folder / "map.mrc", vol, APIX)
    write_mrc(folder / "map60.mrc", lowpass_map(vol.astype(np.float64), APIX, 60.0).astype(np.float32), APIX)
    return mics


def run_picker(folder: Path, ref: str, odir: str, **kw) -> dict:
    """{micrograph name: (xy (n, 2), fom (n,))} from the autopick job."""
    p = autopick.Params(i=folder / "micrographs.star", odir=folder / odir, ref=folder / ref, cpu=True,
                        **{**OPTIONS, **kw})
    out = {}
    for ev in autopick.run(p):
        if isinstance(ev, MicrographPicked):
            out[ev.name] = (np.asarray(ev.coords, float).reshape(-1, 2), np.asarray(ev.scores, float))
    return out


def wilson(p: float, n: int, z: float = 1.96) -> list[float]:
    """Wilson's 95 % interval of a proportion ``p`` of ``n`` (a guide to how many particles a recall is short by:
    the recall at precision 0.8 is a maximum over thresholds, so its spread is somewhat wider)."""
    if n <= 0:
        return [0.0, 1.0]
    d = 1.0 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return [round(float(c - h), 4), round(float(c + h), 4)]


def curve(mics, picks: dict, radius: float) -> dict:
    """Recall ceiling, precision/recall at every pick's FOM as threshold (pooled), and the summary figures."""
    best, fom, hit = [], [], []
    for k, m in enumerate(mics):
        xy, f = picks[f"Micrographs/mic{k:03d}.mrc"]
        t = m.coords.astype(float)
        d, j = cKDTree(xy).query(t) if len(xy) else (np.full(len(t), np.inf), np.zeros(len(t), int))
        best.append(np.where(d <= radius, f[np.minimum(j, max(len(f) - 1, 0))] if len(f) else -np.inf, -np.inf))
        dp, _ = cKDTree(t).query(xy) if len(xy) else (np.zeros(0), None)
        fom.append(f)
        hit.append(dp <= radius)
    best, fom, hit = np.concatenate(best), np.concatenate(fom), np.concatenate(hit)
    n = best.size
    pts = []
    for th in np.unique(fom)[::-1]:
        sel = fom >= th
        pts.append((float(th), float((best >= th).sum() / n), float(hit[sel].mean()), int(sel.sum())))

    def prec_at(r0):
        ok = [p for _, r, p, _ in pts if r >= r0]
        return max(ok) if ok else None

    good = [r for _, r, p, _ in pts if p >= 0.8]
    rec = max(good) if good else 0.0
    return {"recall_at_precision_0.8_wilson95": wilson(rec, n),
            "particles": int(n), "picks": int(fom.size), "recall_ceiling": float(np.isfinite(best).sum() / n),
            "never_picked": int((~np.isfinite(best)).sum()), "precision_at_recall_0.7": prec_at(0.7),
            "precision_at_recall_0.8": prec_at(0.8), "precision_at_recall_0.9": prec_at(0.9),
            "recall_at_precision_0.8": rec,
            "curve": [{"threshold": t, "recall": r, "precision": p, "picks": c} for t, r, p, c in pts[::4]]}


def diagnose(folder: Path, ref: str, mics, radius: float, **kw) -> list[dict]:
    """The fate of every particle with no pick within ``radius``: the autopick job's template maps recomputed
    (its own functions, same options) and RELION's peak search replayed stage by stage. Cause: ``no_candidate``
    (no local maximum passes; ``edge`` says whether the FOM maximum near it lies in the skipped border, ``sigma``
    whether the local-sigma limit rejects it), ``pruned`` (a stronger peak within min_distance removed it in the
    cluster pruning; its FOM and distance from the particle), ``pair_drop`` (it survived the pruning and went in the
    last pass over all clusters, with the partners closer than or (RELION's rule, before the fix) exactly
    min_distance away: their FOMs and distances on the maps' grid; RELION's rule dropped both members of a pair,
    the fixed one only the weaker)."""
    p = autopick.Params(i=folder / "micrographs.star", odir=folder / "diag", ref=folder / ref, cpu=True,
                        **{**OPTIONS, **kw})
    be = select_backend(cpu=True)
    ml = micrograph_list(p.i, p.angpix)
    refs, _ = autopick.load_references(p, APIX, None)
    st = autopick._setup((SIZE, SIZE), p, APIX, np, refs, be)
    g, e = st.grid, st.extra
    link = refs.radius_px * g.scale
    mind = float(round_half_away(np.float64(p.min_distance / APIX))) * g.scale
    out = []
    for k, ent in enumerate(ml.entries):
        raw = np.asarray(read_mrc(folder / ent.name).data)
        x = autopick._prepare([raw], g, p, np, invert=False, seed=0)[0]
        X = pk.crop_spectrum(pk.micrograph_spectrum(x), g.w)
        c_w = autopick._ctf_on(autopick._ctf_of(ml, ent.row), g.n, g.w, APIX, np)
        mic = pk.whiten_micrograph(X, e["ring_ww"], e["n_ring_w"], st.downsize / 2)
        maps = pk.template_zscore_maps(mic, e["bank"], e["psi"], e["pixels"], g.n, c_w, not p.no_local_sigma,
                                       batch=256)
        kk, yy, xx = pk.template_candidates(maps.fom, maps.sigma, maps.mu, p.threshold, st.inside,
                                            p.max_stddev_noise, p.min_avg_noise, g.scale)
        f = maps.fom[kk, yy, xx].astype(np.float64)
        xy = np.stack([xx, yy], 1).astype(np.float64)
        keep = np.zeros(kk.size, bool)
        for r in np.unique(kk):
            sel = np.flatnonzero(kk == r)
            keep[sel] = pk.prune_peaks(xy[sel], f[sel], link, mind)
        i1 = np.flatnonzero(keep)
        i2 = i1[pk.prune_peaks(xy[i1], f[i1], link, mind)]
        i3 = i2[pk.prune_peaks(xy[i2], f[i2], np.inf, mind)] if not hasattr(pk, "drop_close_pairs") else \
            i2[pk.drop_close_pairs(xy[i2], mind)]
        Xc, Yc = g.to_micrograph(yy[i3], xx[i3])
        t = mics[k].coords.astype(float)
        d_pick, _ = cKDTree(np.stack([Xc, Yc], 1)).query(t)
        best = maps.fom.max(0)
        gy, gx = np.mgrid[0:g.w, 0:g.w]
        for i in np.flatnonzero(d_pick > radius):
            cx, cy = t[i] * g.scale
            rw = radius * g.scale
            disc = (gy - cy) ** 2 + (gx - cx) ** 2 <= rw * rw
            am = np.flatnonzero(disc.ravel())[np.argmax(best[disc])]
            my, mx = divmod(int(am), g.w)
            rec = {"micrograph": k, "x": int(t[i, 0]), "y": int(t[i, 1]),
                   "edge_distance_px": int(min(t[i, 0], t[i, 1], SIZE - 1 - t[i, 0], SIZE - 1 - t[i, 1])),
                   "fom_max_near": float(best[my, mx]),
                   "fom_max_offset_px": float(np.hypot(my - cy, mx - cx) / g.scale),
                   "local_sigma_there": float(maps.sigma[my, mx]),
                   "nearest_pick_px": float(d_pick[i])}
            close = np.hypot(xy[:, 0] - cx, xy[:, 1] - cy) <= rw  # candidates within the radius
            n0, n2 = np.flatnonzero(close), i2[close[i2]]
            if n0.size == 0:
                rec["cause"] = "no_candidate"
                rec["edge"] = not bool(st.inside[my, mx])
                rec["sigma"] = bool(p.max_stddev_noise > 0 and maps.sigma[my, mx] > p.max_stddev_noise)
            elif n2.size == 0:
                rec["cause"] = "pruned"
                b = n0[np.argmax(f[n0])]
                dq = np.hypot(*(xy[i2] - xy[b]).T)
                s = i2[np.argmin(np.where(f[i2] > f[b], dq, np.inf))]
                rec["own_peak_fom"] = float(f[b])
                rec["by_fom"] = float(f[s])
                rec["by_distance_from_particle_px"] = float(np.hypot(xy[s, 0] - cx, xy[s, 1] - cy) / g.scale)
            else:
                rec["cause"] = "pair_drop"
                b = n2[np.argmax(f[n2])]
                dq = np.hypot(*(xy[i2] - xy[b]).T)
                partner = i2[(dq <= mind * (1 + 1e-12)) & (i2 != b)]
                rec["own_peak_fom"] = float(f[b])
                rec["partner_fom"] = [float(v) for v in f[partner]]
                rec["partner_distance_working_px"] = [float(v) for v in dq[(dq <= mind * (1 + 1e-12)) & (i2 != b)]]
                rec["min_distance_working_px"] = mind
            out.append(rec)
    return out


def sampling_loss(folder: Path, ref: str, mics, fine_shrink: float = 1.0) -> dict:
    """How much FOM a particle loses on RELION's working grid: the FOM map on the full grid (``--shrink 1``: 5 Å
    pixels here) at each true centre, against the best of the same map's values at the coarse grid's pixels (every
    second pixel, the 10 Å grid of ``--shrink 0 --lowpass 20``) within 1.5 px of it."""
    p = autopick.Params(i=folder / "micrographs.star", odir=folder / "diag", ref=folder / ref, cpu=True,
                        **{**OPTIONS, "shrink": fine_shrink})
    be = select_backend(cpu=True)
    ml = micrograph_list(p.i, p.angpix)
    refs, _ = autopick.load_references(p, APIX, None)
    st = autopick._setup((SIZE, SIZE), p, APIX, np, refs, be)
    g, e = st.grid, st.extra
    assert g.w == SIZE
    exact, coarse = [], []
    for k, ent in enumerate(ml.entries):
        raw = np.asarray(read_mrc(folder / ent.name).data)
        x = autopick._prepare([raw], g, p, np, invert=False, seed=0)[0]
        X = pk.crop_spectrum(pk.micrograph_spectrum(x), g.w)
        c_w = autopick._ctf_on(autopick._ctf_of(ml, ent.row), g.n, g.w, APIX, np)
        mic = pk.whiten_micrograph(X, e["ring_ww"], e["n_ring_w"], st.downsize / 2)
        best = pk.template_zscore_maps(mic, e["bank"], e["psi"], e["pixels"], g.n, c_w, True, batch=256).fom.max(0)
        for cx, cy in mics[k].coords:
            exact.append(float(best[cy, cx]))
            cand = [best[y, x] for y in range(cy - 1, cy + 2) for x in range(cx - 1, cx + 2)
                    if y % 2 == 0 and x % 2 == 0]
            coarse.append(float(max(cand)))
    exact, coarse = np.array(exact), np.array(coarse)
    odd = np.array([(x % 2) + (y % 2) for m in mics for x, y in m.coords])
    return {"fom_at_centre_mean": float(exact.mean()), "fom_on_coarse_grid_mean": float(coarse.mean()),
            "mean_loss_by_odd_coordinates": {str(q): float((exact - coarse)[odd == q].mean()) for q in (0, 1, 2)},
            "mean_relative_loss": float(np.mean((exact - coarse) / exact))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--snr", default="0.01,0.02,0.03")
    ap.add_argument("--refs", default="map,map60")
    ap.add_argument("--n_mics", type=int, default=3)
    ap.add_argument("--n_particles", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--match_px", type=float, default=26.0)
    ap.add_argument("--extra", default="{}", help="more autopick Params as JSON, e.g. '{\"no_local_sigma\": true}'")
    ap.add_argument("--oversample", type=int, default=None, help="set jobs.autopick.ZSCORE_OVERSAMPLE (1: RELION's "
                    "working grid; the code after the fix)")
    ap.add_argument("--diagnose", action="store_true", help="the cause of every never-picked particle")
    ap.add_argument("--sampling", action="store_true", help="the FOM lost on the coarse working grid")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    extra = json.loads(args.extra)
    if args.oversample is not None:
        autopick.ZSCORE_OVERSAMPLE = args.oversample
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=root).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True,
                                cwd=root).stdout.strip())
    res = {"hardware": f"CPU, {os.cpu_count()} cores", "label": args.label, "commit": commit,
           "src_uncommitted_changes": dirty, "options": {**OPTIONS, **extra},
           "zscore_oversample": getattr(autopick, "ZSCORE_OVERSAMPLE", 1), "match_radius_px": args.match_px,
           "data": {"micrograph_px": SIZE, "pixel_size_A": APIX, "box_px": BOX, "map": MAP.name,
                    "n_micrographs": args.n_mics, "particles_per_micrograph": args.n_particles,
                    "min_particle_distance_A": 360.0, "edge_margin_px": 43, "defocus_um": [1.5, 2.0, 2.5],
                    "seed": args.seed, "micrograph_seeds": "seed * 1000 + 100 + k (thirty-sixth session on; "
                    "before: seed + 100 + k)"}, "snr": {}}
    vol = ribosome()
    for snr in (float(s) for s in args.snr.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            mics = make_dataset(folder, vol, snr, args.n_mics, args.n_particles, args.seed)
            entry = {"particles": int(sum(len(m.coords) for m in mics))}
            for ref in args.refs.split(","):
                t0 = time.perf_counter()
                picks = run_picker(folder, f"{ref}.mrc", f"out_{ref}", **extra)
                r = {"seconds": time.perf_counter() - t0, **curve(mics, picks, args.match_px)}
                if args.diagnose:
                    r["never_picked_causes"] = diagnose(folder, f"{ref}.mrc", mics, args.match_px, **extra)
                    r["cause_counts"] = {c: sum(d["cause"] == c for d in r["never_picked_causes"])
                                         for c in ("no_candidate", "pruned", "pair_drop")}
                if args.sampling:
                    r["sampling"] = sampling_loss(folder, f"{ref}.mrc", mics)
                entry[ref] = r
                print(f"SNR {snr:g} {ref:6s} ceiling {r['recall_ceiling']:.3f} ({r['never_picked']} never picked, "
                      f"{r['picks']} picks)  precision at recall 0.7/0.8/0.9: {r['precision_at_recall_0.7']} / "
                      f"{r['precision_at_recall_0.8']} / {r['precision_at_recall_0.9']}  recall at precision 0.8: "
                      f"{r['recall_at_precision_0.8']:.3f} (95 % {r['recall_at_precision_0.8_wilson95']})  "
                      f"{r['seconds']:.0f} s"
                      + (f"  causes {r['cause_counts']}" if args.diagnose else ""), flush=True)
            res["snr"][f"{snr:g}"] = entry
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

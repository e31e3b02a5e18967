"""Issue 16 diagnostic: RELION's own coarse-pass diff2 against ours, sample by sample, from the same state.

Input: a dump of RELION's coarse pass (exp_ipass == 0 of MlOptimiser::getAllSquaredDifferences, the CPU path of a
RELION 5 build without CUDA, with a local debug print; not part of this repository) for a few particles of one
iteration continued from RELION's iteration-k files. Per particle ``p<part_id>``, float64 little-endian:

* ``_diff2.bin``: records of 11 values (class 0-based, idir, ipsi, itrans, rot, tilt, psi, x, y, diff2, ihidden):
  every coarse sample RELION scored, translations in pixels relative to the pre-shifted image;
* ``_fimg.bin``, ``_fimgshift0.bin`` (complex), ``_minvsigma2.bin``, ``_ctf.bin``, ``_mresol.bin``: RELION's
  (s, s/2+1) arrays at the coarse size s: the masked, pre-shifted image, the same shifted by translation 0,
  1/sigma2 per pixel (0 where not used), the CTF, the shell index (-1 where not used);
* ``.txt``: name, part_id, old_offset (rounded, px), highres_Xi2, coarse and current size, ...
* ``fref.bin`` (one particle only): records (class, idir, ipsi) + the (s, s/2+1) complex projection before the CTF;
* optional, ``_fine_diff2.bin``: the fine pass's records of 14 (class, idir, ipsi, iover_rot, itrans, iover_trans,
  rot, tilt, psi, x, y, diff2, ihidden_over, parent ihidden) at the current size; ``_w0.bin`` / ``_w1.bin``:
  (index, weight, significant) of the positive weights after convertAllSquaredDifferencesToWeights of each pass
  (priors included), ``_w0.txt``: min_diff2, sigma2_offset, old offset, ...

Row i of RELION's (s, s/2+1) arrays holds ky = i for i <= s/2 (so ky = +s/2, not -s/2), else i - s.

For every RELION sample the script computes diff2 in several ways from the same iteration-k state (model STAR's
maps, noise spectrum; our prepare_batch image and our CTF unless stated):

* ``emulated``: RELION's pixel set, weights, CTF and image (all from the dump) with our projection zeroed where
  kx^2 + ky^2 > (s/2)^2, plus highres_Xi2 / 2: must equal RELION's diff2 (checks the projection and the shift);
* ``ours``: our E-step's coarse formula (pixel_set(N, s), w = 1/(2 sigma2), reference prepared at r_max =
  current_size / 2 as jobs/em.py does, no truncation at s/2);
* ``ours_truncated``: ``ours`` with the projection zeroed beyond |k| = s/2 (RELION's projector) -- the candidate fix;
* ``scorer``: score_two_poses.py's formula (reference prepared at r_max = s/2).

and the terms (image, CTF, 1/sigma2, projection) against RELION's. With the weights it also checks which prior
RELION applied (log weight + diff2 - min_diff2 against log pdf_direction + four offset priors: the translations
perturbed or not, RELION's or consistent units) and where RELION's coarse parents and ours stand; with the fine
pass, ours against RELION's fine diff2 and whether RELION evaluated our pose at all. Per particle it reports how
well each variant follows RELION's diff2 across samples (the spread of RELION minus variant; a constant offset
is irrelevant), and the diff2 difference between the coarse parents of RELION's and our iteration-(k+1) pose.

Run: python benchmarks/relion_coarse_scores.py --data /tmp/p/p60 --relion relion_class3d_k2s1/run --it 4 \
        --b ours_from_relion_class3d_k2s1_it004_u4/run_it005_data.star --dump /tmp/i16/dump3 \
        --out benchmarks/results/relion_coarse_diff2_p60_k2s1_it004_cpu.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion  # noqa: E402
from score_two_poses import pair_arguments  # noqa: E402

from napari_gpu_relion.compute.ctf import ctf_from_frequencies  # noqa: E402
from napari_gpu_relion.compute.estep import prepare_batch  # noqa: E402
from napari_gpu_relion.compute.expectation import pixel_set  # noqa: E402
from napari_gpu_relion.compute.geometry import euler_to_matrix  # noqa: E402
from napari_gpu_relion.compute.projector import prepare_reference, project_pixels  # noqa: E402
from napari_gpu_relion.io.model_star import read_model_star  # noqa: E402
from napari_gpu_relion.jobs import em  # noqa: E402
from napari_gpu_relion.jobs.particles import load_particle_set  # noqa: E402

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


def read_meta(path: Path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        k, *v = line.split()
        out[k] = v[0] if len(v) == 1 else v
    return out


def relion_grid(s: int):
    """(kx, ky) of RELION's (s, s/2+1) FFTW array, row i -> ky = i for i <= s/2 (FOR_ALL_ELEMENTS_IN_FFTW_TRANSFORM)."""
    i = np.arange(s)
    ky = np.where(i < s // 2 + 1, i, i - s)
    KY, KX = np.meshgrid(ky, np.arange(s // 2 + 1), indexing="ij")
    return KX.reshape(-1).astype(np.float64), KY.reshape(-1).astype(np.float64)


def diff2_table(X, C, w, P, kx, ky, trans, box):
    """diff2[o, t] = sum_k w |X e_t - C P_o|^2 for orientations o (P: (O, K)) and translations t (T, 2) px."""
    e = np.exp(-2j * np.pi * (np.outer(trans[:, 0], kx) + np.outer(trans[:, 1], ky)) / box)  # (T, K)
    Xe = X[None, :] * e  # (T, K)
    CP = C[None, :] * P  # (O, K)
    a = (w[None, :] * np.abs(Xe) ** 2).sum(1)  # (T,)
    b = (w[None, :] * np.abs(CP) ** 2).sum(1)  # (O,)
    cross = np.real(np.conj(CP * w[None, :]) @ Xe.T)  # (O, T)
    return b[:, None] + a[None, :] - 2.0 * cross


def rot_angle_deg(A, B):
    """Angles (deg) between rotation matrices A (..., 3, 3) and B (3, 3)."""
    tr = np.einsum("...ij,ij->...", A, B)
    return np.degrees(np.arccos(np.clip((tr - 1.0) / 2.0, -1.0, 1.0)))


def fine_pass(dump: Path, stem: str, rec, row, ra, ob, Fm, ps, sigma2, refs, cur: int, off_old) -> dict:
    """RELION's fine pass (records of 14: class, idir, ipsi, iover_rot, itrans, iover_trans, rot, tilt, psi, x, y,
    diff2, ihidden_over, ihidden) and weights against ours at the same samples (image size ``cur``)."""
    N, apix = ps.box, ps.pixel_size
    fr = np.fromfile(dump / f"{stem}_fine_diff2.bin").reshape(-1, 14)
    w1 = np.fromfile(dump / f"{stem}_w1.bin").reshape(-1, 3)
    wmap = dict(zip(w1[:, 0].astype(np.int64), w1[:, 1], strict=True))
    lw = np.log(np.array([wmap.get(int(h), 0.0) for h in fr[:, 12]]) + 1e-300)
    best = int(np.argmax(lw))
    kx, ky = relion_grid(cur)
    inside = kx**2 + ky**2 <= (cur / 2) ** 2
    shell = np.round(np.hypot(kx, ky)).astype(int)
    used = (shell >= 1) & (shell <= cur // 2) & ~((kx == 0) & (ky < 0))
    X = Fm[ky.astype(int) % N, kx.astype(int)]
    C = ctf_from_frequencies(ps.ctf_rows([row]), kx / (N * apix), ky / (N * apix))[0].astype(np.float64)
    w = np.where(used, 0.5 / sigma2[np.minimum(shell, len(sigma2) - 1)], 0.0)
    pix = pixel_set(N, cur)
    Xp = Fm.reshape(-1)[pix.flat]
    Cp = ctf_from_frequencies(ps.ctf_rows([row]), pix.kx / (N * apix), pix.ky / (N * apix))[0].astype(np.float64)
    wp = np.where(pix.shell >= 1, 0.5 / sigma2[pix.shell], 0.0)
    okey = np.round(fr[:, [0, 6, 7, 8]], 6)
    uo, oi = np.unique(okey, axis=0, return_inverse=True)
    oi = oi.reshape(-1)
    tkey = np.round(fr[:, 9:11], 6)
    ut, ti = np.unique(tkey, axis=0, return_inverse=True)
    ti = ti.reshape(-1)
    A = euler_to_matrix(uo[:, 1], uo[:, 2], uo[:, 3])
    P_r = np.empty((len(uo), kx.size), np.complex128)
    P_p = np.empty((len(uo), pix.npix), np.complex128)
    for k in range(len(refs)):
        sel = uo[:, 0] == k
        if sel.any():
            P_r[sel] = project_pixels(refs[k], A[sel], kx, ky)
            P_p[sel] = project_pixels(refs[k], A[sel], pix.kx, pix.ky)
    var = {
        "emulated_our_terms": diff2_table(X, C, w, np.where(inside[None], P_r, 0), kx, ky, ut, N),
        "ours": diff2_table(Xp, Cp, wp, P_p, pix.kx, pix.ky, ut, N),
    }
    d2 = fr[:, 11]
    fit = {}
    for name, tab in var.items():
        r = d2 - tab[oi, ti]
        fit[name] = {
            "spread_sd": float(np.std(r)),
            "spread_max_abs": float(np.abs(r - np.median(r)).max()),
            "best_diff2_sample_same": bool(np.argmin(tab[oi, ti]) == np.argmin(d2)),
        }
    out = {"n_fine_samples": int(len(fr)), "fit": fit}
    for lab, tab in (("relion_next_pose", ra), ("our_next_pose", ob)):
        c = int(tab.loc[row, "rlnClassNumber"]) - 1
        B = euler_to_matrix(*(float(tab.loc[row, k]) for k in ANG))
        t = np.array([tab.loc[row, "rlnOriginXAngst"], tab.loc[row, "rlnOriginYAngst"]], float) / apix - off_old
        cand = np.flatnonzero(fr[:, 0] == c)
        if cand.size == 0:
            out[lab] = {"evaluated_by_relion": False}
            continue
        ang = rot_angle_deg(euler_to_matrix(fr[cand, 6], fr[cand, 7], fr[cand, 8]), B)
        dt = np.hypot(fr[cand, 9] - t[0], fr[cand, 10] - t[1])
        k = cand[np.argmin(ang + 10 * dt)]
        hit = bool(ang[np.argmin(ang + 10 * dt)] < 0.05 and dt[np.argmin(ang + 10 * dt)] < 0.02)
        out[lab] = {
            "evaluated_by_relion": hit,
            "nearest_deg": float(ang[np.argmin(ang + 10 * dt)]),
            "nearest_px": float(dt[np.argmin(ang + 10 * dt)]),
            "relion_diff2_minus_best": float(d2[k] - d2[best]),
            "relion_log_weight_minus_best": float(lw[k] - lw[best]),
            "coarse_parent": [int(fr[k, 0]) + 1, int(fr[k, 1]), int(fr[k, 2]), int(fr[k, 4])],
            **{
                f"{n}_diff2_minus_at_relion_best": float(v[oi[k], ti[k]] - v[oi[best], ti[best]])
                for n, v in var.items()
            },
        }
    parents = np.unique(fr[:, 13]).astype(int)
    out["n_coarse_parents_evaluated"] = int(len(parents))
    out["relion_best"] = {
        "class": int(fr[best, 0]) + 1,
        "angles": [float(v) for v in fr[best, 6:9]],
        "xy_px": [float(v) for v in fr[best, 9:11]],
    }
    return out


def main(argv=None):
    ap = pair_arguments()
    ap.add_argument(
        "--relion_next",
        default=None,
        help="RELION's data STAR of iteration it+1 (default: --relion's own, inside --data)",
    )
    ap.add_argument("--dump", required=True, help="folder of RELION's debug dump (p<part_id>_*.bin)")
    ap.add_argument("--diameter", type=float, default=280.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    data, dump = Path(a.data), Path(a.dump)
    stem = data / f"{a.relion}_it{a.it:03d}"
    model = read_model_star(Path(f"{stem}_model.star"))
    vols = em.reference_images(Path(f"{stem}_model.star"))
    old = vs_relion.particles_of(Path(f"{stem}_data.star"))
    ra = vs_relion.particles_of(
        Path(a.relion_next) if a.relion_next else data / f"{a.relion}_it{a.it + 1:03d}_data.star"
    )
    ob = vs_relion.particles_of(data / a.b)
    ps = load_particle_set(data / "particles.star", ctf=True, halves=False)
    N, apix = ps.box, ps.pixel_size
    names = ps.table.particles["rlnImageName"].astype(str)
    order = pd.Index(names)
    old, ra, ob = (q.set_index("rlnImageName").loc[order].reset_index() for q in (old, ra, ob))
    _, mask_r = em.particle_mask(ps, a.diameter, em.MASK_EDGE)
    sigma2 = np.asarray(model.sigma2[0], dtype=np.float64)
    pdf_dir = np.stack(model.pdf_orient)  # RELION's pdf_direction: class prior included

    metas = sorted((p for p in dump.glob("p*.txt") if p.stem[1:].isdigit()), key=lambda p: int(p.stem[1:]))
    if not metas:
        raise SystemExit(f"no p<id>.txt in {dump}")
    m0 = read_meta(metas[0])
    s, cur = int(m0["coarse_size"]), int(m0["current_size"])
    refs_e = [prepare_reference(v, pad=2, r_max=cur / 2) for v in vols]  # as our E-step (jobs/em.py)
    refs_s = [prepare_reference(v, pad=2, r_max=s / 2) for v in vols]  # as score_two_poses.py
    kx, ky = relion_grid(s)
    inside = kx**2 + ky**2 <= (s / 2) ** 2  # RELION's projector: x_max = FLOOR(sqrt(r_max_out^2 - y^2))
    pix = pixel_set(N, s)  # our coarse pixel set
    w_ours_pix = np.where(pix.shell >= 1, 0.5 / sigma2[pix.shell], 0.0)

    fref_check = None
    fref_path = dump / "fref.bin"
    if fref_path.exists():  # RELION's projections (before the CTF) against ours at the same angles
        K = s * (s // 2 + 1)
        fr = np.fromfile(fref_path).reshape(-1, 3 + 2 * K)
        fr = fr[:: max(1, len(fr) // 400)]
        Pr = fr[:, 3::2] + 1j * fr[:, 4::2]
        rec0 = np.fromfile(dump / f"{metas[0].stem}_diff2.bin").reshape(-1, 11)
        key = {(int(c), int(d), int(p)): (r, t, q) for c, d, p, r, t, q in rec0[:, [0, 1, 2, 4, 5, 6]]}
        ang = np.array([key[(int(c), int(d), int(p))] for c, d, p in fr[:, :3]])
        Po = np.empty_like(Pr)
        for k in range(len(refs_e)):
            sel = fr[:, 0] == k
            if sel.any():
                Po[sel] = project_pixels(refs_e[k], euler_to_matrix(*ang[sel].T), kx, ky)
        Po_t = np.where(inside[None], Po, 0)
        used = kx**2 + ky**2 > 0
        fref_check = {
            "n_orientations_compared": int(len(fr)),
            "relative_rms_difference_inside_r": float(
                np.sqrt((np.abs(Pr - Po_t)[:, used & inside] ** 2).mean() / (np.abs(Pr)[:, used & inside] ** 2).mean())
            ),
            "relion_max_abs_outside_r": float(np.abs(Pr[:, ~inside]).max()),
            "ours_rms_outside_r_within_shell": float(
                np.sqrt((np.abs(Po)[:, (~inside) & (np.round(np.hypot(kx, ky)) <= s // 2)] ** 2).mean())
            ),
        }

    per = []
    for mp in metas:
        m = read_meta(mp)
        pid = int(m["part_id"])
        row = int(np.flatnonzero(names.to_numpy() == m["name"])[0])
        rec = np.fromfile(dump / f"{mp.stem}_diff2.bin").reshape(-1, 11)
        rd = lambda suf, stem=mp.stem: np.fromfile(dump / f"{stem}_{suf}.bin")  # noqa: E731
        fimg = rd("fimg").view(np.complex128)
        fsh0 = rd("fimgshift0").view(np.complex128)
        minv, ctf_r, mres = rd("minvsigma2"), rd("ctf"), rd("mresol")
        hx2 = float(m["highres_Xi2"])
        off_old = np.array([float(v) for v in m["old_offset"]])
        # ours: image, CTF, weights at RELION's grid
        old_off = np.array([[old.loc[row, "rlnOriginXAngst"], old.loc[row, "rlnOriginYAngst"]]], float) / apix
        prep = prepare_batch(ps.images([row]), np.ones(1), old_off, mask_r, em.MASK_EDGE)
        Fm = np.asarray(prep.F_masked[0], dtype=np.complex128)
        X = Fm[ky.astype(int) % N, kx.astype(int)]
        C = ctf_from_frequencies(ps.ctf_rows([row]), kx / (N * apix), ky / (N * apix))[0].astype(np.float64)
        shell = np.round(np.hypot(kx, ky)).astype(int)
        used = mres >= 1
        w_r = 0.5 * minv
        terms = {
            "pre_shift_ours_vs_relion_px": [float(v) for v in (prep.rounded_offsets[0] - off_old)],
            "image_rel_rms_diff": float(np.sqrt((np.abs(X - fimg)[used] ** 2).sum() / (np.abs(fimg)[used] ** 2).sum())),
            "ctf_max_abs_diff": float(np.abs(C - ctf_r)[used].max()),
            "invsigma2_max_rel_diff": float(
                np.abs(
                    2
                    * np.where(shell >= 1, 0.5 / sigma2[np.minimum(shell, len(sigma2) - 1)], 0)
                    / np.where(used, minv, 1)
                    - 1
                )[used].max()
            ),
            "n_relion_pixels": int(used.sum()),
            "n_our_pixels": int(pix.npix - 1),  # DC excluded
            "n_relion_pixels_with_reference": int((used & inside).sum()),
        }
        # shift convention: RELION's image shifted by translation 0 against e_t applied to its unshifted image
        t0 = rec[rec[:, 3] == 0][0, 7:9]
        e0 = np.exp(-2j * np.pi * (t0[0] * kx + t0[1] * ky) / N)
        terms["shift_convention_rel_err"] = float(np.abs(fimg * e0 - fsh0)[used].max() / np.abs(fimg[used]).max())

        # unique orientations and translations of the records
        okey = rec[:, 0] * 10**7 + rec[:, 1] * 10**3 + rec[:, 2]
        uo, oi = np.unique(okey, return_inverse=True)
        first = np.zeros(len(uo), dtype=int)
        first[oi[::-1]] = np.arange(len(rec))[::-1]
        ocls = rec[first, 0].astype(int)
        A = euler_to_matrix(rec[first, 4], rec[first, 5], rec[first, 6])
        ut, ti = np.unique(rec[:, 3], return_inverse=True)
        tfirst = np.zeros(len(ut), dtype=int)
        tfirst[ti[::-1]] = np.arange(len(rec))[::-1]
        trans = rec[tfirst, 7:9]
        P_rel, P_ours, P_sc = (np.empty((len(uo), n), np.complex128) for n in (kx.size, pix.npix, pix.npix))
        for k in range(len(vols)):
            sel = ocls == k
            if sel.any():
                P_rel[sel] = project_pixels(refs_e[k], A[sel], kx, ky)
                P_ours[sel] = project_pixels(refs_e[k], A[sel], pix.kx, pix.ky)
                P_sc[sel] = project_pixels(refs_s[k], A[sel], pix.kx, pix.ky)
        Xp = Fm.reshape(-1)[pix.flat]
        Cp = ctf_from_frequencies(ps.ctf_rows([row]), pix.kx / (N * apix), pix.ky / (N * apix))[0].astype(np.float64)
        in_p = pix.kx**2 + pix.ky**2 <= (s / 2) ** 2
        variants = {
            "emulated": diff2_table(fimg, ctf_r, w_r, np.where(inside[None], P_rel, 0), kx, ky, trans, N) + hx2 / 2,
            "emulated_our_terms": diff2_table(
                X,
                C,
                np.where(used, 0.5 / sigma2[np.minimum(shell, len(sigma2) - 1)], 0),
                np.where(inside[None], P_rel, 0),
                kx,
                ky,
                trans,
                N,
            ),
            "ours": diff2_table(Xp, Cp, w_ours_pix, P_ours, pix.kx, pix.ky, trans, N),
            "ours_truncated": diff2_table(
                Xp, Cp, w_ours_pix, np.where(in_p[None], P_ours, 0), pix.kx, pix.ky, trans, N
            ),
            "scorer": diff2_table(Xp, Cp, w_ours_pix, P_sc, pix.kx, pix.ky, trans, N),
        }
        d2r = rec[:, 9]
        fit = {}
        for name, tab in variants.items():
            v = tab[oi, ti]
            r = d2r - v
            fit[name] = {
                "offset": float(np.median(r)),
                "spread_sd": float(np.std(r)),
                "spread_max_abs": float(np.abs(r - np.median(r)).max()),
                "best_sample_same_as_relion": bool(np.argmin(v) == np.argmin(d2r)),
            }
        # coarse parents of RELION's and our next-iteration poses
        parents = {}
        for lab, tab in (("relion", ra), ("ours", ob)):
            c = int(tab.loc[row, "rlnClassNumber"]) - 1
            B = euler_to_matrix(*(float(tab.loc[row, k]) for k in ANG))
            t = np.array([tab.loc[row, "rlnOriginXAngst"], tab.loc[row, "rlnOriginYAngst"]], float) / apix - off_old
            oc = np.flatnonzero(ocls == c)
            o = oc[np.argmin(rot_angle_deg(A[oc], B))]
            tt = int(np.argmin(((trans - t) ** 2).sum(1)))
            idx = int(np.flatnonzero((oi == o) & (ti == tt))[0])  # the record of this coarse sample
            parents[lab] = {
                "class": c + 1,
                "record": idx,
                "idir": int(rec[idx, 1]),
                "ipsi": int(rec[idx, 2]),
                "itrans": int(rec[idx, 3]),
                "orientation_deg_from_parent": float(rot_angle_deg(A[o], B)),
                "translation_px_from_parent": float(np.hypot(*(trans[tt] - t))),
                "relion_diff2": float(d2r[idx]),
                **{f"{k}_diff2": float(v[o, tt]) for k, v in variants.items()},
            }
        dpar = {k: parents["ours"][f"{k}_diff2"] - parents["relion"][f"{k}_diff2"] for k in variants}
        dpar["relion"] = parents["ours"]["relion_diff2"] - parents["relion"]["relion_diff2"]
        # RELION's coarse weights (priors included) and significance, if dumped
        coarse_w = None
        if (dump / f"{mp.stem}_w0.bin").exists():
            w0 = np.fromfile(dump / f"{mp.stem}_w0.bin").reshape(-1, 3)
            m0w = read_meta(dump / f"{mp.stem}_w0.txt")
            lw = np.full(len(rec), -np.inf)
            pos = {int(h): k for k, h in enumerate(rec[:, 10])}
            for h, wv, _ in w0:
                lw[pos[int(h)]] = np.log(wv)
            sig = np.zeros(len(rec), bool)
            sig[[pos[int(h)] for h in w0[w0[:, 2] > 0, 0]]] = True
            lprior = lw + (d2r - float(m0w["min_diff2"]))  # log(pdf_orientation * pdf_offset), normalised
            # which prior RELION used: log pdf_direction(class, idir) + an offset prior; the translations RELION
            # shifted by are perturbed by delta (one value on every axis), the unperturbed grid is t - delta
            ux = np.unique(np.round(rec[:, 7], 9))
            step = float(np.min(np.diff(ux)))
            delta = float(rec[0, 7] - step * np.round(rec[0, 7] / step))
            s2o = float(m0w["sigma2_offset"])
            lpd = np.log(np.maximum(pdf_dir[rec[:, 0].astype(int), rec[:, 1].astype(int)], 1e-300))
            fin = np.isfinite(lw)
            prior_models = {}
            for pert in (False, True):
                tx, ty = rec[:, 7] - (0 if pert else delta), rec[:, 8] - (0 if pert else delta)
                for units in ("relion", "proper"):
                    f = apix if units == "relion" else 1.0  # RELION: translation in Å added to the offset in px
                    lo = -(((off_old[0] + tx * f) * apix) ** 2 + ((off_old[1] + ty * f) * apix) ** 2) / (2 * s2o)
                    r = (lprior - lpd - lo)[fin]
                    prior_models[f"{'perturbed' if pert else 'unperturbed'}_translations_{units}_units"] = {
                        "residual_sd": float(np.std(r)),
                        "residual_range": float(np.ptp(r)),
                    }
            top = np.argsort(-lw)[:5]
            coarse_w = {
                "n_significant": int(sig.sum()),
                "translation_perturbation_px": delta,
                "log_prior_vs_models": prior_models,
                "top5": [
                    {
                        "class": int(rec[k, 0]) + 1,
                        "idir": int(rec[k, 1]),
                        "ipsi": int(rec[k, 2]),
                        "itrans": int(rec[k, 3]),
                        "log_weight_rel": float(lw[k] - lw[top[0]]),
                        "diff2_minus_min": float(d2r[k] - d2r.min()),
                        "log_prior": float(lprior[k]),
                        "significant": bool(sig[k]),
                    }
                    for k in top
                ],
            }
            for lab in ("relion", "ours"):
                k = parents[lab]["record"]
                parents[lab].update(
                    {
                        "relion_log_weight_rel": float(lw[k] - lw[top[0]]),
                        "relion_log_prior": float(lprior[k]),
                        "relion_significant": bool(sig[k]),
                    }
                )
        fine = (
            fine_pass(dump, mp.stem, rec, row, ra, ob, Fm, ps, sigma2, refs_e, cur, off_old)
            if (dump / f"{mp.stem}_fine_diff2.bin").exists()
            else None
        )
        per.append(
            {
                "row": row,
                "name": m["name"],
                "part_id": pid,
                "n_samples": int(len(rec)),
                "coarse_weights": coarse_w,
                "fine": fine,
                "relion_min_diff2": float(d2r.min()),
                "highres_Xi2_half": hx2 / 2,
                "terms": terms,
                "fit": fit,
                "parents": parents,
                "parent_diff2_ours_minus_relion_pose": dpar,
            }
        )
        print(
            f"row {row} {m['name']}: dDiff2(our parent - RELION's parent) RELION {dpar['relion']:.2f}  ours "
            f"{dpar['ours']:.2f}  ours_truncated {dpar['ours_truncated']:.2f}  scorer {dpar['scorer']:.2f}"
            "  | spread sd "
            + " ".join(f"{k} {v['spread_sd']:.3f}" for k, v in fit.items())
        )

    def q(key, sub):
        x = np.array([p["fit"][key][sub] for p in per])
        return [float(v) for v in np.quantile(x, [0.0, 0.5, 1.0])]

    summ = {
        k: {
            "spread_sd_min_median_max": q(k, "spread_sd"),
            "spread_max_abs_min_median_max": q(k, "spread_max_abs"),
            "fraction_best_sample_same": float(np.mean([p["fit"][k]["best_sample_same_as_relion"] for p in per])),
        }
        for k in per[0]["fit"]
    }
    res = {
        "args": vars(a),
        "coarse_size": s,
        "current_size": cur,
        "n_particles": len(per),
        "projection_check": fref_check,
        "summary": summ,
        "per_particle": per,
    }
    print(json.dumps({"projection_check": fref_check, "summary": summ}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

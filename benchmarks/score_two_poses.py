"""Issue 16 diagnostic: where ours and RELION part from the same state, how much does OUR posterior prefer our
pose over RELION's?

From RELION's iteration-k state (class maps, noise spectrum, class and direction priors, offset sigma, the
particles' offsets that the images are pre-shifted by) each particle is scored at two poses (class, orientation,
offset): RELION's at iteration k+1 (``--a``) and ours continued from the same state (``--b``,
``continue_from_relion.py``). The score is our E-step's log posterior written out directly in float64:
log pdf_direction (RELION's value: it holds the class prior too) + offset prior - sum over the pixels of the
image size w |X e_t - CTF P|^2 (w = 1/(2 sigma2), DC left out), with our prepare_batch's pre-shift and mask.
A small difference means a close call that any small difference in scoring can flip; a large one means the two
programs' likelihoods differ. Writes per-particle differences and their summary.

Run: python benchmarks/score_two_poses.py --data /tmp/p/p60 --relion relion_class3d_k2s1/run --it 4 \
        --b ours_from_relion_class3d_k2s1_it004_u4/run_it005_data.star --size 42 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion  # noqa: E402

from napari_gpu_relion.compute.ctf import ctf_from_frequencies  # noqa: E402
from napari_gpu_relion.compute.estep import prepare_batch  # noqa: E402
from napari_gpu_relion.compute.expectation import gather_pixels, pixel_set, translation_ramps  # noqa: E402
from napari_gpu_relion.compute.geometry import euler_to_matrix  # noqa: E402
from napari_gpu_relion.compute.projector import prepare_reference, project_pixels  # noqa: E402
from napari_gpu_relion.compute.sampling import healpix_directions  # noqa: E402
from napari_gpu_relion.io.model_star import read_model_star  # noqa: E402
from napari_gpu_relion.jobs import em  # noqa: E402
from napari_gpu_relion.jobs.particles import load_particle_set  # noqa: E402

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


def unit(rot_deg, tilt_deg) -> np.ndarray:
    r, t = np.deg2rad(rot_deg), np.deg2rad(tilt_deg)
    return np.stack([np.sin(t) * np.cos(r), np.sin(t) * np.sin(r), np.cos(t)], -1)


def scores(ps, rows, poses: pd.DataFrame, old_off_px, refs, model, sigma_off_A: float, size: int, order: int,
           mask_r: float) -> dict:
    """Log posterior parts of particles ``rows`` at ``poses`` (class, angles, offsets in Å)."""
    N, apix = ps.box, ps.pixel_size
    prep = prepare_batch(ps.images(rows), np.ones(len(rows)), old_off_px, mask_r, em.MASK_EDGE)
    pix = pixel_set(N, size)
    X = gather_pixels(prep.F_masked, pix).astype(np.complex128)
    ctf = ctf_from_frequencies(ps.ctf_rows(rows), pix.kx / (N * apix), pix.ky / (N * apix)).astype(np.float64)
    s2 = model.sigma2[0][pix.shell]
    w = np.where(pix.shell >= 1, 0.5 / np.maximum(s2, 1e-30), 0.0)
    cls = poses["rlnClassNumber"].to_numpy(int) - 1
    A = euler_to_matrix(*(poses[c].to_numpy(float) for c in ANG))
    P = np.empty((len(rows), pix.npix), dtype=np.complex128)
    for k, ref in enumerate(refs):
        sel = np.flatnonzero(cls == k)
        if sel.size:
            P[sel] = project_pixels(ref, A[sel], pix.kx, pix.ky)
    off_px = np.stack([poses["rlnOriginXAngst"].to_numpy(float), poses["rlnOriginYAngst"].to_numpy(float)], 1) / apix
    t = off_px - prep.rounded_offsets  # the translation applied to the pre-shifted image
    e = translation_ramps(pix, t).astype(np.complex128)  # (particles, pixels): each particle's own translation
    diff2 = (w * np.abs(X * e - ctf * P) ** 2).sum(axis=1)
    dirs = unit(*healpix_directions(order))
    d = np.argmax(unit(poses["rlnAngleRot"].to_numpy(float), poses["rlnAngleTilt"].to_numpy(float)) @ dirs.T, 1)
    pdf = np.stack(model.pdf_orient)[cls, d]
    log_dir = np.log(np.maximum(pdf, 1e-300))
    log_off = -((off_px * apix) ** 2).sum(1) / (2.0 * sigma_off_A**2)
    return {"diff2": diff2, "log_direction": log_dir, "log_offset": log_off, "log_post": log_dir + log_off - diff2}


def pair_arguments() -> argparse.ArgumentParser:
    """The options of the scripts that compare RELION's step from iteration it with ours (this one and
    relion_coarse_scores.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--relion", required=True, help="RELION's run root inside --data, e.g. relion_class3d_k2s1/run")
    ap.add_argument("--it", type=int, required=True, help="the iteration both programs continued from")
    ap.add_argument("--b", required=True, help="our data STAR of iteration it+1 (inside --data)")
    return ap


def main(argv=None):
    ap = pair_arguments()
    ap.add_argument("--size", type=int, required=True, help="the image size of iteration it+1 (pixels)")
    ap.add_argument("--order", type=int, default=2)
    ap.add_argument("--diameter", type=float, default=280.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    data = Path(a.data)
    stem = data / f"{a.relion}_it{a.it:03d}"
    model = read_model_star(Path(f"{stem}_model.star"))
    refs = [prepare_reference(v, pad=2, r_max=a.size / 2) for v in em.reference_images(Path(f"{stem}_model.star"))]
    sigma_off = float(vs_relion._star_general(Path(f"{stem}_model.star"))["rlnSigmaOffsetsAngst"])
    old = vs_relion.particles_of(Path(f"{stem}_data.star"))
    ra = vs_relion.particles_of(data / f"{a.relion}_it{a.it + 1:03d}_data.star")
    ob = vs_relion.particles_of(data / a.b)
    ps = load_particle_set(data / "particles.star", ctf=True, halves=False)
    names = ps.table.particles["rlnImageName"].astype(str)
    order = pd.Index(names)
    old, ra, ob = (q.set_index("rlnImageName").loc[order].reset_index() for q in (old, ra, ob))
    ang, off = vs_relion.pose_differences(ra, ob)
    same_class = ra["rlnClassNumber"].to_numpy() == ob["rlnClassNumber"].to_numpy()
    part = np.flatnonzero((ang > 5.0) | ~same_class)
    old_off = np.stack([old["rlnOriginXAngst"].to_numpy(float), old["rlnOriginYAngst"].to_numpy(float)], 1)
    old_off /= ps.pixel_size
    _, mask_r = em.particle_mask(ps, a.diameter, em.MASK_EDGE)
    sa = scores(ps, part, ra.iloc[part], old_off[part], refs, model, sigma_off, a.size, a.order, mask_r)
    sb = scores(ps, part, ob.iloc[part], old_off[part], refs, model, sigma_off, a.size, a.order, mask_r)
    d = {k: sb[k] - sa[k] for k in sa}  # ours minus RELION's: > 0 where our posterior prefers our pose
    q = lambda x: [float(v) for v in np.quantile(x, [0.1, 0.25, 0.5, 0.75, 0.9])]  # noqa: E731
    res = {"args": vars(a), "n_particles": len(ps), "n_parting": int(part.size),
           "n_parting_class": int((~same_class).sum()),
           "quantiles": "10, 25, 50, 75, 90 %",
           "delta_log_post": q(d["log_post"]), "delta_likelihood": q(-d["diff2"]),
           "delta_log_direction_prior": q(d["log_direction"]), "delta_log_offset_prior": q(d["log_offset"]),
           "fraction_ours_preferred": float((d["log_post"] > 0).mean()),
           "fraction_close_call_under_1": float((np.abs(d["log_post"]) < 1).mean()),
           "fraction_close_call_under_3": float((np.abs(d["log_post"]) < 3).mean()),
           "per_particle": {"row": part.tolist(), "delta_log_post": d["log_post"].tolist(),
                            "delta_likelihood": (-d["diff2"]).tolist(), "same_class": same_class[part].tolist(),
                            "angle_deg": ang[part].tolist()}}
    for k in ("n_parting", "n_parting_class", "delta_log_post", "delta_likelihood", "delta_log_direction_prior",
              "delta_log_offset_prior", "fraction_ours_preferred", "fraction_close_call_under_1",
              "fraction_close_call_under_3"):
        print(f"{k}: {res[k]}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Per-particle CTF refinement (issue 51): our ``ctf_refine`` on the GPU against the CPU and RELION's
``relion_ctf_refine``, on the same files.

The data are tests/test_ctf_refine.py's simulation, written to a folder: EMD-11007 Fourier-cropped to --box (96:
1.668 Å/px, Nyquist 3.3 Å), particles projected with padding 3 (the refinements project with 2), the TRUE defocus
(mean 0.8-2.0 µm, astigmatism up to 300 Å), beam tilt (0.5, -0.2) mrad and trefoil (odd Zernike 2 = 15, 5 = -10),
white noise at --snr; the STAR holds per-particle defocus errors of sigma 300 Å and no tilt. Both half maps are the
true map. ``postprocess.star`` holds an FSC of 1 at every shell (RELION's relion_ctf_refine needs --f; both programs
get it, so every frequency has weight 1 in both).

  python benchmarks/ctf_refine_bench.py make --out /root/ctf200 --n 200 --seed 0
  python benchmarks/ctf_refine_bench.py ours --data /root/ctf200 --tag gpu [--cpu] --repeat 2 --json x.json
  python benchmarks/ctf_refine_bench.py relion --data /root/ctf200 --tag relion --j 16 --json x.json
  python benchmarks/ctf_refine_bench.py compare A.json B.json ... --out summary.json

Every run is judged against the truth (mean defocus rms error, astigmatism, beam tilt, trefoil); ``compare``
gives the per-particle differences between runs (defocus U/V, mean defocus, angle) and of the optics values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / ".relion_kit" / "emd_11007_centred192.mrc"
TILT = (0.5, -0.2)  # mrad
ODD = (0.0, 0.0, 15.0, 0.0, 0.0, -10.0)  # trefoil: RELION's odd indices 2 and 5
sys.path.insert(0, str(Path(__file__).resolve().parent))
from realistic import gpu_name  # noqa: E402

FLAGS = ["--fit_defocus", "--fit_mode", "fpfff", "--fit_beamtilt", "--odd_aberr_max_n", "3", "--fit_aberr"]


_WORK: dict = {}  # make's inputs, inherited by its forked workers


def _clean_chunk(span: tuple[int, int]) -> np.ndarray:
    """Noise-free images i0..i1-1 of make's set (float32), in a forked worker."""
    from napari_gpu_relion.compute.simulate import ctf_images

    w, (i0, i1) = _WORK, span
    c = w["ctf"]
    ctf = type(c)(c.defocus_u[i0:i1], c.defocus_v[i0:i1], c.defocus_angle[i0:i1])
    return ctf_images(w["ref"], w["A"][i0:i1], ctf, w["angpix"], w["origins"][i0:i1],
                      aberrations=w["ab"]).astype(np.float32)


def make(a) -> None:
    """tests/test_ctf_refine.py's _simulate and `simulated` fixture, at any size, written to --out."""
    import mrcfile

    from napari_gpu_relion.compute.ctf import CtfParams, OpticsAberrations
    from napari_gpu_relion.compute.fourier import fourier_resize
    from napari_gpu_relion.compute.geometry import euler_to_matrix
    from napari_gpu_relion.compute.projector import prepare_reference
    from napari_gpu_relion.compute.simulate import ctf_images, random_rotations
    from napari_gpu_relion.io.star import write_particles

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    box = a.box
    angpix = 0.834 * 192 / box
    t0 = time.time()
    v = fourier_resize(mrcfile.read(a.map).astype(np.float64), box, 3)
    rng = np.random.default_rng(a.seed)
    n = a.n
    ang = random_rotations(n, rng)
    A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
    mic = np.arange(n) // a.per_micrograph
    dmean = rng.uniform(8000, 20000, n)
    ast = rng.uniform(-300, 300, n) / 2
    ctf = CtfParams(dmean + ast, dmean - ast, rng.uniform(-180, 180, n))
    ab = OpticsAberrations(TILT[0], TILT[1], ODD, (), 2.7, 300.0)
    origins = rng.uniform(-3, 3, (n, 2))
    ref = prepare_reference(v, pad=3)
    parts = np.array_split(np.arange(n), max(1, a.jobs))
    if a.jobs > 1:  # the same images, made in forked processes (the random draws stay in this one)
        import multiprocessing as mp

        _WORK.update(ref=ref, A=A, ctf=ctf, angpix=angpix, origins=origins, ab=ab)
        with mp.get_context("fork").Pool(a.jobs) as pool:
            chunks = pool.map(_clean_chunk, [(int(p[0]), int(p[-1]) + 1) for p in parts if len(p)])
    else:
        chunks = [ctf_images(ref, A, ctf, angpix, origins, aberrations=ab).astype(np.float32)]
    clean = np.concatenate(chunks)
    del chunks
    sigma = np.sqrt(clean.reshape(n, -1).astype(np.float64).var(axis=1).mean() / a.snr)
    imgs = clean
    for i0 in range(0, n, 4096):  # the noise in slabs: float64 draws of the whole set would need 8 bytes a value
        imgs[i0:i0 + 4096] += rng.normal(0, sigma, clean[i0:i0 + 4096].shape)
    subset = rng.permutation(np.arange(n) % 2) + 1
    err = rng.normal(0, 300, n)
    with mrcfile.new(out / "particles.mrcs", overwrite=True) as m:
        m.set_data(imgs)
        m.voxel_size = angpix
    for half in (1, 2):
        with mrcfile.new(out / f"half{half}.mrc", overwrite=True) as m:
            m.set_data(v.astype(np.float32))
            m.voxel_size = angpix
    df = pd.DataFrame({
        "rlnImageName": [f"{i + 1:06d}@particles.mrcs" for i in range(n)],
        "rlnMicrographName": [f"mic{k:04d}.mrc" for k in mic],
        "rlnOpticsGroup": np.ones(n, int),
        "rlnDefocusU": ctf.defocus_u + err, "rlnDefocusV": ctf.defocus_v + err,
        "rlnDefocusAngle": ctf.defocus_angle, "rlnPhaseShift": np.zeros(n), "rlnCtfBfactor": np.zeros(n),
        "rlnCtfScalefactor": np.ones(n),
        "rlnAngleRot": ang[:, 0], "rlnAngleTilt": ang[:, 1], "rlnAnglePsi": ang[:, 2],
        "rlnOriginXAngst": origins[:, 0] * angpix, "rlnOriginYAngst": origins[:, 1] * angpix,
        "rlnRandomSubset": subset,
    })
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"], "rlnVoltage": [300.0],
                           "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1],
                           "rlnImagePixelSize": [angpix], "rlnImageSize": [box], "rlnImageDimensionality": [2],
                           "rlnCtfDataAreCtfPremultiplied": [0]})
    write_particles(out / "particles.star", df, optics)
    nsh = box // 2 + 1
    sh = np.arange(nsh)
    res = np.where(sh > 0, box * angpix / np.maximum(sh, 1), 999.0)
    (out / "postprocess.star").write_text(
        "\ndata_general\n\n_rlnFinalResolution " + f"{2 * angpix:.4f}\n_rlnUnfilteredMapHalf1 half1.mrc\n"
        "_rlnUnfilteredMapHalf2 half2.mrc\n\ndata_fsc\n\nloop_\n_rlnSpectralIndex #1\n_rlnResolution #2\n"
        "_rlnAngstromResolution #3\n_rlnFourierShellCorrelationCorrected #4\n"
        + "".join(f"{i} {i / (box * angpix):.6f} {r:.4f} 1.000000\n" for i, r in zip(sh, res, strict=True)))
    np.savez(out / "truth.npz", dmean=dmean, defocus_u=ctf.defocus_u, defocus_v=ctf.defocus_v,
             defocus_angle=ctf.defocus_angle, err=err)
    md5 = hashlib.md5((out / "particles.mrcs").read_bytes()).hexdigest()
    info = {"n": n, "box": box, "angpix": angpix, "snr": a.snr, "seed": a.seed, "per_micrograph": a.per_micrograph,
            "tilt_mrad": TILT, "odd": ODD, "defocus_error_sigma_A": 300.0, "particles_md5": md5,
            "made_s": time.time() - t0, "jobs": a.jobs, "host": platform.node()}
    (out / "data.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def judge(data: Path, star: Path) -> dict:
    """The refined STAR against the truth."""
    from napari_gpu_relion.compute.ctf import parse_zernike
    from napari_gpu_relion.io.star import read_particles

    t = read_particles(star)
    truth = np.load(data / "truth.npz")
    p = t.particles
    dm = 0.5 * (p["rlnDefocusU"].to_numpy(float) + p["rlnDefocusV"].to_numpy(float))
    o = t.optics.iloc[0]
    res = {"defocus_rms_error_A": float(np.sqrt(np.mean((dm - truth["dmean"]) ** 2))),
           "defocus_rms_error_before_A": float(np.sqrt(np.mean(truth["err"] ** 2))),
           "defocus_max_abs_error_A": float(np.abs(dm - truth["dmean"]).max()),
           "beam_tilt_mrad": [float(o.get("rlnBeamTiltX", np.nan)), float(o.get("rlnBeamTiltY", np.nan))],
           "odd_zernike": list(parse_zernike(o["rlnOddZernike"])) if "rlnOddZernike" in o else None,
           "even_zernike": list(parse_zernike(o["rlnEvenZernike"])) if "rlnEvenZernike" in o else None}
    res["beam_tilt_error_mrad"] = [res["beam_tilt_mrad"][0] - TILT[0], res["beam_tilt_mrad"][1] - TILT[1]]
    return res


def timed(cmd: list[str], log: Path, cwd: Path) -> float:
    t = time.time()
    with open(log, "w") as fh:
        r = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.time() - t
    if r.returncode:
        sys.exit(f"failed (rc {r.returncode}): {' '.join(cmd)}\n" + log.read_text()[-3000:])
    return wall


def save(path: str | None, res: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=1))


def ours(a) -> None:
    data = Path(a.data).resolve()
    info = json.loads((data / "data.json").read_text())
    res = {"program": "ours", "gpu": "CPU" if a.cpu else gpu_name(), "host": platform.node(),
           "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "data": info, "runs": []}
    for k in range(a.repeat):
        o = data / f"CtfRefine_{a.tag}_{k + 1}"
        cmd = [sys.executable, "-m", "napari_gpu_relion.cli", "ctf_refine", "--i", "particles.star", "--m1",
               "half1.mrc", "--m2", "half2.mrc", "--f", "postprocess.star", *FLAGS, "--o", f"{o.name}/",
               *(["--cpu"] if a.cpu else []), *a.extra.split()]
        wall = timed(cmd, data / f"{o.name}.log", data)
        run = {"command": " ".join(cmd[2:]), "wall_s": wall, "star": str(o / "particles_ctf_refine.star")}
        run.update(judge(data, o / "particles_ctf_refine.star"))
        log = (data / f"{o.name}.log").read_text()
        run["log_tail"] = log[-600:]
        res["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "log_tail"}), flush=True)
        save(a.json, res)


def relion(a) -> None:
    data = Path(a.data).resolve()
    info = json.loads((data / "data.json").read_text())
    rb = os.environ.get("RB", "/root/rb")
    res = {"program": "relion_ctf_refine", "host": platform.node(), "cpu_count": os.cpu_count(), "j": a.j,
           "date": time.strftime("%Y-%m-%d %H:%M"), "data": info, "runs": []}
    o = data / f"CtfRefine_{a.tag}"
    o.mkdir(exist_ok=True)
    line = (f". {rb}/env.sh && cd {data} && rl $RELION_BIN/{a.program} --i particles.star --m1 half1.mrc --m2 "
            f"half2.mrc --f postprocess.star {' '.join(FLAGS)} --o {o.name}/ {a.extra}")
    if a.program.endswith("_mpi"):
        line = line.replace("rl $RELION_BIN", f"rl mpirun --allow-run-as-root -n {a.ranks} $RELION_BIN")
    line += f" --j {a.j}"
    wall = timed(["bash", "-c", line], data / f"{o.name}.log", data)
    run = {"command": line.split("&& ", 2)[-1], "wall_s": wall, "star": str(o / "particles_ctf_refine.star")}
    run.update(judge(data, o / "particles_ctf_refine.star"))
    run["log_tail"] = (data / f"{o.name}.log").read_text()[-1500:]
    res["runs"].append(run)
    print(json.dumps({k: v for k, v in run.items() if k != "log_tail"}), flush=True)
    save(a.json, res)


def compare(a) -> None:
    """Per-particle differences between the first run of each JSON (paths to the STARs are taken from the JSON,
    relative to --root if they do not exist)."""
    from napari_gpu_relion.io.star import read_particles

    runs = []
    for j in a.json_files:
        r = json.loads(Path(j).read_text())
        for k, run in enumerate(r["runs"]):
            star = Path(run["star"])
            if not star.exists() and a.root:
                star = Path(a.root) / star.parent.name / star.name
            runs.append((f"{Path(j).stem}#{k + 1}", run, star))
    tables = {}
    for name, _, star in runs:
        if star.exists():
            tables[name] = read_particles(star).particles
    out = {"pairs": []}
    names = list(tables)
    for i in range(len(names)):
        for k in range(i + 1, len(names)):
            p, q = tables[names[i]], tables[names[k]]
            d = {}
            for c in ("rlnDefocusU", "rlnDefocusV"):
                x = q[c].to_numpy(float) - p[c].to_numpy(float)
                d[c] = {"max_abs": float(np.abs(x).max()), "rms": float(np.sqrt(np.mean(x * x)))}
            mp = 0.5 * (p["rlnDefocusU"].to_numpy(float) + p["rlnDefocusV"].to_numpy(float))
            mq = 0.5 * (q["rlnDefocusU"].to_numpy(float) + q["rlnDefocusV"].to_numpy(float))
            x = mq - mp
            d["mean_defocus"] = {"max_abs": float(np.abs(x).max()), "rms": float(np.sqrt(np.mean(x * x))),
                                 "median_abs": float(np.median(np.abs(x)))}
            out["pairs"].append({"a": names[i], "b": names[k], **d})
            print(names[i], "vs", names[k], json.dumps(d))
    out["runs"] = {name: {k: v for k, v in run.items() if k not in ("log_tail",)} for name, run, _ in runs}
    save(a.out, out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--map", default=str(MAP))
    m.add_argument("--n", type=int, default=200)
    m.add_argument("--box", type=int, default=96)
    m.add_argument("--snr", type=float, default=1.0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--per_micrograph", type=int, default=20)
    m.add_argument("--jobs", type=int, default=1, help="processes that make the noise-free images")
    o = sub.add_parser("ours")
    o.add_argument("--data", required=True)
    o.add_argument("--tag", required=True)
    o.add_argument("--cpu", action="store_true")
    o.add_argument("--repeat", type=int, default=1)
    o.add_argument("--extra", default="")
    o.add_argument("--json")
    r = sub.add_parser("relion")
    r.add_argument("--data", required=True)
    r.add_argument("--tag", required=True)
    r.add_argument("--program", default="relion_ctf_refine")
    r.add_argument("--ranks", type=int, default=1)
    r.add_argument("--j", type=int, default=1)
    r.add_argument("--extra", default="")
    r.add_argument("--json")
    c = sub.add_parser("compare")
    c.add_argument("json_files", nargs="+")
    c.add_argument("--root", default="")
    c.add_argument("--out")
    a = ap.parse_args(argv)
    {"make": make, "ours": ours, "relion": relion, "compare": compare}[a.cmd](a)


if __name__ == "__main__":
    main()

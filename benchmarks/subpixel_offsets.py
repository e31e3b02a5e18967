"""Offsets searched around whole pixels (RELION's) or around the exact offsets (--subpixel_offsets), late in an
auto-refine (issue 48: ours lost accuracy from HEALPix order 8 at box 192, where the translation range fell to
0.27 px around offsets rounded to whole pixels; docs/high_resolution.md).

The data: tests/test_high_resolution.py's simulation (EMD-11007 at 2.5 Å/px, box 64, SNR 1, poses perturbed by
1.5° and 1 Å, local searches from HEALPix order 4) with --n particles. Each variant runs the auto-refine to
convergence from the same start; per iteration: the median angular and offset errors against the true poses, the
translation range and step, and the distance of the previous offsets from whole pixels for the particles whose
offset error grew most.

  python benchmarks/subpixel_offsets.py --work /tmp/subpix --n 300 --out benchmarks/results/x.json [--cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import mrcfile
import numpy as np
import starfile
from scipy import ndimage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realistic import gpu_name  # noqa: E402
from vs_relion import pose_differences  # noqa: E402

from napari_gpu_relion.cli import main as cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAPS = (ROOT / ".relion_kit" / "emd_11007_centred192.mrc",
        ROOT.parent / "shared" / "data" / "real" / "emd_11007_centred192.mrc")
BOX, ANGPIX = 64, 0.834 * 3


def run(*argv) -> None:
    if cli([str(a) for a in argv]) != 0:
        raise SystemExit(f"failed: {' '.join(map(str, argv))}")


def write_map64(work: Path) -> Path:
    """EMD-11007 at a third of its sampling (box 64, 2.5 Å/px), median 0, as ``work``/map64.mrc: the truth of the
    box-64 simulations (this script's and frame_turn.py's)."""
    src = next((p for p in MAPS if p.exists()), None)
    if src is None:
        raise SystemExit("EMD-11007's centred copy is in neither " + " nor ".join(map(str, MAPS))
                         + " (on the GPU machine: . benchmarks/gpu_env.sh unpacks it from .relion_kit)")
    small = ndimage.zoom(mrcfile.read(src).astype(np.float32), 1 / 3, order=1)
    with mrcfile.new(work / "map64.mrc", overwrite=True) as m:
        m.set_data((small - np.median(small)).astype(np.float32))
        m.voxel_size = ANGPIX
    return work / "map64.mrc"


def simulate(work: Path, n: int) -> Path:
    write_map64(work)
    run("simulate", "--o", work / "sim", "--map", work / "map64.mrc", "--box", BOX, "--angpix", ANGPIX,
        "--n_particles", n, "--snr", 1.0, "--n_micrographs", 0, "--ini_high", 10, "--seed", 3, "--overwrite")
    star = starfile.read(work / "sim" / "particles.star")
    p = star["particles"]
    rng = np.random.default_rng(1)
    for c in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi"):
        p[c] = p[c] + rng.normal(0, 1.5, len(p))
    for c in ("rlnOriginXAngst", "rlnOriginYAngst"):
        p[c] = p[c] + rng.normal(0, 1.0, len(p))
    starfile.write(star, work / "sim" / "start.star", overwrite=True)
    return work / "sim"


def keyed(table):
    """A particle table indexed by image number and stack file name (the jobs write the stacks' full paths)."""
    names = table["rlnImageName"].astype(str)
    return table.set_index(names.str.split("@").str[0].astype(int).astype(str) + "@"
                           + names.str.split("@").str[1].map(lambda x: Path(x).name))


def iterations(folder: Path, truth) -> list[dict]:
    out = []
    prev = None
    files = [f for f in sorted(folder.glob("run_it*_data.star")) if "_it000_" not in f.name]
    for f in files + [folder / "run_data.star"]:  # the iterations, then the final (joined) one
        d = keyed(starfile.read(f)["particles"]).loc[truth.index]
        ang, off = pose_differences(truth, d)
        it = re.search(r"_it(\d+)_", f.name)
        row = {"iteration": int(it.group(1)) if it else "final", "median_angular_error_deg":
               float(np.median(ang)), "median_offset_error_A": float(np.median(off))}
        if prev is not None:  # the previous offsets' distance from whole pixels, where the error grew most
            grew = off - prev["off"]
            frac = np.abs(prev["xy"] / ANGPIX - np.round(prev["xy"] / ANGPIX)).max(axis=1)
            worst = np.argsort(grew)[-max(1, len(grew) // 10):]
            row["previous_offset_from_whole_pixel_px"] = {"all_median": float(np.median(frac)),
                                                          "worst_tenth_median": float(np.median(frac[worst]))}
        out.append(row)
        prev = {"off": off, "xy": d[["rlnOriginXAngst", "rlnOriginYAngst"]].to_numpy(float)}
    return out


def sampling(log: Path) -> dict:
    res = {}
    for m in re.finditer(r"iteration (\d+): image size .*?(\d+) translations \(range ([\d.]+), step ([\d.]+) px\)",
                         log.read_text()):
        res[int(m.group(1))] = {"translations": int(m.group(2)), "range_px": float(m.group(3)),
                                "step_px": float(m.group(4))}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    sim = a.work / "sim" if (a.work / "sim" / "start.star").exists() else simulate(a.work, a.n)
    truth = keyed(starfile.read(sim / "particles.star")["particles"])
    res = {"gpu": "CPU" if a.cpu else gpu_name(), "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "n": a.n, "box": BOX, "angpix": ANGPIX, "variants": {}}
    for name, extra in (("rounded (RELION)", []), ("subpixel", ["--subpixel_offsets"])):
        folder = a.work / ("sub" if extra else "round")
        t0 = time.time()
        folder.mkdir(parents=True, exist_ok=True)
        args = ["refine3d", "--i", sim / "start.star", "--ref", sim / "reference.mrc", "--o", folder / "run",
                "--ini_high", 10, "--particle_diameter", 150, "--ctf", "--flatten_solvent", "--zero_mask",
                "--healpix_order", 4, "--auto_local_healpix_order", 4, "--offset_range", 2, "--offset_step", 1,
                "--random_seed", 1, *(["--cpu"] if a.cpu else []), *extra]
        rc = 0
        if not (folder / "run_data.star").exists():  # a finished run of an earlier call is judged again
            with open(a.work / f"{folder.name}.log", "w") as fh:
                rc = subprocess.run([sys.executable, "-m", "napari_gpu_relion.cli", *map(str, args)], stdout=fh,
                                    stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"{name}: refine3d failed (rc {rc}); see {a.work / f'{folder.name}.log'}")
        its = iterations(folder, truth)
        smp = sampling(a.work / f"{folder.name}.log")
        for row in its:
            row.update(smp.get(row["iteration"], {}))
        done = re.search(r"\[done in ([\d.]+) s\]", (a.work / f"{folder.name}.log").read_text())
        res["variants"][name] = {"job_s": float(done.group(1)) if done else None, "judged_s": time.time() - t0,
                                 "command": "napari-gpu-relion " + " ".join(map(str, args)), "iterations": its}
        print(name, json.dumps(its[-1]), flush=True)
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

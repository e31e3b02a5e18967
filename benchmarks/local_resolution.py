"""Local resolution: ours against RELION's ``relion_postprocess --locres`` on the same half maps (issue 51).

Both programs run on the same files with the same options (--angpix, --adhoc_bfac, --mask, --locres_sampling,
--locres_maskrad, --locres_edgwidth, --locres_randomize_at, --locres_minres, --random_seed), one after the other;
the JSON says: the median local resolution of each inside the mask (> 0.5), the voxel-wise Pearson correlation of
the two local-resolution maps (and of the two locally filtered maps) inside the mask, per window how often the
two resolutions agree (RELION's ``kk= .. ii= .. jj= .. local resolution= ..`` lines against our
``local_resolution`` block: the same windows by the same names), the wall times and the speed ratio, and the GPU
(nvidia-smi's name). The same agreement between ours and ours with --random_seed + 1 (``ours_vs_ours_other_seed``)
shows how much the random phases of the mask correction alone move the result: RELION's phases come from another
generator, so ours and RELION's cannot agree better than that.

Ours is timed three ways: the command line as a user runs it, twice (``wall_first_s``: on a fresh machine the
first run includes CuPy's one-time compilation of its kernels into its on-disk cache, which any earlier run or
``napari-gpu-relion warmup`` leaves; ``wall_s``: every run after that, the basis of ``speed_ratio``), and the job
alone in this process after a first run (``warm_s``). RELION's wall time is its command line's. The done
criteria of issue 51 (median within 0.2 Å, correlation >= 0.9, >= 10x faster) are checked under ``criteria``.

RELION is found as benchmarks/vs_relion.py finds it: ``$RB/env.sh`` (default /root/rb/env.sh, made by
../shared/relion_gpu/build_relion.sh) sets RELION_BIN and the ``rl`` wrapper. That build script does not build
relion_postprocess: when it is missing and ``$RB/build/build.ninja`` exists, this script builds it there (``ninja
relion_postprocess``, about a minute; --no_build to skip). Without RELION only ours is measured, and the JSON says
why (``relion.absent``).

``--make_halves`` first makes a test pair from a real map (default ../shared/data/real/emd_11007_centred192.mrc,
192^3 at 0.834 Å/px, or .relion_kit/emd_11007_centred192.mrc where ../shared is not there): the map Fourier-cropped
to --box (160: 1.0008 Å/px), low-passed by a resolution that varies across the particle (from --best_A at the
centre of its density to --worst_A at its edge, and a little along x, so that the two sides differ), plus
independent white noise in each half (--noise times the signal's standard deviation inside the mask); a soft mask
from the map low-passed to 15 Å (relion_mask_create's steps). Writes half1.mrc, half2.mrc and mask.mrc in --out.

Run (GPU machine, RELION built with ../shared/relion_gpu/build_relion.sh into /root/rb):
  python benchmarks/local_resolution.py --make_halves --out /root/locres160 --json results/local_resolution_h200.json
  python benchmarks/local_resolution.py --half1 h1.mrc --half2 h2.mrc --mask mask.mrc --out DIR --json X.json
Local check on the CPU (a small box; without RELION only ours is measured):
  python benchmarks/local_resolution.py --make_halves --box 64 --cpu --out /tmp/locres64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute.fourier import fourier_resize, lowpass_map
from napari_gpu_relion.compute.masks import create_mask
from napari_gpu_relion.io.mrc import read_mrc, write_mrc

ROOT = Path(__file__).resolve().parents[1]
MAP_CANDIDATES = (ROOT.parent / "shared" / "data" / "real" / "emd_11007_centred192.mrc",
                  ROOT / "shared" / "data" / "real" / "emd_11007_centred192.mrc",
                  ROOT / ".relion_kit" / "emd_11007_centred192.mrc")
#: The same options for both programs: (our Params field, RELION's flag).
SHARED_OPTIONS = ("angpix", "adhoc_bfac", "locres_sampling", "locres_maskrad", "locres_edgwidth",
                  "locres_randomize_at", "locres_minres", "random_seed")


def gpu_name() -> str:
    if not shutil.which("nvidia-smi"):
        return ""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


# --------------------------------------------------------------------------------------------------------------
# Test half maps
# --------------------------------------------------------------------------------------------------------------

def pad_or_crop(v: np.ndarray, box: int) -> np.ndarray:
    """The cube v centred in a box^3 cube (zeros around it, or its centre cut out)."""
    n = v.shape[0]
    if box >= n:
        out = np.zeros((box,) * 3, v.dtype)
        o = (box - n) // 2
        out[o:o + n, o:o + n, o:o + n] = v
        return out
    o = (n - box) // 2
    return np.ascontiguousarray(v[o:o + box, o:o + box, o:o + box])


def make_halves(a, out: Path) -> tuple[Path, Path, Path, float]:
    src = Path(a.map) if a.map else next((p for p in MAP_CANDIDATES if p.is_file()), None)
    if src is None or not src.is_file():
        sys.exit(f"--make_halves: no map ({a.map or ', '.join(map(str, MAP_CANDIDATES))}); give --map")
    m = read_mrc(src)
    v = np.asarray(m.data, np.float64)
    apix0 = m.pixel_size or 0.834
    N0 = v.shape[0]
    box = a.box
    if a.angpix_target > 0:  # the map's pixel size set by Fourier resizing, then the box by padding or cropping
        n1 = 2 * round(N0 * apix0 / a.angpix_target / 2)
        v = fourier_resize(v, n1, 3) if n1 != N0 else v
        apix = apix0 * N0 / n1
        v = pad_or_crop(v - np.median(v), box)
    else:  # the box by Fourier resizing (the pixel size follows)
        v = fourier_resize(v, box, 3) if box != N0 else v
        apix = apix0 * N0 / box
    v -= np.median(v)
    mask = create_mask(v, apix, ini_threshold=float(np.percentile(lowpass_map(v, apix, 15.0), 90)),
                       extend_inimask=3.0, width_soft_edge=6.0, lowpass_A=15.0).astype(np.float64)
    # the resolution varies across the particle: best at its density's centre, worst at its edge, and along x
    zyx = np.indices(v.shape).astype(np.float64)
    w = np.clip(v, 0, None) * (mask > 0.5)
    c = [(zyx[i] * w).sum() / w.sum() for i in range(3)]
    d = np.sqrt(sum((zyx[i] - c[i]) ** 2 for i in range(3)))
    R = float(np.percentile(d[mask > 0.5], 95))
    t = np.clip(0.75 * d / R + 0.25 * np.clip((zyx[2] - c[2]) / R, -1, 1), 0, 1)  # 0 best .. 1 worst
    best = max(a.best_A, 2.2 * apix)
    levels = np.geomspace(best, a.worst_A, a.levels)
    filtered = [lowpass_map(v, apix, r) for r in levels]
    pos = t * (len(levels) - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, len(levels) - 1)
    f = pos - lo
    signal = np.zeros_like(v)
    for k in range(len(levels)):
        signal += np.where(lo == k, 1 - f, 0) * filtered[k] + np.where(hi == k, f, 0) * filtered[k]
    sd = a.noise * float(signal[mask > 0.5].std())
    rng = np.random.default_rng(a.seed)
    out.mkdir(parents=True, exist_ok=True)
    h1 = write_mrc(out / "half1.mrc", (signal + rng.normal(0, sd, v.shape)).astype(np.float32), apix)
    h2 = write_mrc(out / "half2.mrc", (signal + rng.normal(0, sd, v.shape)).astype(np.float32), apix)
    mk = write_mrc(out / "mask.mrc", mask.astype(np.float32), apix)
    print(f"made {h1}, {h2}, {mk}: {box}^3 at {apix:.4f} Å/px from {src}; local low-pass {best:.2f}-{a.worst_A:.1f} "
          f"Å, noise sd {sd:.4g}")
    return h1, h2, mk, apix


# --------------------------------------------------------------------------------------------------------------
# The two programs
# --------------------------------------------------------------------------------------------------------------

def option_words(a, apix: float, seed_offset: int = 0) -> list[str]:
    words = []
    for name in SHARED_OPTIONS:
        v = apix if name == "angpix" else getattr(a, name)
        if name == "random_seed":
            v += seed_offset
        words += [f"--{name}", f"{v:.10g}" if isinstance(v, float) else str(v)]
    return words


def our_cli(a, h1: Path, h2: Path, mask: Path | None, root: Path, apix: float, log: Path,
            seed_offset: int = 0) -> tuple[list[str], float]:
    """Our command line, as a user runs it (a new process); (command, wall seconds)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "napari_gpu_relion.cli", "local_resolution", "--locres", "--i", str(h1),
           "--i2", str(h2), "--o", str(root), *option_words(a, apix, seed_offset)]
    if mask is not None:
        cmd += ["--mask", str(mask)]
    if a.cpu:
        cmd += ["--cpu"]
    t = time.time()
    with open(log, "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.time() - t
    if r.returncode:
        sys.exit(f"ours failed (rc {r.returncode}): {shlex.join(cmd)}\n" + log.read_text()[-3000:])
    return cmd, wall


def files_of(root: Path) -> dict:
    return {"locres": str(root) + "_locres.mrc", "filtered": str(root) + "_locres_filtered.mrc",
            "fscs": str(root) + "_locres_fscs.star"}


def run_ours(a, h1: Path, h2: Path, mask: Path | None, out: Path, apix: float) -> dict:
    """Our command line twice (the first on a fresh machine includes CuPy's one-time compilation of its kernels
    into its on-disk cache, which `napari-gpu-relion warmup` or any earlier run leaves behind; the second is what
    a user sees from then on), the job alone in this process after a first run, and the command line once more
    with --random_seed + 1 (``other_seed``: how much the random phases alone change the result)."""
    root = out / "ours" / "relion"
    cmd, first = our_cli(a, h1, h2, mask, root, apix, out / "ours_first.log")
    _, wall = our_cli(a, h1, h2, mask, root, apix, out / "ours.log")
    from napari_gpu_relion.cli import run_job  # noqa: PLC0415
    from napari_gpu_relion.jobs import local_resolution as job  # noqa: PLC0415

    kw = {name: (apix if name == "angpix" else getattr(a, name)) for name in SHARED_OPTIONS}
    params = job.Params(i=h1, i2=h2, o=out / "ours_warm" / "relion", mask=mask, cpu=a.cpu, **kw)
    (out / "ours_warm").mkdir(exist_ok=True)
    times = []
    with open(out / "ours_warm.log", "w") as fh:
        for _ in range(2):
            t = time.time()
            run_job(job, params, out=fh)
            times.append(time.time() - t)
    other = out / "ours_seed" / "relion"
    our_cli(a, h1, h2, mask, other, apix, out / "ours_seed.log", seed_offset=1)
    return {"command": shlex.join(cmd), "wall_first_s": first, "wall_s": wall, "first_in_process_s": times[0],
            "warm_s": times[1], **files_of(root), "other_seed": files_of(other)}


def relion_env() -> Path:
    return Path(os.environ.get("RB", "/root/rb"))


def relion_bash(cmd: str, log: Path, cwd: Path | None = None) -> tuple[int, float]:
    """A command under the build's env.sh (``rl`` sets its library path); (return code, wall seconds)."""
    rb = relion_env()
    t = time.time()
    with open(log, "w") as fh:
        r = subprocess.run(["bash", "-c", f". {rb}/env.sh && {cmd}"], stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
    return r.returncode, time.time() - t


def find_relion(a, out: Path) -> tuple[str | None, str]:
    """(the relion_postprocess binary's path, or None, and why not)."""
    rb = relion_env()
    if not (rb / "env.sh").is_file():
        return None, f"no RELION build: {rb / 'env.sh'} missing (build it with ../shared/relion_gpu/build_relion.sh)"
    binary = rb / "build" / "bin" / ("relion_postprocess_mpi" if a.relion_mpi > 1 else "relion_postprocess")
    if not binary.is_file():
        if a.no_build or not (rb / "build" / "build.ninja").is_file():
            return None, f"{binary} missing (and not built here: {'--no_build' if a.no_build else 'no build.ninja'})"
        print(f"building {binary.name} in {rb / 'build'} ...", flush=True)
        rc, wall = relion_bash(f"ninja -C {shlex.quote(str(rb / 'build'))} {binary.name}", out / "relion_build.log")
        if rc or not binary.is_file():
            return None, f"building {binary.name} failed (rc {rc}; {out / 'relion_build.log'})"
        print(f"built in {wall:.0f} s", flush=True)
    return str(binary), ""


def run_relion(a, h1: Path, h2: Path, mask: Path | None, out: Path, apix: float) -> dict:
    binary, why = find_relion(a, out)
    if binary is None:
        return {"absent": why}
    root = out / "relion" / "relion"
    root.parent.mkdir(parents=True, exist_ok=True)
    words = ["--locres", "--i", str(h1), "--i2", str(h2), "--o", str(root), *option_words(a, apix)]
    if mask is not None:
        words += ["--mask", str(mask)]
    prog = f"$RELION_BIN/{Path(binary).name}"
    if a.relion_mpi > 1:
        cmd = f"rl mpirun --allow-run-as-root -x LD_LIBRARY_PATH -n {a.relion_mpi} {prog} {shlex.join(words)}"
    else:
        cmd = f"rl {prog} {shlex.join(words)}"
    rc, wall = relion_bash(cmd, out / "relion.log", cwd=root.parent)
    if rc:
        return {"absent": f"RELION failed (rc {rc}): {(out / 'relion.log').read_text()[-2000:]}", "command": cmd}
    return {"command": cmd, "wall_s": wall, "locres": str(root) + "_locres.mrc",
            "filtered": str(root) + "_locres_filtered.mrc", "fscs": str(root) + "_locres_fscs.star"}


# --------------------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------------------

_RELION_LINE = re.compile(r"kk=\s*(-?\d+)\s+ii=\s*(-?\d+)\s+jj=\s*(-?\d+)\s+local resolution=\s*([-\d.eE+]+)")


def relion_windows(path: Path) -> dict[str, float]:
    """RELION's per-window resolutions from the free-text lines of its _locres_fscs.star, by block name."""
    out = {}
    for line in Path(path).read_text().splitlines():
        m = _RELION_LINE.search(line)
        if m:
            kk, ii, jj = (int(m.group(i)) for i in (1, 2, 3))
            out[f"fsc_{kk:05d}_{ii:05d}_{jj:05d}"] = float(m.group(4))
    return out


def our_windows(path: Path, box: int) -> dict[str, float]:
    """Our per-window resolutions (the local_resolution block), by RELION's block name."""
    from napari_gpu_relion.io.star import read_star  # noqa: PLC0415

    t = read_star(path)["local_resolution"]
    h = box // 2
    return {f"fsc_{int(x) - h:05d}_{int(y) - h:05d}_{int(z) - h:05d}": float(r)
            for x, y, z, r in zip(t["rlnCoordinateX"], t["rlnCoordinateY"], t["rlnCoordinateZ"],
                                  t["rlnAngstromResolution"], strict=True)}


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum()))


def in_mask_stats(path: str, sel: np.ndarray) -> dict:
    v = np.asarray(read_mrc(path).data, np.float64)[sel]
    q = np.percentile(v, [5, 25, 50, 75, 95])
    return {"median_A": float(q[2]), "percentiles_5_25_50_75_95_A": [float(x) for x in q]}


def agreement(x: dict, y: dict, sel: np.ndarray, box: int, apix: float) -> dict:
    """Two runs' outputs (files_of) inside ``sel``: medians, the voxel-wise Pearson correlation of the
    local-resolution maps and of the filtered maps, and per window how often the resolutions agree (RELION's
    free-text lines or our local_resolution block, whichever a file has)."""
    lx = np.asarray(read_mrc(x["locres"]).data, np.float64)
    ly = np.asarray(read_mrc(y["locres"]).data, np.float64)
    res = {"median_difference_A": float(np.median(lx[sel]) - np.median(ly[sel])),
           "pearson_locres_in_mask": pearson(lx[sel], ly[sel]),
           "mean_abs_difference_A": float(np.abs(lx[sel] - ly[sel]).mean())}
    fx = np.asarray(read_mrc(x["filtered"]).data, np.float64)[sel]
    fy = np.asarray(read_mrc(y["filtered"]).data, np.float64)[sel]
    res["pearson_filtered_in_mask"] = pearson(fx, fy)
    try:
        wx, wy = (relion_windows(Path(f["fscs"])) or our_windows(Path(f["fscs"]), box) for f in (x, y))
        common = sorted(set(wx) & set(wy))
        u = np.array([wx[k] for k in common])
        v = np.array([wy[k] for k in common])
        res["windows"] = {"first": len(wx), "second": len(wy), "common": len(common),
                          "same_resolution": int(np.sum(np.abs(u - v) < 1e-3 * v)),
                          "within_one_shell": int(np.sum(np.abs(box * apix / u - box * apix / v) <= 1.0 + 1e-6)),
                          "pearson": pearson(u, v) if len(common) > 2 else None}
    except (OSError, KeyError, ValueError) as exc:
        res["windows"] = {"error": str(exc)}
    return res


def compare(ours: dict, relion: dict, mask_path: Path | None, box: int, apix: float) -> dict:
    lo = np.asarray(read_mrc(ours["locres"]).data, np.float64)
    sel = (np.asarray(read_mrc(mask_path).data) > 0.5) if mask_path is not None else lo > 0
    res = {"voxels": int(sel.sum()), "ours": in_mask_stats(ours["locres"], sel),
           "ours_vs_ours_other_seed": agreement(ours, ours["other_seed"], sel, box, apix)}
    if "wall_s" in relion:
        res["relion"] = in_mask_stats(relion["locres"], sel)
        res["ours_vs_relion"] = agreement(ours, relion, sel, box, apix)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--half1", type=Path)
    ap.add_argument("--half2", type=Path)
    ap.add_argument("--mask", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="working folder (maps, both programs' outputs, logs)")
    ap.add_argument("--json", type=Path, help="where to write the JSON (default: <out>/local_resolution.json)")
    ap.add_argument("--make_halves", action="store_true", help="make half1/half2/mask.mrc in --out from --map")
    ap.add_argument("--map", help="the map --make_halves starts from (default: emd_11007_centred192.mrc)")
    ap.add_argument("--box", type=int, default=160, help="--make_halves: box after Fourier cropping (even)")
    ap.add_argument("--angpix_target", type=float, default=-1.0, help="--make_halves: the map's pixel size (Å) "
                    "by Fourier resizing, then the box (--box) by padding or cropping (-1: the box by Fourier "
                    "resizing, the pixel size follows); the resized box is even, so the pixel size is near the "
                    "target (1.05 gives 1.0535 Å from the 192-pixel map at 0.834 Å), and the JSON records it")
    ap.add_argument("--best_A", type=float, default=3.0, help="--make_halves: best local low-pass (Å)")
    ap.add_argument("--worst_A", type=float, default=9.0, help="--make_halves: worst local low-pass (Å)")
    ap.add_argument("--levels", type=int, default=6, help="--make_halves: low-pass maps blended")
    ap.add_argument("--noise", type=float, default=1.0, help="--make_halves: noise sd / signal sd in the mask")
    ap.add_argument("--seed", type=int, default=0, help="--make_halves: noise seed")
    ap.add_argument("--angpix", type=float, default=-1.0, help="-1: from the map header")
    ap.add_argument("--adhoc_bfac", type=float, default=0.0)
    ap.add_argument("--locres_sampling", type=float, default=25.0)
    ap.add_argument("--locres_maskrad", type=float, default=-1.0)
    ap.add_argument("--locres_edgwidth", type=float, default=-1.0)
    ap.add_argument("--locres_randomize_at", type=float, default=25.0)
    ap.add_argument("--locres_minres", type=float, default=50.0)
    ap.add_argument("--random_seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="ours on the CPU (NumPy)")
    ap.add_argument("--relion_mpi", type=int, default=1, help="RELION under mpirun with this many ranks "
                    "(relion_postprocess_mpi; 1: relion_postprocess, as the issue asks)")
    ap.add_argument("--no_build", action="store_true", help="do not build relion_postprocess when it is missing")
    ap.add_argument("--skip_relion", action="store_true")
    a = ap.parse_args(argv)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.make_halves:
        h1, h2, mask, apix = make_halves(a, out)
    else:
        if a.half1 is None or a.half2 is None:
            sys.exit("give --half1 and --half2 (and --mask), or --make_halves")
        h1, h2, mask = a.half1.resolve(), a.half2.resolve(), (a.mask.resolve() if a.mask else None)
        apix = read_mrc(h1).pixel_size or 0.0
    if a.angpix > 0:
        apix = a.angpix
    if not apix > 0:
        sys.exit("the half map has no pixel size in its header: give --angpix")
    box = int(read_mrc(h1).data.shape[0])
    print(f"ours on {'the CPU' if a.cpu else 'the GPU'} ...", flush=True)
    ours = run_ours(a, h1, h2, mask, out, apix)
    print(f"ours: {ours['wall_s']:.2f} s (command line; the first: {ours['wall_first_s']:.2f} s), "
          f"{ours['warm_s']:.2f} s warm", flush=True)
    if a.skip_relion:
        relion = {"absent": "--skip_relion"}
    else:
        print("RELION ...", flush=True)
        relion = run_relion(a, h1, h2, mask, out, apix)
    if "wall_s" in relion:
        print(f"RELION: {relion['wall_s']:.2f} s", flush=True)
    else:
        print(f"RELION not measured ({relion['absent']}): ours only", flush=True)
    cmp = compare(ours, relion, mask, box, apix)
    result = {"gpu": "" if a.cpu else gpu_name(), "host": platform.node(), "ours_device": "cpu" if a.cpu else "gpu",
              "half1": str(h1), "half2": str(h2), "mask": str(mask) if mask else None, "box": box, "angpix": apix,
              "options": {k: (apix if k == "angpix" else getattr(a, k)) for k in SHARED_OPTIONS},
              "relion_mpi": a.relion_mpi, "ours": ours, "relion": relion, "comparison": cmp}
    if "wall_s" in relion:
        vs = cmp["ours_vs_relion"]
        result["speed_ratio"] = relion["wall_s"] / ours["wall_s"]
        result["speed_ratio_first_run"] = relion["wall_s"] / ours["wall_first_s"]
        result["speed_ratio_warm"] = relion["wall_s"] / ours["warm_s"]
        result["criteria"] = {"median_within_0.2_A": abs(vs["median_difference_A"]) <= 0.2,
                              "pearson_at_least_0.9": vs["pearson_locres_in_mask"] >= 0.9,
                              "at_least_10x_faster": result["speed_ratio"] >= 10.0}
    path = a.json or out / "local_resolution.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("gpu", "speed_ratio", "speed_ratio_first_run", "speed_ratio_warm",
                                             "criteria") if k in result}
                     | {"comparison": cmp}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

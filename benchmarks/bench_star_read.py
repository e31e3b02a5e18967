"""How long an EM job takes to read its particles STAR (issue 47's start-up: "reading the particles" was 0.7-1.3 s of
every rank's start on an H200 host at 100,000 particles): a particles STAR of N rows in the layout relion_project
writes (32 stacks, the columns of a refinement's input), read by the package (io.star.read_particles, and
jobs.particles.load_particle_set, which also checks every stack's header and parses the image names) and by the
starfile package (the reader the package used before; its blocks equal ours on RELION-made files: tests/test_io_star).

    python benchmarks/bench_star_read.py --n 100000 --reps 3 --out benchmarks/results/star_read_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import mrcfile
import numpy as np
import pandas as pd
import starfile

from napari_gpu_relion.io.star import read_particles, write_particles
from napari_gpu_relion.jobs.particles import load_particle_set

STACKS = 32


def make_set(folder: Path, n: int, box: int = 16) -> Path:
    """A particles STAR of ``n`` rows over STACKS image stacks of ``box`` px (small: the pixels are not read)."""
    rng = np.random.default_rng(0)
    (folder / "Particles").mkdir(parents=True, exist_ok=True)
    per = -(-n // STACKS)
    names, mics = [], []
    for s in range(STACKS):
        count = min(per, n - s * per)
        if count <= 0:
            break
        stack = f"Particles/stack{s:03d}.mrcs"
        with mrcfile.new_mmap(folder / stack, shape=(count, box, box), mrc_mode=2, overwrite=True) as m:
            m.data[:] = rng.normal(size=(count, box, box)).astype(np.float32)
        names += [f"{i + 1:06d}@{stack}" for i in range(count)]
        mics += [f"MotionCorr/mic{s:03d}.mrc"] * count
    df = pd.DataFrame({
        "rlnImageName": names, "rlnMicrographName": mics,
        "rlnCoordinateX": rng.uniform(0, 4000, n), "rlnCoordinateY": rng.uniform(0, 4000, n),
        "rlnAngleRot": rng.uniform(-180, 180, n), "rlnAngleTilt": rng.uniform(0, 180, n),
        "rlnAnglePsi": rng.uniform(-180, 180, n), "rlnOriginXAngst": rng.normal(size=n),
        "rlnOriginYAngst": rng.normal(size=n), "rlnDefocusU": rng.uniform(8000, 25000, n),
        "rlnDefocusV": rng.uniform(8000, 25000, n), "rlnDefocusAngle": rng.uniform(0, 180, n),
        "rlnOpticsGroup": np.ones(n, int), "rlnRandomSubset": rng.integers(1, 3, n), "rlnClassNumber": np.ones(n, int)})
    optics = pd.DataFrame({"rlnOpticsGroupName": ["opticsGroup1"], "rlnOpticsGroup": [1], "rlnVoltage": [300.0],
                           "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1],
                           "rlnImagePixelSize": [1.05], "rlnImageSize": [box], "rlnImageDimensionality": [2]})
    star = folder / "particles.star"
    write_particles(star, df, optics)
    return star


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(round(time.perf_counter() - t0, 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        star = make_set(Path(tmp), a.n)
        cwd = os.getcwd()
        os.chdir(tmp)  # the stacks' paths start from the project folder
        try:
            res = {
                "n": a.n, "stacks": STACKS, "star_bytes": star.stat().st_size,
                "hardware": f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
                "date": time.strftime("%Y-%m-%d"),
                "read_particles_s": timed(lambda: read_particles(star), a.reps),
                "load_particle_set_s": timed(lambda: load_particle_set(star, ctf=True), a.reps),
                "starfile_read_s": timed(lambda: starfile.read(star, always_dict=True), a.reps),
            }
        finally:
            os.chdir(cwd)
    print(json.dumps(res))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

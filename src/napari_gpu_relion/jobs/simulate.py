"""Simulated data sets written as RELION files: particle stacks + STAR with the true parameters,
micrographs + micrographs STAR + coordinate STARs of the truth, reference and truth maps.

``napari-gpu-relion simulate --o DIR`` writes one; the repository's sample_data/ is made by
``napari-gpu-relion simulate --o sample_data --overwrite`` with the defaults below (deterministic for the seed;
without ``--overwrite`` a folder that already holds a data set is refused).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute import simulate as sim
from ..compute.fourier import irfft_centered, lowpass_map, phase_shift_2d
from ..compute.geometry import euler_to_matrix
from ..compute.projector import prepare_reference, project
from ..errors import InputError
from ..events import Finished, Progress, Started
from ..io.atomic import ensure_not_input
from ..io.mrc import read_mrc, require_usable_map, write_mrc
from ..io.star import write_coordinates, write_particles
from .common import check_output_folder, mrc_bytes, param, prepare_output, require_file, write_note

JOB_NAME = "simulate"


@dataclass(frozen=True)
class Params:
    o: Path = param(flag="--o", help="Output folder for the simulated data set")
    n_particles: int = param(400, "--n_particles", "Number of particle images")
    box: int = param(64, "--box", "Box size (pixels, even)")
    angpix: float = param(3.0, "--angpix", "Pixel size (Å)")
    snr: float = param(0.1, "--snr", "Signal-to-noise ratio of the particle images (signal/noise variance)")
    diameter: float = param(150.0, "--particle_diameter", "Phantom diameter (Å)")
    map: Path | None = param(None, "--map", "Use this map as the phantom instead of the pseudo-atomic one")
    n_micrographs: int = param(2, "--n_micrographs", "Number of micrographs")
    micrograph_size: int = param(512, "--micrograph_size", "Micrograph edge (pixels)")
    particles_per_micrograph: int = param(20, "--particles_per_micrograph", "Particles per micrograph")
    ini_high: float = param(40.0, "--ini_high", "Low-pass of the reference map written as reference.mrc (Å)")
    conformations: int = param(1, "--conformations", "Number of conformations (states >= 2 each lack one domain); "
                               "particles are split evenly, the truth in particles_truth.star (rlnClassNumber)")
    seed: int = param(0, "--seed", "Random seed")
    overwrite: bool = param(False, "--overwrite", "Replace a data set already in --o (otherwise refused)")

    def outputs(self) -> list[Path]:
        """The files a run writes (note.txt, which is appended to, aside)."""
        out = Path(self.o)
        files = [out / "particles.star", out / "particles" / "particles.mrcs", out / "micrographs.star",
                 out / "truth.mrc", out / "reference.mrc"]
        if self.conformations > 1:
            files += [out / "particles_truth.star"] + [out / f"truth_state{s}.mrc"
                                                       for s in range(2, self.conformations + 1)]
        for k in range(self.n_micrographs):
            files += [out / "micrographs" / f"mic{k + 1:03d}.mrc", out / "coords" / f"mic{k + 1:03d}_truth.star"]
        return files

    def __post_init__(self):
        if self.box % 2 or self.box < 16:
            raise InputError(f"--box must be an even number >= 16, got {self.box}")
        if self.angpix <= 0:
            raise InputError(f"--angpix must be > 0, got {self.angpix}")
        if self.snr <= 0:
            raise InputError(f"--snr must be > 0, got {self.snr}")
        if self.n_particles < 2:
            raise InputError(f"--n_particles must be >= 2, got {self.n_particles}")
        if self.conformations < 1:
            raise InputError(f"--conformations must be >= 1, got {self.conformations}")
        if self.conformations > 1 and self.map is not None:
            raise InputError("--conformations > 1 needs the pseudo-atomic phantom (not --map)")
        for flag, value in (("--n_micrographs", self.n_micrographs), ("--particles_per_micrograph",
                                                                      self.particles_per_micrograph)):
            if value < 0:
                raise InputError(f"{flag} must be >= 0, got {value}")
        if self.n_micrographs and self.micrograph_size <= self.box:
            raise InputError(f"--micrograph_size must be larger than the box ({self.box} px), got "
                             f"{self.micrograph_size}")
        if self.diameter <= 0:
            raise InputError(f"--particle_diameter must be > 0 Å, got {self.diameter:g}")
        if self.o is None:
            raise InputError("--o (output folder) is required")
        check_output_folder(self.o, "--o")
        if self.map is not None:
            require_file(self.map, "--map", (".mrc", ".map"))
            for f in self.outputs():
                ensure_not_input(f, self.map)
        present = [f for f in self.outputs() if f.exists()]
        if present and not self.overwrite:
            names = ", ".join(str(f.relative_to(self.o)) for f in present[:3])
            more = f" and {len(present) - 3} more" if len(present) > 3 else ""
            raise InputError(f"--o already holds a data set ({names}{more}); give --overwrite to replace it, or "
                             "another folder", path=str(self.o))


def _optics(box: int, angpix: float, name_col: str) -> pd.DataFrame:
    df = pd.DataFrame({
        "rlnOpticsGroupName": ["opticsGroup1"], "rlnOpticsGroup": [1],
        "rlnVoltage": [300.0], "rlnSphericalAberration": [2.7], "rlnAmplitudeContrast": [0.1],
    })
    if name_col == "particles":
        df["rlnImagePixelSize"] = [angpix]
        df["rlnImageSize"] = [box]
        df["rlnImageDimensionality"] = [2]
        df["rlnCtfDataAreCtfPremultiplied"] = [0]
    else:
        df["rlnMicrographPixelSize"] = [angpix]
    return df


def run(p: Params) -> Iterator:
    out = Path(p.o)
    need = (2 * mrc_bytes(p.box, p.box, p.box) * p.conformations + mrc_bytes(p.n_particles, p.box, p.box)
            + p.n_micrographs * mrc_bytes(p.micrograph_size, p.micrograph_size) + p.n_particles * 600 * 2)
    notes = prepare_output(out, need, "the simulated data set")
    yield Started(JOB_NAME, out, "CPU (NumPy)", "simulating")
    yield from notes
    out.mkdir(parents=True, exist_ok=True)
    write_note(out, JOB_NAME, p)
    if p.map is not None:
        m = read_mrc(p.map)
        if m.data.ndim != 3:
            raise InputError(f"--map must be a 3D map, got shape {m.data.shape}", path=str(p.map))
        require_usable_map(m.data, p.map, "--map phantom")
        vol = sim.fit_box(np.asarray(m.data, np.float32), p.box)
        phantom = None
        ref = prepare_reference(vol.astype(np.float64), pad=2)

        def proj_fn(A, sh):
            F = project(ref, A)
            return irfft_centered(phase_shift_2d(F, -sh, p.box), p.box, 2).astype(np.float32)
    else:
        phantom = sim.pseudo_atomic_phantom(p.diameter, seed=p.seed)
        vol = sim.phantom_volume(phantom, p.box, p.angpix)
        proj_fn = None
    write_mrc(out / "truth.mrc", vol, p.angpix)
    write_mrc(out / "reference.mrc", lowpass_map(vol.astype(np.float64), p.angpix, p.ini_high).astype(np.float32),
              p.angpix)
    total = 2 + p.n_micrographs
    yield Progress(1, total, "maps")

    n = p.n_particles
    if p.conformations == 1:
        parts = sim.simulate_particles(n, p.box, p.angpix, phantom=phantom, projections_fn=proj_fn,
                                       snr=p.snr, seed=p.seed + 1)
        state = np.zeros(n, int)
    else:
        parts, state = _simulate_states(p, phantom, out)
    pdir = out / "particles"
    pdir.mkdir(exist_ok=True)
    write_mrc(pdir / "particles.mrcs", parts.images, p.angpix)
    rng = np.random.default_rng(p.seed + 2)
    df = pd.DataFrame({
        "rlnImageName": [f"{i + 1:06d}@particles/particles.mrcs" for i in range(n)],
        "rlnMicrographName": ["simulated.mrc"] * n,
        "rlnOpticsGroup": np.ones(n, int),
        "rlnDefocusU": parts.ctf.defocus_u, "rlnDefocusV": parts.ctf.defocus_v,
        "rlnDefocusAngle": parts.ctf.defocus_angle, "rlnCtfBfactor": np.zeros(n),
        "rlnCtfScalefactor": np.ones(n), "rlnPhaseShift": np.zeros(n),
        "rlnAngleRot": parts.angles[:, 0], "rlnAngleTilt": parts.angles[:, 1], "rlnAnglePsi": parts.angles[:, 2],
        "rlnOriginXAngst": parts.origins_px[:, 0] * p.angpix, "rlnOriginYAngst": parts.origins_px[:, 1] * p.angpix,
        "rlnRandomSubset": rng.permutation(np.arange(n) % 2) + 1,
        "rlnClassNumber": np.ones(n, int),
    })
    write_particles(out / "particles.star", df, _optics(p.box, p.angpix, "particles"))
    if p.conformations > 1:
        write_particles(out / "particles_truth.star", df.assign(rlnClassNumber=state + 1),
                        _optics(p.box, p.angpix, "particles"))
    yield Progress(2, total, "particles")

    mdir = out / "micrographs"
    cdir = out / "coords"
    mdir.mkdir(exist_ok=True)
    cdir.mkdir(exist_ok=True)
    mic_rows = []
    if phantom is None:
        phantom = sim.pseudo_atomic_phantom(p.diameter, seed=p.seed)
    for k in range(p.n_micrographs):
        mic = sim.simulate_micrograph(phantom, (p.micrograph_size, p.micrograph_size), p.angpix,
                                      p.particles_per_micrograph, p.box, snr=p.snr, seed=p.seed + 100 + k,
                                      defocus_A=12000.0 + 4000.0 * k)
        name = f"mic{k + 1:03d}"
        write_mrc(mdir / f"{name}.mrc", mic.image, p.angpix)
        write_coordinates(cdir / f"{name}_truth.star", mic.coords[:, 0].astype(float),
                          mic.coords[:, 1].astype(float), fom=np.ones(len(mic.coords)),
                          class_number=np.zeros(len(mic.coords), int), psi=np.zeros(len(mic.coords)))
        mic_rows.append({"rlnMicrographName": f"micrographs/{name}.mrc", "rlnOpticsGroup": 1,
                         "rlnDefocusU": float(mic.ctf.defocus_u[0]), "rlnDefocusV": float(mic.ctf.defocus_v[0]),
                         "rlnDefocusAngle": float(mic.ctf.defocus_angle[0]), "rlnCtfMaxResolution": 6.0,
                         "rlnCtfFigureOfMerit": 0.2})
        yield Progress(3 + k, total, f"micrograph {k + 1}")
    write_particles(out / "micrographs.star", pd.DataFrame(mic_rows), _optics(p.box, p.angpix, "micrographs"),
                    block="micrographs")
    yield Finished({"particles": out / "particles.star", "micrographs": out / "micrographs.star",
                    "reference": out / "reference.mrc", "truth": out / "truth.mrc"},
                   f"{n} particles (box {p.box}, {p.angpix} Å/px, SNR {p.snr}) and {p.n_micrographs} micrographs")


def write_micrographs(folder: Path, mics: list, pixel_size: float) -> Path:
    """Simulated micrographs (compute.simulate.simulate_micrograph's) as ``folder``/Micrographs/micNNN.mrc (from
    000) and their micrographs.star (name, optics group, defocus; one optics group); returns the STAR's path."""
    (folder / "Micrographs").mkdir(parents=True, exist_ok=True)
    rows = []
    for k, m in enumerate(mics):
        name = f"Micrographs/mic{k:03d}.mrc"
        write_mrc(folder / name, m.image, pixel_size)
        rows.append({"rlnMicrographName": name, "rlnOpticsGroup": 1, "rlnDefocusU": float(m.ctf.defocus_u[0]),
                     "rlnDefocusV": float(m.ctf.defocus_v[0]), "rlnDefocusAngle": float(m.ctf.defocus_angle[0])})
    return write_particles(folder / "micrographs.star", pd.DataFrame(rows), _optics(0, pixel_size, "micrographs"),
                           block="micrographs")


def _simulate_states(p: Params, phantom: sim.Phantom, out: Path) -> tuple[sim.SimulatedParticles, np.ndarray]:
    """Particles from ``p.conformations`` states (evenly split, shuffled) with ONE noise level for all, so
    that only the structure tells the states apart. Writes truth_state2.mrc, ... next to truth.mrc."""
    states = sim.conformations(phantom, p.conformations)
    for s, ph in enumerate(states[1:], start=2):
        write_mrc(out / f"truth_state{s}.mrc", sim.phantom_volume(ph, p.box, p.angpix), p.angpix)
    n = p.n_particles
    state = np.random.default_rng(p.seed + 3).permutation(np.arange(n) % p.conformations)
    per = [sim.simulate_particles(int((state == s).sum()), p.box, p.angpix, phantom=ph, snr=0.0,
                                  seed=p.seed + 1 + 1000 * s) for s, ph in enumerate(states)]
    clean = np.empty((n, p.box, p.box), np.float32)
    ang, org = np.empty((n, 3)), np.empty((n, 2))
    ctf_cols = {k: np.empty(n) for k in ("defocus_u", "defocus_v", "defocus_angle")}
    for s, sp in enumerate(per):
        idx = np.flatnonzero(state == s)
        clean[idx], ang[idx], org[idx] = sp.clean, sp.angles, sp.origins_px
        for k in ctf_cols:
            ctf_cols[k][idx] = getattr(sp.ctf, k)
    noise_sigma = float(np.sqrt(clean.reshape(n, -1).var(axis=1).mean() / p.snr))
    noisy = clean + np.random.default_rng(p.seed + 4).normal(0.0, noise_sigma, clean.shape).astype(np.float32)
    ctf = sim.CtfParams(ctf_cols["defocus_u"], ctf_cols["defocus_v"], ctf_cols["defocus_angle"])
    return sim.SimulatedParticles(noisy, clean, ang, org, ctf, p.angpix, noise_sigma), state


def make_sample_data(out_dir: Path, **overrides) -> Path:
    """Write the standard sample set (defaults of Params) into ``out_dir``, replacing one already there (the
    caller asked for it); returns it."""
    overrides.setdefault("overwrite", True)
    for _ in run(Params(o=Path(out_dir), **overrides)):
        pass
    return Path(out_dir)


def sample_data_dir() -> Path:
    """The sample data: the repository's sample_data/ when present (editable installs), else a copy generated
    once into the user's cache (deterministic, same content)."""
    repo = Path(__file__).resolve().parents[3] / "sample_data"
    if (repo / "particles.star").is_file():
        return repo
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "napari-gpu-relion" / "sample_data"
    if not (cache / "particles.star").is_file():
        make_sample_data(cache)
    return cache


def make_views_and_junk(out: Path, views_deg: np.ndarray, n_per_view: int, n_junk: int, box: int, angpix: float,
                        snr: float, seed: int = 0) -> Path:
    """A 2D-classification data set in ``out``: ``n_per_view`` particles of each view (rot, tilt; random psi, CTF,
    offsets) of the L-shaped phantom at signal-to-noise ``snr`` plus ``n_junk`` images of pure noise at the same
    noise level, shuffled; particles.star (offsets unknown: 0), label.npy (the view of each particle, -1 = junk)
    and views.npy (the noise-free projections of the views, psi 0)."""
    out = Path(out)
    rng = np.random.default_rng(seed)
    ph = sim.l_shaped_phantom()
    views = np.asarray(views_deg, dtype=float)
    ang = np.repeat(views, n_per_view, axis=0)
    ang[:, 2] = rng.uniform(-180, 180, len(ang))
    sp = sim.simulate_particles(len(ang), box, angpix, phantom=ph, angles=ang, snr=0.0, seed=seed + 1)
    noise = float(np.sqrt(sp.clean.reshape(len(ang), -1).var(1).mean() / snr))
    clean = np.concatenate([sp.clean, np.zeros((n_junk, box, box), np.float32)])
    n = len(clean)
    perm = rng.permutation(n)
    imgs = (clean + rng.normal(0, noise, clean.shape).astype(np.float32))[perm]
    (out / "particles").mkdir(parents=True, exist_ok=True)
    write_mrc(out / "particles" / "particles.mrcs", imgs, angpix)
    ctf = {k: np.concatenate([getattr(sp.ctf, k), np.full(n_junk, v)])[perm]
           for k, v in (("defocus_u", 15000.0), ("defocus_v", 15000.0), ("defocus_angle", 0.0))}
    df = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@particles/particles.mrcs" for i in range(n)],
                       "rlnOpticsGroup": np.ones(n, int), "rlnDefocusU": ctf["defocus_u"],
                       "rlnDefocusV": ctf["defocus_v"], "rlnDefocusAngle": ctf["defocus_angle"],
                       "rlnOriginXAngst": np.zeros(n), "rlnOriginYAngst": np.zeros(n)})
    write_particles(out / "particles.star", df, _optics(box, angpix, "particles"))
    np.save(out / "label.npy", np.concatenate([np.repeat(np.arange(len(views)), n_per_view),
                                               np.full(n_junk, -1)])[perm])
    np.save(out / "views.npy", sim.phantom_projections(ph, euler_to_matrix(*views.T), box, angpix))
    return out

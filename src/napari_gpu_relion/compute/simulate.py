"""Simulated data with ground truth: phantoms, particle images, micrographs. Deterministic for a seed.

The pseudo-atomic phantom is a sum of isotropic 3D Gaussians ("atoms"), so both its sampled volume and its
projections are analytic: a projection at orientation A is the sum of 2D Gaussians centred at (A c)_xy
(RELION convention: the image is the z-projection of V(A^T r)). This makes simulated images independent of
our Fourier projector, which the tests then check against them.

Conventions: coordinates x = column - N/2, y = row - N/2 (pixels). A particle with origin offset o
(rlnOriginX/YAngst = o * pixel size) has its centre at box_centre - o in the image (shifting the image by
+o centres it). Particle images are white (positive density -> positive values, as after RELION's contrast
inversion); micrographs are raw (particles dark).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import expit

from .ctf import CtfParams, ctf_from_frequencies, ctf_half_grid
from .fourier import half_grid_indices, irfft_centered, phase_shift_2d, rfft_centered
from .geometry import euler_to_matrix, magnified, magnified_frequencies
from .projector import project


@dataclass(frozen=True)
class Phantom:
    """Gaussian atoms: centres (n, 3) in Å as (x, y, z) from the box centre, amplitudes (n,), width sigma (Å)."""

    centres_A: np.ndarray
    amplitudes: np.ndarray
    sigma_A: float


def pseudo_atomic_phantom(diameter_A: float = 150.0, n_atoms: int = 400, n_domains: int = 5,
                          sigma_A: float | None = None, seed: int = 0) -> Phantom:
    """A deterministic, asymmetric, protein-like phantom: ``n_domains`` lobes of Gaussian atoms of unequal
    size inside a sphere of ``diameter_A``. Lobe sizes differ so that no rotation maps it onto itself."""
    rng = np.random.default_rng(seed)
    R = diameter_A / 2.0
    sigma = sigma_A if sigma_A is not None else diameter_A / 40.0
    dom_c = rng.normal(size=(n_domains, 3))
    dom_c *= (rng.uniform(0.35, 0.6, n_domains) * R / np.linalg.norm(dom_c, axis=1))[:, None]
    dom_w = np.linspace(1.0, 0.35, n_domains)
    dom_s = np.linspace(0.28, 0.14, n_domains) * R
    which = rng.choice(n_domains, size=n_atoms, p=dom_w / dom_w.sum())
    c = dom_c[which] + rng.normal(size=(n_atoms, 3)) * dom_s[which, None]
    # keep every atom inside the sphere (pull outliers in)
    r = np.linalg.norm(c, axis=1)
    lim = R - 2.5 * sigma
    c[r > lim] *= (lim / r[r > lim])[:, None]
    c -= c.mean(0)
    amp = rng.uniform(0.6, 1.4, n_atoms)
    return Phantom(c, amp, float(sigma))


def _gauss_1d(coords, centres, sigma):
    """exp(-(coords - centres)^2 / 2 sigma^2): (..., n_atoms, len(coords))."""
    return np.exp(-((coords[None, :] - centres[..., None]) ** 2) / (2.0 * sigma**2))


def phantom_volume(ph: Phantom, box: int, pixel_size: float) -> np.ndarray:
    """The phantom sampled on an (N, N, N) grid [z, y, x] (float32)."""
    c = (np.arange(box) - box // 2).astype(np.float64)
    p = ph.centres_A / pixel_size
    s = ph.sigma_A / pixel_size
    gx, gy, gz = (_gauss_1d(c, p[:, i], s) for i in range(3))
    return np.einsum("a,az,ay,ax->zyx", ph.amplitudes, gz, gy, gx, optimize=True).astype(np.float32)


def phantom_projections(ph: Phantom, A: np.ndarray, box: int, pixel_size: float,
                        shifts_px: np.ndarray | None = None, batch: int = 512) -> np.ndarray:
    """Analytic projections (n, N, N) float32 of the phantom at Euler matrices A (n, 3, 3), with the particle
    centre moved by -shift (so that applying rlnOrigin = shift re-centres it)."""
    n = A.shape[0]
    c = (np.arange(box) - box // 2).astype(np.float64)
    p = ph.centres_A / pixel_size
    s = ph.sigma_A / pixel_size
    out = np.empty((n, box, box), np.float32)
    w = ph.amplitudes * np.sqrt(2 * np.pi) * s
    for i0 in range(0, n, batch):
        Ab = A[i0:i0 + batch]
        pr = np.einsum("rij,aj->rai", Ab, p)  # rotated atom centres (A c)
        if shifts_px is not None:
            pr[..., :2] -= shifts_px[i0:i0 + batch, None, :]
        gx = _gauss_1d(c, pr[..., 0], s)  # (r, a, x)
        gy = _gauss_1d(c, pr[..., 1], s)  # (r, a, y)
        out[i0:i0 + batch] = np.matmul(gy.transpose(0, 2, 1) * w[None, None, :], gx)
    return out


def fit_box(vol: np.ndarray, box: int) -> np.ndarray:
    """Crop or zero-pad a map to an even cubic ``box`` keeping its centre voxel (index n//2) at box//2."""
    out = np.zeros((box,) * vol.ndim, dtype=np.float32)
    src, dst = [], []
    for n in vol.shape:
        lo_s = max(0, n // 2 - box // 2)
        lo_d = max(0, box // 2 - n // 2)
        m = min(n - lo_s, box - lo_d)
        src.append(slice(lo_s, lo_s + m))
        dst.append(slice(lo_d, lo_d + m))
    out[tuple(dst)] = vol[tuple(src)]
    return out


def random_rotations(n: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random rotations as RELION Euler angles (rot, tilt, psi) in degrees, (n, 3)."""
    rot = rng.uniform(-180, 180, n)
    tilt = np.degrees(np.arccos(rng.uniform(-1, 1, n)))
    psi = rng.uniform(-180, 180, n)
    return np.stack([rot, tilt, psi], axis=1)


def apply_ctf(images: np.ndarray, ctf: CtfParams, pixel_size: float) -> np.ndarray:
    """Multiply each image's FT by its CTF (RELION image formation, white particles)."""
    box = images.shape[-1]
    F = rfft_centered(images.astype(np.float64), 2)
    return irfft_centered(F * ctf_half_grid(ctf, box, pixel_size), box, 2).astype(np.float32)


def ctf_images(ref, A: np.ndarray, ctf: CtfParams, pixel_size: float, origins_px: np.ndarray, aberrations=None,
               mag=None, chunk: int = 500) -> np.ndarray:
    """Noise-free particle images (n, N, N) float64 of a prepared map ``ref`` (projector.FourierReference) at
    rotations A (n, 3, 3), as an instrument records them: the projection at geometry.magnified(A, mag), times the
    CTF (float64) at mag k and, with ``aberrations`` (ctf.OpticsAberrations), its antisymmetric phase; shifted by
    -origins_px (x, y pixels: the particle off centre by what re-centres it). The simulations of the CTF-refinement
    and magnification tests and of ctf_refine's benchmark."""
    box = ref.size
    n = A.shape[0]
    MA = magnified(np.asarray(A, np.float64), mag)
    F = np.concatenate([project(ref, MA[i:i + chunk]) for i in range(0, n, chunk)])
    ky, kx = half_grid_indices(box, 2)
    fx = np.broadcast_to(kx / (box * pixel_size), (box, box // 2 + 1))
    fy = np.broadcast_to(ky / (box * pixel_size), (box, box // 2 + 1))
    F = F * ctf_from_frequencies(ctf, *magnified_frequencies(mag, fx, fy), dtype=np.float64)
    if aberrations is not None:
        F = F * np.exp(1j * aberrations.odd_phase(fx, fy))
    return irfft_centered(phase_shift_2d(F, -np.asarray(origins_px), box), box, 2)


@dataclass(frozen=True)
class SimulatedParticles:
    images: np.ndarray  # (n, N, N) float32, noisy
    clean: np.ndarray  # (n, N, N) float32, CTF-affected, no noise
    angles: np.ndarray  # (n, 3) rot, tilt, psi (degrees)
    origins_px: np.ndarray  # (n, 2) x, y (pixels): the shift that re-centres each particle
    ctf: CtfParams
    pixel_size: float
    noise_sigma: float


def simulate_particles(n: int, box: int, pixel_size: float, phantom: Phantom | None = None,
                       projections_fn=None, snr: float = 0.05, seed: int = 0,
                       defocus_range_A: tuple[float, float] = (8000.0, 25000.0), astigmatism_A: float = 300.0,
                       max_shift_px: float = 3.0, angles: np.ndarray | None = None,
                       voltage: float = 300.0, cs: float = 2.7, amplitude_contrast: float = 0.1,
                       use_ctf: bool = True) -> SimulatedParticles:
    """Particle images with known orientations, offsets and per-particle defocus, plus white Gaussian noise.

    SNR is the ratio of the mean per-image signal variance (CTF-affected, over the whole box) to the noise
    variance. Either ``phantom`` (analytic projections) or ``projections_fn(A, shifts_px) -> (n, N, N)``
    (e.g. the Fourier projector of a map) provides the clean projections."""
    rng = np.random.default_rng(seed)
    ang = random_rotations(n, rng) if angles is None else np.asarray(angles, np.float64)
    A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
    sh = rng.uniform(-max_shift_px, max_shift_px, (n, 2)) if max_shift_px > 0 else np.zeros((n, 2))
    dmean = rng.uniform(*defocus_range_A, n)
    dast = rng.uniform(-astigmatism_A, astigmatism_A, n) / 2
    ctf = CtfParams(dmean + dast, dmean - dast, rng.uniform(-180, 180, n), voltage, cs, amplitude_contrast)
    if phantom is not None:
        proj = phantom_projections(phantom, A, box, pixel_size, sh)
    elif projections_fn is not None:
        proj = projections_fn(A, sh)
    else:
        raise ValueError("simulate_particles needs a phantom or a projections_fn")
    clean = apply_ctf(proj, ctf, pixel_size) if use_ctf else proj.astype(np.float32)
    sig_var = float(clean.reshape(n, -1).var(axis=1).mean())
    noise_sigma = float(np.sqrt(sig_var / snr)) if snr > 0 else 0.0
    noisy = clean + rng.normal(0.0, noise_sigma, clean.shape).astype(np.float32) if noise_sigma else clean.copy()
    return SimulatedParticles(noisy.astype(np.float32), clean, ang, sh, ctf, pixel_size, noise_sigma)


@dataclass(frozen=True)
class SimulatedMicrograph:
    image: np.ndarray  # (ny, nx) float32, raw contrast (particles dark)
    coords: np.ndarray  # (n, 2) x, y particle centres (pixels, integers)
    angles: np.ndarray  # (n, 3)
    ctf: CtfParams  # one entry
    contamination: np.ndarray  # (m, 3) x, y, radius (pixels) of contamination blobs
    noise_sigma: float


def simulate_micrograph(phantom: Phantom | None, shape: tuple[int, int], pixel_size: float, n_particles: int,
                        box: int, snr: float = 0.1, seed: int = 0, defocus_A: float = 15000.0,
                        astigmatism_A: float = 300.0, n_contamination: int = 2,
                        min_distance_px: float | None = None, projections_fn=None,
                        margin_px: int | None = None) -> SimulatedMicrograph:
    """A micrograph with particles at known integer coordinates, optional dark contamination blobs, the CTF
    applied to the whole field and white noise at the given per-particle SNR (signal variance measured
    inside each particle's box, clipped to the micrograph). Projections: of ``phantom`` (analytic), or
    ``projections_fn(A) -> (n, box, box)`` (e.g. a map's Fourier projections). Particle centres lie at least
    ``margin_px`` pixels from the edges (default box // 2) and ``min_distance_px`` apart (default 0.9 box)."""
    rng = np.random.default_rng(seed)
    ny, nx = shape
    half = box // 2
    margin = half if margin_px is None else int(margin_px)
    dmin = box * 0.9 if min_distance_px is None else min_distance_px
    coords: list[tuple[int, int]] = []
    tries = 0
    while len(coords) < n_particles and tries < 200 * n_particles:
        tries += 1
        x, y = int(rng.integers(margin, nx - margin)), int(rng.integers(margin, ny - margin))
        if all((x - a) ** 2 + (y - b) ** 2 >= dmin**2 for a, b in coords):
            coords.append((x, y))
    xy = np.array(coords, dtype=np.int64).reshape(-1, 2)
    ang = random_rotations(len(xy), rng)
    A = euler_to_matrix(ang[:, 0], ang[:, 1], ang[:, 2])
    if projections_fn is not None:
        proj = np.asarray(projections_fn(A), np.float64)
    elif phantom is not None:
        proj = phantom_projections(phantom, A, box, pixel_size)
    else:
        raise ValueError("simulate_micrograph needs a phantom or a projections_fn")
    field = np.zeros(shape, np.float64)
    for (x, y), p in zip(xy, proj, strict=True):
        field[_box(y, half, ny), _box(x, half, nx)] += p[_box(y, half, ny, True), _box(x, half, nx, True)]
    ctf = CtfParams(np.array([defocus_A + astigmatism_A / 2]), np.array([defocus_A - astigmatism_A / 2]),
                    np.array([rng.uniform(-180, 180)]))
    # CTF over the whole (square-padded) field
    n = max(ny, nx) + (max(ny, nx) % 2)
    pad = np.zeros((n, n))
    pad[:ny, :nx] = field
    F = rfft_centered(pad, 2)
    img = irfft_centered(F * ctf_half_grid(ctf, n, pixel_size)[0], n, 2)[:ny, :nx]
    # per-particle signal variance inside boxes, for the SNR definition
    sig_var = float(np.mean([img[_box(y, half, ny), _box(x, half, nx)].var() for x, y in xy])) if len(xy) else 1.0
    contam = []
    yy, xx = np.mgrid[0:ny, 0:nx]
    for _ in range(n_contamination):
        cx, cy = rng.uniform(0, nx), rng.uniform(0, ny)
        rad = rng.uniform(1.0, 2.0) * box / 2
        contam.append((cx, cy, rad))
        blob = expit(-((xx - cx) ** 2 + (yy - cy) ** 2 - rad**2) / (rad * 4.0))
        img = img + 6.0 * np.sqrt(sig_var) * blob  # white in particle contrast = dark after inversion
    noise_sigma = float(np.sqrt(sig_var / snr))
    img = img + rng.normal(0.0, noise_sigma, img.shape)
    return SimulatedMicrograph((-img).astype(np.float32), xy, ang, ctf,
                               np.array(contam).reshape(-1, 3), noise_sigma)


def _box(c: int, half: int, n: int, inner: bool = False) -> slice:
    """The rows (or columns) [c - half, c + half) of a box centred at pixel ``c`` clipped to [0, n); with
    ``inner`` the same rows as indices into the box (0 .. 2 half)."""
    lo, hi = max(0, c - half), min(n, c + half)
    return slice(lo - (c - half), hi - (c - half)) if inner else slice(lo, hi)


def conformations(ph: Phantom, n_states: int, fraction: float = 0.25) -> list[Phantom]:
    """``n_states`` conformations of a phantom for classification tests: state 0 is the phantom itself; state
    s >= 1 lacks the ``fraction`` of atoms nearest anchor atom s (anchors: outermost atoms, each as far as
    possible from the earlier ones), i.e. a missing domain at a different place in each state."""
    c = ph.centres_A
    anchors = [int(np.argmax((c**2).sum(1)))]
    while len(anchors) < n_states - 1:
        d = np.min(((c[:, None, :] - c[anchors][None]) ** 2).sum(-1), axis=1)
        anchors.append(int(np.argmax(d)))
    k = int(round(fraction * len(c)))
    states = [ph]
    for a in anchors[: n_states - 1]:
        keep = np.argsort(((c - c[a]) ** 2).sum(1))[k:]
        keep.sort()
        states.append(Phantom(c[keep], ph.amplitudes[keep], ph.sigma_A))
    return states


def l_shaped_phantom(seed: int = 0) -> Phantom:
    """A rod (~60 Å), an arm at one end and a knob above the other end (Å): its projections along different axes
    differ clearly, which makes it the 2D-classification test object."""
    rng = np.random.default_rng(seed)
    parts = [((-20.0, 0, 0), (30.0, 7, 7), 120), ((25.0, 28, 0), (7.0, 18, 7), 60), ((-35.0, 0, 25), (9.0, 9, 9), 40)]
    c = np.concatenate([np.array(m) + rng.normal(size=(n, 3)) * np.array(sd) for m, sd, n in parts])
    return Phantom(c - c.mean(0), rng.uniform(0.6, 1.4, len(c)), 3.4)

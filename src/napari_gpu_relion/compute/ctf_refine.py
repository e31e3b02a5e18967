"""Per-particle CTF refinement (relion_ctf_refine, RELION 5.0.1; docs/ctf_refinement.md), for many particles at once.

What RELION does (src/jaz/single_particle/ctf/*.cpp) and what this module does with it:

- **Data.** Each particle's FT, centred by its origin offset (StackHelper::loadStackFS), against a prediction:
  the reference half map projected at the particle's pose (trilinear, padding 2), without CTF. RELION 5.0.1
  predicts from the particle's OWN half map (``ReferenceMap::Own`` in CtfRefiner::processSubsetMicrographs, the
  variables' names "predOpp..." notwithstanding); this module takes the half map of the OTHER half (the caller
  chooses: :class:`CtfRefiner` takes the reference of each particle), so that a particle is never compared with
  a map it was averaged into (gold standard kept).
- **Weights.** The frequency weight is RELION's ReferenceMap::getHollowWeight: the postprocess FSC
  (rlnFourierShellCorrelationCorrected, each shell below 0.143 set to 0, else the FSC itself) at the nearest
  reference shell, 0 below 1/kmin (--kmin_defocus 30 Å, --kmin_tilt 20 Å, --kmin_aberr 20 Å); white noise.
- **Defocus (ModularCtfOptimisation).** Per particle p and half-grid pixel k (factor 1 at kx = 0, 2 elsewhere):
  E = sum_p sum_k w_k |y_pk - c_pk x_pk|^2 with c = kf exp(-B u^2/4) (-sin gamma),
  gamma = phi + dz u^2 + a1 (x^2 - y^2) + 2 a2 x y + cs u^4 + gamma_even(k), x_pk the prediction times the optics
  group's antisymmetric phase. The parameters (phase phi, defocus dz, astigmatism a1/a2, Cs, B-factor and scale)
  are each per particle ('p'), per micrograph ('m') or fixed ('f'): --fit_mode, five characters (phase,
  defocus, astigmatism, Cs, B-factor/scale), default "fpmfm". RELION minimises E with L-BFGS from the current
  values. Here, with y x* and |x|^2 reduced to two real numbers per pixel (E = sum w (|x|^2 c^2 - 2 Re(y x*) c) +
  const), E is evaluated for every particle at once: first on a grid of average-defocus offsets of +-bf_range
  (as RELION's --bf0 brute-force search, but finer: the step is at most a quarter of the CTF's period at the
  fit's highest frequency), all grid points as five matrix products; then Levenberg-Marquardt steps (exact
  Gauss-Newton normal matrix of the least squares, Marquardt's diagonal damping, a step kept only where it lowers
  E), alternating between the per-particle and the per-micrograph parameters. Defocus is kept in Å (the mean
  defocus and the two astigmatism components), converted to rlnDefocusU/V/Angle as RELION's writeToTable
  (U >= V, the angle of U's axis).
- **Antisymmetric aberrations (TiltEstimator, TiltHelper).** Per optics group and pixel: xy = sum_p c_p x_p* y_p
  and w = sum_p c_p^2 |x_p|^2, with x the prediction WITHOUT the group's current antisymmetric phase and c the
  (refined) CTF. The phase of xy is fitted, weighted by w times the hollow weight, by a linear least squares
  in the basis (x, y, |k|^2 x, |k|^2 y) for the beam tilt alone (--odd_aberr_max_n < 3) or the odd Zernike
  polynomials up to --odd_aberr_max_n, then refined by minimising sum W |xy/w - exp(i phi)|^2 (RELION: Nelder-Mead;
  here Levenberg-Marquardt). The coma terms become rlnBeamTiltX/Y (TiltHelper::extractTilt).
- **Symmetric aberrations (AberrationEstimator).** Per pixel, with gamma0 the CTF's phase without the even Zernike
  terms: sums of |x|^2 (sin^2, sin cos, cos^2)(gamma0) and -Re(y x*) (sin, cos)(gamma0); the 2x2 solve gives
  (cos d, sin d) of the phase offset d; d is fitted by even Zernike polynomials up to --even_aberr_max_n weighted
  by the hollow weight times sqrt|det|, then refined by minimising the 2x2-weighted distance (RELION's
  AnisoBasisOptimisation).

Pixels: the half grid of the box within |k| <= N/2, without the Nyquist row (ky = N/2): the projector has no
values beyond N/2, and RELION's aberration images put that row at -N/2 where the CTF image puts it at +N/2.
Everything is float64; a batch is whole micrographs (a per-micrograph parameter needs all its particles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .backend import get_array_module, to_host
from .ctf import (
    CtfParams,
    OpticsAberrations,
    electron_wavelength_A,
    extract_tilt,
    number_of_even_coeffs,
    number_of_odd_coeffs,
    tilt_scale,
    zernike_basis,
)
from .fourier import half_grid_indices, rfft_centered
from .geometry import magnified, magnified_frequencies
from .projector import FourierReference, project_pixels

#: RELION's defaults (relion_ctf_refine).
FIT_MODE = "fpmfm"
KMIN_DEFOCUS_A = 30.0
KMIN_TILT_A = 20.0
KMIN_ABERR_A = 20.0
BF_RANGE_A = 2000.0
MAX_DEFOCUS_ITERS = 100
EVEN_ABERR_MAX_N = 4
KMIN_MAG_A = 20.0  # --kmin_mag
#: Step (image pixels) of the central differences that give the predictions' gradient for the magnification fit.
GRADIENT_STEP_PX = 0.25
FSC_THRESHOLD = 0.143
#: The defocus grid's largest step (Å); smaller when a quarter of the CTF's period at the fit's highest frequency
#: is smaller.
GRID_STEP_MAX_A = 100.0
#: Levenberg-Marquardt: relative decrease of the summed objective below which a round counts as still, and the
#: rounds in a row that must be still for the iterations to stop (a round whose steps all overshoot is still too,
#: but its larger damping may well go on).
LM_TOLERANCE = 1e-12
LM_STILL_ROUNDS = 3
#: Bytes per (particle, fitted pixel) of a batch at the peak: y and x (complex128), the reduced terms, gamma,
#: the CTF and its partial derivatives (float64), with a margin. The caller sizes batches with it.
BYTES_PER_PARTICLE_PIXEL = 320
#: Bytes per particle per box pixel for the images and their FT (float32 image, complex64 FT).
BYTES_PER_IMAGE_PIXEL = 24

#: --fit_mode characters: parameter name -> columns of the parameter array.
MODE_PARAMS = ("phase", "defocus", "astigmatism", "cs", "bfactor")
_COLUMNS = {"phase": (0,), "defocus": (1,), "astigmatism": (2, 3), "cs": (4,), "bfactor": (5, 6)}
N_PARAMS = 7  # phi (rad), zavg, z1, z2 (Å), Cs (mm), B (Å^2), scale


@dataclass(frozen=True)
class FitModes:
    """RELION's --fit_mode: per particle 'p', per micrograph 'm' or fixed 'f' for the phase shift, the defocus,
    the astigmatism, Cs and the B-factor with the scale factor (in that order)."""

    phase: str = "f"
    defocus: str = "p"
    astigmatism: str = "m"
    cs: str = "f"
    bfactor: str = "m"

    @classmethod
    def parse(cls, text: str) -> FitModes:
        text = str(text).strip()
        if len(text) != 5 or any(ch not in "pmf" for ch in text):
            raise ValueError(f"--fit_mode must be 5 characters of p, m or f (phase, defocus, astigmatism, Cs, "
                             f"B-factor), got '{text}'")
        return cls(*text)

    def __str__(self) -> str:
        return "".join(getattr(self, n) for n in MODE_PARAMS)

    def columns(self, mode: str) -> tuple[int, ...]:
        """Parameter columns with this mode character."""
        return tuple(c for n in MODE_PARAMS if getattr(self, n) == mode for c in _COLUMNS[n])

    @property
    def fits_anything(self) -> bool:
        return any(getattr(self, n) != "f" for n in MODE_PARAMS)


# ----------------------------------------------------------------------------------------------------------
# Pixels and weights


@dataclass
class FitPixels:
    """The half-grid pixels of an s-box at a pixel size used by the fits: |k| <= s/2, the Nyquist row left out."""

    box: int
    angpix: float
    ky: object  # (npix,) int
    kx: object
    flat: object  # index into the (s, s//2+1) half grid
    fx: object  # (npix,) float64, 1/Å
    fy: object
    hermitian: object  # (npix,) float64: 1 at kx = 0, 2 elsewhere (RELION's sums over the half grid)

    @property
    def npix(self) -> int:
        return int(self.flat.shape[0])

    def subset(self, keep) -> FitPixels:
        return FitPixels(self.box, self.angpix, self.ky[keep], self.kx[keep], self.flat[keep], self.fx[keep],
                         self.fy[keep], self.hermitian[keep])


def fit_pixels(box: int, angpix: float, xp=np) -> FitPixels:
    ky, kx = half_grid_indices(box, 2, xp)
    KY, KX = (a.reshape(-1) for a in xp.broadcast_arrays(ky, kx))
    keep = (KX * KX + KY * KY <= (box // 2) ** 2) & (KY != box // 2)
    flat = xp.nonzero(keep)[0]
    ky, kx = KY[flat], KX[flat]
    size = box * angpix
    return FitPixels(box, float(angpix), ky, kx, flat, kx.astype(np.float64) / size, ky.astype(np.float64) / size,
                     xp.where(kx == 0, 1.0, 2.0))


def fsc_shell_weight(fsc, threshold: float = FSC_THRESHOLD) -> np.ndarray:
    """RELION's RefinementHelper::drawFSC: each shell's FSC, 0 where it is below the threshold."""
    f = np.asarray(fsc, np.float64).copy()
    f[f < threshold] = 0.0
    return f


def hollow_weight(pix: FitPixels, kmin_A: float, shell_weight=None, ref_box: int | None = None,
                  ref_angpix: float | None = None) -> object:
    """RELION's ReferenceMap::getHollowWeight at the pixels: the shell weight (:func:`fsc_shell_weight`; 1 when
    None) of the nearest reference shell (ROUND of |k| in the reference's box, the last shell beyond), 0 below
    1/kmin_A."""
    xp = get_array_module(pix.fx)
    r = xp.sqrt(pix.fx ** 2 + pix.fy ** 2)
    w = xp.where(r < 1.0 / kmin_A, 0.0, 1.0) if kmin_A > 0 else xp.ones(pix.npix)
    if shell_weight is None:
        return w
    sw = xp.asarray(np.asarray(shell_weight, np.float64))
    size_ref = (ref_box or pix.box) * (ref_angpix or pix.angpix)
    shell = xp.minimum(xp.floor(r * size_ref + 0.5).astype(np.int64), sw.shape[0] - 1)
    return w * sw[shell]


# ----------------------------------------------------------------------------------------------------------
# Parameters: CtfParams <-> the fit's array (phi, zavg, z1, z2, Cs, B, scale)


def _k3(q0):
    q0 = np.asarray(q0, np.float64)
    return np.arctan(q0 / np.sqrt(1.0 - q0 * q0))


def params_to_array(p: CtfParams) -> np.ndarray:
    """(n, 7) float64: phi = -phase shift (rad) - atan(Q0/sqrt(1-Q0^2)) (RELION's ``-K5 - K3``), the mean defocus
    zavg = (U+V)/2, the astigmatism z1 = (U-V)/2 cos 2a, z2 = (U-V)/2 sin 2a (Å), Cs (mm), B (Å^2), scale."""
    n = len(p)

    def col(v):
        return np.broadcast_to(np.asarray(v, np.float64), (n,)).astype(np.float64)

    du, dv, ang = col(p.defocus_u), col(p.defocus_v), np.radians(col(p.defocus_angle))
    half = 0.5 * (du - dv)
    out = np.empty((n, N_PARAMS))
    out[:, 0] = -np.radians(col(p.phase_shift)) - _k3(col(p.amplitude_contrast))
    out[:, 1] = 0.5 * (du + dv)
    out[:, 2] = half * np.cos(2 * ang)
    out[:, 3] = half * np.sin(2 * ang)
    out[:, 4] = col(p.cs)
    out[:, 5] = col(p.bfactor)
    out[:, 6] = col(p.scale)
    return out


def array_to_columns(theta: np.ndarray, amplitude_contrast) -> dict[str, np.ndarray]:
    """RELION's columns from the fit's array (ModularCtfOptimisation::writeToTable): rlnDefocusU >= rlnDefocusV
    (Å), rlnDefocusAngle (degrees, U's axis, in (-90, 90]), rlnPhaseShift (degrees), rlnSphericalAberration (mm),
    rlnCtfBfactor (Å^2), rlnCtfScalefactor."""
    t = np.asarray(theta, np.float64)
    q0 = np.broadcast_to(np.asarray(amplitude_contrast, np.float64), (t.shape[0],))
    r = np.hypot(t[:, 2], t[:, 3])
    return {"rlnDefocusU": t[:, 1] + r, "rlnDefocusV": t[:, 1] - r,
            "rlnDefocusAngle": np.degrees(0.5 * np.arctan2(t[:, 3], t[:, 2])),
            "rlnPhaseShift": np.degrees(-t[:, 0] - _k3(q0)),
            "rlnSphericalAberration": t[:, 4].copy(), "rlnCtfBfactor": t[:, 5].copy(),
            "rlnCtfScalefactor": t[:, 6].copy()}


# ----------------------------------------------------------------------------------------------------------
# The CTF of the fit's parameters and its partial derivatives


@dataclass
class _Geometry:
    """Per pixel: u^2, x^2 - y^2, 2xy, u^4 (1/Å powers)."""

    u2: object
    a1: object
    a2: object
    u4: object

    @classmethod
    def of(cls, pix: FitPixels) -> _Geometry:
        x, y = pix.fx, pix.fy
        u2 = x * x + y * y
        return cls(u2, x * x - y * y, 2.0 * x * y, u2 * u2)


def _gamma(theta, lam, g: _Geometry, gamma_even):
    """(P, npix) gamma of the fit's parametrisation (RELION's ModularCtfOptimisation, defocus in Å)."""
    xp = get_array_module(theta)
    pl = (np.pi * lam)[:, None]
    k2 = (0.5 * np.pi * 1e7 * lam ** 3)[:, None]
    gam = (theta[:, 0:1] - pl * (theta[:, 1:2] * g.u2 + theta[:, 2:3] * g.a1 + theta[:, 3:4] * g.a2)
           + k2 * theta[:, 4:5] * g.u4)
    if gamma_even is not None:
        gam = gam + gamma_even
    return xp.asarray(gam)


def ctf_values(theta, lam, g: _Geometry, gamma_even=None, columns: tuple[int, ...] = ()):
    """c (P, npix) and, for each of ``columns``, dc/dtheta_j (P, npix)."""
    xp = get_array_module(theta)
    gam = _gamma(theta, lam, g, gamma_even)
    env = xp.exp(-theta[:, 5:6] * g.u2 / 4.0)
    amp = theta[:, 6:7] * env
    s = xp.sin(gam)
    c = -amp * s
    if not columns:
        return c, []
    dgam = -amp * xp.cos(gam)
    pl = (np.pi * lam)[:, None]
    parts = []
    for j in columns:
        if j == 0:
            parts.append(dgam)
        elif j == 1:
            parts.append(dgam * (-pl * g.u2))
        elif j == 2:
            parts.append(dgam * (-pl * g.a1))
        elif j == 3:
            parts.append(dgam * (-pl * g.a2))
        elif j == 4:
            parts.append(dgam * ((0.5 * np.pi * 1e7 * lam ** 3)[:, None] * g.u4))
        elif j == 5:
            parts.append(c * (-g.u2 / 4.0))
        else:
            parts.append(-env * s)
    return c, parts


# ----------------------------------------------------------------------------------------------------------
# Observations and predictions


def magnified_pixels(pix: FitPixels, mag) -> FitPixels:
    """The fit's pixels with the CTF's frequencies at mag k (an optics group's magnification matrix; the same
    pixels, indices and weights): RELION evaluates the CTF of a magnified group there. ``pix`` for None."""
    if mag is None:
        return pix
    fx, fy = magnified_frequencies(mag, pix.fx, pix.fy)
    return FitPixels(pix.box, pix.angpix, pix.ky, pix.kx, pix.flat, fx, fy, pix.hermitian)


def centred_observations(images, offsets_px, pix: FitPixels):
    """(P, npix) complex128: RELION's FT of each image (rfft_centered), shifted by +origin (pixels, (P, 2) x, y) so
    that the particle sits at the centre, at the fit's pixels."""
    xp = get_array_module(images)
    F = rfft_centered(xp.asarray(images, dtype=np.float32), 2)
    F = F.reshape(F.shape[0], -1)[:, pix.flat].astype(np.complex128)
    t = xp.asarray(offsets_px, dtype=np.float64)
    phase = (-2.0 * np.pi / pix.box) * (pix.kx[None, :] * t[:, 0:1] + pix.ky[None, :] * t[:, 1:2])
    return F * xp.exp(1j * phase)


def predictions(ref: FourierReference, A, index, pix: FitPixels):
    """(P, npix) complex128: the reference (a stacked pair of half maps, ``index`` (P,) which of them) projected
    at the rotation matrices A (P, 3, 3), no CTF."""
    return project_pixels(ref, A, pix.kx, pix.ky, index=index).astype(np.complex128)


def prediction_gradient(ref: FourierReference, A, index, pix: FitPixels, step: float = GRADIENT_STEP_PX):
    """(d/dkx, d/dky) of :func:`predictions` per image pixel, each (P, npix) complex128, by central differences
    of the projector at k +- ``step`` pixels (RELION projects the reference's gradient; both are the slope of
    the interpolated slice)."""
    kx, ky = pix.kx.astype(np.float64), pix.ky.astype(np.float64)
    out = []
    for dx, dy in ((step, 0.0), (0.0, step)):
        hi = project_pixels(ref, A, kx + dx, ky + dy, index=index).astype(np.complex128)
        lo = project_pixels(ref, A, kx - dx, ky - dy, index=index).astype(np.complex128)
        out.append((hi - lo) / (2.0 * step))
    return out[0], out[1]


def fit_magnification(sums, weight, pix: FitPixels) -> np.ndarray:
    """The 2x2 matrix M = I + D that best maps each pixel k of the observations onto the predictions (y(k) ~
    c x(M k)), from one group's per-pixel sums (Axx, Axy, Ayy, bx, by) = sum (c^2 |gx|^2, c^2 Re gx gy*, c^2 |gy|^2,
    c Re gx* r, c Re gy* r) (g the predictions' gradient, r = y - c x): the linearised least squares over the
    pixels weighted by ``weight``, RELION's MagnificationHelper::solveLinearlyFreq."""
    xp = get_array_module(sums)
    axx, axy, ayy, bx, by = (sums[i] * weight for i in range(5))
    x, y = pix.kx.astype(np.float64), pix.ky.astype(np.float64)
    xx, xy_, yy = x * x, x * y, y * y
    A = xp.stack([xp.stack([xx * axx, xy_ * axx, xx * axy, xy_ * axy]),
                  xp.stack([xy_ * axx, yy * axx, xy_ * axy, yy * axy]),
                  xp.stack([xx * axy, xy_ * axy, xx * ayy, xy_ * ayy]),
                  xp.stack([xy_ * axy, yy * axy, xy_ * ayy, yy * ayy])]).sum(axis=-1)
    b = xp.stack([x * bx, y * bx, x * by, y * by]).sum(axis=-1)
    d = np.linalg.solve(np.asarray(to_host(A), np.float64), np.asarray(to_host(b), np.float64))
    return np.eye(2) + d.reshape(2, 2)


def magnification_anisotropy(m) -> tuple[float, float]:
    """(mean magnification, anisotropy) of a magnification matrix: the mean and the difference of its singular
    values (RELION's report: anisotropy x 100 %)."""
    sv = np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)
    return float(sv.mean()), float(abs(sv[0] - sv[1]))


def adapt_astigmatism(theta: np.ndarray, old, new) -> np.ndarray:
    """The fit's parameters (P, 7) with the defocus and astigmatism carried from the CTF at ``old`` k to the CTF
    at ``new`` k (magnification matrices, None = identity), so that the CTF's defocus term is the same function of
    the image pixels (RELION's --fit_aniso translates the astigmatism unless --keep_astig): the quadratic form
    D = [[z + z1, z2], [z2, z - z1]] becomes T^T D T with T = old new^-1."""
    T = (np.eye(2) if old is None else np.asarray(old, np.float64)) @ np.linalg.inv(
        np.eye(2) if new is None else np.asarray(new, np.float64))
    t = np.array(theta, np.float64, copy=True)
    D = np.empty((t.shape[0], 2, 2))
    D[:, 0, 0], D[:, 1, 1] = t[:, 1] + t[:, 2], t[:, 1] - t[:, 2]
    D[:, 0, 1] = D[:, 1, 0] = t[:, 3]
    D = T.T[None] @ D @ T[None]
    t[:, 1], t[:, 2], t[:, 3] = 0.5 * (D[:, 0, 0] + D[:, 1, 1]), 0.5 * (D[:, 0, 0] - D[:, 1, 1]), D[:, 0, 1]
    return t


# ----------------------------------------------------------------------------------------------------------
# The defocus fit of one batch


def _unit_sums(values, unit, n_units: int):
    """(n_units, ...) sums of ``values`` (P, ...) over the particles of each unit (a one-hot matrix product)."""
    xp = get_array_module(values)
    onehot = (xp.asarray(unit)[None, :] == xp.arange(n_units)[:, None]).astype(np.float64)
    flat = values.reshape(values.shape[0], -1)
    return (onehot @ flat).reshape((n_units,) + values.shape[1:])


@dataclass
class DefocusData:
    """A batch reduced for the defocus fit: a = Re(y x*), b = |x|^2 (P, npix), the weights w (npix,) (the hollow
    weight times the Hermitian factor), the geometry, the wavelength (P,) and the symmetric phase (P or 1, npix)."""

    a: object
    b: object
    w: object
    geometry: _Geometry
    lam: object
    gamma_even: object = None

    def energy(self, theta):
        """(P,) sum_k w (b c^2 - 2 a c): E up to the particles' sum_k w |y|^2."""
        c, _ = ctf_values(theta, self.lam, self.geometry, self.gamma_even)
        return ((self.b * c - 2.0 * self.a) * c) @ self.w


def defocus_data(y, x, weight, pix: FitPixels, lam, gamma_even=None) -> DefocusData:
    """The reduced terms of observations y and predictions x (P, npix) at the fit pixels (x with its optics
    group's antisymmetric phase already applied)."""
    xp = get_array_module(y)
    a = (y * xp.conj(x)).real
    b = (x * xp.conj(x)).real
    return DefocusData(a, b, weight * pix.hermitian, _Geometry.of(pix), xp.asarray(lam, dtype=np.float64),
                       gamma_even)


def grid_step(pix: FitPixels, weight, lam: float) -> float:
    """The defocus grid's step (Å): a quarter of the CTF's period 2 / (lambda u^2) at the highest weighted
    frequency, at most GRID_STEP_MAX_A."""
    xp = get_array_module(weight)
    u2 = pix.fx ** 2 + pix.fy ** 2
    u2max = float(to_host(xp.max(xp.where(weight > 0, u2, 0.0))))
    if u2max <= 0:
        return GRID_STEP_MAX_A
    return float(min(GRID_STEP_MAX_A, 0.5 / (lam * u2max)))


def defocus_grid_energy(d: DefocusData, theta, offsets):
    """(P, D) E of each particle with its mean defocus moved by each offset (Å): with gamma0 its current gamma,
    sin(gamma0 + beta o) = sin gamma0 cos(beta o) + cos gamma0 sin(beta o), beta = -pi lambda u^2, so E is five
    (P, npix) x (npix, D) matrix products. Particles of one wavelength per product."""
    xp = get_array_module(theta)
    o = xp.asarray(offsets, dtype=np.float64)
    gam = _gamma(theta, d.lam, d.geometry, d.gamma_even)
    amp = theta[:, 6:7] * xp.exp(-theta[:, 5:6] * d.geometry.u2 / 4.0)
    s, c = xp.sin(gam), xp.cos(gam)
    wb = d.w * d.b * amp * amp
    wa = 2.0 * d.w * d.a * amp
    U = (wb * s * s, 2.0 * wb * s * c, wb * c * c, wa * s, wa * c)
    out = xp.empty((theta.shape[0], o.shape[0]), dtype=np.float64)
    lam_host = to_host(d.lam)
    for lv in np.unique(lam_host):
        rows = xp.asarray(np.flatnonzero(lam_host == lv))
        ph = (-np.pi * float(lv) * d.geometry.u2)[:, None] * o[None, :]  # (npix, D)
        C, S = xp.cos(ph), xp.sin(ph)
        out[rows] = (U[0][rows] @ (C * C) + U[1][rows] @ (C * S) + U[2][rows] @ (S * S)
                     + U[3][rows] @ C + U[4][rows] @ S)
    return out


def _set_unit_means(theta, cols, unit, n_units: int):
    """Per-micrograph parameters start at the mean of their particles' values (RELION: the first particle's)."""
    xp = get_array_module(theta)
    counts = _unit_sums(xp.ones(theta.shape[0]), unit, n_units)
    for j in cols:
        mean = _unit_sums(theta[:, j], unit, n_units) / xp.maximum(counts, 1.0)
        theta[:, j] = mean[unit]
    return theta


@dataclass
class _Block:
    cols: tuple[int, ...]
    unit: object  # (P,) unit of each particle
    n_units: int
    damping: object = None


def _lm_step(d: DefocusData, theta, blk: _Block, per_particle: bool):
    """One Levenberg-Marquardt step of the block's parameters for every unit; returns (theta, decrease)."""
    xp = get_array_module(theta)
    c, parts = ctf_values(theta, d.lam, d.geometry, d.gamma_even, blk.cols)
    r = d.b * c - d.a
    E = ((r - d.a) * c) @ d.w
    n = len(blk.cols)
    g = xp.stack([2.0 * ((r * p_) @ d.w) for p_ in parts], axis=1)  # (P, n)
    wb = d.w * d.b
    H = xp.empty((theta.shape[0], n, n))
    for i in range(n):
        for j in range(i, n):
            H[:, i, j] = H[:, j, i] = 2.0 * xp.sum(parts[i] * parts[j] * wb, axis=1)
    if not per_particle:
        E, g, H = (_unit_sums(v, blk.unit, blk.n_units) for v in (E, g, H))
    diag = xp.diagonal(H, axis1=1, axis2=2)
    tiny = 1e-12 * xp.maximum(diag.max(axis=1), 1e-300)
    A = H + (blk.damping[:, None] * diag)[:, :, None] * xp.eye(n) + tiny[:, None, None] * xp.eye(n)
    delta = -xp.linalg.solve(A, g[:, :, None])[:, :, 0]  # (U, n)
    trial = theta.copy()
    step = delta if per_particle else delta[blk.unit]
    for i, j in enumerate(blk.cols):
        trial[:, j] = theta[:, j] + step[:, i]
    Et = d.energy(trial)
    if not per_particle:
        Et = _unit_sums(Et, blk.unit, blk.n_units)
    ok = Et < E
    okp = ok if per_particle else ok[blk.unit]
    theta = xp.where(okp[:, None], trial, theta)
    blk.damping = xp.where(ok, blk.damping / 3.0, blk.damping * 4.0)
    decrease = float(to_host(xp.sum(xp.where(ok, E - Et, 0.0))))
    scale = float(to_host(xp.sum(xp.abs(E))))
    return theta, decrease, scale


def fit_ctf_parameters(d: DefocusData, theta0, micrograph, modes: FitModes, bf_range_A: float = BF_RANGE_A,
                       max_iters: int = MAX_DEFOCUS_ITERS, step_A: float | None = None,
                       check: Callable[[], None] | None = None):
    """The refined parameters (P, 7) of a batch of whole micrographs (``micrograph`` (P,) their indices 0..M-1).

    1. Per-micrograph parameters start at the mean of their particles' values.
    2. When the defocus is fitted: the grid of mean-defocus offsets -bf_range..+bf_range (step ``step_A``, default
       :func:`grid_step`) for each unit of the defocus mode (a particle, or a micrograph: the sum of its
       particles' E), the best grid point kept.
    3. Levenberg-Marquardt, alternating the per-particle block and the per-micrograph block, until the summed
       decrease of E has been below LM_TOLERANCE of |E| for LM_STILL_ROUNDS rounds in a row (or ``max_iters``
       rounds)."""
    xp = get_array_module(d.a)
    theta = xp.asarray(theta0, dtype=np.float64).copy()
    mic = xp.asarray(micrograph)
    n_mic = int(to_host(mic.max())) + 1 if mic.size else 0
    P = theta.shape[0]
    per_mic = modes.columns("m")
    if per_mic:
        theta = _set_unit_means(theta, per_mic, mic, n_mic)
    if modes.defocus != "f" and bf_range_A > 0:
        step = step_A or grid_step(_pixels_like(d), d.w, float(to_host(d.lam.max())))
        n_side = max(1, int(np.ceil(bf_range_A / step)))
        offsets = xp.arange(-n_side, n_side + 1, dtype=np.float64) * (bf_range_A / n_side)
        Eg = defocus_grid_energy(d, theta, offsets)
        if modes.defocus == "m":
            Eg = _unit_sums(Eg, mic, n_mic)
            best = offsets[xp.argmin(Eg, axis=1)][mic]
        else:
            best = offsets[xp.argmin(Eg, axis=1)]
        theta[:, 1] = theta[:, 1] + best
    blocks = []
    if modes.columns("p"):
        blocks.append((_Block(modes.columns("p"), xp.arange(P), P, xp.full(P, 1e-3)), True))
    if per_mic:
        blocks.append((_Block(per_mic, mic, n_mic, xp.full(n_mic, 1e-3)), False))
    still = 0
    for _ in range(int(max_iters) if blocks else 0):
        if check is not None:
            check()
        total, scale = 0.0, 0.0
        for blk, pp in blocks:
            theta, dec, sc = _lm_step(d, theta, blk, pp)
            total += dec
            scale = max(scale, sc)
        still = still + 1 if total <= LM_TOLERANCE * max(scale, 1e-300) else 0
        if still >= LM_STILL_ROUNDS:
            break
    return theta


def _pixels_like(d: DefocusData) -> FitPixels:
    """Frequencies of the data (only u^2 matters for the grid step)."""
    xp = get_array_module(d.geometry.u2)
    fx = xp.sqrt(d.geometry.u2)
    z = xp.zeros_like(fx)
    return FitPixels(0, 1.0, z, z, z, fx, z, z)


# ----------------------------------------------------------------------------------------------------------
# The aberration sums of a batch and their fits


@dataclass
class AberrationSums:
    """Per optics group, per pixel: xy = sum c x* y and w = sum c^2 |x|^2 (antisymmetric; x without the group's
    odd phase), Axx, Axy, Ayy = sum |x|^2 (s^2, c s, c^2)(gamma0), bx, by = -sum Re(y x*) (s, c)(gamma0)
    (symmetric; x with the odd phase, gamma0 without the even terms)."""

    n_groups: int
    npix: int
    xp: object = np
    xy: object = field(init=False)
    w: object = field(init=False)
    even: object = field(init=False)  # (G, 5, npix): Axx, Axy, Ayy, bx, by
    mag: object = field(init=False)  # (G, 5, npix): the magnification fit's sums (fit_magnification)

    def __post_init__(self):
        self.xy = self.xp.zeros((self.n_groups, self.npix), dtype=np.complex128)
        self.w = self.xp.zeros((self.n_groups, self.npix), dtype=np.float64)
        self.even = self.xp.zeros((self.n_groups, 5, self.npix), dtype=np.float64)
        self.mag = self.xp.zeros((self.n_groups, 5, self.npix), dtype=np.float64)

    def arrays(self) -> list:
        """The accumulators (for a sum over MPI ranks)."""
        return [self.xy, self.w, self.even, self.mag]

    def add_mag(self, y, x, gx, gy, c, group) -> None:
        xp = self.xp
        r = y - c * x
        terms = xp.stack([c * c * (gx * xp.conj(gx)).real, c * c * (gx * xp.conj(gy)).real,
                          c * c * (gy * xp.conj(gy)).real, c * (xp.conj(gx) * r).real, c * (xp.conj(gy) * r).real],
                         axis=1)
        self.mag += _unit_sums(terms, group, self.n_groups)

    def add_odd(self, y, x_plain, c, group) -> None:
        xp = self.xp
        self.xy += _unit_sums_complex(c * xp.conj(x_plain) * y, group, self.n_groups)
        self.w += _unit_sums(c * c * (x_plain * xp.conj(x_plain)).real, group, self.n_groups)

    def add_even(self, y, x_odd, gamma0, group) -> None:
        xp = self.xp
        s, c = xp.sin(gamma0), xp.cos(gamma0)
        nr = (x_odd * xp.conj(x_odd)).real
        zz = (y * xp.conj(x_odd)).real
        terms = xp.stack([nr * s * s, nr * c * s, nr * c * c, -zz * s, -zz * c], axis=1)  # (P, 5, npix)
        self.even += _unit_sums(terms, group, self.n_groups)


def _unit_sums_complex(values, unit, n_units: int):
    return _unit_sums(values.real, unit, n_units) + 1j * _unit_sums(values.imag, unit, n_units)


def _weighted_lstsq(basis, values, weight):
    """argmin_c sum weight (basis^T c - values)^2; basis (n, npix)."""
    xp = get_array_module(basis)
    sw = xp.sqrt(xp.maximum(weight, 0.0))
    M = (basis * sw[None, :]).T
    c = xp.linalg.lstsq(M, values * sw, rcond=None)[0]
    return c


def _lm_fit_phase(basis, c0, energy_grad_hess, iters: int = 200):
    """Minimise a phase objective over coefficients c (basis (n, npix)) from c0 by Levenberg-Marquardt;
    ``energy_grad_hess(phi) -> (E, dE/dphi (npix,), GN curvature (npix,))``."""
    xp = get_array_module(basis)
    c = xp.asarray(c0, dtype=np.float64).copy()
    lam = 1e-3
    E, gphi, hphi = energy_grad_hess(basis.T @ c)
    for _ in range(iters):
        g = basis @ gphi
        H = (basis * hphi[None, :]) @ basis.T
        d = xp.diagonal(H)
        A = H + lam * xp.diag(d) + 1e-15 * float(to_host(d.max())) * xp.eye(H.shape[0])
        step = -xp.linalg.solve(A, g)
        trial = c + step
        Et, gt, ht = energy_grad_hess(basis.T @ trial)
        if float(to_host(Et)) < float(to_host(E)):
            done = float(to_host(E - Et)) <= 1e-13 * abs(float(to_host(E)))
            c, E, gphi, hphi = trial, Et, gt, ht
            lam = max(lam / 3.0, 1e-12)
            if done:
                break
        else:
            lam *= 4.0
            if lam > 1e12:
                break
    return c


@dataclass
class OddFit:
    """An optics group's antisymmetric fit: the beam tilt (mrad), the odd Zernike coefficients left after the tilt
    was taken out (None when only the tilt was fitted), the per-pixel phase and weight, and the fitted phase."""

    beam_tilt_x: float
    beam_tilt_y: float
    odd: np.ndarray | None
    phase: np.ndarray
    weight: np.ndarray
    fit: np.ndarray


def fit_odd_aberrations(xy, w, hollow, pix: FitPixels, n_max: int, cs_mm: float, voltage_kV: float) -> OddFit:
    """RELION's TiltEstimator::parametricFit for one optics group: the beam tilt alone (``n_max`` < 3: phase =
    sx x + sy y + |k|^2 (tx' x + ty' y), tilt = -t' / (Cs 2e4 pi lambda^2)) or the odd Zernike polynomials up to
    ``n_max`` with the tilt taken out of the coma terms (extractTilt)."""
    xp = get_array_module(xy)
    z = xp.where(w > 0, xy / xp.where(w > 0, w, 1.0), 0.0)
    W = w * hollow
    phase = xp.angle(xy)
    x, y = pix.fx, pix.fy
    if n_max < 3:
        u2 = x * x + y * y
        basis = xp.stack([x, y, u2 * x, u2 * y])
    else:
        basis = zernike_basis(number_of_odd_coeffs(n_max), True, x, y, xp)
    c0 = _weighted_lstsq(basis, phase, W)

    def egh(phi):  # E = sum W |exp(i phi) - z|^2
        e = xp.exp(1j * phi)
        E = xp.sum(W * xp.abs(e - z) ** 2)
        return E, 2.0 * W * (xp.conj(z) * e).imag, 2.0 * W

    c = _lm_fit_phase(basis, c0, egh)
    fit = basis.T @ c
    c = to_host(c)
    if n_max < 3:
        s = tilt_scale(cs_mm, voltage_kV)
        tx, ty, odd = -c[2] / s, -c[3] / s, None
    else:
        odd, tx, ty = extract_tilt(c, cs_mm, voltage_kV)
        odd = odd[:number_of_odd_coeffs(n_max)]
    return OddFit(float(tx), float(ty), odd, to_host(phase), to_host(W), to_host(fit))


@dataclass
class EvenFit:
    """An optics group's symmetric fit: the even Zernike coefficients, the per-pixel phase and weight, the fit."""

    even: np.ndarray
    phase: np.ndarray
    weight: np.ndarray
    fit: np.ndarray


def fit_even_aberrations(sums, hollow, pix: FitPixels, n_max: int) -> EvenFit:
    """RELION's AberrationEstimator::parametricFit for one optics group (``sums`` (5, npix): Axx, Axy, Ayy, bx,
    by)."""
    xp = get_array_module(sums)
    Axx, Axy, Ayy, bx, by = sums
    det = Axx * Ayy - Axy * Axy
    ok = det != 0
    sd = xp.where(ok, det, 1.0)
    ox = xp.where(ok, (Ayy * bx - Axy * by) / sd, 0.0)
    oy = xp.where(ok, (Axx * by - Axy * bx) / sd, 0.0)
    phase = xp.where(xp.abs(ox) > 0, xp.arctan2(oy, ox), 0.0)
    W0 = xp.where(ok, hollow, 0.0)
    W = W0 * xp.sqrt(xp.abs(det))
    basis = zernike_basis(number_of_even_coeffs(n_max), False, pix.fx, pix.fy, xp)
    c0 = _weighted_lstsq(basis, phase, W)

    def egh(phi):  # E = sum W0 e^T A e, e = (cos phi - ox, sin phi - oy)
        cp, sp = xp.cos(phi), xp.sin(phi)
        ex, ey = cp - ox, sp - oy
        E = xp.sum(W0 * (Axx * ex * ex + 2 * Axy * ex * ey + Ayy * ey * ey))
        tx, ty = -sp, cp
        g = 2.0 * W0 * ((Axx * ex + Axy * ey) * tx + (Axy * ex + Ayy * ey) * ty)
        h = 2.0 * W0 * (Axx * tx * tx + 2 * Axy * tx * ty + Ayy * ty * ty)
        return E, g, h

    c = _lm_fit_phase(basis, c0, egh)
    return EvenFit(to_host(c), to_host(phase), to_host(W), to_host(basis.T @ c))


def full_grid_image(values, pix: FitPixels, odd: bool) -> np.ndarray:
    """(s, s) centred image (origin at s//2) of per-pixel values of the half grid, the other half from
    Hermitian symmetry (values at -k: -v for an antisymmetric phase, v for a symmetric one); NaN where no pixel."""
    s = pix.box
    out = np.full((s, s), np.nan)
    v = np.asarray(to_host(values), np.float64)
    ky, kx = np.asarray(to_host(pix.ky)), np.asarray(to_host(pix.kx))
    out[(ky + s // 2) % s, (kx + s // 2) % s] = v
    out[(-ky + s // 2) % s, (-kx + s // 2) % s] = -v if odd else v
    return out


# ----------------------------------------------------------------------------------------------------------
# A whole refinement, batch by batch


@dataclass
class CtfRefineOptions:
    fit_defocus: bool = False
    modes: FitModes = field(default_factory=FitModes)
    kmin_defocus_A: float = KMIN_DEFOCUS_A
    bf_range_A: float = BF_RANGE_A
    max_iters: int = MAX_DEFOCUS_ITERS
    fit_beamtilt: bool = False
    kmin_tilt_A: float = KMIN_TILT_A
    odd_aberr_max_n: int = 0
    fit_aberr: bool = False
    kmin_aberr_A: float = KMIN_ABERR_A
    even_aberr_max_n: int = EVEN_ABERR_MAX_N
    fit_aniso: bool = False
    kmin_mag_A: float = KMIN_MAG_A


class CtfRefiner:
    """relion_ctf_refine over batches of whole micrographs on the device of ``xp``.

    ``reference``: the two half maps as one stacked FourierReference (index 0 = half 1); ``groups``: each optics
    group's aberrations (list index = group index 0..G-1); ``shell_weight``: RELION's FSC weight per reference shell
    (None: 1 everywhere). :meth:`process` refines one batch's CTF parameters (returning them) and adds the batch
    to the aberration sums; :meth:`fit_aberrations` fits the groups' aberrations from the sums."""

    def __init__(self, reference: FourierReference, box: int, angpix: float, groups: list[OpticsAberrations],
                 options: CtfRefineOptions, shell_weight=None, xp=np, mags: list | None = None):
        self.ref = reference
        self.xp = xp
        self.groups = list(groups)
        self.mags = [None] * len(self.groups) if mags is None else list(mags)  # each group's rlnMagMat (or None)
        self.opt = options
        self.pix = fit_pixels(box, angpix, xp)
        hw = {}
        for name, kmin in (("defocus", options.kmin_defocus_A), ("tilt", options.kmin_tilt_A),
                           ("aberr", options.kmin_aberr_A), ("mag", options.kmin_mag_A)):
            hw[name] = hollow_weight(self.pix, kmin, shell_weight, reference.size,
                                     angpix * box / reference.size)
        self.hollow = hw
        keep = hw["defocus"] > 0
        self.fit_index = xp.nonzero(keep)[0]  # the defocus fit's pixels among self.pix
        self.fit_pix = self.pix.subset(self.fit_index)
        self.odd_phase = xp.stack([g.odd_phase(self.pix.fx, self.pix.fy, xp) for g in self.groups])  # (G, npix)
        self.even_phase = xp.stack([g.even_phase(self.pix.fx, self.pix.fy, xp) for g in self.groups])
        self.has_odd = [g.has_odd for g in self.groups]
        self.has_even = [g.has_even for g in self.groups]
        self.sums = AberrationSums(len(self.groups), self.pix.npix, xp)

    def _per_particle(self, table, group):
        """(P or 1, npix) rows of a per-group table for the particles of ``group`` (P,)."""
        xp = self.xp
        g = to_host(group)
        if np.all(g == g[0]):
            return table[int(g[0])][None]
        return table[xp.asarray(g)]

    def process(self, images, A, offsets_px, other_half, ctf: CtfParams, group, micrograph,
                check: Callable[[], None] | None = None) -> np.ndarray:
        """One batch: images (P, s, s) (host or device), rotation matrices A (P, 3, 3), origin offsets (P, 2)
        pixels, ``other_half`` (P,) the reference index (0/1) to compare with, CTF parameters, optics group index
        (P,) 0..G-1 and micrograph index (P,) 0..M-1 (whole micrographs). Returns the refined parameters (P, 7)
        on the host (the input's when the defocus is not fitted)."""
        group = np.asarray(group, np.int64)
        if all(m is None for m in self.mags):
            return self._process(images, A, offsets_px, other_half, ctf, group, micrograph, None, check)
        theta = params_to_array(ctf)  # a magnified group's CTF and projections need its own pixels: group by group
        for g in np.unique(group):
            rows = np.flatnonzero(group == g)
            mic = np.unique(np.asarray(micrograph)[rows], return_inverse=True)[1]
            theta[rows] = self._process(np.asarray(images)[rows] if isinstance(images, np.ndarray) else images[rows],
                                        np.asarray(A)[rows], np.asarray(offsets_px)[rows],
                                        np.asarray(other_half)[rows], ctf.subset(rows), group[rows], mic,
                                        self.mags[int(g)], check)
        return theta

    def _process(self, images, A, offsets_px, other_half, ctf: CtfParams, group, micrograph, mag,
                 check) -> np.ndarray:
        """process() for particles that share the magnification ``mag`` (None: none)."""
        xp = self.xp
        pix = magnified_pixels(self.pix, mag)  # the CTF's frequencies (the same pixels)
        fit_pix = self.fit_pix if mag is None else pix.subset(self.fit_index)
        theta = params_to_array(ctf)
        lam = electron_wavelength_A(np.broadcast_to(np.asarray(ctf.voltage, np.float64), (len(ctf),)))
        y = centred_observations(xp.asarray(images), offsets_px, self.pix)
        A = magnified(xp.asarray(A, dtype=np.float64), mag)
        x = predictions(self.ref, A, xp.asarray(other_half), self.pix)
        gam_even = self._per_particle(self.even_phase, group)
        odd = self._per_particle(self.odd_phase, group)
        x_odd = x * xp.exp(1j * odd)
        if self.opt.fit_defocus and self.opt.modes.fits_anything:
            fi = self.fit_index
            d = defocus_data(y[:, fi], x_odd[:, fi], self.hollow["defocus"][fi], fit_pix, xp.asarray(lam),
                             gam_even[:, fi])
            theta = to_host(fit_ctf_parameters(d, xp.asarray(theta), np.asarray(micrograph), self.opt.modes,
                                               self.opt.bf_range_A, self.opt.max_iters, check=check))
            del d
        if self.opt.fit_beamtilt or self.opt.fit_aberr or self.opt.fit_aniso:
            th = xp.asarray(theta)
            g_ = _Geometry.of(pix)
            lam_d = xp.asarray(lam)
            gdev = xp.asarray(group)
            if self.opt.fit_beamtilt or self.opt.fit_aniso:
                c, _ = ctf_values(th, lam_d, g_, gam_even)
                if self.opt.fit_beamtilt:
                    self.sums.add_odd(y, x, c, gdev)
                if self.opt.fit_aniso:  # the gradient of the prediction with the group's odd phase
                    gx, gy = prediction_gradient(self.ref, A, xp.asarray(other_half), self.pix)
                    phase = xp.exp(1j * odd)
                    self.sums.add_mag(y, x_odd, gx * phase, gy * phase, c, gdev)
                    del gx, gy
            if self.opt.fit_aberr:
                gamma0 = _gamma(th, lam_d, g_, None)
                self.sums.add_even(y, x_odd, gamma0, gdev)
        return theta

    def fit_magnifications(self) -> dict[int, np.ndarray]:
        """Per optics group with particles (--fit_aniso): its new magnification matrix, the fitted one composed
        with the group's current matrix (the predictions were made at it: y(k) ~ c x0(M_old M_fit k))."""
        out = {}
        if not self.opt.fit_aniso:
            return out
        for gi in range(len(self.groups)):
            if float(to_host(self.sums.mag[gi, 0].sum())) > 0:
                fitted = fit_magnification(self.sums.mag[gi], self.hollow["mag"], self.pix)
                old = np.eye(2) if self.mags[gi] is None else np.asarray(self.mags[gi], np.float64)
                out[gi] = old @ fitted
        return out

    def fit_aberrations(self) -> tuple[dict[int, OddFit], dict[int, EvenFit]]:
        """Per optics group with particles: the antisymmetric and symmetric fits that were asked for."""
        odd, even = {}, {}
        for gi, g in enumerate(self.groups):
            if self.opt.fit_beamtilt and float(to_host(self.sums.w[gi].sum())) > 0:
                odd[gi] = fit_odd_aberrations(self.sums.xy[gi], self.sums.w[gi], self.hollow["tilt"], self.pix,
                                              self.opt.odd_aberr_max_n, g.cs, g.voltage)
            if self.opt.fit_aberr and float(to_host(self.sums.even[gi, 0].sum())) > 0:
                even[gi] = fit_even_aberrations(self.sums.even[gi], self.hollow["aberr"], self.pix,
                                                self.opt.even_aberr_max_n)
        return odd, even

"""RELION's CTF (relion_algorithm.md section 1.4), evaluated on half grids for a batch of particles.

With spatial frequencies x, y in 1/Å (x = kx/(N p)), u^2 = x^2 + y^2 and theta = atan2(y, x):
    defocus(theta) = dU cos^2(theta - a) + dV sin^2(theta - a)
    gamma = -pi lambda defocus u^2 + (pi/2) Cs lambda^3 u^4 - phase_shift - atan(Q0 / sqrt(1 - Q0^2))
    CTF   = -sin(gamma) exp(-B u^2 / 4) scale                 (so CTF(0) = +Q0)
lambda (Å) = 12.2643247 / sqrt(V (1 + 0.978466e-6 V)), V in volts; Cs in mm (x 1e7 -> Å).

Higher-order aberrations of an optics group (RELION 5.0.1, src/jaz/single_particle/obs_model.cpp,
src/jaz/math/Zernike.cpp, src/jaz/single_particle/ctf/tilt_helper.cpp; docs/ctf_refinement.md):
- symmetric (rlnEvenZernike): gamma += sum_i c_i Z_i(x, y), Z_i the even Zernike polynomial of index i
  (:func:`even_index_to_mn`) at the spatial frequency (x, y) in 1/Å (not normalised to a pupil radius);
- antisymmetric (rlnOddZernike, and rlnBeamTiltX/Y in mrad folded into its coma terms by :func:`insert_tilt`): the
  particle's FT is multiplied by exp(i phi), phi = sum_i c_i Z_i(x, y) over the odd polynomials
  (:func:`odd_index_to_mn`). Beam tilt alone gives phi = -2e4 pi Cs lambda^2 |k|^2 (tx x + ty y) (Cs in mm,
  lambda in Å, tilt in mrad).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .fourier import half_grid_indices


def electron_wavelength_A(voltage_kV):
    """Relativistic electron wavelength (Å) for an acceleration voltage in kV."""
    v = np.asarray(voltage_kV, dtype=np.float64) * 1e3
    return 12.2643247 / np.sqrt(v * (1.0 + 0.978466e-6 * v))


@dataclass(frozen=True)
class CtfParams:
    """Per-particle CTF parameters as 1-D arrays (or scalars), RELION units.

    defocus_u, defocus_v: Å (underfocus positive); defocus_angle: degrees; voltage: kV; cs: mm;
    amplitude_contrast: fraction; bfactor: Å^2; scale: unitless; phase_shift: degrees."""

    defocus_u: np.ndarray
    defocus_v: np.ndarray
    defocus_angle: np.ndarray
    voltage: np.ndarray | float = 300.0
    cs: np.ndarray | float = 2.7
    amplitude_contrast: np.ndarray | float = 0.1
    bfactor: np.ndarray | float = 0.0
    scale: np.ndarray | float = 1.0
    phase_shift: np.ndarray | float = 0.0

    @classmethod
    def from_table(cls, df) -> CtfParams:
        """From a particles DataFrame with optics merged in (RELION column names)."""
        def col(name, default):
            return df[name].to_numpy(np.float64) if name in df else np.full(len(df), default, np.float64)

        return cls(
            defocus_u=col("rlnDefocusU", 0.0), defocus_v=col("rlnDefocusV", 0.0),
            defocus_angle=col("rlnDefocusAngle", 0.0), voltage=col("rlnVoltage", 300.0),
            cs=col("rlnSphericalAberration", 2.7), amplitude_contrast=col("rlnAmplitudeContrast", 0.1),
            bfactor=col("rlnCtfBfactor", 0.0), scale=col("rlnCtfScalefactor", 1.0),
            phase_shift=col("rlnPhaseShift", 0.0),
        )

    def __len__(self) -> int:
        return int(np.size(self.defocus_u))

    def subset(self, idx) -> CtfParams:
        def pick(a):
            a = np.asarray(a, dtype=np.float64)
            return a[idx] if a.ndim else a

        return CtfParams(*(pick(getattr(self, f)) for f in self.__dataclass_fields__))


def ctf_from_frequencies(p: CtfParams, fx, fy, xp=np, gamma_offset=None, dtype=np.float32):
    """CTF at spatial frequencies fx, fy (1/Å), broadcast against a leading particle axis.

    fx, fy have any grid shape G; the result is (n,) + G float32 (computed in float64; ``dtype`` float64 keeps
    it). ``gamma_offset`` (G or (n,) + G, radians), when given, is added to gamma: RELION's symmetric
    aberrations (:func:`aberration_phase` of the optics group's rlnEvenZernike)."""
    def arr(a):
        return xp.asarray(np.atleast_1d(np.asarray(a, dtype=np.float64)))

    n = len(p)
    du, dv, ang = arr(p.defocus_u), arr(p.defocus_v), arr(p.defocus_angle)
    lam = arr(electron_wavelength_A(np.broadcast_to(np.asarray(p.voltage, np.float64), (n,))))
    cs = arr(np.broadcast_to(np.asarray(p.cs, np.float64), (n,))) * 1e7
    q0 = arr(np.broadcast_to(np.asarray(p.amplitude_contrast, np.float64), (n,)))
    bf = arr(np.broadcast_to(np.asarray(p.bfactor, np.float64), (n,)))
    sc = arr(np.broadcast_to(np.asarray(p.scale, np.float64), (n,)))
    ph = arr(np.broadcast_to(np.asarray(p.phase_shift, np.float64), (n,))) * (np.pi / 180.0)

    ex = (None,) * fx.ndim
    fx = xp.asarray(fx, dtype=np.float64)[None]
    fy = xp.asarray(fy, dtype=np.float64)[None]
    u2 = fx**2 + fy**2
    theta = xp.arctan2(fy, fx)
    a = (ang * (np.pi / 180.0))[(slice(None),) + ex]
    c2 = xp.cos(theta - a) ** 2
    defocus = du[(slice(None),) + ex] * c2 + dv[(slice(None),) + ex] * (1.0 - c2)
    K = lambda v: v[(slice(None),) + ex]  # noqa: E731
    gamma = (-np.pi * K(lam) * defocus * u2 + 0.5 * np.pi * K(cs) * K(lam) ** 3 * u2**2
             - K(ph) - xp.arctan(K(q0) / xp.sqrt(1.0 - K(q0) ** 2)))
    if gamma_offset is not None:
        gamma = gamma + xp.asarray(gamma_offset, dtype=np.float64)
    ctf = -xp.sin(gamma) * xp.exp(-K(bf) * u2 / 4.0) * K(sc)
    return ctf.astype(dtype, copy=False)


def ctf_half_grid(p: CtfParams, box: int, pixel_size: float, size: int | None = None, xp=np):
    """CTF of each particle on the (s, s//2+1) half grid of a box of ``box`` pixels at ``pixel_size`` Å.

    ``size`` s < box gives the window of the box's grid (same frequencies, cropped), as RELION windows the
    CTF image to current_size."""
    s = box if size is None else int(size)
    ky, kx = half_grid_indices(s, 2, xp)
    fx = xp.broadcast_to(kx / (box * pixel_size), (s, s // 2 + 1))
    fy = xp.broadcast_to(ky / (box * pixel_size), (s, s // 2 + 1))
    return ctf_from_frequencies(p, fx, fy, xp)


# ----------------------------------------------------------------------------------------------------------
# Zernike aberrations (RELION's conventions, src/jaz/math/Zernike.cpp)


def odd_index_to_mn(i: int) -> tuple[int, int]:
    """(m, n) of RELION's odd Zernike index i: 0 (-1, 1) = y, 1 (1, 1) = x, 2 (-3, 3) trefoil sin, 3 (-1, 3)
    coma y, 4 (1, 3) coma x, 5 (3, 3) trefoil cos, 6 (-5, 5), ..."""
    k = int((np.sqrt(1 + 4 * i) - 1.0) / 2.0)
    n = 2 * k + 1
    return 2 * (i - (k * k + k)) - n, n


def even_index_to_mn(i: int) -> tuple[int, int]:
    """(m, n) of RELION's even Zernike index i: 0 (0, 0) piston, 1 (-2, 2), 2 (0, 2) defocus, 3 (2, 2),
    4 (-4, 4), 5 (-2, 4), 6 (0, 4) spherical, 7 (2, 4), 8 (4, 4), ..."""
    k = int(np.sqrt(float(i)))
    return 2 * (i - k * k - k), 2 * k


def number_of_odd_coeffs(n_max: int) -> int:
    """Odd Zernike coefficients up to degree n_max (RELION: 6 for n_max 3, 12 for 5)."""
    m = (int(n_max) - 1) // 2 + 1
    return m * m + m


def number_of_even_coeffs(n_max: int) -> int:
    """Even Zernike coefficients up to degree n_max (RELION: 9 for n_max 4, 16 for 6)."""
    m = int(n_max) // 2
    return m * m + 2 * m + 1


def zernike_radial_coeffs(m: int, n: int) -> list[tuple[float, int]]:
    """R_n^|m|(rho) = sum_k coeff_k rho^(n - 2k): (coeff_k, power) pairs (empty when n - |m| is odd)."""
    m = abs(int(m))
    if m > n:
        raise ValueError(f"Zernike polynomial with |m| = {m} > n = {n}")
    if (n - m) % 2:
        return []
    from math import factorial  # noqa: PLC0415

    return [((-1) ** k * factorial(n - k) / (factorial(k) * factorial((n + m) // 2 - k)
                                              * factorial((n - m) // 2 - k)), n - 2 * k)
            for k in range((n - m) // 2 + 1)]


def zernike_cart(m: int, n: int, x, y, xp=np):
    """RELION's Z_cart(m, n, x, y): R_n^|m|(rho) cos(m phi) for m >= 0, R_n^|m|(rho) sin(|m| phi) for m < 0, with
    rho = |(x, y)| and phi = atan2(y, x) (0 at the origin), in float64."""
    x = xp.asarray(x, dtype=np.float64)
    y = xp.asarray(y, dtype=np.float64)
    rho = xp.sqrt(x * x + y * y)
    phi = xp.arctan2(y, x)  # atan2(0, 0) = 0, RELION's choice at the origin
    r = xp.zeros(xp.broadcast(x, y).shape, dtype=np.float64)
    for c, power in zernike_radial_coeffs(m, n):
        r = r + c * rho**power
    return r * (xp.cos(m * phi) if m >= 0 else xp.sin(-m * phi))


def zernike_basis(n_coeffs: int, odd: bool, fx, fy, xp=np):
    """(n_coeffs,) + G float64: the odd (or even) Zernike polynomials of RELION's indices 0..n_coeffs-1 at the
    spatial frequencies fx, fy (1/Å, any shape G)."""
    to_mn = odd_index_to_mn if odd else even_index_to_mn
    return xp.stack([zernike_cart(*to_mn(i), fx, fy, xp) for i in range(int(n_coeffs))]) if n_coeffs else \
        xp.zeros((0,) + xp.broadcast(xp.asarray(fx), xp.asarray(fy)).shape, dtype=np.float64)


def aberration_phase(coeffs, odd: bool, fx, fy, xp=np):
    """sum_i coeffs[i] Z_i(fx, fy) (radians; float64, the shape of fx, fy): the antisymmetric phase (odd) or the
    gamma offset (even) of an optics group, as RELION's ObservationModel::getPhaseCorrection / getGammaOffset."""
    c = np.asarray(coeffs, dtype=np.float64).reshape(-1)
    fx = xp.asarray(fx, dtype=np.float64)
    fy = xp.asarray(fy, dtype=np.float64)
    out = xp.zeros(xp.broadcast(fx, fy).shape, dtype=np.float64)
    to_mn = odd_index_to_mn if odd else even_index_to_mn
    for i, ci in enumerate(c):
        if ci != 0.0:
            out = out + float(ci) * zernike_cart(*to_mn(i), fx, fy, xp)
    return out


def tilt_scale(cs_mm: float, voltage_kV: float) -> float:
    """RELION's beam-tilt scale Cs 2e4 lambda^2 pi (TiltHelper::insertTilt): the coefficient of |k|^2 (k . t)
    in the antisymmetric phase, per mrad of tilt, with k in 1/Å."""
    lam = float(electron_wavelength_A(voltage_kV))
    return float(cs_mm) * 20000.0 * lam * lam * 3.141592654


def insert_tilt(odd_coeffs, tilt_x: float, tilt_y: float, cs_mm: float, voltage_kV: float) -> np.ndarray:
    """RELION's TiltHelper::insertTilt: the beam tilt (mrad) added to the odd Zernike coefficients (at least 5
    long afterwards): Z3x = -scale tx / 3 on coma x (index 4) and 2 Z3x on x (index 1), the same for y (indices
    3 and 0), so that together they are -scale |k|^2 (tx x + ty y)."""
    c = np.zeros(max(5, np.size(odd_coeffs)), np.float64)
    c[:np.size(odd_coeffs)] = np.asarray(odd_coeffs, np.float64).reshape(-1)
    s = tilt_scale(cs_mm, voltage_kV)
    z3x, z3y = -s * float(tilt_x) / 3.0, -s * float(tilt_y) / 3.0
    c[1] += 2.0 * z3x
    c[0] += 2.0 * z3y
    c[4] += z3x
    c[3] += z3y
    return c


def extract_tilt(odd_coeffs, cs_mm: float, voltage_kV: float) -> tuple[np.ndarray, float, float]:
    """RELION's TiltHelper::extractTilt, the inverse of :func:`insert_tilt`: the coma terms (indices 3, 4) become
    a beam tilt (mrad) and are zeroed, their linear parts moved to indices 0, 1. Returns (coefficients, tilt_x,
    tilt_y)."""
    c = np.zeros(max(5, np.size(odd_coeffs)), np.float64)
    c[:np.size(odd_coeffs)] = np.asarray(odd_coeffs, np.float64).reshape(-1)
    s = tilt_scale(cs_mm, voltage_kV)
    z3x, z3y = c[4], c[3]
    c[4] = c[3] = 0.0
    c[1] -= 2.0 * z3x
    c[0] -= 2.0 * z3y
    return c, -3.0 * z3x / s, -3.0 * z3y / s


@dataclass(frozen=True)
class OpticsAberrations:
    """One optics group's higher-order aberrations as RELION's optics table holds them: rlnBeamTiltX/Y (mrad),
    rlnOddZernike and rlnEvenZernike (radians per polynomial, frequencies in 1/Å), with the group's Cs (mm) and
    voltage (kV) that turn the tilt into odd coefficients."""

    beam_tilt_x: float = 0.0
    beam_tilt_y: float = 0.0
    odd: tuple = ()
    even: tuple = ()
    cs: float = 2.7
    voltage: float = 300.0

    def odd_coefficients(self) -> np.ndarray:
        """The odd coefficients with the beam tilt folded in (RELION's ObservationModel does so on reading)."""
        if self.beam_tilt_x == 0.0 and self.beam_tilt_y == 0.0:
            return np.asarray(self.odd, np.float64)
        return insert_tilt(self.odd, self.beam_tilt_x, self.beam_tilt_y, self.cs, self.voltage)

    @property
    def has_odd(self) -> bool:
        return bool(np.any(self.odd_coefficients() != 0))

    @property
    def has_even(self) -> bool:
        return bool(np.any(np.asarray(self.even, np.float64) != 0))

    def odd_phase(self, fx, fy, xp=np):
        """The antisymmetric phase (radians) at fx, fy (1/Å): a prediction is multiplied by exp(i phase)."""
        return aberration_phase(self.odd_coefficients(), True, fx, fy, xp)

    def even_phase(self, fx, fy, xp=np):
        """The symmetric phase (radians) added to gamma at fx, fy (1/Å)."""
        return aberration_phase(self.even, False, fx, fy, xp)


def demodulation_factors(aberrations, box: int, pixel_size: float, xp=np):
    """exp(-i phase) of each optics group's antisymmetric aberrations (beam tilt and odd Zernike terms) on the
    (box, box//2+1) half grid, (G, box, box//2+1) complex64; None when no group has any. An observed image's
    Fourier transform multiplied by it is what RELION's ObservationModel::demodulatePhase makes of it: compared
    with and back-projected as CTF x projection, as if the prediction were multiplied by exp(i phase).
    ``aberrations``: one OpticsAberrations (or None) per 0-based optics group."""
    if not any(a is not None and a.has_odd for a in aberrations):
        return None
    ky, kx = half_grid_indices(box, 2, np)
    fx = np.broadcast_to(kx / (box * pixel_size), (box, box // 2 + 1))
    fy = np.broadcast_to(ky / (box * pixel_size), (box, box // 2 + 1))
    out = np.ones((len(aberrations), box, box // 2 + 1), np.complex64)
    for g, a in enumerate(aberrations):
        if a is not None and a.has_odd:
            out[g] = np.exp(-1j * a.odd_phase(fx, fy))
    return xp.asarray(out)


def gamma_offsets(aberrations, fx, fy, xp=np):
    """Each optics group's symmetric aberrations (even Zernike terms) at frequencies fx, fy (1/Å): the gamma
    offsets (G,) + fx.shape, float64 radians, that ctf_from_frequencies adds (RELION's getGammaOffset); None when
    no group has any."""
    if not any(a is not None and a.has_even for a in aberrations):
        return None
    fx, fy = xp.broadcast_arrays(xp.asarray(fx, dtype=np.float64), xp.asarray(fy, dtype=np.float64))
    return xp.stack([a.even_phase(fx, fy, xp) if a is not None and a.has_even else xp.zeros(fx.shape)
                     for a in aberrations])


def parse_zernike(value) -> tuple:
    """A STAR value of rlnOddZernike / rlnEvenZernike ('[a,b,c]', RELION's vector format; '[]' or NaN: none)."""
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ()
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(float(v) for v in value)
    text = str(value).strip().strip("[]").strip()
    return tuple(float(t) for t in text.split(",") if t.strip()) if text else ()


def format_zernike(coeffs) -> str:
    """RELION's text of a vector of doubles: '[a,b,c]' with 12 significant digits ('[]' when empty)."""
    return "[" + ",".join(f"{float(c):.12g}" for c in np.asarray(coeffs, np.float64).reshape(-1)) + "]"

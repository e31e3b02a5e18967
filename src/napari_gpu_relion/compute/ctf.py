"""RELION's CTF (relion_algorithm.md section 1.4), evaluated on half grids for a batch of particles.

With spatial frequencies x, y in 1/Å (x = kx/(N p)), u^2 = x^2 + y^2 and theta = atan2(y, x):
    defocus(theta) = dU cos^2(theta - a) + dV sin^2(theta - a)
    gamma = -pi lambda defocus u^2 + (pi/2) Cs lambda^3 u^4 - phase_shift - atan(Q0 / sqrt(1 - Q0^2))
    CTF   = -sin(gamma) exp(-B u^2 / 4) scale                 (so CTF(0) = +Q0)
lambda (Å) = 12.2643247 / sqrt(V (1 + 0.978466e-6 V)), V in volts; Cs in mm (x 1e7 -> Å).
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


def ctf_from_frequencies(p: CtfParams, fx, fy, xp=np):
    """CTF at spatial frequencies fx, fy (1/Å), broadcast against a leading particle axis.

    fx, fy have any grid shape G; the result is (n,) + G float32 (computed in float64)."""
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
    ctf = -xp.sin(gamma) * xp.exp(-K(bf) * u2 / 4.0) * K(sc)
    return ctf.astype(np.float32)


def ctf_half_grid(p: CtfParams, box: int, pixel_size: float, size: int | None = None, xp=np):
    """CTF of each particle on the (s, s//2+1) half grid of a box of ``box`` pixels at ``pixel_size`` Å.

    ``size`` s < box gives the window of the box's grid (same frequencies, cropped), as RELION windows the
    CTF image to current_size."""
    s = box if size is None else int(size)
    ky, kx = half_grid_indices(s, 2, xp)
    fx = xp.broadcast_to(kx / (box * pixel_size), (s, s // 2 + 1))
    fy = xp.broadcast_to(ky / (box * pixel_size), (s, s // 2 + 1))
    return ctf_from_frequencies(p, fx, fy, xp)

"""A 3D initial model from the particles alone: RELION's gradient-driven refinement (VDAM, ``relion_refine --grad
--denovo_3dref``) on top of the shared E-step.

Every iteration aligns a random mini-batch of particles (split in two pseudo half-sets) against the current K
references, back-projects them (the ordinary E-step accumulators: data = sum p c X, weight = sum p c^2, in the
padded Fourier grid of compute/backprojector.py), and moves each reference along the reweighted gradient
(data - weight V) / max(1, weight) with momentum (first moment, mu = 0.9) and a per-voxel noise-to-signal
normalisation (second moment from the two pseudo half-sets), regularised by an FSC estimate from the half-set
momenta. The schedule grows the mini-batch, the resolution and lowers the step size over the iterations (RELION's
initial / in-between / final phases).

Units: maps in real space are (N, N, N) in the particles' grey values, pixel size in Å; Fourier grids are the
padded half grids (P, P, P // 2 + 1), P = pad N, in the back-projector's normalisation (``reference_to_grid``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import get_array_module, to_host
from .backprojector import BackProjector, grid_shape, insertion_reach, support_index
from .ctf import CtfParams, ctf_half_grid
from .fourier import half_grid_indices, irfft_centered, lowpass_map, rfft_centered, round_half_away
from .projector import sinc2_gridding
from .symmetry_alignment import rotate_map

#: RELION's initial value of the second moment (per voxel noise-to-signal ratio) and momentum of the updates.
MOM2_INIT = 1.0
MU = 0.9
#: Floor of sqrt(second moment) in the step (this project's guard, not RELION's; see ``vdam_update``).
MOM2_SQRT_FLOOR = 0.05


def default_subset_sizes(n_particles: int) -> tuple[int, int]:
    """RELION's mini-batch sizes for a 3D initial model (initial, final): 0.5 % of the particles within
    [200, 5000] and 10 % within [1000, 50000]."""
    ini = int(max(min(n_particles * 0.005, 5000), 200))
    fin = int(max(min(n_particles * 0.1, 50000), 1000))
    return ini, fin


@dataclass(frozen=True)
class GradSchedule:
    """RELION's gradient schedule over ``n_iter`` iterations (numbered 1..n_iter): ``ini_frac`` of them in the
    initial phase (small batch ``ini_subset``, low resolution ``ini_resol`` Å, inflated step size), ``fin_frac``
    in the final phase (``fin_subset``, ``fin_resol`` Å) and a linear ramp in between. The step size is
    ``stepsize`` times a sigmoid from ``inflate`` down to 1 over the first half of the in-between phase (RELION's
    "<inflate>-step" scheme; 3D initial model: stepsize 0.5, inflate 0.9 / 0.5).

    RELION 5 takes the resolution of each iteration from its FSC estimate; here the resolution follows the same
    ramp as the mini-batch (a simpler rule, stated as such)."""

    n_iter: int
    ini_subset: int
    fin_subset: int
    ini_resol: float = 35.0
    fin_resol: float = 15.0
    ini_frac: float = 0.3
    fin_frac: float = 0.2
    stepsize: float = 0.5
    inflate: float = 0.9 / 0.5

    def phases(self) -> tuple[int, int, int]:
        """(initial, in-between, final) iteration counts; fractions summing over 0.9 are scaled down as RELION
        does."""
        a, b = self.ini_frac, self.fin_frac
        if a + b > 0.9:
            s = a + b + 0.1
            a, b = a / s, b / s
        ini, fin = int(self.n_iter * a), int(self.n_iter * b)
        return ini, self.n_iter - ini - fin, fin

    def _ramp(self, iteration: int) -> float:
        """0 in the initial phase, rising linearly to 1 over the in-between phase, 1 after."""
        ini, mid, _ = self.phases()
        if iteration < ini:
            return 0.0
        if iteration < ini + mid:
            return (iteration - ini) / max(mid, 1)
        return 1.0

    def subset(self, iteration: int) -> int:
        """Mini-batch size (particles) of this iteration."""
        return int(self.ini_subset + round(self._ramp(iteration) * (self.fin_subset - self.ini_subset)))

    def resolution_A(self, iteration: int) -> float:
        """Resolution limit (Å) of this iteration, linear in spatial frequency between ini_resol and fin_resol."""
        f = 1 / self.ini_resol + self._ramp(iteration) * (1 / self.fin_resol - 1 / self.ini_resol)
        return 1.0 / f

    def step(self, iteration: int) -> float:
        """Step size of this iteration (RELION's sigmoid: inflate x stepsize early, stepsize late)."""
        ini, mid, _ = self.phases()
        a = mid / 2.0
        if a <= 0:
            return self.stepsize
        with np.errstate(over="ignore"):
            scale = 1.0 / (10.0 ** ((iteration - ini - a / 2.0) / (a / 4.0)) + 1.0)
        return float(self.stepsize * self.inflate * scale + self.stepsize * (1.0 - scale))


def class_stepsize(step: float, pdf_class: float, n_classes: int) -> float:
    """RELION's per-class step: ``step`` (1 - exp(-(3K + 10) pdf_class)), small for nearly empty classes."""
    return float(step * (1.0 - np.exp(-(3 * n_classes + 10) * pdf_class)))


# ----------------------------------------------------------------------------------------------------------
# Maps <-> the back-projector's padded Fourier grid
# ----------------------------------------------------------------------------------------------------------


def _inside(P: int, pad: int, r_max: float, xp):
    ks = half_grid_indices(P, 3, xp)
    q2 = sum(k.astype(np.float64) ** 2 for k in ks)
    lim = float(round_half_away(np.float64(pad * r_max))) ** 2
    shells = round_half_away(xp.sqrt(q2) / pad).astype(np.int64)
    return q2 < lim, shells


def reference_to_grid(vol, pad: int):
    """Real-space map (N, N, N) -> complex padded half grid (P, P, P // 2 + 1) in the normalisation of
    data / weight of the back-projector (the inverse of ``grid_to_reference``; no gridding correction, as
    RELION's gradient step)."""
    xp = get_array_module(vol)
    N = vol.shape[-1]
    P = pad * N
    padded = xp.zeros((P,) * 3, dtype=np.float64)
    lo = P // 2 - N // 2
    padded[lo:lo + N, lo:lo + N, lo:lo + N] = vol
    return rfft_centered(padded, 3) * (pad**3 * N)


def grid_to_reference(grid, size: int, pad: int):
    """Complex padded half grid -> real-space map (N, N, N) float64: inverse FFT, central crop, / (pf^3 N)
    (the steps of BackProjector.reconstruct without its regularisation, soft edge and gridding correction)."""
    P = pad * size
    vol = irfft_centered(grid, P, 3)
    lo = P // 2 - size // 2
    return vol[lo:lo + size, lo:lo + size, lo:lo + size] / (pad**3 * size)


# ----------------------------------------------------------------------------------------------------------
# The gradient step
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Moments:
    """Per class: first moments of the reweighted gradient of each pseudo half-set (two complex padded grids) and
    the second moment (real grid: per-voxel noise-to-signal ratio of the two half-set gradients). Kept in single
    precision (complex64 / float32), as RELION keeps and writes them: what ``moment_blocks`` writes to a file is
    exactly what the run goes on with, so that ``--continue`` repeats the uninterrupted run."""

    mom1: list
    mom2: object
    started: bool = False

    @classmethod
    def zeros(cls, size: int, pad: int, xp=np) -> Moments:
        shape = grid_shape(size, pad, 3)
        return cls([xp.zeros(shape, np.complex64), xp.zeros(shape, np.complex64)],
                   xp.full(shape, MOM2_INIT, np.float32))


def moment_reach(pad: int, r_max: float) -> int:
    """Grid pixels from the origin within which ``vdam_update`` at resolution limit ``r_max`` (Fourier pixels of
    the box) changes the moments; outside the largest reach a run has used they are still 0 (first moments) and
    MOM2_INIT (second moment)."""
    return insertion_reach(pad, r_max)


def moment_blocks(moments: Moments, reach: int) -> list[np.ndarray]:
    """The moments within ``reach`` grid pixels of the origin as host float32 arrays: [first moment of pseudo
    half-set 1, of half-set 2, second moment]; complex values interleaved (re, im) along x as RELION writes its
    moment images. The blocks are the grid rows [0, reach] and [P - reach, P) of the full axes and [0, reach] of
    the half axis (``backprojector.support_index``; the whole grid where that covers it)."""
    xp = get_array_module(moments.mom2)
    ix = support_index(moments.mom2.shape, reach, xp)

    def crop(a):
        return a if ix is None else a[ix]

    out = [to_host(xp.ascontiguousarray(crop(m).astype(np.complex64))).view(np.float32) for m in moments.mom1]
    out.append(to_host(xp.ascontiguousarray(crop(moments.mom2).astype(np.float32))))
    return out


def moments_from_blocks(blocks: list[np.ndarray], size: int, pad: int, xp=np) -> Moments:
    """The inverse of ``moment_blocks``: full grids with the blocks put back, 0 / MOM2_INIT outside them; a
    ValueError when the blocks do not fit this box and padding."""
    m = Moments.zeros(size, pad, xp)
    shape = m.mom2.shape
    b2 = np.asarray(blocks[2], np.float32)
    if b2.ndim != 3 or b2.shape[0] % 2 != 1 or b2.shape[0] > shape[0] + 1 or b2.shape[2] > shape[2]:
        raise ValueError(f"moment block of shape {b2.shape} does not fit the grid {shape} (box {size}, pad {pad})")
    whole = b2.shape == shape
    ix = None if whole else support_index(shape, (b2.shape[0] - 1) // 2, xp)
    if (ix is None) != whole:
        raise ValueError(f"moment block of shape {b2.shape} does not fit the grid {shape} (box {size}, pad {pad})")
    for h in range(2):
        b1 = np.ascontiguousarray(np.asarray(blocks[h], np.float32))
        if b1.shape != b2.shape[:2] + (2 * b2.shape[2],):
            raise ValueError(f"first-moment block of shape {b1.shape} does not match the second moment's {b2.shape}")
        c = xp.asarray(b1.view(np.complex64))
        if whole:
            m.mom1[h] = c
        else:
            m.mom1[h][ix] = c
    if whole:
        m.mom2 = xp.asarray(b2)
    else:
        m.mom2[ix] = xp.asarray(b2)
    m.started = True
    return m


def reweighted_gradient(data, weight, ref_grid, inside):
    """(data - weight V) / max(1, weight) within ``inside`` (0 elsewhere): the per-voxel gradient of the
    mini-batch's log-likelihood, preconditioned by its curvature (RELION reweightGrad); ``data`` complex and
    ``weight`` real padded grids of one class and one half-set."""
    xp = get_array_module(weight)
    g = (data - weight * ref_grid) / xp.maximum(weight, 1.0)
    return xp.where(inside, g, 0)


def vdam_update(ref_grid, halves: list, moments: Moments, step: float, tau2_fudge: float, r_max: float,
                pad: int, mu: float = MU):
    """One VDAM step of one class. ``ref_grid``: the current reference (``reference_to_grid``); ``halves``:
    [(data, weight)] of the two pseudo half-sets (Hermitian pairs already summed); ``step``: this class's step
    size; ``r_max``: the resolution limit (Fourier pixels of N). Updates ``moments`` in place and returns
    (new reference grid, fsc estimate per shell).

    g_h = reweighted gradient of half h; m1_h <- mu m1_h + (1 - mu) g_h (m1_h = g_h at the first step);
    m2 <- mu m2 + (1 - mu) |g_2 - g_1|^2 / |(g_1 + g_2) / 2|^2; G = (m1_1 + m1_2) / 2 / max(sqrt(m2), 0.05);
    fsc = snr / (1 + snr) per shell with snr = 2 T <|V|> / <|m1_1 - m1_2|> (T = tau2_fudge);
    V <- V + step (fsc G - (1 - fsc) V)."""
    xp = get_array_module(ref_grid)
    P = ref_grid.shape[0]
    size = P // pad
    inside, shells = _inside(P, pad, r_max, xp)
    g = [reweighted_gradient(d, w, ref_grid, inside) for d, w in halves]
    for h in range(2):  # kept in single precision (see Moments)
        m1 = g[h] if not moments.started else mu * moments.mom1[h] + (1 - mu) * g[h]
        moments.mom1[h] = m1.astype(np.complex64)
    n = g[1] - g[0]
    s = (g[1] + g[0]) / 2
    ratio = (n.real**2 + n.imag**2) / (s.real**2 + s.imag**2 + 1e-12)
    moments.mom2 = xp.where(inside, mu * moments.mom2 + (1 - mu) * ratio, moments.mom2).astype(np.float32)
    moments.started = True
    # RELION divides by sqrt(m2) + 1e-12; a floor keeps the heavy ball stable where the half-sets agree almost
    # exactly (m2 -> 0 at very high SNR: gain s (1 - mu) / sqrt(m2) must stay below 2 (1 + mu))
    G = (moments.mom1[0] + moments.mom1[1]) / 2 / xp.maximum(xp.sqrt(moments.mom2), MOM2_SQRT_FLOOR)
    nsh = size // 2 + 1
    sh = xp.where(inside, xp.minimum(shells, nsh - 1), nsh)  # outside r_max: a discarded bin
    cnt = xp.bincount(sh.ravel(), minlength=nsh + 1)[:nsh]
    prev = xp.bincount(sh.ravel(), weights=xp.abs(ref_grid).ravel(), minlength=nsh + 1)[:nsh]
    noise = xp.bincount(sh.ravel(), weights=xp.abs(moments.mom1[1] - moments.mom1[0]).ravel(),
                        minlength=nsh + 1)[:nsh]
    prev, noise = prev / xp.maximum(cnt, 1), noise / xp.maximum(cnt, 1)
    snr = xp.where(noise > 0, 2 * tau2_fudge * prev / xp.where(noise > 0, noise, 1), 0.0)
    # no difference between the half-sets at all (noise-free data): infinite SNR where there is signal
    fsc = xp.where(noise > 0, xp.clip(snr / (1 + snr), 0, 1), xp.where(prev > 0, 1.0, 0.0))
    f = fsc[xp.minimum(shells, nsh - 1)]
    new = xp.where(inside, ref_grid + step * (f * G - (1 - f) * ref_grid), 0)
    return new, fsc


# ----------------------------------------------------------------------------------------------------------
# The first reference
# ----------------------------------------------------------------------------------------------------------


def random_angle_average(images, matrices, ctf: CtfParams | None, pixel_size: float, pad: int = 2,
                         lowpass_A: float | None = None, r_max: float | None = None):
    """The average of the particles back-projected at the given (random) orientations: a featureless, roughly
    spherical blob in the particles' grey values (RELION's "average of unaligned images" for --denovo_3dref).
    ``images`` (n, N, N) real, ``matrices`` (n, 3, 3); with ``ctf`` the images are CTF-weighted and divided by
    the summed c^2 (Wiener-like, unregularised). Returns (N, N, N) float64, low-passed to ``lowpass_A`` Å."""
    xp = get_array_module(images)
    N = images.shape[-1]
    bp = BackProjector(N, pad, r_max=N / 2 - 1 if r_max is None else r_max, ndim=3, xp=xp)
    F = rfft_centered(xp.asarray(images, np.float64), 2)
    if ctf is not None:
        c = ctf_half_grid(ctf, N, pixel_size, xp=xp)
        W, F = c * c, F * c
    else:
        W = xp.ones(F.shape)
    bp.insert_images(xp.asarray(matrices, np.float64), F, W)
    bp.enforce_hermitian()
    vol = bp.reconstruct(None, soft_edge=True) * sinc2_gridding(N, pad, 3, xp)  # smooth: no gridding boost
    vol = vol.astype(np.float64)
    if lowpass_A is not None:
        vol = lowpass_map(vol, pixel_size, lowpass_A)
    return vol


# ----------------------------------------------------------------------------------------------------------
# Comparing a map with the truth: best rotation, shift and hand
# ----------------------------------------------------------------------------------------------------------


def rotation_grid(step_deg: float) -> np.ndarray:
    """(R, 3, 3) rotations covering SO(3) at about ``step_deg``: rot and psi every step, tilt with cos(tilt)
    uniform so that directions are about equally spaced."""
    from .geometry import euler_to_matrix  # noqa: PLC0415

    n_tilt = max(2, int(round(180.0 / step_deg)))
    tilts = np.degrees(np.arccos(np.linspace(1, -1, n_tilt)))
    rows = []
    for t in tilts:
        n_rot = max(1, int(round(360.0 * np.sin(np.radians(t)) / step_deg))) if 0 < t < 180 else 1
        for r in np.arange(n_rot) * 360.0 / n_rot:
            for p in np.arange(0, 360.0, step_deg):
                rows.append((r, t, p))
    a = np.asarray(rows)
    return euler_to_matrix(a[:, 0], a[:, 1], a[:, 2])


def _rotate(vol, R, order: int = 1):
    """``vol`` turned by R about (N - 1) / 2 (the frame of ``aligned_map_correlation``'s search)."""
    return rotate_map(vol, R, order, center=(np.asarray(vol.shape) - 1) / 2.0)


def _best_shift_cc(Fa, b, mask):
    """Pearson correlation of a with b at the best cyclic shift of b (a given as the FFT of its masked,
    mean-removed, unit-norm copy)."""
    bb = b * mask
    bb = bb - bb[mask > 0].mean() * mask
    nb = np.sqrt((bb * bb).sum())
    if nb == 0:
        return -1.0, (0, 0, 0)
    cc = np.fft.irfftn(Fa * np.conj(np.fft.rfftn(bb)), s=b.shape, axes=tuple(range(b.ndim))) / nb
    i = np.unravel_index(int(cc.argmax()), cc.shape)
    return float(cc[i]), i


def apply_alignment(vol: np.ndarray, alignment: dict) -> np.ndarray:
    """``vol`` (N, N, N) moved as ``aligned_map_correlation`` found best: the other hand when it says mirrored
    (z flipped), then its rotation (trilinear), then its shift (``shift_px``, voxels of the full box, applied
    cyclically as a Fourier phase ramp). Puts an initial model into a reference map's frame and hand."""
    from scipy.ndimage import fourier_shift  # noqa: PLC0415

    src = np.asarray(vol, np.float64)
    src = src[::-1] if alignment["mirrored"] else src
    rotated = _rotate(src, alignment["matrix"])
    shifted = np.fft.ifftn(fourier_shift(np.fft.fftn(rotated), np.asarray(alignment["shift_px"], float))).real
    return shifted.astype(np.float32)


def aligned_map_correlation(vol, truth, pixel_size: float, resolution_A: float, step_deg: float = 10.0,
                            box: int = 24, refine: bool = True) -> dict:
    """Best real-space correlation of ``vol`` with ``truth`` over rotations, shifts and the hand (mirror), both
    low-passed to ``resolution_A`` Å and resampled to ``box`` voxels: per hand an exhaustive search at
    ``step_deg``, then (``refine``) a local search at step / 3 around that hand's best. Returns the best of the
    two hands, {"cc", "matrix" (3, 3, applied to vol), "mirrored", "shift_px"} (shift in voxels of the full box),
    and under "by_hand" both hands' best, {False: {...}, True: {...}} ("mirrored" True: ``vol`` z-flipped), so
    that a caller sees how clearly the hand was decided (a map whose mirror image scores almost as well has a hand
    that this resolution cannot tell)."""
    from .fourier import fourier_resize  # noqa: PLC0415
    from .masks import soft_spherical_mask  # noqa: PLC0415

    N = truth.shape[0]
    b = min(box, N)
    scale = N / b

    def prep(v):
        v = lowpass_map(np.asarray(v, np.float64), pixel_size, resolution_A)
        return fourier_resize(v, b, 3) if b != N else v

    t, v = prep(truth), prep(vol)
    mask = soft_spherical_mask(b, b / 2 - 2, 2.0, 3)
    tm = t * mask
    tm = tm - tm[mask > 0].mean() * mask
    Ft = np.fft.rfftn(tm / np.sqrt((tm * tm).sum()))

    def search(mats, mirrored, best):
        src = v[::-1] if mirrored else v  # z-flip: the other hand
        for R in mats:
            cc, sh = _best_shift_cc(Ft, _rotate(src, R), mask)
            if cc > best["cc"]:
                best.update(cc=cc, matrix=R, mirrored=mirrored, shift_px=np.asarray(sh) * scale)
        return best

    from .geometry import small_turns  # noqa: PLC0415

    grid = rotation_grid(step_deg)
    by_hand = {}
    for mirrored in (False, True):
        best = search(grid, mirrored, {"cc": -2.0})
        if refine:
            best = search(np.einsum("nij,jk->nik", small_turns(step_deg / 3), best["matrix"]), mirrored, best)
        by_hand[mirrored] = best
    return dict(max(by_hand.values(), key=lambda r: r["cc"]), by_hand=by_hand)


def invert_hand(vol):
    """``vol`` (..., N) mirrored in x about the box centre N / 2 (RELION's origin): voxel x goes to (N - x) mod N,
    so the centre stays where it is and the edge plane x = 0 wraps onto itself (relion_image_handler
    --invert_hand). The map of the other hand; applied twice it gives ``vol`` back. NumPy or CuPy."""
    xp = get_array_module(vol)
    return xp.roll(xp.flip(vol, axis=-1), 1, axis=-1)
